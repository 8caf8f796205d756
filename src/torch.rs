//! PyTorch's and torch_npu's dialect: the fields of `reduce_tensor` / `_share_cuda_()` /
//! `_share_npu_()`, to and from a [`DevshareHandle`].
//!
//! Storage handle forms:
//!
//! | backend | bytes | form |
//! |---|---|---|
//! | cuda | 64 | raw `cudaIpcMemHandle_t` (PyTorch <= 2.4, and what devshare sends) |
//! | cuda | 66 | `[version 1..=3]['c'][64-byte handle]` (PyTorch >= 2.5) |
//! | acl | 65 | raw NUL-terminated ACL IPC key (legacy torch_npu) |
//! | acl | 67 | `[1]['c'][65-byte key]` (torch_npu, and what devshare sends) |
//! | acl | 18 + 8n | `[1]['e'][u64 segment_size][u64 n][n x u64 shareable handle]` (torch_npu expandable segments) |
//! | cuda | 26 + 4n / 26 + 64n | `[2]['e'][i32 pid][4 pad][u64 segment_size][u64 n][n x i32 fd or 64-byte fabric handle]` (PyTorch 2.5-2.12 expandable segments; version 3 is refused until its layout is confirmed) |

use crate::dtype::DevshareDType;
use crate::error::{Error, Result};
use crate::export::contiguous_strides;
use crate::handle::encode::Decoded;
use crate::handle::segments;
use crate::handle::{
    is_shm_name, validate, AclKey, DevshareHandle, ACL_KEY_LEN, DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA,
    DEVSHARE_EVENT_HANDLE_SIZE, DEVSHARE_HANDLE_FLAG_EVENT, DEVSHARE_MAX_NDIM, DEVSHARE_REF_NAME_CAPACITY,
};

/// Size of a CUDA IPC memory handle.
const CUDA_HANDLE: usize = 64;
/// Highest handle-format version whose 'c' payload is known (PyTorch writes 1, 2 or 3).
const CUDA_MAX_VERSION: u8 = 3;
/// torch_npu writes version 1 only.
const ACL_MAX_VERSION: u8 = 1;

/// The fields of one `reduce_tensor` tuple that describe the tensor and its storage (the tensor
/// and storage classes and `requires_grad` are Python-side matters).
#[derive(Clone, Copy, Debug)]
pub struct TorchArgs<'a> {
    /// `DEVSHARE_BACKEND_CUDA` (PyTorch) or `DEVSHARE_BACKEND_ACL` (torch_npu).
    pub backend: u16,
    /// Arg 5.
    pub dtype: DevshareDType,
    /// Arg 1, in elements.
    pub shape: &'a [i64],
    /// Arg 2, in elements; `None` for C-contiguous.
    pub strides: Option<&'a [i64]>,
    /// Arg 3: the tensor's offset in its storage, in elements.
    pub tensor_offset: i64,
    /// Arg 6: the device index (as the producer numbers it, or as rewritten by the receiver).
    pub device: i32,
    /// The producer's pid when the caller knows it; 0: taken from a `/torch_<pid>_...`
    /// ref-counter name, else unknown.
    pub producer_pid: i32,
    /// Arg 7: the storage handle bytes.
    pub handle: &'a [u8],
    /// Arg 8: the storage's size in bytes.
    pub storage_size: u64,
    /// Arg 9: the storage's byte offset in the exported allocation.
    pub storage_offset: u64,
    /// Arg 11: the ref-counter shm name (empty: no release signal).
    pub ref_name: &'a [u8],
    /// Arg 12: the ref-counter slot.
    pub ref_slot: u64,
    /// Arg 13: the event handle (ignored unless `event_sync_required`).
    pub event_handle: &'a [u8],
    /// Arg 14.
    pub event_sync_required: bool,
}

/// The 8-tuple a PyTorch consumer rebuilds a storage from (`_new_shared_cuda` /
/// `_new_shared_npu`), as bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchStorage {
    pub device: i32,
    pub handle: Vec<u8>,
    pub storage_size: u64,
    pub storage_offset: u64,
    pub ref_name: Vec<u8>,
    pub ref_slot: u64,
    pub event_handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
    pub event_sync_required: bool,
}

/// What a PyTorch storage handle names.
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

