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
//! | either | any | `[v]['e']...` expandable segments: refused, with the allocator setting to change |

use crate::dtype::DevshareDType;
use crate::error::{Error, Result};
use crate::export::contiguous_strides;
use crate::handle::{
    is_shm_name, validate, DevshareHandle, DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA, DEVSHARE_EVENT_HANDLE_SIZE,
    DEVSHARE_HANDLE_FLAG_EVENT, DEVSHARE_MAX_NDIM, DEVSHARE_REF_NAME_CAPACITY,
};

/// Size of a CUDA IPC memory handle.
const CUDA_HANDLE: usize = 64;
/// Size of an ACL IPC key buffer.
const ACL_KEY: usize = 65;
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

fn expandable(backend: u16) -> Error {
    let setting = if backend == DEVSHARE_BACKEND_ACL {
        "PYTORCH_NPU_ALLOC_CONF=expandable_segments:False"
    } else {
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
    };
    Error::Unsupported(format!(
        "the storage handle is an expandable-segment ('e') handle, which devshare cannot import; \
         start the producer with {setting} so that it shares plain allocations ('c' handles)"
    ))
}

/// The vendor key inside a PyTorch storage handle, for `backend`.
pub fn parse_storage_handle(backend: u16, bytes: &[u8]) -> Result<Vec<u8>> {
    let (raw, max_version, name) = match backend {
        DEVSHARE_BACKEND_CUDA => (CUDA_HANDLE, CUDA_MAX_VERSION, "CUDA"),
        DEVSHARE_BACKEND_ACL => (ACL_KEY, ACL_MAX_VERSION, "ACL"),
        _ => {
            return Err(Error::InvalidArgument(format!(
                "backend {backend}: PyTorch storage handles exist for cuda (3) and acl (2)"
            )))
        }
    };
    if bytes.is_empty() {
        return Err(Error::InvalidArgument(
            "the storage handle is empty (PyTorch sends None for an empty storage): there is no memory to share"
                .into(),
        ));
    }
    let key: &[u8] = if bytes.len() == raw {
        bytes
    } else if bytes.len() >= 2 && bytes[1] == b'e' {
        return Err(expandable(backend));
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
    let mut key = key.to_vec();
    if backend == DEVSHARE_BACKEND_ACL {
        // A C string in a 65-byte buffer; what follows the NUL is unspecified.
        match key.iter().position(|&b| b == 0) {
            None => return Err(Error::BadKey("ACL IPC key has no NUL terminator in its 65 bytes".into())),
            Some(0) => return Err(Error::BadKey("ACL IPC key is empty".into())),
            Some(n) => key[n..].fill(0),
        }
    }
    Ok(key)
}

/// The pid in a PyTorch ref-counter name `/torch_<pid>_<random>_<n>`, if it has that form.
fn pid_from_ref_name(name: &[u8]) -> Option<i32> {
    let rest = name.strip_prefix(b"/torch_")?;
    let end = rest.iter().position(|&b| b == b'_')?;
    std::str::from_utf8(&rest[..end]).ok()?.parse::<i32>().ok().filter(|&p| p > 0)
}

/// Build and validate a handle from the fields of a PyTorch / torch_npu tuple.
pub fn handle_from_torch(a: &TorchArgs<'_>) -> Result<DevshareHandle> {
    let key = parse_storage_handle(a.backend, a.handle)?;
    if a.device < 0 {
        return Err(Error::InvalidArgument(format!("device {} is negative", a.device)));
    }
    if a.storage_size == 0 {
        return Err(Error::InvalidArgument(
            "the storage is 0 bytes: there is no memory to share (PyTorch sends no handle for empty storages)".into(),
        ));
    }
    if a.shape.len() > DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!(
            "{} dimensions is above the maximum {DEVSHARE_MAX_NDIM}",
            a.shape.len()
        )));
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
        alloc_size: a.storage_offset.checked_add(a.storage_size).ok_or_else(|| {
            Error::bad_size("storage_size", "storage_offset + storage_size overflows")
        })?,
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
    h.set_key(&key);
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
    Ok(h)
}

/// The 8-tuple that `UntypedStorage._new_shared_cuda` (raw 64-byte handle) or
/// `_new_shared_npu` (version-1 'c' handle) accepts for a device handle.
pub fn handle_to_torch(h: &DevshareHandle) -> Result<TorchStorage> {
    validate(h)?;
    if h.storage_size == 0 {
        return Err(Error::InvalidArgument(
            "the storage is 0 bytes: a PyTorch consumer builds an empty storage from that and never \
             returns the reference; share a storage of at least one byte"
                .into(),
        ));
    }
    let handle = match h.backend {
        DEVSHARE_BACKEND_CUDA => h.key_bytes().to_vec(),
        DEVSHARE_BACKEND_ACL => {
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
