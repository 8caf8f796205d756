//! Segmented allocations: memory made of equal VMM segments (PyTorch's and torch_npu's
//! expandable segments, or a C producer's `aclrtMallocPhysical` / `cuMemCreate` + map).
//!
//! A segmented handle sets `DEVSHARE_HANDLE_FLAG_SEGMENTED` (a "must understand" flag) and
//! carries one `DEVSHARE_EXT_SEGMENTS` extension record (a "must understand" type) that
//! describes the segments:
//!
//! ```text
//! segment_size:u64 count:u32 kind:u16 flags:u16 table_crc32:u32      (20 bytes, little-endian)
//! ```
//!
//! The segment table — one record per segment, in address order — is `count` x
//! [`record_size`] bytes: a `u64` shareable handle (acl), an `i32` POSIX fd number valid in the
//! producer whose pid is `producer_pid` (cuda, fd), or a 64-byte `CUmemFabricHandle` (cuda,
//! fabric). When it fits the 128-byte key area it is stored there (`DEVSHARE_SEGMENTS_INLINE`,
//! `key_len` = its length). Longer tables do not fit the fixed-size struct: they travel in the
//! byte and text encodings (as a `DEVSHARE_EXT_SEGMENTS` section) and in PyTorch tuples, and the
//! struct then holds only the description (`key_len` = 0) plus the table's CRC-32, so a table
//! that arrives separately is checked against the handle it belongs to.
//!
//! `alloc_size` is `count x segment_size`; `storage_offset` is relative to the first segment.

use super::*;
use crate::error::{Error, Result};

/// Handle flag ("must understand"): the allocation is a list of equal VMM segments described by
/// a `DEVSHARE_EXT_SEGMENTS` extension record.
pub const DEVSHARE_HANDLE_FLAG_SEGMENTED: u32 = 4;
/// Extension record type (and encoding section type) of a segmented handle's description (in
/// `ext`) and of its segment table (a section of the byte encoding). "Must understand".
pub const DEVSHARE_EXT_SEGMENTS: u16 = 0x8001;
/// Segment table kind (acl): one `uint64_t` shareable handle per segment
/// (`aclrtMemExportToShareableHandle`).
pub const DEVSHARE_SEGMENTS_ACL: u16 = 1;
/// Segment table kind (cuda): one `int32_t` POSIX file descriptor number per segment, valid in
/// the producer process (`producer_pid`); the consumer takes it with `pidfd_getfd`.
pub const DEVSHARE_SEGMENTS_CUDA_FD: u16 = 2;
/// Segment table kind (cuda): one 64-byte `CUmemFabricHandle` per segment.
pub const DEVSHARE_SEGMENTS_CUDA_FABRIC: u16 = 3;
/// Segment description flag: the table is stored in the handle's key area.
pub const DEVSHARE_SEGMENTS_INLINE: u16 = 1;
/// Segment sizes are multiples of this (2 MiB: the VMM granularity of ACL and CUDA devices).
pub const DEVSHARE_SEGMENT_GRANULARITY: u64 = 2 << 20;
/// Most segments one handle may name (65536: 1.25 TiB of 20 MiB segments).
pub const DEVSHARE_MAX_SEGMENTS: u32 = 65536;

const RECORD_LEN: usize = 20;

/// The description of a segmented allocation, from its extension record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segments {
    /// Bytes per segment.
    pub segment_size: u64,
    /// Number of segments.
    pub count: u32,
    /// `DEVSHARE_SEGMENTS_*` kind of the table.
    pub kind: u16,
    /// Whether the table is in the handle's key area.
    pub inline: bool,
    /// CRC-32 (IEEE) of the table.
    pub table_crc: u32,
}

/// Bytes per segment-table record of `kind`.
pub fn record_size(kind: u16) -> Option<usize> {
    match kind {
        DEVSHARE_SEGMENTS_ACL => Some(8),
        DEVSHARE_SEGMENTS_CUDA_FD => Some(4),
        DEVSHARE_SEGMENTS_CUDA_FABRIC => Some(64),
        _ => None,
    }
}

