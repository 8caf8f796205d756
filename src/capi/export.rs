//! Exporter functions: allocate or export, hand out handles, count and wait for releases, close.

use super::abi::{init, read_input, sized_struct};
use super::{arg, arg_mut, arg_slice, boundary, write_out};
use crate::backend::ExportOptions;
use crate::dtype::DevshareDType;
use crate::error::Error;
use crate::export::{Exporter, TensorDesc};
use crate::handle::{DevshareHandle, DEVSHARE_MAX_NDIM};
use std::ffi::c_void;
use std::time::Duration;

/// `DevshareTensorDesc::storage_size` value meaning "from `storage_offset` to the end of the
/// allocation".
pub const DEVSHARE_STORAGE_TO_END: u64 = u64::MAX;
/// `devshare_exporter_close` flag: close even while references are outstanding.
pub const DEVSHARE_CLOSE_FORCE: u32 = 1;
/// `devshare_exporter_close` flag: remove the shm names (data and ref-counter) now, even if a
/// consumer still maps them — e.g. one that died without releasing. Only for buffers that no
/// PyTorch process maps: PyTorch aborts when a name it expects to unlink is gone.
pub const DEVSHARE_CLOSE_UNLINK: u32 = 2;

/// An exported allocation (opaque). Thread-safe: `share`, `outstanding` and `wait` may be called
/// from several threads at once; `close` must not race with other calls on the same exporter.
pub struct DevshareExporter(pub(crate) std::sync::Arc<Exporter>);

/// Describes a tensor inside an exported allocation, for `devshare_exporter_share`.
/// Initialise with `devshare_tensor_desc_init(&desc, sizeof desc)`, then set the fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareTensorDesc {
    /// Size of this struct in the caller's header (`devshare_tensor_desc_init` sets it).
    pub struct_size: u32,
    /// Element type.
    pub dtype: DevshareDType,
    /// Number of dimensions, 0..=`DEVSHARE_MAX_NDIM`.
    pub ndim: u32,
    /// `DEVSHARE_SHARE_*` bits.
    pub flags: u32,
    /// `ndim` sizes in elements (may be NULL when ndim is 0); read during the call only.
    pub shape: *const i64,
    /// `ndim` strides in elements, or NULL for C-contiguous; read during the call only.
    pub strides: *const i64,
    /// Byte offset of the storage in the allocation.
    pub storage_offset: u64,
    /// Storage size in bytes, or `DEVSHARE_STORAGE_TO_END` (the default).
    pub storage_size: u64,
    /// Element offset of the tensor in its storage.
    pub tensor_offset: i64,
    /// Device backends: the stream (`aclrtStream`, `CUstream`) whose work produced the data, or
    /// NULL for all work on the device. Without `DEVSHARE_SHARE_EVENT` it is synchronised before
    /// the handle is returned; with it, the event is recorded on it. Ignored for host memory.
    pub stream: *mut c_void,
}

sized_struct!(
    DevshareTensorDesc,
    "DevshareTensorDesc",
    first_size = 64,
    sum = 4 * 4 + 8 * 6,
    defaults = DevshareTensorDesc {
        struct_size: 0,
        dtype: DevshareDType { code: 0, bits: 0, lanes: 0 },
        ndim: 0,
        flags: 0,
        shape: std::ptr::null(),
        strides: std::ptr::null(),
        storage_offset: 0,
        storage_size: DEVSHARE_STORAGE_TO_END,
        tensor_offset: 0,
        stream: std::ptr::null_mut(),
    }
);

/// Initialise a `DevshareTensorDesc` of `size` bytes (pass `sizeof *desc`): all zero (dtype
/// included: set it), `storage_size = DEVSHARE_STORAGE_TO_END`, `struct_size = size`.
#[no_mangle]
pub unsafe extern "C" fn devshare_tensor_desc_init(desc: *mut DevshareTensorDesc, size: u32) -> i32 {
    boundary("devshare_tensor_desc_init", || ffi!(init(desc, size, "desc")))
}

