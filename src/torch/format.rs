//! The bytes of a PyTorch / torch_npu storage handle (arg 7 of `reduce_tensor`, item 1 of
//! `_share_cuda_()` / `_share_npu_()`): every version's form, read into one neutral
//! [`StorageHandle`] and written back in the form a given consumer reads ([`TorchFormat`]).
//!
//! | backend | bytes | form | written by |
//! |---|---|---|---|
//! | cuda | 64 | raw `cudaIpcMemHandle_t` | PyTorch <= 2.4; read by every PyTorch |
//! | cuda | 66 | `[v]['c'][64-byte handle]`, v = 1, 2 or 3 | PyTorch 2.5-2.12 (2), 2.13+ (3) |
//! | cuda | 26 + 4n / 26 + 64n | `[2]['e'][i32 pid][4 pad][u64 segment_size][u64 n][records]` | PyTorch 2.5-2.12 |
//! | cuda | 34 + 4n / 34 + 64n | `[3]['e'][i32 pid][4 pad][u64 segment_size][u64 n][i32 handle_type][4 pad][records]` | PyTorch 2.13+ |
//! | acl | 65 | raw NUL-terminated ACL IPC key | legacy torch_npu |
//! | acl | 67 | `[1]['c'][65-byte key]` | torch_npu |
//! | acl | 18 + 8n | `[1]['e'][u64 segment_size][u64 n][n x u64 shareable handle]` | torch_npu |
//!
//! Readers: a PyTorch consumer accepts `version <= its own` (2 up to 2.12, 3 from 2.13) and a raw
//! 64-byte handle always. PyTorch 2.13+ reads every 'e' handle of version <= 3 with the 32-byte
//! header, so a version-2 'e' handle is misparsed there; PyTorch 2.5-2.12 refuse version 3 ("a
//! future version of torch") and decide between fd and fabric records from their own settings,
//! not from the handle. Padding words are not reliably zeroed by PyTorch: they are ignored here
//! and written as zero, and nothing compares raw 'e' bytes.

use crate::error::{Error, Result};
use crate::handle::segments::{
    self, DEVSHARE_MAX_SEGMENTS, DEVSHARE_SEGMENTS_ACL, DEVSHARE_SEGMENTS_CUDA_FABRIC, DEVSHARE_SEGMENTS_CUDA_FD,
};
use crate::handle::{AclKey, ACL_KEY_LEN, DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA};

/// Size of a CUDA IPC memory handle.
pub(crate) const CUDA_HANDLE: usize = 64;
/// Highest handle-format version PyTorch writes (2.13 and later write 3).
const CUDA_MAX_VERSION: u8 = 3;
/// torch_npu writes version 1 only.
const ACL_MAX_VERSION: u8 = 1;
/// `handle_type` of a version-3 CUDA 'e' header: POSIX fd records.
const V3_TYPE_FD: i32 = 1;
/// `handle_type` of a version-3 CUDA 'e' header: 64-byte fabric records.
const V3_TYPE_FABRIC: i32 = 2;

/// What a PyTorch storage handle names, whatever form it came in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageHandle {
    /// One allocation: its vendor key (ACL key with a zero tail, or CUDA IPC handle).
    Key(Vec<u8>),
    /// An expandable segment: equal VMM segments, from the first page that holds the block.
    Segmented {
        /// Bytes per segment.
        segment_size: u64,
        /// `DEVSHARE_SEGMENTS_*` kind of `table`.
        kind: u16,
        /// The producer's pid (CUDA 'e' headers carry it; torch_npu's do not).
        pid: Option<i32>,
        /// The segment table in devshare's form (little-endian records).
        table: Vec<u8>,
    },
}

/// Which form of storage handle to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchFormat {
    /// What devshare 1.0 and 1.1 wrote: cuda 'c' as the raw 64-byte handle (every PyTorch reads
    /// it), cuda 'e' as version 2 (PyTorch 2.5-2.12); acl as version 1 (every torch_npu).
    Default,
    /// The unprefixed key: the raw 64-byte CUDA handle or 65-byte ACL key (PyTorch <= 2.4 and
    /// legacy torch_npu write it, every version reads it). Expandable segments have no such form.
    Unversioned,
    /// This handle-format version byte: 1, 2 or 3 (cuda), 1 (acl).
    Version(u8),
}