fn kind_name(kind: u16) -> &'static str {
    match kind {
        DEVSHARE_SEGMENTS_ACL => "acl shareable handles",
        DEVSHARE_SEGMENTS_CUDA_FD => "cuda POSIX fds",
        DEVSHARE_SEGMENTS_CUDA_FABRIC => "cuda fabric handles",
        _ => "unknown",
    }
}

impl Segments {
    /// Length of the table in bytes (the kind is valid once parsed).
    pub fn table_len(&self) -> usize {
        self.count as usize * record_size(self.kind).unwrap_or(0)
    }

    fn encode(&self) -> [u8; RECORD_LEN] {
        let mut r = [0u8; RECORD_LEN];
        r[..8].copy_from_slice(&self.segment_size.to_le_bytes());
        r[8..12].copy_from_slice(&self.count.to_le_bytes());
        r[12..14].copy_from_slice(&self.kind.to_le_bytes());
        r[14..16].copy_from_slice(&(if self.inline { DEVSHARE_SEGMENTS_INLINE } else { 0 }).to_le_bytes());
        r[16..20].copy_from_slice(&self.table_crc.to_le_bytes());
        r
    }
}

/// The segment description of a handle: `None` when it is not segmented. Checks the
/// description's fields and that it agrees with the handle (not the table: see [`check_table`]).
pub fn segments(h: &DevshareHandle) -> Result<Option<Segments>> {
    let records = ext_records(h.ext_bytes())?;
    let mut found = records.iter().filter(|r| r.kind == DEVSHARE_EXT_SEGMENTS);
    let record = found.next();
    if found.next().is_some() {
        return Err(Error::invalid("ext", "more than one segments record"));
    }
    let flagged = h.flags & DEVSHARE_HANDLE_FLAG_SEGMENTED != 0;
    let data = match (flagged, record) {
        (false, None) => return Ok(None),
        (true, Some(r)) => r.data,
        (true, None) => {
            return Err(Error::invalid("ext", "DEVSHARE_HANDLE_FLAG_SEGMENTED is set but there is no segments record"))
        }
        (false, Some(_)) => {
            return Err(Error::invalid("flags", "a segments record needs DEVSHARE_HANDLE_FLAG_SEGMENTED"))
        }
    };
    if data.len() != RECORD_LEN {
        return Err(Error::invalid("ext", format!("segments record is {} bytes, not {RECORD_LEN}", data.len())));
    }
    let u64_at = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(data[i..i + 4].try_into().expect("4 bytes"));
    let u16_at = |i: usize| u16::from_le_bytes(data[i..i + 2].try_into().expect("2 bytes"));
    let seg = Segments {
        segment_size: u64_at(0),
        count: u32_at(8),
        kind: u16_at(12),
        inline: u16_at(14) & DEVSHARE_SEGMENTS_INLINE != 0,
        table_crc: u32_at(16),
    };
    if u16_at(14) & !DEVSHARE_SEGMENTS_INLINE != 0 {
        return Err(Error::invalid("ext", format!("segments record: unknown flags {:#x}", u16_at(14))));
    }
    let expected_kinds: &[u16] = match h.backend {
        DEVSHARE_BACKEND_ACL => &[DEVSHARE_SEGMENTS_ACL],
        DEVSHARE_BACKEND_CUDA => &[DEVSHARE_SEGMENTS_CUDA_FD, DEVSHARE_SEGMENTS_CUDA_FABRIC],
        _ => return Err(Error::invalid("flags", format!("{} handles cannot be segmented", h.backend_name()))),
    };
    if !expected_kinds.contains(&seg.kind) {
        return Err(Error::invalid(
            "ext",
            format!("segment table kind {} is not one of the {} kinds {expected_kinds:?}", seg.kind, h.backend_name()),
        ));
    }
    if seg.count == 0 {
        return Err(Error::invalid("ext", "a segmented handle has zero segments"));
    }
    if seg.count > DEVSHARE_MAX_SEGMENTS {
        return Err(Error::bad_size(
            "ext",
            format!("{} segments is above the maximum {DEVSHARE_MAX_SEGMENTS}", seg.count),
        ));
    }
    if seg.segment_size == 0 || seg.segment_size % DEVSHARE_SEGMENT_GRANULARITY != 0 {
        return Err(Error::bad_size(
            "ext",
            format!(
                "segment_size {} is not a positive multiple of the {DEVSHARE_SEGMENT_GRANULARITY}-byte granularity",
                seg.segment_size
            ),
        ));
    }
    let total =
        seg.segment_size.checked_mul(u64::from(seg.count)).filter(|&t| t <= i64::MAX as u64).ok_or_else(|| {
            Error::bad_size("ext", format!("{} x {} bytes overflows 2^63-1", seg.count, seg.segment_size))
        })?;
    if h.alloc_size != total {
        return Err(Error::bad_size(
            "alloc_size",
            format!(
                "{} is not segment count {} x segment_size {} = {total}",
                h.alloc_size, seg.count, seg.segment_size
            ),
        ));
    }
    if seg.kind == DEVSHARE_SEGMENTS_CUDA_FD && h.producer_pid <= 0 {
        return Err(Error::invalid("producer_pid", "fd segment tables need the producer's pid (0 is not a pid)"));
    }
    let key_len = h.key_len as usize;
    if seg.inline {
        if key_len != seg.table_len() {
            return Err(Error::BadLength(format!(
                "inline segment table: key_len {key_len} is not {} segments x {} bytes",
                seg.count,
                record_size(seg.kind).unwrap_or(0)
            )));
        }
        check_table(&seg, h.key_bytes())?;
    } else if key_len != 0 {
        return Err(Error::invalid("key_len", "must be 0 when the segment table is not inline"));
    }
    Ok(Some(seg))
}

