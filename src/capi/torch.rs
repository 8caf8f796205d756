//! PyTorch / torch_npu tuples to and from handles.

use super::{arg, arg_mut, arg_slice, boundary};
use crate::dtype::DevshareDType;
use crate::error::Error;
use crate::handle::DevshareHandle;
use crate::torch::{handle_from_torch, handle_to_torch, TorchArgs};

/// Capacity of `DevshareTorchStorage::handle` (the largest form devshare writes is 67 bytes).
pub const DEVSHARE_TORCH_HANDLE_CAPACITY: usize = 128;

/// The fields of one `torch.multiprocessing.reductions.reduce_tensor` tuple (15 args) that a
/// consumer needs, for `devshare_handle_from_torch`. Arg numbers refer to that tuple; args 6..14
/// (without 10) are the 8-tuple of `storage._share_cuda_()` / `_share_npu_()`. Initialise with
/// `memset(0)` and set `struct_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareTorchArgs {
    /// `sizeof(DevshareTorchArgs)`.
    pub struct_size: u32,
    /// `DEVSHARE_BACKEND_CUDA` (PyTorch) or `DEVSHARE_BACKEND_ACL` (torch_npu): whose handle
    /// forms to read.
    pub backend: u16,
    /// Reserved, zero.
    pub reserved0: u16,
    /// Arg 5 as a DLPack dtype.
    pub dtype: DevshareDType,
    /// Number of dimensions (length of arg 1), 0..=`DEVSHARE_MAX_NDIM`.
    pub ndim: u32,
    /// Arg 1: shape in elements.
    pub shape: *const i64,
    /// Arg 2: strides in elements, or NULL for C-contiguous.
    pub strides: *const i64,
    /// Arg 3: the tensor's offset in its storage, in elements.
    pub tensor_offset: i64,
    /// Arg 6: device index (the producer's, or rewritten to the receiver's own).
    pub device: i32,
    /// The producer's pid if known; 0: read from a `/torch_<pid>_...` ref-counter name.
    pub producer_pid: i32,
    /// Arg 7: storage handle bytes (raw 64/65 bytes or `[version]['c'][...]`).
    pub handle: *const u8,
    pub handle_len: usize,
    /// Arg 8: storage size in bytes.
    pub storage_size: u64,
    /// Arg 9: storage offset in the exported allocation, in bytes.
    pub storage_offset: u64,
    /// Arg 11: ref-counter shm name (with its leading '/'); length 0 for none.
    pub ref_name: *const u8,
    pub ref_name_len: usize,
    /// Arg 12: ref-counter slot.
    pub ref_slot: u64,
    /// Arg 13: event handle bytes (read only when `event_sync_required`; must then be 64).
    pub event_handle: *const u8,
    pub event_handle_len: usize,
    /// Arg 14: nonzero when the consumer must wait on the event.
    pub event_sync_required: u32,
    /// Reserved, zero.
    pub reserved1: u32,
}

/// The 8-tuple `(device, handle, storage_size_bytes, storage_offset_bytes, ref_counter_name,
/// ref_counter_slot, event_handle, event_sync_required)` that PyTorch's
/// `UntypedStorage._new_shared_cuda` and torch_npu's `_new_shared_npu` rebuild a storage from,
/// from `devshare_handle_to_torch`. Pass each byte field as a Python `bytes` of its length.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareTorchStorage {
    pub device: i32,
    /// Bytes used in `handle`: 64 (cuda, raw handle) or 67 (acl, version-1 'c' handle).
    pub handle_len: u32,
    pub handle: [u8; DEVSHARE_TORCH_HANDLE_CAPACITY],
    pub storage_size: u64,
    pub storage_offset: u64,
    /// Bytes used in `ref_name` (0: none; send `b""`).
    pub ref_name_len: u32,
    pub reserved0: u32,
    pub ref_name: [u8; 64],
    pub ref_slot: u64,
    /// Always 64 bytes; all zero unless `event_sync_required`.
    pub event_handle: [u8; 64],
    pub event_sync_required: u32,
    pub reserved1: u32,
}