/// `DevshareTensorDesc::flags` (host only): count the receiver in before the handle travels
/// (PyTorch's `file_system` protocol). The object then cannot vanish while the handle is in
/// flight, even if the exporter closes first; the handle's first import takes the reference
/// over. A handle sent this way must be imported, or the object outlives everyone.
pub const DEVSHARE_SHARE_INFLIGHT: u32 = 1;
/// `DevshareTensorDesc::flags` (device backends): record an interprocess event on `stream` and
/// send it with the handle (`DEVSHARE_HANDLE_FLAG_EVENT`); the consumer's import makes its own
/// stream wait on it, so the producer need not synchronise. The exporter keeps the event until
/// the handle's reference is released. Without this flag, share synchronises `stream`.
pub const DEVSHARE_SHARE_EVENT: u32 = 2;
/// `devshare_export` flag (acl): export the key without pid validation, so any process may
/// import it (what torch_npu does). By default only processes whose pid was added with
/// `devshare_exporter_allow_pid` may import. Other backends ignore it.
pub const DEVSHARE_EXPORT_NO_PID_CHECK: u32 = 1;

/// Allocate `size` bytes of zero-filled, shareable host memory (POSIX shared memory, mode
/// 0600, unguessable name) and export it. `*ptr_out` (if not NULL) receives its address, valid
/// until `devshare_exporter_close`.
#[no_mangle]
pub unsafe extern "C" fn devshare_host_alloc(
    size: u64,
    out: *mut *mut DevshareExporter,
    ptr_out: *mut *mut c_void,
) -> i32 {
    boundary("devshare_host_alloc", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let e = Exporter::host_alloc(size)?;
        if let Some(p) = ffi!(ptr_out.as_mut()) {
            *p = e.ptr().cast();
        }
        *out = Box::into_raw(Box::new(DevshareExporter(std::sync::Arc::new(e))));
        Ok(())
    })
}

/// Export an existing host shared memory object in PyTorch's `file_system` layout — a 64-byte
/// header with the mapping count, then `size` data bytes — without copying, e.g. the `name` that
/// PyTorch's `storage._share_filename_cpu_()` returned, or a buffer another devshare process
/// exported. The exporter maps it and counts itself in, like any holder; `*ptr_out` (if not
/// NULL) receives the data address.
#[no_mangle]
pub unsafe extern "C" fn devshare_host_adopt(
    name: *const std::ffi::c_char,
    size: u64,
    out: *mut *mut DevshareExporter,
    ptr_out: *mut *mut c_void,
) -> i32 {
    boundary("devshare_host_adopt", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let name = ffi!(arg(name, "name"))?;
        let name = ffi!(std::ffi::CStr::from_ptr(name)).to_bytes();
        let e = Exporter::host_adopt(name, size)?;
        if let Some(p) = ffi!(ptr_out.as_mut()) {
            *p = e.ptr().cast();
        }
        *out = Box::into_raw(Box::new(DevshareExporter(std::sync::Arc::new(e))));
        Ok(())
    })
}

/// Export existing device memory `[ptr, ptr + size)` on `backend` (`DEVSHARE_BACKEND_*`) and
/// `device` (`DEVSHARE_EXPORT_*` `flags`). The caller keeps owning the memory and frees it after
/// `devshare_exporter_close`. Exporting the same allocation again reuses its export key.
///
/// - acl: `ptr` and `size` must be page aligned (allocate >= 2 MiB with a HUGE policy); the
///   key is exported with pid validation unless `DEVSHARE_EXPORT_NO_PID_CHECK`.
/// - cuda: `ptr` may point inside a `cuMemAlloc`/`cudaMalloc` block; the whole block is
///   exported and handles carry the offset. VMM and stream-ordered pool memory are refused.
/// - host memory cannot be exported this way (use `devshare_host_alloc`).
///
/// A backend whose runtime is missing returns `DEVSHARE_STATUS_BACKEND_UNAVAILABLE`.
#[no_mangle]
pub unsafe extern "C" fn devshare_export(
    backend: u16,
    device: i32,
    ptr: *mut c_void,
    size: u64,
    flags: u32,
    out: *mut *mut DevshareExporter,
) -> i32 {
    boundary("devshare_export", || {
        let out = ffi!(arg_mut(out, "out"))?;
        if ptr.is_null() {
            return Err(Error::NullArgument("ptr"));
        }
        if flags & !DEVSHARE_EXPORT_NO_PID_CHECK != 0 {
            return Err(Error::InvalidArgument(format!("unknown export flags {flags:#x}")));
        }
        if device < 0 {
            return Err(Error::InvalidArgument(format!("device {device} is negative")));
        }
        let opts = ExportOptions { no_pid_check: flags & DEVSHARE_EXPORT_NO_PID_CHECK != 0, ..Default::default() };
        let e = Exporter::export(backend, device, ptr.cast(), size, &opts)?;
        *out = Box::into_raw(Box::new(DevshareExporter(std::sync::Arc::new(e))));
        Ok(())
    })
}

