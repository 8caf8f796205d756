//! PyTorch / torch_npu tuples to and from handles.

use super::abi::{init, read_input, sized_struct, write_output, SizedStruct};
use super::{arg, arg_mut, arg_slice, boundary};
use crate::dtype::DevshareDType;
use crate::error::Error;
use crate::handle::DevshareHandle;
use crate::torch::{
    convert_storage_handle, format_for_torch_version, handle_from_torch, handle_from_torch_full, handle_to_torch_as,
    TorchArgs, TorchFormat, TorchStorage,
};
use std::ffi::{c_char, CStr};

/// Capacity of `DevshareTorchStorage::handle`: every 'c' and legacy form (at most 67 bytes) and
/// the shortest 'e' forms fit; longer 'e' forms come from `devshare_torch_storage_handle`.
pub const DEVSHARE_TORCH_HANDLE_CAPACITY: usize = 128;

/// Storage-handle format (`devshare_handle_to_torch_as`, `devshare_torch_storage_handle_as`,
/// `devshare_torch_handle_convert`): what devshare 1.0 and 1.1 write — cuda 'c' as the raw
/// 64-byte IPC handle (read by every PyTorch), cuda 'e' as version 2 (read by PyTorch 2.5 to
/// 2.12 only: 2.13 and later misparse it, so name `DEVSHARE_TORCH_FORMAT_V3` for them), acl as
/// version 1 (every torch_npu).
pub const DEVSHARE_TORCH_FORMAT_DEFAULT: u32 = 0;
/// Storage-handle format: version byte 1 (torch_npu's 'c' and 'e' forms; a cuda `[1]['c']`).
pub const DEVSHARE_TORCH_FORMAT_V1: u32 = 1;
/// Storage-handle format: version byte 2 (PyTorch 2.5 to 2.12; cuda 'e' with the 24-byte header).
pub const DEVSHARE_TORCH_FORMAT_V2: u32 = 2;
/// Storage-handle format: version byte 3 (PyTorch 2.13 and later; cuda 'e' with the 32-byte
/// header that names the handle type).
pub const DEVSHARE_TORCH_FORMAT_V3: u32 = 3;
/// Storage-handle format: the unprefixed key, the raw 64-byte CUDA handle or 65-byte ACL key
/// (PyTorch 2.4 and earlier, legacy torch_npu; read by every version). Expandable segments have
/// no such form.
pub const DEVSHARE_TORCH_FORMAT_UNVERSIONED: u32 = 0x100;
static_assertions::const_assert_eq!(DEVSHARE_TORCH_FORMAT_UNVERSIONED, crate::torch::format::FORMAT_UNVERSIONED);

/// The fields of one `torch.multiprocessing.reductions.reduce_tensor` tuple (15 args) that a
/// consumer needs, for `devshare_handle_from_torch`. Arg numbers refer to that tuple; args 6..14
/// (without 10) are the 8-tuple of `storage._share_cuda_()` / `_share_npu_()`. Initialise with
/// `devshare_torch_args_init(&args, sizeof args)`. Pointers are read during the call only.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareTorchArgs {
    /// Size of this struct in the caller's header (`devshare_torch_args_init` sets it).
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
    /// Arg 1: shape in elements (`ndim` entries; may be NULL when ndim is 0).
    pub shape: *const i64,
    /// Arg 2: strides in elements (`ndim` entries), or NULL for C-contiguous.
    pub strides: *const i64,
    /// Arg 3: the tensor's offset in its storage, in elements.
    pub tensor_offset: i64,
    /// Arg 6: device index (the producer's, or rewritten to the receiver's own).
    pub device: i32,
    /// The producer's pid if known; 0: read from a `/torch_<pid>_...` ref-counter name.
    pub producer_pid: i32,
    /// Arg 7: storage handle bytes (raw 64/65 bytes or `[version][form][...]`).
    pub handle: *const u8,
    /// Number of bytes at `handle`.
    pub handle_len: usize,
    /// Arg 8: storage size in bytes.
    pub storage_size: u64,
    /// Arg 9: storage offset in the exported allocation, in bytes.
    pub storage_offset: u64,
    /// Arg 11: ref-counter shm name (with its leading '/', no NUL needed); NULL/length 0: none.
    pub ref_name: *const u8,
    /// Number of bytes at `ref_name`.
    pub ref_name_len: usize,
    /// Arg 12: ref-counter slot.
    pub ref_slot: u64,
    /// Arg 13: event handle bytes (read only when `event_sync_required`; must then be 64).
    pub event_handle: *const u8,
    /// Number of bytes at `event_handle`.
    pub event_handle_len: usize,
    /// Arg 14: nonzero when the consumer must wait on the event.
    pub event_sync_required: u32,
    /// Reserved, zero.
    pub reserved1: u32,
}