/// `[u64 segment_size][u64 num_handles]` of an 'e' payload (host-endian), with the records.
fn segment_header<'a>(name: &str, p: &'a [u8]) -> Result<(u64, u64, &'a [u8])> {
    if p.len() < 16 {
        return Err(Error::BadLength(format!(
            "{name} 'e' storage handle ends inside its header ({} bytes after the prefix, 16 needed)",
            p.len()
        )));
    }
    let seg = u64::from_ne_bytes(p[..8].try_into().expect("8 bytes"));
    let n = u64::from_ne_bytes(p[8..16].try_into().expect("8 bytes"));
    if n == 0 {
        return Err(Error::invalid("handle", format!("{name} 'e' storage handle lists zero segments")));
    }
    if n > u64::from(segments::DEVSHARE_MAX_SEGMENTS) {
        return Err(Error::bad_size(
            "handle",
            format!(
                "{name} 'e' storage handle lists {n} segments, above the maximum {}",
                segments::DEVSHARE_MAX_SEGMENTS
            ),
        ));
    }
    Ok((seg, n, &p[16..]))
}

/// Parse the 'e' payload (after `[version]['e']`) of a torch_npu or PyTorch CUDA handle.
fn parse_expandable(backend: u16, version: u8, p: &[u8]) -> Result<StorageHandle> {
    if backend == DEVSHARE_BACKEND_ACL {
        if version != 1 {
            return Err(Error::UnsupportedVersion(format!(
                "ACL 'e' storage handle version {version} (torch_npu writes version 1, the only one this library reads)"
            )));
        }
        let (segment_size, n, records) = segment_header("ACL", p)?;
        if records.len() as u64 != n * 8 {
            return Err(Error::BadLength(format!(
                "ACL 'e' storage handle says {n} segments but carries {} bytes of shareable handles ({} needed)",
                records.len(),
                n * 8
            )));
        }
        let table = records
            .chunks_exact(8)
            .flat_map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")).to_le_bytes())
            .collect();
        return Ok(StorageHandle::Segmented { segment_size, kind: segments::DEVSHARE_SEGMENTS_ACL, pid: None, table });
    }
    match version {
        2 => {}
        1 => {
            return Err(Error::UnsupportedVersion(
                "CUDA 'e' storage handle version 1: its layout is not confirmed, so this library does not guess; \
                 PyTorch 2.5 to 2.12 write version 2"
                    .into(),
            ))
        }
        3 => {
            return Err(Error::UnsupportedVersion(
                "CUDA 'e' storage handle version 3 (PyTorch 2.13 and later): its layout is not confirmed \
                 from PyTorch's source yet, so this library refuses it rather than guess; start the producer \
                 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False to send 'c' handles"
                    .into(),
            ))
        }
        v => {
            return Err(Error::UnsupportedVersion(format!(
                "CUDA 'e' storage handle version {v} (this library reads version 2)"
            )))
        }
    }
    if p.len() < 8 {
        return Err(Error::BadLength(format!(
            "CUDA 'e' storage handle ends inside its header ({} bytes after the prefix, 24 needed)",
            p.len()
        )));
    }
    // {int32 pid; 4 padding bytes (not reliably zeroed: ignored); u64 segment_size; u64 num_handles}
    let pid = i32::from_ne_bytes(p[..4].try_into().expect("4 bytes"));
    let (segment_size, n, records) = segment_header("CUDA", &p[8..])?;
    let (kind, table): (u16, Vec<u8>) = if records.len() as u64 == n * 4 {
        let table = records
            .chunks_exact(4)
            .flat_map(|c| i32::from_ne_bytes(c.try_into().expect("4 bytes")).to_le_bytes())
            .collect();
        (segments::DEVSHARE_SEGMENTS_CUDA_FD, table)
    } else if records.len() as u64 == n * 64 {
        (segments::DEVSHARE_SEGMENTS_CUDA_FABRIC, records.to_vec())
    } else {
        return Err(Error::BadLength(format!(
            "CUDA 'e' storage handle says {n} segments but carries {} record bytes: neither {} (POSIX fds) \
             nor {} (fabric handles)",
            records.len(),
            n * 4,
            n * 64
        )));
    };
    if kind == segments::DEVSHARE_SEGMENTS_CUDA_FD && pid <= 0 {
        return Err(Error::invalid("handle", format!("CUDA 'e' storage handle: producer pid {pid} is not a pid")));
    }
    Ok(StorageHandle::Segmented { segment_size, kind, pid: Some(pid), table })
}

