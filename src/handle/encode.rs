//! The canonical byte encoding of a handle.
//!
//! Little-endian, never the raw struct: a 12-byte header (`"DVSH"`, format major version u16,
//! format minor version u16, total length u32), the fields that are in use (only `ndim`
//! dimensions, only `key_len` key bytes, the ref-counter and event only when present), the
//! handle's extension records, then sections a later minor version may add, then a CRC-32 of
//! everything before it.
//!
//! Minor 0 (what devshare 0.1 wrote) ends after the event; minor >= 1 adds the extension block
//! and the sections. A reader accepts every minor version of its major version: it skips
//! sections it does not know unless their type carries `DEVSHARE_EXT_MUST_UNDERSTAND`, in which
//! case it refuses the handle with `UnsupportedVersion`, naming the type. The struct's flags and
//! extension records travel as they are (also those the encoder did not understand);
//! `layout_minor` does not: a decoded handle is laid out by the decoder and carries its minor.
//!
//! ```text
//! magic[4] version:u16 minor:u16 total_len:u32
//! backend:u16 ndim:u8 key_len:u8 flags:u32 device_index:i32 producer_pid:i32
//! device_uuid[16] host_id[16] alloc_size:u64 storage_offset:u64 storage_size:u64
//! tensor_offset:i64 dtype_code:u8 dtype_bits:u8 dtype_lanes:u16
//! shape[ndim]:i64 strides[ndim]:i64 key[key_len]
//! ref_name_len:u8 ref_name[ref_name_len] (ref_slot:u64 if ref_name_len > 0)
//! (event_handle[64] if flags & EVENT)
//! ext_len:u8 ext[ext_len]                         -- minor >= 1: the struct's extension records
//! { type:u16 0:u16 len:u32 data[len] } ...        -- minor >= 1: sections, up to the checksum
//! crc32:u32   -- CRC-32 (IEEE) of every byte before it
//! ```

use super::*;
use crate::error::{Error, Result};

/// The four bytes every encoded handle starts with.
pub const MAGIC: [u8; 4] = *b"DVSH";
/// Encoding format (major) version written and read by this library.
pub const DEVSHARE_ENCODING_VERSION: u16 = 1;
/// Encoding minor version written by this library (any minor of the major version is read).
pub const DEVSHARE_ENCODING_MINOR: u16 = 1;
const HEADER_LEN: usize = 12;
const FIXED_BODY_LEN: usize = 84;
/// Largest encoded handle this library writes for a handle whose segment table (if any) is
/// inline, in bytes. A segmented handle with a longer table, and any handle of a later minor
/// version, may encode longer (sections): size buffers with the length query, not only with
/// this constant.
pub const DEVSHARE_HANDLE_MAX_ENCODED_SIZE: usize = 606;
/// Largest encoding any reader accepts (8 MiB), whatever sections it carries: room for the
/// longest segment table (`DEVSHARE_MAX_SEGMENTS` 64-byte fabric handles, 4 MiB). Writers refuse
/// to produce more.
pub const DEVSHARE_HANDLE_DECODE_LIMIT: usize = 8 << 20;
static_assertions::const_assert_eq!(
    DEVSHARE_HANDLE_MAX_ENCODED_SIZE,
    HEADER_LEN
        + FIXED_BODY_LEN
        + 2 * 8 * DEVSHARE_MAX_NDIM
        + DEVSHARE_KEY_CAPACITY
        + 1
        + DEVSHARE_REF_NAME_CAPACITY
        + 8
        + DEVSHARE_EVENT_HANDLE_SIZE
        + 1
        + DEVSHARE_HANDLE_EXT_CAPACITY
        + 4
);

/// Encode a valid handle into `out` (cleared first). Invalid handles are refused.
pub fn encode_into(h: &DevshareHandle, out: &mut Vec<u8>) -> Result<()> {
    encode_full_into(h, None, out)
}