sized_struct!(
    DevshareTorchArgs,
    "DevshareTorchArgs",
    first_size = 128,
    sum = 128,
    defaults = DevshareTorchArgs {
        struct_size: 0,
        backend: 0,
        reserved0: 0,
        dtype: DevshareDType { code: 0, bits: 0, lanes: 0 },
        ndim: 0,
        shape: std::ptr::null(),
        strides: std::ptr::null(),
        tensor_offset: 0,
        device: 0,
        producer_pid: 0,
        handle: std::ptr::null(),
        handle_len: 0,
        storage_size: 0,
        storage_offset: 0,
        ref_name: std::ptr::null(),
        ref_name_len: 0,
        ref_slot: 0,
        event_handle: std::ptr::null(),
        event_handle_len: 0,
        event_sync_required: 0,
        reserved1: 0,
    }
);

/// The 8-tuple `(device, handle, storage_size_bytes, storage_offset_bytes, ref_counter_name,
/// ref_counter_slot, event_handle, event_sync_required)` that PyTorch's
/// `UntypedStorage._new_shared_cuda` and torch_npu's `_new_shared_npu` rebuild a storage from,
/// from `devshare_handle_to_torch` (initialise with `devshare_torch_storage_init(&s, sizeof s)`).
/// Pass each byte field as a Python `bytes` of its length.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareTorchStorage {
    /// Size of this struct in the caller's header; on return, the bytes the library filled in.
    pub struct_size: u32,
    /// Tuple item 0: device index (the handle's `device_index`).
    pub device: i32,
    /// Length of the storage handle: 64 (cuda, raw handle), 67 (acl, version-1 'c' handle), or
    /// for a segmented handle the length of its 'e' form (18 + 8n acl, 26 + 4n / 26 + 64n cuda).
    /// When it exceeds `DEVSHARE_TORCH_HANDLE_CAPACITY` ('e' forms of more than 13 acl, 25 fd or
    /// 1 fabric segment), `handle` is all zero: get the bytes with `devshare_torch_storage_handle`.
    pub handle_len: u32,
    /// Bytes used in `ref_name` (0: none; send `b""`).
    pub ref_name_len: u32,
    /// Tuple item 1: storage handle bytes; `handle_len` are used, the rest is zero.
    pub handle: [u8; DEVSHARE_TORCH_HANDLE_CAPACITY],
    /// Tuple item 2: storage size in bytes.
    pub storage_size: u64,
    /// Tuple item 3: storage offset in the exported allocation, in bytes.
    pub storage_offset: u64,
    /// Tuple item 5: ref-counter slot.
    pub ref_slot: u64,
    /// Tuple item 4: ref-counter shm name with its leading '/', not NUL-terminated.
    pub ref_name: [u8; 64],
    /// Tuple item 6: always 64 bytes; all zero unless `event_sync_required`.
    pub event_handle: [u8; 64],
    /// Tuple item 7: 1 when the consumer must wait on the event (send `True`), else 0.
    pub event_sync_required: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

sized_struct!(
    DevshareTorchStorage,
    "DevshareTorchStorage",
    first_size = 304,
    sum = 16 + DEVSHARE_TORCH_HANDLE_CAPACITY + 24 + 64 + 64 + 8,
    defaults = DevshareTorchStorage {
        struct_size: 0,
        device: 0,
        handle_len: 0,
        ref_name_len: 0,
        handle: [0; DEVSHARE_TORCH_HANDLE_CAPACITY],
        storage_size: 0,
        storage_offset: 0,
        ref_slot: 0,
        ref_name: [0; 64],
        event_handle: [0; 64],
        event_sync_required: 0,
        reserved: 0,
    }
);

/// Initialise `DevshareTorchArgs` of `size` bytes (pass `sizeof *args`): all zero.
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_args_init(args: *mut DevshareTorchArgs, size: u32) -> i32 {
    boundary("devshare_torch_args_init", || ffi!(init(args, size, "args")))
}

