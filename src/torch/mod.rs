//! PyTorch's and torch_npu's dialect: the fields of `reduce_tensor` / `_share_cuda_()` /
//! `_share_npu_()`, to and from a [`DevshareHandle`].
//!
//! The storage-handle bytes of every PyTorch and torch_npu version, and the version bridge, are
//! in [`format`].

pub mod format;

use crate::dtype::DevshareDType;
use crate::error::{Error, Result};
use crate::handle::encode::Decoded;
use crate::handle::segments;
use crate::handle::{
    contiguous_strides, is_shm_name, validate, DevshareHandle, DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA,
    DEVSHARE_EVENT_HANDLE_SIZE, DEVSHARE_HANDLE_FLAG_EVENT, DEVSHARE_MAX_NDIM, DEVSHARE_REF_NAME_CAPACITY,
};
pub use format::{
    convert_storage_handle, format_for_torch_version, parse_storage_handle, write_storage_handle, KeyForm,
    StorageHandle, TorchFormat,
};

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
/// the 'e' forms of [`TorchFormat::Default`] (torch_npu version 1, PyTorch CUDA version 2).
pub fn handle_to_torch(h: &DevshareHandle) -> Result<TorchStorage> {
    handle_to_torch_as(h, None, TorchFormat::Default)
}

/// [`handle_to_torch`] for a segmented handle whose table is not inline (`table`).
pub fn handle_to_torch_full(h: &DevshareHandle, table: Option<&[u8]>) -> Result<TorchStorage> {
    handle_to_torch_as(h, table, TorchFormat::Default)
}

/// What a device handle names, as a [`StorageHandle`] (`table`: the segment table of a
/// segmented handle whose table is not inline).
pub fn storage_of(h: &DevshareHandle, table: Option<&[u8]>) -> Result<StorageHandle> {
    validate(h)?;
    if h.backend != DEVSHARE_BACKEND_CUDA && h.backend != DEVSHARE_BACKEND_ACL {
        return Err(Error::Unsupported(format!(
            "{} handles have no PyTorch device tuple (host memory opens with \
             UntypedStorage._new_shared_filename_cpu)",
            h.backend_name()
        )));
    }
    let Some(seg) = segments::segments(h)? else {
        return Ok(StorageHandle::Key(h.key_bytes().to_vec()));
    };
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
    Ok(StorageHandle::Segmented {
        segment_size: seg.segment_size,
        kind: seg.kind,
        pid: Some(h.producer_pid),
        table: t.to_vec(),
    })
}

/// The storage 8-tuple of a device handle with its storage handle written in `format` (see
/// [`KeyForm::HandBack`]: cuda 'c' handles are always the raw 64 bytes, which every PyTorch
/// reads; the format picks the 'e' layout, and the acl forms).
pub fn handle_to_torch_as(h: &DevshareHandle, table: Option<&[u8]>, format: TorchFormat) -> Result<TorchStorage> {
    let storage = storage_of(h, table)?;
    if h.storage_size == 0 {
        return Err(Error::InvalidArgument(
            "the storage is 0 bytes: a PyTorch consumer builds an empty storage from that and never \
             returns the reference; share a storage of at least one byte"
                .into(),
        ));
    }
    let handle = write_storage_handle(h.backend, &storage, format, KeyForm::HandBack)?;
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