/// How a 'c' handle is written for a format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyForm {
    /// Handing a devshare export to a consumer: the form every reader of the format reads
    /// (cuda: always the raw 64 bytes; acl: `[1]['c']` unless [`TorchFormat::Unversioned`]).
    HandBack,
    /// Rewriting another producer's handle: exactly the named version's bytes.
    Exact,
}

/// `DEVSHARE_TORCH_FORMAT_UNVERSIONED` in the C API (outside the version bytes 0..=255).
pub(crate) const FORMAT_UNVERSIONED: u32 = 0x100;

impl TorchFormat {
    /// From the C API's `DEVSHARE_TORCH_FORMAT_*` value.
    pub fn from_c(v: u32) -> Result<TorchFormat> {
        match v {
            0 => Ok(TorchFormat::Default),
            FORMAT_UNVERSIONED => Ok(TorchFormat::Unversioned),
            1..=3 => Ok(TorchFormat::Version(v as u8)),
            _ => Err(Error::InvalidArgument(format!(
                "format {v:#x} is not a storage-handle format: DEVSHARE_TORCH_FORMAT_DEFAULT (0), a handle \
                 version 1..=3, DEVSHARE_TORCH_FORMAT_UNVERSIONED ({FORMAT_UNVERSIONED:#x}), or \
                 devshare_torch_format_for_version's answer"
            ))),
        }
    }

    /// The C API's `DEVSHARE_TORCH_FORMAT_*` value.
    pub fn to_c(self) -> u32 {
        match self {
            TorchFormat::Default => 0,
            TorchFormat::Unversioned => FORMAT_UNVERSIONED,
            TorchFormat::Version(v) => u32::from(v),
        }
    }

    fn describe(self) -> String {
        match self {
            TorchFormat::Default => "the default format".into(),
            TorchFormat::Unversioned => "the unversioned (raw key) format".into(),
            TorchFormat::Version(v) => format!("version {v}"),
        }
    }
}

/// The `(major, minor)` of a version string such as `2.13.0+cu128`, `2.7.1.post2` or `2.14.0a0+git1234`.
fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts.next()?.chars().take_while(|c| c.is_ascii_digit()).collect();
    Some((major, minor.parse().ok()?))
}

/// The format a consumer running this torch (cuda: PyTorch's `torch.__version__`) or torch_npu
/// (acl: `torch_npu.__version__`, or the torch version it is built for) reads and would write
/// itself: PyTorch <= 2.4 the unversioned raw handle, 2.5-2.12 version 2, 2.13 and later
/// version 3; every torch_npu version 1.
pub fn format_for_torch_version(backend: u16, version: &str) -> Result<TorchFormat> {
    let (major, minor) = major_minor(version).ok_or_else(|| {
        Error::InvalidArgument(format!("{version:?} is not a torch version (MAJOR.MINOR[.PATCH...])"))
    })?;
    match backend {
        DEVSHARE_BACKEND_CUDA => Ok(match (major, minor) {
            (0 | 1, _) | (2, 0..=4) => TorchFormat::Unversioned,
            (2, 5..=12) => TorchFormat::Version(2),
            _ => TorchFormat::Version(3),
        }),
        DEVSHARE_BACKEND_ACL => Ok(TorchFormat::Version(1)),
        _ => Err(Error::InvalidArgument(format!(
            "backend {backend}: PyTorch storage handles exist for cuda (3) and acl (2)"
        ))),
    }
}

fn names(backend: u16) -> Result<(usize, u8, &'static str)> {
    match backend {
        DEVSHARE_BACKEND_CUDA => Ok((CUDA_HANDLE, CUDA_MAX_VERSION, "CUDA")),
        DEVSHARE_BACKEND_ACL => Ok((ACL_KEY_LEN, ACL_MAX_VERSION, "ACL")),
        _ => Err(Error::InvalidArgument(format!(
            "backend {backend}: PyTorch storage handles exist for cuda (3) and acl (2)"
        ))),
    }
}

fn ne_u64(b: &[u8]) -> u64 {
    u64::from_ne_bytes(b.try_into().expect("8 bytes"))
}

fn ne_i32(b: &[u8]) -> i32 {
    i32::from_ne_bytes(b.try_into().expect("4 bytes"))
}