/// Check a segment table against its handle's description: length, checksum and entries.
pub fn check_table(seg: &Segments, table: &[u8]) -> Result<()> {
    if table.len() != seg.table_len() {
        return Err(Error::BadLength(format!(
            "segment table has {} bytes; {} segments of {} need {}",
            table.len(),
            seg.count,
            kind_name(seg.kind),
            seg.table_len()
        )));
    }
    let crc = crc32fast::hash(table);
    if crc != seg.table_crc {
        return Err(Error::ChecksumMismatch(format!(
            "segment table crc32 {crc:#010x} does not match the handle's {:#010x}: the table belongs \
             to another handle or was altered",
            seg.table_crc
        )));
    }
    if seg.kind == DEVSHARE_SEGMENTS_CUDA_FD {
        for (i, fd) in table.chunks_exact(4).enumerate() {
            let fd = i32::from_le_bytes(fd.try_into().expect("4 bytes"));
            if fd < 0 {
                return Err(Error::invalid("segments", format!("segment {i}: fd {fd} is negative")));
            }
        }
    }
    Ok(())
}

/// Make `h` a segmented handle: flag, description record and (when it fits) the inline table.
/// `alloc_size` is set to `count x segment_size`. The caller validates afterwards.
pub fn set_segments(h: &mut DevshareHandle, segment_size: u64, kind: u16, table: &[u8]) -> Result<Segments> {
    let rec = record_size(kind).ok_or_else(|| Error::InvalidArgument(format!("segment kind {kind} is unknown")))?;
    if table.is_empty() || table.len() % rec != 0 {
        return Err(Error::BadLength(format!(
            "segment table of {} bytes is not a list of {rec}-byte records",
            table.len()
        )));
    }
    let count = u32::try_from(table.len() / rec).map_err(|_| Error::bad_size("segments", "too many segments"))?;
    let inline = table.len() <= DEVSHARE_KEY_CAPACITY;
    let seg = Segments { segment_size, count, kind, inline, table_crc: crc32fast::hash(table) };
    h.flags |= DEVSHARE_HANDLE_FLAG_SEGMENTED;
    h.alloc_size = segment_size.saturating_mul(u64::from(count));
    if inline {
        h.set_key(table);
    } else {
        h.set_key(&[]);
    }
    // The description is the first record: rebuild the area with it and any other records.
    let others: Vec<(u16, Vec<u8>)> = ext_records(h.ext_bytes())?
        .into_iter()
        .filter(|r| r.kind != DEVSHARE_EXT_SEGMENTS)
        .map(|r| (r.kind, r.data.to_vec()))
        .collect();
    let mut area = Vec::with_capacity(DEVSHARE_HANDLE_EXT_CAPACITY);
    for (kind, data) in std::iter::once((DEVSHARE_EXT_SEGMENTS, seg.encode().to_vec())).chain(others) {
        area.extend_from_slice(&kind.to_le_bytes());
        area.extend_from_slice(&(data.len() as u16).to_le_bytes());
        area.extend_from_slice(&data);
    }
    if area.len() > DEVSHARE_HANDLE_EXT_CAPACITY {
        return Err(Error::invalid("ext", "no room for the segments record"));
    }
    h.ext = [0; DEVSHARE_HANDLE_EXT_CAPACITY];
    h.ext[..area.len()].copy_from_slice(&area);
    h.ext_len = area.len() as u16;
    Ok(seg)
}