/// Initialise `DevshareTorchStorage` of `size` bytes (pass `sizeof *storage`) for
/// `devshare_handle_to_torch`.
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_storage_init(storage: *mut DevshareTorchStorage, size: u32) -> i32 {
    boundary("devshare_torch_storage_init", || ffi!(init(storage, size, "storage")))
}

/// Build and validate a handle from the fields of a PyTorch (cuda) or torch_npu (acl) tuple.
/// Expandable-segment ('e') storage handles (torch_npu version 1, PyTorch CUDA version 2) give
/// segmented handles; when their segment table is longer than the handle holds (see
/// `DEVSHARE_HANDLE_FLAG_SEGMENTED`), the handle describes it without the table: use
/// `devshare_import_torch` or `devshare_handle_from_torch_encoded` for those. Unknown or
/// unconfirmed handle versions are refused with `DEVSHARE_STATUS_UNSUPPORTED_VERSION`, naming
/// them. For a 'c' handle `alloc_size` is the storage's end (the tuple does not carry the
/// allocation's size); for an 'e' handle it is segments x segment size.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_from_torch(args: *const DevshareTorchArgs, out: *mut DevshareHandle) -> i32 {
    boundary("devshare_handle_from_torch", || {
        let a = ffi!(read_input(args, "args"))?;
        let out = ffi!(arg_mut(out, "out"))?;
        *out = handle_from_torch(&ffi!(torch_args(&a))?)?;
        Ok(())
    })
}

/// Like `devshare_handle_from_torch`, but writes the handle's byte encoding into `buf` — the
/// form that also carries an expandable segment's table when it is too long for a
/// `DevshareHandle` (decode it with `devshare_handle_decode`, import it with
/// `devshare_import_encoded`). `*len_out` (if not NULL) receives the length, also when `buf` is
/// NULL or too small (`DEVSHARE_STATUS_BUFFER_TOO_SMALL`).
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_from_torch_encoded(
    args: *const DevshareTorchArgs,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_handle_from_torch_encoded", || {
        let a = ffi!(read_input(args, "args"))?;
        let d = handle_from_torch_full(&ffi!(torch_args(&a))?)?;
        let mut bytes = Vec::new();
        crate::handle::encode::encode_full_into(&d.handle, d.table.as_deref(), &mut bytes)?;
        ffi!(super::write_out(&bytes, false, buf, cap, len_out))
    })
}

/// Import the storage a PyTorch (cuda) or torch_npu (acl) tuple names, in one call: like
/// `devshare_handle_from_torch` + `devshare_import`, and also for expandable segments whose
/// segment table is too long for a `DevshareHandle`. Release with `devshare_import_release`.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_torch(
    args: *const DevshareTorchArgs,
    options: *const super::import::DevshareImportOptions,
    out: *mut *mut super::import::DevshareImport,
) -> i32 {
    boundary("devshare_import_torch", || {
        let a = ffi!(read_input(args, "args"))?;
        let out = ffi!(arg_mut(out, "out"))?;
        let d = handle_from_torch_full(&ffi!(torch_args(&a))?)?;
        let req = ffi!(super::import::request_from(options))?;
        let imp = crate::import::import_full(&d.handle, d.table.as_deref(), req)?;
        *out = Box::into_raw(Box::new(super::import::DevshareImport::new(imp)));
        Ok(())
    })
}

/// The tuple fields of a C `DevshareTorchArgs`, checked.
///
/// # Safety
/// The pointers in `a` are NULL or valid for their lengths.
unsafe fn torch_args(a: &DevshareTorchArgs) -> crate::error::Result<TorchArgs<'_>> {
    if a.reserved0 != 0 || a.reserved1 != 0 {
        return Err(Error::InvalidArgument("args.reserved0 and args.reserved1 must be 0".into()));
    }
    if a.ndim as usize > crate::handle::DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!("args.ndim {} is above the maximum", a.ndim)));
    }
    let n = a.ndim as usize;
    let shape = ffi!(arg_slice(a.shape, n, "args.shape"))?;
    let strides = if a.strides.is_null() { None } else { Some(ffi!(arg_slice(a.strides, n, "args.strides"))?) };
    let event_handle = if a.event_sync_required != 0 {
        ffi!(arg_slice(a.event_handle, a.event_handle_len, "args.event_handle"))?
    } else {
        &[]
    };
    Ok(TorchArgs {
        backend: a.backend,
        dtype: a.dtype,
        shape,
        strides,
        tensor_offset: a.tensor_offset,
        device: a.device,
        producer_pid: a.producer_pid,
        handle: ffi!(arg_slice(a.handle, a.handle_len, "args.handle"))?,
        storage_size: a.storage_size,
        storage_offset: a.storage_offset,
        ref_name: ffi!(arg_slice(a.ref_name, a.ref_name_len, "args.ref_name"))?,
        ref_slot: a.ref_slot,
        event_handle,
        event_sync_required: a.event_sync_required != 0,
    })
}