/// `[u64 segment_size][u64 num_handles]` of an 'e' payload (host-endian), checked.
fn segment_count(name: &str, seg_and_n: &[u8]) -> Result<(u64, u64)> {
    let seg = ne_u64(&seg_and_n[..8]);
    let n = ne_u64(&seg_and_n[8..16]);
    if n == 0 {
        return Err(Error::invalid("handle", format!("{name} 'e' storage handle lists zero segments")));
    }
    if n > u64::from(DEVSHARE_MAX_SEGMENTS) {
        return Err(Error::bad_size(
            "handle",
            format!("{name} 'e' storage handle lists {n} segments, above the maximum {DEVSHARE_MAX_SEGMENTS}"),
        ));
    }
    Ok((seg, n))
}

fn short_header(name: &str, version: u8, got: usize, need: usize) -> Error {
    Error::BadLength(format!(
        "{name} 'e' storage handle of version {version} ends inside its header ({got} bytes after the prefix, {need} needed)"
    ))
}

/// Parse the 'e' payload (after `[version]['e']`) of a torch_npu or PyTorch CUDA handle.
fn parse_expandable(backend: u16, version: u8, p: &[u8]) -> Result<StorageHandle> {
    if backend == DEVSHARE_BACKEND_ACL {
        if version != 1 {
            return Err(Error::UnsupportedVersion(format!(
                "ACL 'e' storage handle version {version} (torch_npu writes version 1, the only one this library reads)"
            )));
        }
        if p.len() < 16 {
            return Err(short_header("ACL", version, p.len(), 16));
        }
        let (segment_size, n) = segment_count("ACL", &p[..16])?;
        let records = &p[16..];
        if records.len() as u64 != n * 8 {
            return Err(Error::BadLength(format!(
                "ACL 'e' storage handle says {n} segments but carries {} bytes of shareable handles ({} needed)",
                records.len(),
                n * 8
            )));
        }
        let table = records.chunks_exact(8).flat_map(|c| ne_u64(c).to_le_bytes()).collect();
        return Ok(StorageHandle::Segmented { segment_size, kind: DEVSHARE_SEGMENTS_ACL, pid: None, table });
    }
    // Version 2: {int32 pid; 4 pad; u64 segment_size; u64 num_handles}, record kind from the
    // length. Version 3: the same plus {int32 handle_type; 4 pad}, record kind from the type
    // (0: from the length). Both padding words are ignored.
    let header = match version {
        2 => 24,
        3 => 32,
        1 => {
            return Err(Error::UnsupportedVersion(
                "CUDA 'e' storage handle version 1: no released PyTorch writes it and its layout is not \
                 known, so this library does not guess; PyTorch 2.5 to 2.12 write version 2, 2.13 and later 3"
                    .into(),
            ))
        }
        v => {
            return Err(Error::UnsupportedVersion(format!(
                "CUDA 'e' storage handle version {v} (this library reads versions 2 and 3: PyTorch 2.5 to 2.15)"
            )))
        }
    };
    if p.len() < header {
        return Err(short_header("CUDA", version, p.len(), header));
    }
    let pid = ne_i32(&p[..4]);
    let (segment_size, n) = segment_count("CUDA", &p[8..24])?;
    let records = &p[header..];
    let fd_len = n * 4;
    let fabric_len = n * 64;
    let kind = if version == 3 {
        let handle_type = ne_i32(&p[24..28]);
        let (kind, need, what) = match handle_type {
            V3_TYPE_FD => (DEVSHARE_SEGMENTS_CUDA_FD, fd_len, "POSIX fd"),
            V3_TYPE_FABRIC => (DEVSHARE_SEGMENTS_CUDA_FABRIC, fabric_len, "fabric"),
            0 => (0, 0, ""),
            t => {
                return Err(Error::invalid(
                    "handle",
                    format!(
                        "CUDA 'e' storage handle of version 3 has handle type {t}: not one of 0 (infer), \
                         1 (POSIX fd), 2 (fabric)"
                    ),
                ))
            }
        };
        if kind != 0 && records.len() as u64 != need {
            return Err(Error::BadLength(format!(
                "CUDA 'e' storage handle of version 3 has handle type {handle_type} ({what} records) and {n} \
                 segments but carries {} record bytes ({need} needed)",
                records.len()
            )));
        }
        kind
    } else {
        0
    };
    let kind = match kind {
        0 if records.len() as u64 == fd_len => DEVSHARE_SEGMENTS_CUDA_FD,
        0 if records.len() as u64 == fabric_len => DEVSHARE_SEGMENTS_CUDA_FABRIC,
        0 => {
            return Err(Error::BadLength(format!(
                "CUDA 'e' storage handle of version {version} says {n} segments but carries {} record bytes: \
                 neither {fd_len} (POSIX fds) nor {fabric_len} (fabric handles)",
                records.len(),
            )))
        }
        k => k,
    };
    let table: Vec<u8> = if kind == DEVSHARE_SEGMENTS_CUDA_FD {
        records.chunks_exact(4).flat_map(|c| ne_i32(c).to_le_bytes()).collect()
    } else {
        records.to_vec()
    };
    if kind == DEVSHARE_SEGMENTS_CUDA_FD && pid <= 0 {
        return Err(Error::invalid("handle", format!("CUDA 'e' storage handle: producer pid {pid} is not a pid")));
    }
    Ok(StorageHandle::Segmented { segment_size, kind, pid: Some(pid), table })
}