/// `devshare_export_segments` flag (cuda): share 64-byte fabric handles (multi-node NVLink
/// systems; the physical memory must have been created with `CU_MEM_HANDLE_TYPE_FABRIC`)
/// instead of POSIX file descriptors.
pub const DEVSHARE_EXPORT_FABRIC: u32 = 2;

/// Export a segmented (VMM) allocation that the caller built and mapped itself: `count`
/// segments of `segment_size` bytes mapped back to back from `base` on `device`, with
/// `physical[i]` the physical allocation handle of segment i (`aclrtDrvMemHandle` cast to
/// `uint64_t`, or `CUmemGenericAllocationHandle`). `segment_size` is a multiple of
/// `DEVSHARE_SEGMENT_GRANULARITY`. Handles made from the exporter are segmented handles, which
/// stock torch_npu and PyTorch (`expandable_segments`) consumers open as 'e' storages
/// (`devshare_handle_to_torch`). The caller keeps owning the memory and frees it after
/// `devshare_exporter_close`; `physical` is read during the call only.
///
/// - acl: each segment is exported once with `aclrtMemExportToShareableHandle`, with pid
///   validation unless `DEVSHARE_EXPORT_NO_PID_CHECK` (then `devshare_exporter_allow_pid`).
/// - cuda: each segment is exported as a POSIX fd (kept open until the exporter closes, which
///   consumers take with `pidfd_getfd`: see `devshare_allow_ptrace`), or as a fabric handle
///   with `DEVSHARE_EXPORT_FABRIC`.
#[no_mangle]
pub unsafe extern "C" fn devshare_export_segments(
    backend: u16,
    device: i32,
    base: *mut c_void,
    physical: *const u64,
    count: usize,
    segment_size: u64,
    flags: u32,
    out: *mut *mut DevshareExporter,
) -> i32 {
    boundary("devshare_export_segments", || {
        let out = ffi!(arg_mut(out, "out"))?;
        if base.is_null() {
            return Err(Error::NullArgument("base"));
        }
        if count == 0 {
            return Err(Error::InvalidArgument("count is 0: there is nothing to export".into()));
        }
        if count > crate::handle::segments::DEVSHARE_MAX_SEGMENTS as usize {
            return Err(Error::bad_size(
                "count",
                format!("{count} segments is above the maximum {}", crate::handle::segments::DEVSHARE_MAX_SEGMENTS),
            ));
        }
        let physical = ffi!(arg_slice(physical, count, "physical"))?;
        let unknown = flags & !(DEVSHARE_EXPORT_NO_PID_CHECK | DEVSHARE_EXPORT_FABRIC);
        if unknown != 0 {
            return Err(Error::UnsupportedVersion(format!("export flags {unknown:#x} are unknown to this library")));
        }
        if device < 0 {
            return Err(Error::InvalidArgument(format!("device {device} is negative")));
        }
        let opts = ExportOptions {
            no_pid_check: flags & DEVSHARE_EXPORT_NO_PID_CHECK != 0,
            fabric: flags & DEVSHARE_EXPORT_FABRIC != 0,
        };
        let mem = crate::backend::SegmentedMemory { base: base.cast(), segment_size, physical };
        let e = Exporter::export_segments(backend, device, &mem, &opts)?;
        *out = Box::into_raw(Box::new(DevshareExporter(std::sync::Arc::new(e))));
        Ok(())
    })
}