/// The storage 8-tuple a stock PyTorch (cuda: raw 64-byte handle) or torch_npu (acl: version-1
/// 'c' handle) consumer opens with `rebuild_cuda_tensor` / `rebuild_npu_tensor`, for a device
/// handle (typically one `devshare_exporter_share` made). That consumer decrements the handle's
/// slot when it lets go, which the exporter sees in `devshare_exporter_outstanding`. The tensor
/// part (shape, strides, offset, dtype) is in the handle itself. Segmented handles get the 'e'
/// form of `DEVSHARE_TORCH_FORMAT_DEFAULT` (PyTorch 2.5 to 2.12): for PyTorch 2.13 and later use
/// `devshare_handle_to_torch_as`.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_to_torch(
    handle: *const DevshareHandle,
    out: *mut DevshareTorchStorage,
) -> i32 {
    boundary("devshare_handle_to_torch", || {
        let h = ffi!(arg(handle, "handle"))?;
        ffi!(write_output(out, storage_struct(&handle_to_torch_as(h, None, TorchFormat::Default)?), "out"))
    })
}

/// `devshare_handle_to_torch` with the storage handle written in `format`
/// (`DEVSHARE_TORCH_FORMAT_*`, or what `devshare_torch_format_for_version` gives for the
/// consumer's torch version). cuda 'c' handles stay the raw 64 bytes whatever the format (every
/// PyTorch reads them); the format picks the cuda 'e' layout (`_V2` for PyTorch 2.5 to 2.12,
/// `_V3` for 2.13 and later) and the acl form (`_V1` or `_UNVERSIONED`). A format that cannot
/// express the handle is refused with `DEVSHARE_STATUS_UNSUPPORTED`, naming why (a cuda 'e'
/// handle in `_V1` or `_UNVERSIONED`; fabric segments in `_V2`, whose reader cannot tell them
/// from fds; acl in `_V2` or `_V3`), and `out` is left untouched.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_to_torch_as(
    handle: *const DevshareHandle,
    format: u32,
    out: *mut DevshareTorchStorage,
) -> i32 {
    boundary("devshare_handle_to_torch_as", || {
        let h = ffi!(arg(handle, "handle"))?;
        let t = handle_to_torch_as(h, None, TorchFormat::from_c(format)?)?;
        ffi!(write_output(out, storage_struct(&t), "out"))
    })
}

fn storage_struct(t: &TorchStorage) -> DevshareTorchStorage {
    let mut s = DevshareTorchStorage {
        device: t.device,
        handle_len: t.handle.len() as u32,
        storage_size: t.storage_size,
        storage_offset: t.storage_offset,
        ref_name_len: t.ref_name.len() as u32,
        ref_slot: t.ref_slot,
        event_handle: t.event_handle,
        event_sync_required: u32::from(t.event_sync_required),
        ..DevshareTorchStorage::defaults()
    };
    if t.handle.len() <= DEVSHARE_TORCH_HANDLE_CAPACITY {
        s.handle[..t.handle.len()].copy_from_slice(&t.handle);
    }
    s.ref_name[..t.ref_name.len()].copy_from_slice(&t.ref_name);
    s
}

/// Write the storage handle bytes (tuple item 1 of the 8-tuple, arg 7 of `reduce_tensor`) for a
/// device handle into `buf`: the raw 64-byte CUDA handle, the 67-byte torch_npu 'c' form, or a
/// segmented handle's 'e' form (torch_npu version 1, PyTorch CUDA version 2: for PyTorch 2.13
/// and later use `devshare_torch_storage_handle_as`). `table` is the segment table of a
/// segmented handle whose table is not inline (`devshare_exporter_segment_table`), NULL
/// otherwise. `*len_out` (if not NULL) receives the length, also when `buf` is NULL or too small
/// (`DEVSHARE_STATUS_BUFFER_TOO_SMALL`).
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_storage_handle(
    handle: *const DevshareHandle,
    table: *const u8,
    table_len: usize,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_torch_storage_handle", || {
        ffi!(storage_handle_as(handle, table, table_len, TorchFormat::Default, buf, cap, len_out))
    })
}