/// Build and validate a handle from the fields of a PyTorch (cuda) or torch_npu (acl) tuple.
/// Expandable-segment ('e') storage handles are refused with `DEVSHARE_STATUS_UNSUPPORTED`
/// naming the allocator setting that avoids them; unknown handle versions with
/// `DEVSHARE_STATUS_UNSUPPORTED_VERSION`. The handle's `alloc_size` is the storage's end (the
/// tuple does not carry the allocation's size).
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_from_torch(args: *const DevshareTorchArgs, out: *mut DevshareHandle) -> i32 {
    boundary("devshare_handle_from_torch", || {
        let a = unsafe { arg(args, "args") }?;
        let out = unsafe { arg_mut(out, "out") }?;
        if a.struct_size as usize != std::mem::size_of::<DevshareTorchArgs>() {
            return Err(Error::InvalidArgument(format!(
                "args.struct_size {} is not sizeof(DevshareTorchArgs)",
                a.struct_size
            )));
        }
        if a.reserved0 != 0 || a.reserved1 != 0 {
            return Err(Error::InvalidArgument("args.reserved0 and args.reserved1 must be 0".into()));
        }
        if a.ndim as usize > crate::handle::DEVSHARE_MAX_NDIM {
            return Err(Error::BadNdim(format!("args.ndim {} is above the maximum", a.ndim)));
        }
        let n = a.ndim as usize;
        let shape = unsafe { arg_slice(a.shape, n, "args.shape") }?;
        let strides = if a.strides.is_null() { None } else { Some(unsafe { arg_slice(a.strides, n, "args.strides") }?) };
        let event_handle = if a.event_sync_required != 0 {
            unsafe { arg_slice(a.event_handle, a.event_handle_len, "args.event_handle") }?
        } else {
            &[]
        };
        *out = handle_from_torch(&TorchArgs {
            backend: a.backend,
            dtype: a.dtype,
            shape,
            strides,
            tensor_offset: a.tensor_offset,
            device: a.device,
            producer_pid: a.producer_pid,
            handle: unsafe { arg_slice(a.handle, a.handle_len, "args.handle") }?,
            storage_size: a.storage_size,
            storage_offset: a.storage_offset,
            ref_name: unsafe { arg_slice(a.ref_name, a.ref_name_len, "args.ref_name") }?,
            ref_slot: a.ref_slot,
            event_handle,
            event_sync_required: a.event_sync_required != 0,
        })?;
        Ok(())
    })
}

/// The storage 8-tuple a stock PyTorch (cuda: raw 64-byte handle) or torch_npu (acl: version-1
/// 'c' handle) consumer opens with `rebuild_cuda_tensor` / `rebuild_npu_tensor`, for a device
/// handle (typically one `devshare_exporter_share` made). That consumer decrements the handle's
/// slot when it lets go, which the exporter sees in `devshare_exporter_outstanding`. The tensor
/// part (shape, strides, offset, dtype) is in the handle itself.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_to_torch(handle: *const DevshareHandle, out: *mut DevshareTorchStorage) -> i32 {
    boundary("devshare_handle_to_torch", || {
        let h = unsafe { arg(handle, "handle") }?;
        let out = unsafe { arg_mut(out, "out") }?;
        let t = handle_to_torch(h)?;
        let mut s = DevshareTorchStorage {
            device: t.device,
            handle_len: t.handle.len() as u32,
            handle: [0; DEVSHARE_TORCH_HANDLE_CAPACITY],
            storage_size: t.storage_size,
            storage_offset: t.storage_offset,
            ref_name_len: t.ref_name.len() as u32,
            reserved0: 0,
            ref_name: [0; 64],
            ref_slot: t.ref_slot,
            event_handle: t.event_handle,
            event_sync_required: u32::from(t.event_sync_required),
            reserved1: 0,
        };
        s.handle[..t.handle.len()].copy_from_slice(&t.handle);
        s.ref_name[..t.ref_name.len()].copy_from_slice(&t.ref_name);
        *out = s;
        Ok(())
    })
}

/// Return the reference a PyTorch tuple carries without importing it (args 11 and 12 are read,
/// nothing else): for a consumer that received a tuple it cannot or will not open — e.g. one
/// `devshare_handle_from_torch` refused — so the producer's allocator gets the block back.
/// A tuple with no ref-counter name has nothing to return. Refused with `DEVSHARE_STATUS_BUSY`
/// while an import in this process holds that reference.
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_discard(args: *const DevshareTorchArgs) -> i32 {
    boundary("devshare_torch_discard", || {
        let a = unsafe { arg(args, "args") }?;
        if a.struct_size as usize != std::mem::size_of::<DevshareTorchArgs>() {
            return Err(Error::InvalidArgument(format!(
                "args.struct_size {} is not sizeof(DevshareTorchArgs)",
                a.struct_size
            )));
        }
        let name = unsafe { arg_slice(a.ref_name, a.ref_name_len, "args.ref_name") }?;
        crate::import::discard(name, a.ref_slot)
    })
}