/// Adopt one reference of a device handle that another exporter in this process made — PyTorch's
/// or torch_npu's share of a CUDA / NPU storage (`reduce_tensor`'s tuple, converted with
/// `devshare_handle_from_torch` or `_encoded`) — as an exporter, so that the storage can be
/// leased over channels (`devshare_channel_send`) or shared again (`devshare_exporter_share`).
///
/// - Its handles name tensors inside the adopted storage: `desc.storage_offset` counts from the
///   storage's first byte, and `DEVSHARE_STORAGE_TO_END` ends where the storage ends.
/// - The adopted handle's event is not used: each share records its own on `desc.stream`
///   (`DEVSHARE_SHARE_EVENT`) or synchronises it.
/// - A segmented CUDA handle lists POSIX fd numbers valid in this process (where the allocator
///   exported them): they are duplicated now, and channels pass the duplicates with
///   `SCM_RIGHTS`, so consumers need no `pidfd_getfd`. Adopting such a handle made in another
///   process is refused. Each fd must be a segment's memory — an NVIDIA driver fd, or a memfd
///   at least a segment large — and any other open descriptor (a file, a socket, a pipe) is
///   refused with `DEVSHARE_STATUS_UNTRUSTED` naming it, so that it never reaches a consumer.
/// - The reference the handle carries (its ref-counter slot) is given back when the exporter is
///   closed, exactly once: keep the storage alive until `devshare_exporter_close` succeeds
///   (it refuses with `DEVSHARE_STATUS_BUSY` while leases are out), then let it go; PyTorch then
///   frees the block at once, with no `ipc_collect`. Only the share's own reference is taken:
///   a ref-counter of another process (PyTorch's names carry its pid), a devshare ref-counter of
///   an exporter of other memory or of none alive here (`DEVSHARE_STATUS_UNTRUSTED`), or a slot
///   that another adoption or an import in this process holds (`DEVSHARE_STATUS_BUSY`) is
///   refused, and a refused handle's reference stays the caller's.
/// - ACL: consumers that connect over a channel are whitelisted on the key (or shareable
///   handles) where the runtime takes it; torch_npu exports without pid validation.
///
/// `table`/`table_len`: the segment table when it travels outside the handle (NULL/0
/// otherwise). `flags`: 0. Host handles are adopted by name (`devshare_host_adopt`).
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_adopt(
    handle: *const DevshareHandle,
    table: *const u8,
    table_len: usize,
    flags: u32,
    out: *mut *mut DevshareExporter,
) -> i32 {
    boundary("devshare_exporter_adopt", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let h = ffi!(arg(handle, "handle"))?;
        if flags != 0 {
            return Err(Error::UnsupportedVersion(format!("adopt flags {flags:#x} are unknown to this library")));
        }
        let table = if table_len == 0 { None } else { Some(ffi!(arg_slice(table, table_len, "table"))?) };
        let e = Exporter::adopt(h, table)?;
        *out = Box::into_raw(Box::new(DevshareExporter(std::sync::Arc::new(e))));
        Ok(())
    })
}

/// Let the process `pid` take this process's file descriptors with `pidfd_getfd` under Yama
/// `ptrace_scope` = 1 (`prctl(PR_SET_PTRACER, pid)`; `-1`: any process, `0`: nobody again).
/// Needed by a CUDA producer whose segmented exports go to a consumer that is not its
/// ancestor (a sibling or an unrelated process). It is process-wide and names one process at a
/// time (the last call wins); devshare never calls it on its own. Without Yama, a no-op.
#[no_mangle]
pub unsafe extern "C" fn devshare_allow_ptrace(pid: i32) -> i32 {
    boundary("devshare_allow_ptrace", || crate::backend::pidfd::allow_ptrace(pid))
}

/// The exported allocation's address and size in this process (either out pointer may be NULL).
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_memory(
    exporter: *const DevshareExporter,
    ptr_out: *mut *mut c_void,
    size_out: *mut u64,
) -> i32 {
    boundary("devshare_exporter_memory", || {
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        if let Some(p) = ffi!(ptr_out.as_mut()) {
            *p = e.ptr().cast();
        }
        if let Some(s) = ffi!(size_out.as_mut()) {
            *s = e.size();
        }
        Ok(())
    })
}

/// Make a handle for a tensor in the allocation (`desc` NULL: the whole allocation as 1-D
/// uint8). Each handle is one reference with its own ref-counter slot set to 1: give each
/// consumer its own handle. The consumer's release sets the slot to 0.
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_share(
    exporter: *const DevshareExporter,
    desc: *const DevshareTensorDesc,
    out: *mut DevshareHandle,
) -> i32 {
    boundary("devshare_exporter_share", || {
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        let out = ffi!(arg_mut(out, "out"))?;
        *out = ffi!(share_from_c(e, desc))?;
        Ok(())
    })
}