/// `devshare_torch_storage_handle` in `format` (as in `devshare_handle_to_torch_as`). On any
/// error nothing is written to `buf`.
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_storage_handle_as(
    handle: *const DevshareHandle,
    table: *const u8,
    table_len: usize,
    format: u32,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_torch_storage_handle_as", || {
        let format = TorchFormat::from_c(format)?;
        ffi!(storage_handle_as(handle, table, table_len, format, buf, cap, len_out))
    })
}

/// # Safety
/// The pointers are NULL or valid for their lengths.
unsafe fn storage_handle_as(
    handle: *const DevshareHandle,
    table: *const u8,
    table_len: usize,
    format: TorchFormat,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> crate::error::Result<()> {
    let h = ffi!(arg(handle, "handle"))?;
    let table = if table.is_null() { None } else { Some(ffi!(arg_slice(table, table_len, "table"))?) };
    let t = handle_to_torch_as(h, table, format)?;
    ffi!(super::write_out(&t.handle, false, buf, cap, len_out))
}

/// The version bridge: rewrite a PyTorch (`backend` cuda) or torch_npu (acl) storage handle —
/// arg 7 of a `reduce_tensor` tuple, item 1 of `_share_cuda_()` / `_share_npu_()`, in any form
/// `devshare_handle_from_torch` reads — as the producer of `format` would have written it, so a
/// consumer of another torch version rebuilds it with its own stock `rebuild_cuda_tensor`
/// (e.g. a torch 2.13 'e' or 'c' handle for torch 2.11: `DEVSHARE_TORCH_FORMAT_V2`, and back with
/// `_V3`). 'c' handles become `[version]['c'][key]`, or the raw key for `_UNVERSIONED` and, cuda,
/// `_DEFAULT`; 'e' handles keep their pid, segment size and records, with zero padding. Nothing
/// else in the tuple changes between versions. What the target cannot express is refused with
/// `DEVSHARE_STATUS_UNSUPPORTED` naming why (see `devshare_handle_to_torch_as`), malformed input
/// with the status `devshare_handle_from_torch` gives it; on any error nothing is written to
/// `buf`. `*len_out` (if not NULL) receives the length, also when `buf` is NULL or too small
/// (`DEVSHARE_STATUS_BUFFER_TOO_SMALL`). The output is at most `handle_len + 8` bytes.
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_handle_convert(
    backend: u16,
    handle: *const u8,
    handle_len: usize,
    format: u32,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_torch_handle_convert", || {
        let bytes = ffi!(arg_slice(handle, handle_len, "handle"))?;
        let out = convert_storage_handle(backend, bytes, TorchFormat::from_c(format)?)?;
        ffi!(super::write_out(&out, false, buf, cap, len_out))
    })
}

/// The storage-handle format a consumer running `torch_version` reads (and whose producer writes
/// it): for cuda, PyTorch's `torch.__version__` — 2.4 and earlier `DEVSHARE_TORCH_FORMAT_UNVERSIONED`,
/// 2.5 to 2.12 `_V2`, 2.13 and later `_V3`; for acl, torch_npu's version (or its torch's) — always
/// `_V1`. Accepts `"2.13"`, `"2.13.0+cu128"`, `"2.14.0a0+git1234"`, `"2.7.1.post2"`;
/// anything without `MAJOR.MINOR` is `DEVSHARE_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn devshare_torch_format_for_version(
    backend: u16,
    torch_version: *const c_char,
    format_out: *mut u32,
) -> i32 {
    boundary("devshare_torch_format_for_version", || {
        if torch_version.is_null() {
            return Err(Error::NullArgument("torch_version"));
        }
        let out = ffi!(arg_mut(format_out, "format_out"))?;
        // SAFETY: non-null, NUL-terminated (contract).
        let v = unsafe { CStr::from_ptr(torch_version) };
        let v = v.to_str().map_err(|_| Error::InvalidArgument("torch_version is not UTF-8".into()))?;
        *out = format_for_torch_version(backend, v)?.to_c();
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
        let a = ffi!(read_input(args, "args"))?;
        let name = ffi!(arg_slice(a.ref_name, a.ref_name_len, "args.ref_name"))?;
        crate::import::discard(name, a.ref_slot)
    })
}