/// What a PyTorch storage handle names, for `backend`.
pub fn parse_storage_handle(backend: u16, bytes: &[u8]) -> Result<StorageHandle> {
    let (raw, max_version, name) = match backend {
        DEVSHARE_BACKEND_CUDA => (CUDA_HANDLE, CUDA_MAX_VERSION, "CUDA"),
        DEVSHARE_BACKEND_ACL => (ACL_KEY_LEN, ACL_MAX_VERSION, "ACL"),
        _ => {
            return Err(Error::InvalidArgument(format!(
                "backend {backend}: PyTorch storage handles exist for cuda (3) and acl (2)"
            )))
        }
    };
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

/// The pid in a PyTorch ref-counter name `/torch_<pid>_<random>_<n>`, if it has that form.
fn pid_from_ref_name(name: &[u8]) -> Option<i32> {
    let rest = name.strip_prefix(b"/torch_")?;
    let end = rest.iter().position(|&b| b == b'_')?;
    std::str::from_utf8(&rest[..end]).ok()?.parse::<i32>().ok().filter(|&p| p > 0)
}

/// Build and validate a handle from the fields of a PyTorch / torch_npu tuple. An expandable
/// segment whose table does not fit the handle is described without its table: import such
/// tuples with [`handle_from_torch_full`].
pub fn handle_from_torch(a: &TorchArgs<'_>) -> Result<DevshareHandle> {
    handle_from_torch_full(a).map(|d| d.handle)
}

/// Build and validate a handle from the fields of a PyTorch / torch_npu tuple, with the segment
/// table of an expandable segment when it does not fit the handle.
pub fn handle_from_torch_full(a: &TorchArgs<'_>) -> Result<Decoded> {
    let storage = parse_storage_handle(a.backend, a.handle)?;
    if a.device < 0 {
        return Err(Error::InvalidArgument(format!("device {} is negative", a.device)));
    }
    if a.storage_size == 0 {
        return Err(Error::InvalidArgument(
            "the storage is 0 bytes: there is no memory to share (PyTorch sends no handle for empty storages)".into(),
        ));
    }
    if a.shape.len() > DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!("{} dimensions is above the maximum {DEVSHARE_MAX_NDIM}", a.shape.len())));
    }
    if a.ref_name.len() > DEVSHARE_REF_NAME_CAPACITY || !(a.ref_name.is_empty() || is_shm_name(a.ref_name)) {
        return Err(Error::InvalidArgument(format!(
            "ref-counter name {:?} is not a shm name of at most {DEVSHARE_REF_NAME_CAPACITY} bytes",
            String::from_utf8_lossy(a.ref_name)
        )));
    }
    let mut h = DevshareHandle {
        backend: a.backend,
        device_index: a.device,
        producer_pid: if a.producer_pid > 0 { a.producer_pid } else { pid_from_ref_name(a.ref_name).unwrap_or(0) },
        ndim: a.shape.len() as u32,
        // The allocation's size is not in the tuple: the storage's end is what is known.
        alloc_size: a
            .storage_offset
            .checked_add(a.storage_size)
            .ok_or_else(|| Error::bad_size("storage_size", "storage_offset + storage_size overflows"))?,
        storage_offset: a.storage_offset,
        storage_size: a.storage_size,
        tensor_offset: a.tensor_offset,
        dtype: a.dtype,
        ..Default::default()
    };
    h.shape[..a.shape.len()].copy_from_slice(a.shape);
    match a.strides {
        Some(s) if s.len() != a.shape.len() => {
            return Err(Error::InvalidArgument(format!("{} strides for {} dimensions", s.len(), a.shape.len())))
        }
        Some(s) => h.strides[..s.len()].copy_from_slice(s),
        None => h.strides[..a.shape.len()].copy_from_slice(&contiguous_strides(a.shape)),
    }
    let mut external = None;
    match storage {
        StorageHandle::Key(key) => h.set_key(&key),
        StorageHandle::Segmented { segment_size, kind, pid, table } => {
            if let Some(pid) = pid {
                h.producer_pid = pid;
            }
            let seg = segments::set_segments(&mut h, segment_size, kind, &table)?;
            if !seg.inline {
                external = Some(table);
            }
        }
    }
    if !a.ref_name.is_empty() {
        h.set_ref(a.ref_name, a.ref_slot);
    }
    if a.event_sync_required {
        if a.event_handle.len() != DEVSHARE_EVENT_HANDLE_SIZE {
            return Err(Error::InvalidArgument(format!(
                "event_sync_required is set but the event handle is {} bytes, not {DEVSHARE_EVENT_HANDLE_SIZE}",
                a.event_handle.len()
            )));
        }
        h.event_handle.copy_from_slice(a.event_handle);
        h.flags |= DEVSHARE_HANDLE_FLAG_EVENT;
    }
    validate(&h)?;
    if let (Some(seg), Some(t)) = (segments::segments(&h)?, &external) {
        segments::check_table(&seg, t)?;
    }
    Ok(Decoded { handle: h, table: external })
}