/// `Exporter::share` for a C description (NULL: the whole allocation as bytes).
///
/// # Safety
/// `desc` is NULL or valid for its `struct_size`, its shape/strides for `ndim` entries.
unsafe fn share_from_c(e: &Exporter, desc: *const DevshareTensorDesc) -> crate::error::Result<DevshareHandle> {
    if desc.is_null() {
        return e.share_bytes();
    }
    let d = ffi!(read_input(desc, "desc"))?;
    e.share(&ffi!(tensor_desc_from_c(&d))?)
}

/// The `TensorDesc` a C description gives (its shape and strides borrowed from the caller).
///
/// # Safety
/// `d.shape` / `d.strides` are NULL or valid for `ndim` entries for the lifetime `'a`.
pub(crate) unsafe fn tensor_desc_from_c<'a>(d: &DevshareTensorDesc) -> crate::error::Result<TensorDesc<'a>> {
    if d.ndim as usize > DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!("desc.ndim {} is above the maximum {DEVSHARE_MAX_NDIM}", d.ndim)));
    }
    let unknown = d.flags & !(DEVSHARE_SHARE_INFLIGHT | DEVSHARE_SHARE_EVENT);
    if unknown != 0 {
        return Err(Error::UnsupportedVersion(format!(
            "desc.flags: bits {unknown:#x} are not share flags this library knows"
        )));
    }
    let n = d.ndim as usize;
    let shape = ffi!(arg_slice(d.shape, n, "desc.shape"))?;
    let strides = if d.strides.is_null() { None } else { Some(ffi!(arg_slice(d.strides, n, "desc.strides"))?) };
    Ok(TensorDesc {
        dtype: d.dtype,
        shape,
        strides,
        storage_offset: d.storage_offset,
        storage_size: (d.storage_size != DEVSHARE_STORAGE_TO_END).then_some(d.storage_size),
        tensor_offset: d.tensor_offset,
        inflight: d.flags & DEVSHARE_SHARE_INFLIGHT != 0,
        event: d.flags & DEVSHARE_SHARE_EVENT != 0,
        stream: d.stream,
    })
}

/// Like `devshare_exporter_share`, but writes the handle's byte encoding into `buf` — the form
/// that also carries a segmented export's segment table when it is too long for the struct.
/// `*len_out` (if not NULL) receives the length, also when `buf` is NULL or too small
/// (`DEVSHARE_STATUS_BUFFER_TOO_SMALL`: nothing was shared then, call again).
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_share_encoded(
    exporter: *const DevshareExporter,
    desc: *const DevshareTensorDesc,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_exporter_share_encoded", || {
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        let h = ffi!(share_from_c(e, desc))?;
        let mut bytes = Vec::new();
        let encoded = crate::handle::encode::encode_full_into(&h, e.external_table(), &mut bytes);
        if encoded.is_err() || buf.is_null() || cap < bytes.len() {
            // Give the reference back: nothing travels (the caller may ask again with a larger
            // buffer). A failure to return it is secondary to why nothing travels.
            let _ = crate::import::discard_handle(&h);
        }
        encoded?;
        ffi!(write_out(&bytes, false, buf, cap, len_out))
    })
}

/// The segment table of a segmented export whose table does not fit a `DevshareHandle` (more
/// than `DEVSHARE_KEY_CAPACITY` bytes of records), for `devshare_torch_storage_handle`; its
/// length is 0 (and nothing is written) for other exports. `*len_out` (if not NULL) receives
/// the length, also when `buf` is NULL or too small (`DEVSHARE_STATUS_BUFFER_TOO_SMALL`).
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_segment_table(
    exporter: *const DevshareExporter,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_exporter_segment_table", || {
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        let t = e.external_table().unwrap_or(&[]);
        if t.is_empty() {
            if let Some(l) = ffi!(len_out.as_mut()) {
                *l = 0;
            }
            return Ok(());
        }
        ffi!(write_out(t, false, buf, cap, len_out))
    })
}

/// Allow the importer whose pid is `pid` to import this export. For acl this adds `pid` to the
/// key's whitelist (`aclrtIpcMemSetImportPid`); the importer learns the pid to send with
/// `devshare_local_pid` (on Ascend it is the bare tgid, which differs from `getpid()` in
/// containers). Backends without a pid whitelist accept every pid and do nothing.
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_allow_pid(exporter: *const DevshareExporter, pid: i32) -> i32 {
    boundary("devshare_exporter_allow_pid", || ffi!(arg(exporter, "exporter"))?.0.allow_pid(pid))
}