/// A validated segment table next to its description: what a backend maps.
#[derive(Clone, Copy, Debug)]
pub struct SegmentTable<'a> {
    /// The description.
    pub seg: Segments,
    /// `seg.count` records of `seg.kind`, little-endian.
    pub table: &'a [u8],
    /// The producer's pid (the process in which fd records are valid).
    pub producer_pid: i32,
}

impl<'a> SegmentTable<'a> {
    /// The table of a segmented handle: inline, or `external` (checked against the handle).
    /// `Ok(None)` for a handle that is not segmented.
    pub fn of(h: &'a DevshareHandle, external: Option<&'a [u8]>) -> Result<Option<SegmentTable<'a>>> {
        let Some(seg) = segments(h)? else {
            if external.is_some() {
                return Err(Error::InvalidArgument(
                    "a segment table was given for a handle that is not segmented".into(),
                ));
            }
            return Ok(None);
        };
        let table = match (seg.inline, external) {
            (true, None) => h.key_bytes(),
            (true, Some(_)) => {
                return Err(Error::InvalidArgument("the handle holds its segment table: pass none".into()))
            }
            (false, Some(t)) => {
                check_table(&seg, t)?;
                t
            }
            (false, None) => {
                return Err(Error::InvalidArgument(format!(
                    "the handle names {} segments whose table does not fit the handle struct: import from \
                     the encoding (devshare_import_encoded / devshare_import_text) or the PyTorch tuple \
                     (devshare_import_torch), which carry it",
                    seg.count
                )))
            }
        };
        Ok(Some(SegmentTable { seg, table, producer_pid: h.producer_pid }))
    }

    /// acl: the shareable handles, in address order.
    pub fn acl_handles(&self) -> impl Iterator<Item = u64> + 'a {
        self.table.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
    }

    /// cuda fd tables: the producer's fd numbers, in address order.
    pub fn fds(&self) -> impl Iterator<Item = i32> + 'a {
        self.table.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
    }

    /// cuda fabric tables: the 64-byte fabric handles, in address order.
    pub fn fabric_handles(&self) -> impl Iterator<Item = [u8; 64]> + 'a {
        self.table.chunks_exact(64).map(|c| c.try_into().expect("64 bytes"))
    }
}