/// Encode a valid handle together with its segment table when the table is not inline (a
/// segmented handle of many segments); `table` must be `None` otherwise.
pub fn encode_full_into(h: &DevshareHandle, table: Option<&[u8]>, out: &mut Vec<u8>) -> Result<()> {
    validate(h)?;
    let external = match (segments::segments(h)?, table) {
        (Some(seg), Some(t)) if !seg.inline => {
            segments::check_table(&seg, t)?;
            Some(t)
        }
        (Some(seg), None) if !seg.inline => {
            return Err(Error::InvalidArgument(format!(
                "the handle's {} segments are not inline: its segment table must be encoded with it",
                seg.count
            )))
        }
        (_, Some(_)) => {
            return Err(Error::InvalidArgument(
                "a segment table was given for a handle that holds its own (or none)".into(),
            ))
        }
        (_, None) => None,
    };
    out.clear();
    out.reserve(DEVSHARE_HANDLE_MAX_ENCODED_SIZE);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&DEVSHARE_ENCODING_VERSION.to_le_bytes());
    out.extend_from_slice(&DEVSHARE_ENCODING_MINOR.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes()); // total length, patched below
    out.extend_from_slice(&h.backend.to_le_bytes());
    out.push(h.ndim as u8);
    out.push(h.key_len as u8);
    out.extend_from_slice(&h.flags.to_le_bytes());
    out.extend_from_slice(&h.device_index.to_le_bytes());
    out.extend_from_slice(&h.producer_pid.to_le_bytes());
    out.extend_from_slice(&h.device_uuid);
    out.extend_from_slice(&h.host_id);
    out.extend_from_slice(&h.alloc_size.to_le_bytes());
    out.extend_from_slice(&h.storage_offset.to_le_bytes());
    out.extend_from_slice(&h.storage_size.to_le_bytes());
    out.extend_from_slice(&h.tensor_offset.to_le_bytes());
    out.push(h.dtype.code);
    out.push(h.dtype.bits);
    out.extend_from_slice(&h.dtype.lanes.to_le_bytes());
    for d in h.dims() {
        out.extend_from_slice(&d.to_le_bytes());
    }
    for s in h.stride_dims() {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.extend_from_slice(h.key_bytes());
    out.push(h.ref_name_len as u8);
    if h.ref_name_len > 0 {
        out.extend_from_slice(h.ref_name_bytes());
        out.extend_from_slice(&h.ref_slot.to_le_bytes());
    }
    if h.flags & DEVSHARE_HANDLE_FLAG_EVENT != 0 {
        out.extend_from_slice(&h.event_handle);
    }
    out.push(h.ext_len as u8);
    out.extend_from_slice(h.ext_bytes());
    if let Some(t) = external {
        out.extend_from_slice(&segments::DEVSHARE_EXT_SEGMENTS.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(t.len() as u32).to_le_bytes());
        out.extend_from_slice(t);
    }
    if out.len() + 4 > DEVSHARE_HANDLE_DECODE_LIMIT {
        return Err(Error::BadLength(format!(
            "the encoding would be {} bytes, above the {DEVSHARE_HANDLE_DECODE_LIMIT}-byte limit readers accept",
            out.len() + 4
        )));
    }
    let total = (out.len() + 4) as u32;
    out[8..12].copy_from_slice(&total.to_le_bytes());
    let crc = crc32fast::hash(out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Encode a valid handle into a new vector.
pub fn encode(h: &DevshareHandle) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encode_into(h, &mut out)?;
    Ok(out)
}

/// A decoded handle and, for a segmented handle whose table is not inline, its segment table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    /// The handle, validated.
    pub handle: DevshareHandle,
    /// The segment table that travelled next to it (checked against the handle's description).
    pub table: Option<Vec<u8>>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            Error::Truncated(format!(
                "encoding ends inside field {field} (needs {n} bytes at offset {}, {} left)",
                self.pos,
                self.buf.len() - self.pos
            ))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        Ok(self.take(N, field)?.try_into().expect("take returned N bytes"))
    }
    fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.take(1, field)?[0])
    }
    fn u16(&mut self, field: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn i32(&mut self, field: &str) -> Result<i32> {
        Ok(i32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    fn i64(&mut self, field: &str) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array(field)?))
    }
}

/// Decode and validate handle bytes. Every rejection has its own status and names the field.
/// A segmented handle's external table is checked and dropped: use [`decode_full`] to keep it.
pub fn decode(buf: &[u8]) -> Result<DevshareHandle> {
    decode_full(buf).map(|d| d.handle)
}