/// The pid an exporter must pass to `devshare_exporter_allow_pid` so that this process can import
/// on `backend` (`DEVSHARE_BACKEND_*`) and `device`: acl: `aclrtDeviceGetBareTgid`; others:
/// `getpid()`.
#[no_mangle]
pub unsafe extern "C" fn devshare_local_pid(backend: u16, device: i32, pid: *mut i32) -> i32 {
    boundary("devshare_local_pid", || {
        let pid = ffi!(arg_mut(pid, "pid"))?;
        if device < 0 {
            return Err(Error::InvalidArgument(format!("device {device} is negative")));
        }
        *pid = crate::backend::get(backend)?.local_pid(device)?;
        Ok(())
    })
}

/// Number of references handed out by `devshare_exporter_share` and not yet released, plus the
/// leases and pool attachments of this export out over channels (those are counted back when a
/// call serves their channel: `devshare_channel_service`, or `devshare_exporter_wait`).
/// `DEVSHARE_STATUS_UNTRUSTED` (`*count` untouched) when a ref-counter slot holds anything but 0
/// or 1: something else wrote to it, and the message names the slot.
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_outstanding(exporter: *const DevshareExporter, count: *mut u64) -> i32 {
    boundary("devshare_exporter_outstanding", || {
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        let count = ffi!(arg_mut(count, "count"))?;
        *count = e.outstanding()?;
        Ok(())
    })
}

/// Wait until every handed-out reference was released: `DEVSHARE_STATUS_OK`, or
/// `DEVSHARE_STATUS_TIMEOUT` after `timeout_ms` milliseconds (negative: wait forever), or
/// `DEVSHARE_STATUS_UNTRUSTED` at once when a slot is corrupt (see
/// `devshare_exporter_outstanding`). Serves the channels the export was leased through while
/// it waits; before it sleeps it may poll their rings (`devshare_channel_set_spin`, or, with
/// no spin set, for up to 50 µs while a consumer is awake on another CPU: docs/channels.md,
/// "The adaptive spin") and yield the CPU once to a consumer awake on this one.
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_wait(exporter: *const DevshareExporter, timeout_ms: i64) -> i32 {
    boundary("devshare_exporter_wait", || {
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        e.wait(u64::try_from(timeout_ms).ok().map(Duration::from_millis))
    })
}

/// Close the exporter and free it. Host memory: importers that still map the buffer keep it
/// valid; whoever brings its mapping count to 0 unlinks the name (PyTorch's rule), so once every
/// importer released nothing is left in /dev/shm. A consumer that died without releasing keeps
/// the object alive; `DEVSHARE_CLOSE_UNLINK` removes the names at once. Handles not imported
/// before the close may fail to open: wait for consumers first. Device backends refuse with
/// `DEVSHARE_STATUS_BUSY` while references are outstanding (the exporter stays valid) unless
/// `flags` has `DEVSHARE_CLOSE_FORCE`.
///
/// `DEVSHARE_CLOSE_FORCE` on a segmented CUDA export (fd table) with references outstanding is
/// unsafe: it closes the exported fds, a later export may get the same fd numbers, and a consumer
/// that still holds an import of the old table (its imports are cached by producer pid and fd
/// numbers) gets the old mapping for a handle of the new memory. Wait for the references (or
/// make sure every consumer released its imports) before closing such an export.
#[no_mangle]
pub unsafe extern "C" fn devshare_exporter_close(exporter: *mut DevshareExporter, flags: u32) -> i32 {
    boundary("devshare_exporter_close", || {
        if exporter.is_null() {
            return Err(Error::NullArgument("exporter"));
        }
        if flags & !(DEVSHARE_CLOSE_FORCE | DEVSHARE_CLOSE_UNLINK) != 0 {
            return Err(Error::InvalidArgument(format!("unknown close flags {flags:#x}")));
        }
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        e.prepare_close(flags & DEVSHARE_CLOSE_FORCE != 0, flags & DEVSHARE_CLOSE_UNLINK != 0)?;
        // SAFETY: exporter came from Box::into_raw in this module; after a successful check the
        // caller gives it up, so it is freed exactly once.
        drop(ffi!(Box::from_raw(exporter)));
        Ok(())
    })
}