/// What a PyTorch storage handle names, for `backend`: every form of the module table.
pub fn parse_storage_handle(backend: u16, bytes: &[u8]) -> Result<StorageHandle> {
    let (raw, max_version, name) = names(backend)?;
    if bytes.is_empty() {
        return Err(Error::InvalidArgument(
            "the storage handle is empty (PyTorch sends None for an empty storage): there is no memory to share".into(),
        ));
    }
    let key: &[u8] = if bytes.len() == raw {
        bytes
    } else if bytes.len() >= 2 && bytes[1] == b'e' {
        return parse_expandable(backend, bytes[0], &bytes[2..]);
    } else if bytes.len() >= 2 && bytes[1] == b'c' {
        let version = bytes[0];
        if version == 0 || version > max_version {
            return Err(Error::UnsupportedVersion(format!(
                "{name} storage handle version {version} (this library reads 'c' handles of versions 1..={max_version})"
            )));
        }
        if bytes.len() != raw + 2 {
            return Err(Error::BadKey(format!(
                "{name} 'c' storage handle of version {version} must be {} bytes, got {}",
                raw + 2,
                bytes.len()
            )));
        }
        &bytes[2..]
    } else {
        return Err(Error::BadKey(format!(
            "{name} storage handle of {} bytes is neither the raw {raw}-byte form nor \
             [version]['c'][{raw} bytes]",
            bytes.len()
        )));
    };
    if backend == DEVSHARE_BACKEND_ACL {
        // A C string in a 65-byte buffer; what follows the NUL is unspecified.
        return Ok(StorageHandle::Key(AclKey::normalize(key)?.as_bytes().to_vec()));
    }
    Ok(StorageHandle::Key(key.to_vec()))
}

fn refuse(name: &str, what: &str, format: TorchFormat, why: &str) -> Error {
    Error::Unsupported(format!("{name} {what} cannot be written in {}: {why}", format.describe()))
}