/// Decode and validate handle bytes, keeping a segment table that travelled with them.
pub fn decode_full(buf: &[u8]) -> Result<Decoded> {
    let probe = buf.len().min(MAGIC.len());
    if buf[..probe] != MAGIC[..probe] {
        return Err(Error::BadMagic(format!("input starts with {:02x?}, expected \"DVSH\"", &buf[..probe])));
    }
    if buf.len() < HEADER_LEN + 4 {
        return Err(Error::Truncated(format!(
            "{} bytes is shorter than the {}-byte header and checksum",
            buf.len(),
            HEADER_LEN + 4
        )));
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version != DEVSHARE_ENCODING_VERSION {
        return Err(Error::UnsupportedVersion(format!(
            "encoding format version {version} (this library reads format \
             {DEVSHARE_ENCODING_VERSION}.x)"
        )));
    }
    let minor = u16::from_le_bytes([buf[6], buf[7]]);
    let total = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
    if total > DEVSHARE_HANDLE_DECODE_LIMIT {
        return Err(Error::BadLength(format!(
            "header says {total} bytes, above the {DEVSHARE_HANDLE_DECODE_LIMIT}-byte limit"
        )));
    }
    if total > buf.len() {
        return Err(Error::Truncated(format!("header says {total} bytes, input has {}", buf.len())));
    }
    if total < buf.len() {
        return Err(Error::BadLength(format!("header says {total} bytes, input has {} (trailing bytes)", buf.len())));
    }
    let (content, crc) = buf.split_at(total - 4);
    let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    let actual = crc32fast::hash(content);
    if stored != actual {
        return Err(Error::ChecksumMismatch(format!(
            "stored crc32 {stored:#010x}, computed {actual:#010x}: the bytes were altered"
        )));
    }

    let mut r = Reader { buf: content, pos: HEADER_LEN };
    let mut table: Option<Vec<u8>> = None;
    let mut h = DevshareHandle { backend: r.u16("backend")?, ..Default::default() };
    let ndim = r.u8("ndim")? as usize;
    if ndim > DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!("{ndim} is above the maximum {DEVSHARE_MAX_NDIM}")));
    }
    h.ndim = ndim as u32;
    let key_len = r.u8("key_len")? as usize;
    if key_len > DEVSHARE_KEY_CAPACITY {
        return Err(Error::BadKey(format!("key_len {key_len} exceeds the capacity of {DEVSHARE_KEY_CAPACITY} bytes")));
    }
    h.flags = r.u32("flags")?;
    h.device_index = r.i32("device_index")?;
    h.producer_pid = r.i32("producer_pid")?;
    h.device_uuid = r.array("device_uuid")?;
    h.host_id = r.array("host_id")?;
    h.alloc_size = r.u64("alloc_size")?;
    h.storage_offset = r.u64("storage_offset")?;
    h.storage_size = r.u64("storage_size")?;
    h.tensor_offset = r.i64("tensor_offset")?;
    h.dtype.code = r.u8("dtype")?;
    h.dtype.bits = r.u8("dtype")?;
    h.dtype.lanes = r.u16("dtype")?;
    for i in 0..ndim {
        h.shape[i] = r.i64("shape")?;
    }
    for i in 0..ndim {
        h.strides[i] = r.i64("strides")?;
    }
    h.set_key(r.take(key_len, "key")?);
    let name_len = r.u8("ref_name_len")? as usize;
    if name_len > DEVSHARE_REF_NAME_CAPACITY {
        return Err(Error::invalid(
            "ref_name_len",
            format!("{name_len} exceeds the capacity of {DEVSHARE_REF_NAME_CAPACITY} bytes"),
        ));
    }
    if name_len > 0 {
        let name = r.take(name_len, "ref_name")?;
        let slot = r.u64("ref_slot")?;
        h.set_ref(name, slot);
    }
    if h.flags & DEVSHARE_HANDLE_FLAG_EVENT != 0 {
        h.event_handle = r.array("event_handle")?;
    }
    if minor >= 1 {
        let ext_len = r.u8("ext_len")? as usize;
        if ext_len > DEVSHARE_HANDLE_EXT_CAPACITY {
            return Err(Error::invalid(
                "ext_len",
                format!("{ext_len} exceeds the capacity of {DEVSHARE_HANDLE_EXT_CAPACITY} bytes"),
            ));
        }
        h.ext[..ext_len].copy_from_slice(r.take(ext_len, "ext")?);
        h.ext_len = ext_len as u16;
        // Sections: the segment table (kept); every other one it may ignore is skipped.
        while r.pos < content.len() {
            let kind = r.u16("section type")?;
            if r.u16("section reserved")? != 0 {
                return Err(Error::invalid("section", format!("section {kind:#06x}: reserved bytes must be 0")));
            }
            let len = r.u32("section length")? as usize;
            let data = r.take(len, "section data")?;
            if kind == segments::DEVSHARE_EXT_SEGMENTS {
                if table.is_some() {
                    return Err(Error::invalid("section", "more than one segment table"));
                }
                table = Some(data.to_vec());
                continue;
            }
            if kind == 0 {
                return Err(Error::invalid("section", "section type 0 is invalid"));
            }
            if kind & DEVSHARE_EXT_MUST_UNDERSTAND != 0 {
                return Err(Error::UnsupportedVersion(format!(
                    "the encoding (format {version}.{minor}) carries section type {kind:#06x} that \
                     must be understood, which this library (format \
                     {DEVSHARE_ENCODING_VERSION}.{DEVSHARE_ENCODING_MINOR}) does not know; update \
                     devshare on the receiving side"
                )));
            }
        }
    }
    if r.pos != content.len() {
        return Err(Error::BadLength(format!("{} unexpected bytes after the last field", content.len() - r.pos)));
    }
    validate(&h)?;
    match (segments::segments(&h)?, &table) {
        (Some(seg), Some(t)) if !seg.inline => segments::check_table(&seg, t)?,
        (Some(seg), None) if !seg.inline => {
            return Err(Error::Truncated(format!(
                "the handle names {} segments but the encoding carries no segment table",
                seg.count
            )))
        }
        (_, Some(_)) => return Err(Error::invalid("section", "a segment table section for a handle that needs none")),
        (_, None) => {}
    }
    Ok(Decoded { handle: h, table })
}