/// The 8-tuple that `UntypedStorage._new_shared_cuda` (raw 64-byte handle) or
/// `_new_shared_npu` (version-1 'c' handle) accepts for a device handle; segmented handles give
/// the 'e' forms (torch_npu version 1, PyTorch CUDA version 2).
pub fn handle_to_torch(h: &DevshareHandle) -> Result<TorchStorage> {
    handle_to_torch_full(h, None)
}

/// The storage handle bytes of an 'e' form for a segmented handle and its table.
fn expandable_bytes(h: &DevshareHandle, seg: &segments::Segments, table: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(26 + table.len());
    if h.backend == DEVSHARE_BACKEND_ACL {
        v.extend_from_slice(&[1, b'e']);
    } else {
        v.extend_from_slice(&[2, b'e']);
        v.extend_from_slice(&h.producer_pid.to_ne_bytes());
        v.extend_from_slice(&[0; 4]);
    }
    v.extend_from_slice(&seg.segment_size.to_ne_bytes());
    v.extend_from_slice(&u64::from(seg.count).to_ne_bytes());
    match seg.kind {
        segments::DEVSHARE_SEGMENTS_ACL => {
            for c in table.chunks_exact(8) {
                v.extend_from_slice(&u64::from_le_bytes(c.try_into().expect("8 bytes")).to_ne_bytes());
            }
        }
        segments::DEVSHARE_SEGMENTS_CUDA_FD => {
            for c in table.chunks_exact(4) {
                v.extend_from_slice(&i32::from_le_bytes(c.try_into().expect("4 bytes")).to_ne_bytes());
            }
        }
        _ => v.extend_from_slice(table),
    }
    v
}

/// [`handle_to_torch`] for a segmented handle whose table is not inline (`table`).
pub fn handle_to_torch_full(h: &DevshareHandle, table: Option<&[u8]>) -> Result<TorchStorage> {
    validate(h)?;
    let seg = segments::segments(h)?;
    if h.storage_size == 0 {
        return Err(Error::InvalidArgument(
            "the storage is 0 bytes: a PyTorch consumer builds an empty storage from that and never \
             returns the reference; share a storage of at least one byte"
                .into(),
        ));
    }
    let handle = match (h.backend, seg) {
        (_, Some(seg)) => {
            let t = if seg.inline {
                h.key_bytes()
            } else {
                let t = table.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the handle's {} segments are not inline: pass its segment table",
                        seg.count
                    ))
                })?;
                segments::check_table(&seg, t)?;
                t
            };
            expandable_bytes(h, &seg, t)
        }
        (DEVSHARE_BACKEND_CUDA, None) => h.key_bytes().to_vec(),
        (DEVSHARE_BACKEND_ACL, None) => {
            let mut v = vec![1, b'c'];
            v.extend_from_slice(h.key_bytes());
            v
        }
        _ => {
            return Err(Error::Unsupported(format!(
                "{} handles have no PyTorch device tuple (host memory opens with \
                 UntypedStorage._new_shared_filename_cpu)",
                h.backend_name()
            )))
        }
    };
    let event = h.flags & DEVSHARE_HANDLE_FLAG_EVENT != 0;
    Ok(TorchStorage {
        device: h.device_index,
        handle,
        storage_size: h.storage_size,
        storage_offset: h.storage_offset,
        ref_name: h.ref_name_bytes().to_vec(),
        ref_slot: h.ref_slot,
        event_handle: if event { h.event_handle } else { [0; DEVSHARE_EVENT_HANDLE_SIZE] },
        event_sync_required: event,
    })
}