/// The bytes of `storage` in `format` for `backend` (`key_form`: see [`KeyForm`]). Refuses, by
/// name, what the format cannot express.
pub fn write_storage_handle(
    backend: u16,
    storage: &StorageHandle,
    format: TorchFormat,
    key_form: KeyForm,
) -> Result<Vec<u8>> {
    let (raw, _, name) = names(backend)?;
    if let TorchFormat::Version(v @ (0 | 4..)) = format {
        return Err(Error::InvalidArgument(format!("storage-handle version {v} does not exist (1, 2 or 3)")));
    }
    match storage {
        StorageHandle::Key(key) => {
            if key.len() > raw {
                return Err(Error::BadKey(format!("{name} key of {} bytes (at most {raw})", key.len())));
            }
            let mut k = key.clone();
            k.resize(raw, 0);
            let version = match (backend, format, key_form) {
                (_, TorchFormat::Unversioned, _) => None,
                (DEVSHARE_BACKEND_CUDA, TorchFormat::Default, _) | (DEVSHARE_BACKEND_CUDA, _, KeyForm::HandBack) => {
                    None
                }
                (DEVSHARE_BACKEND_CUDA, TorchFormat::Version(v), KeyForm::Exact) => Some(v),
                (_, TorchFormat::Default | TorchFormat::Version(1), _) => Some(1),
                (_, TorchFormat::Version(_), _) => {
                    return Err(refuse(name, "'c' handles", format, "torch_npu writes and reads version 1 only"))
                }
            };
            Ok(match version {
                None => k,
                Some(v) => [&[v, b'c'][..], &k].concat(),
            })
        }
        StorageHandle::Segmented { segment_size, kind, pid, table } => {
            let rec = segments::record_size(*kind)
                .ok_or_else(|| Error::InvalidArgument(format!("segment kind {kind} is unknown")))?;
            if table.is_empty() || table.len() % rec != 0 {
                return Err(Error::BadLength(format!(
                    "segment table of {} bytes is not a list of {rec}-byte records",
                    table.len()
                )));
            }
            let n = (table.len() / rec) as u64;
            let mut v = Vec::with_capacity(34 + table.len());
            if backend == DEVSHARE_BACKEND_ACL {
                if *kind != DEVSHARE_SEGMENTS_ACL {
                    return Err(Error::InvalidArgument(format!("segment kind {kind} is not an ACL kind")));
                }
                match format {
                    TorchFormat::Default | TorchFormat::Version(1) => {}
                    _ => {
                        return Err(refuse(
                            name,
                            "'e' handles",
                            format,
                            "torch_npu's expandable segments exist in version 1 only",
                        ))
                    }
                }
                v.extend_from_slice(&[1, b'e']);
                v.extend_from_slice(&segment_size.to_ne_bytes());
                v.extend_from_slice(&n.to_ne_bytes());
                for c in table.chunks_exact(8) {
                    v.extend_from_slice(&u64::from_le_bytes(c.try_into().expect("8 bytes")).to_ne_bytes());
                }
                return Ok(v);
            }
            let fabric = match *kind {
                DEVSHARE_SEGMENTS_CUDA_FD => false,
                DEVSHARE_SEGMENTS_CUDA_FABRIC => true,
                k => return Err(Error::InvalidArgument(format!("segment kind {k} is not a CUDA kind"))),
            };
            let version = match format {
                TorchFormat::Default => 2,
                TorchFormat::Version(2) if fabric => {
                    return Err(refuse(
                        name,
                        "'e' handles of fabric segments",
                        format,
                        "a version-2 header has no handle type and PyTorch 2.5-2.12 read the records as \
                         whatever their own settings say (POSIX fds unless configured for fabric); write \
                         version 3 for PyTorch 2.13 and later",
                    ))
                }
                TorchFormat::Version(v @ (2 | 3)) => v,
                TorchFormat::Version(_) => {
                    return Err(refuse(
                        name,
                        "'e' handles",
                        format,
                        "PyTorch writes expandable segments as version 2 (2.5-2.12) or 3 (2.13 and later) only",
                    ))
                }
                TorchFormat::Unversioned => {
                    return Err(refuse(
                        name,
                        "'e' handles",
                        format,
                        "PyTorch 2.4 and earlier cannot open expandable segments of another process",
                    ))
                }
            };
            v.extend_from_slice(&[version, b'e']);
            v.extend_from_slice(&pid.unwrap_or(0).to_ne_bytes());
            v.extend_from_slice(&[0; 4]);
            v.extend_from_slice(&segment_size.to_ne_bytes());
            v.extend_from_slice(&n.to_ne_bytes());
            if version == 3 {
                v.extend_from_slice(&(if fabric { V3_TYPE_FABRIC } else { V3_TYPE_FD }).to_ne_bytes());
                v.extend_from_slice(&[0; 4]);
            }
            if fabric {
                v.extend_from_slice(table);
            } else {
                for c in table.chunks_exact(4) {
                    v.extend_from_slice(&i32::from_le_bytes(c.try_into().expect("4 bytes")).to_ne_bytes());
                }
            }
            Ok(v)
        }
    }
}

/// The version bridge: `bytes` (any form [`parse_storage_handle`] reads) rewritten in `format`,
/// exactly as that version's producer writes it ('c' handles keep their key, 'e' handles their
/// pid, segment size and records; padding is written as zero).
pub fn convert_storage_handle(backend: u16, bytes: &[u8], format: TorchFormat) -> Result<Vec<u8>> {
    let storage = parse_storage_handle(backend, bytes)?;
    write_storage_handle(backend, &storage, format, KeyForm::Exact)
}
