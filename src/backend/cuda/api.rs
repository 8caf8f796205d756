//! The CUDA driver API (`libcuda.so.1`, loaded at run time) as safe, typed calls.
//!
//! [`CudaApi`] is the only caller of the driver's raw symbols. Each method is one driver call,
//! named after it (`cuIpcOpenMemHandle` → [`CudaApi::ipc_open_mem_handle`]); it returns
//! `Result`, with a failure formatted once ([`CudaApi::error`]). At the end, the wrapper is bound
//! into the shared plumbing of `backend/runtime.rs`: per-thread contexts and IPC events.
//!
//! Calls that only some drivers have come in `Optional` groups, as in `acl/api.rs`: the driver
//! loads without them and their methods fail with `Unsupported`. The VMM calls are one: a struct
//! of raw signatures (`VmmFns`: `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`,
//! `cuMemExportToShareableHandle`, ...), a field `vmm: Optional<VmmFns>` filled inside the
//! `unsafe` block of [`CudaApi::load`] with `Optional::load("this CUDA driver has no VMM calls",
//! || Ok(VmmFns { mem_map: lib.required("cuMemMap")?, ... }))`, and one method per call starting
//! with `let f = self.vmm.get()?;`. The driver structs those calls take (`CUmemAccessDesc`,
//! `CUmemAllocationProp`, `CUmemLocation`) are written out with `cuda.h`'s layout, checked by
//! size. Required calls go into `Fns`.

use crate::backend::runtime::{Context, DeviceContexts, Event, IpcEvents, Stream};
use crate::error::{Error, Result};
use crate::handle::DEVSHARE_EVENT_HANDLE_SIZE;
use crate::loader::{self, c_text, Optional, Symbols};
use std::ffi::{c_char, c_int, c_uint, c_void};

/// Size of a `CUipcMemHandle` / `CUipcEventHandle`.
pub(crate) const HANDLE_LEN: usize = 64;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
pub(crate) const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_EVENT_INTERPROCESS: c_uint = 4;

type CuResult = c_int;
/// `CUdevice`: a device as the driver numbers it (from [`CudaApi::device_get`]).
pub(crate) type Device = c_int;
/// `CUdeviceptr`.
pub(crate) type DevPtr = u64;

/// `CUipcMemHandle` / `CUipcEventHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; HANDLE_LEN],
}

/// The `CUpointer_attribute`s devshare reads: each is a 4-byte int or bool, which is what makes
/// [`CudaApi::pointer_get_attribute`] safe with any of them.
#[derive(Clone, Copy, Debug)]
#[repr(i32)]
pub(crate) enum IntPointerAttribute {
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`: the ordinal of the memory's device.
    DeviceOrdinal = 9,
    /// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`: whether `cuIpcGetMemHandle` works.
    IsLegacyCudaIpcCapable = 10,
}

/// `CUmemGenericAllocationHandle`: a physical VMM allocation (created, imported or retained),
/// compared by value, never dereferenced.
pub(crate) type MemHandle = u64;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: an `int` fd, passed as `(void *)(uintptr_t)fd`.
pub(crate) const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_FABRIC`: a 64-byte `CUmemFabricHandle`, passed by address.
pub(crate) const CU_MEM_HANDLE_TYPE_FABRIC: c_int = 8;
/// Size of a `CUmemFabricHandle`.
pub(crate) const FABRIC_HANDLE_LEN: usize = 64;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`: what `cuMemMap` and `cuMemAddressReserve` sizes and
/// addresses must be multiples of.
const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;

/// `CUmemAccess_flags`: what a device may do with a mapped range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub(crate) enum MemAccess {
    /// `CU_MEM_ACCESS_FLAGS_PROT_READ`.
    Read = 1,
    /// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
    ReadWrite = 3,
}

/// `CUmemLocation` (`cuda.h`): `{CUmemLocationType type; int id;}`, 8 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemAccessDesc` (`cuda.h`): `{CUmemLocation location; CUmemAccess_flags flags;}`, 12 bytes
/// (the flags are an enum: 4 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct MemAccessDesc {
    location: MemLocation,
    flags: c_int,
}

/// `CUmemAllocationProp` (`cuda.h`): type, requested handle types, location, the Windows
/// metadata pointer and `allocFlags` (compression type, RDMA capable, usage, 4 reserved bytes):
/// 32 bytes on x86-64.
#[repr(C)]
#[derive(Clone, Copy)]
struct MemAllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location: MemLocation,
    win32_handle_meta_data: *mut c_void,
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

static_assertions::const_assert_eq!(std::mem::size_of::<MemAccessDesc>(), 12);
#[cfg(target_pointer_width = "64")]
static_assertions::const_assert_eq!(std::mem::size_of::<MemAllocationProp>(), 32);

/// The driver calls devshare needs.
struct Fns {
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut Device, c_int) -> CuResult,
    device_get_uuid: unsafe extern "C" fn(*mut [u8; 16], Device) -> CuResult,
    device_primary_ctx_retain: unsafe extern "C" fn(*mut Context, Device) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut Context) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Context) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_get_address_range: unsafe extern "C" fn(*mut DevPtr, *mut usize, DevPtr) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(DevPtr) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(DevPtr, *const c_void, usize) -> CuResult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, DevPtr) -> CuResult,
    ipc_get_mem_handle: unsafe extern "C" fn(*mut IpcHandle, DevPtr) -> CuResult,
    ipc_open_mem_handle: unsafe extern "C" fn(*mut DevPtr, IpcHandle, c_uint) -> CuResult,
    ipc_close_mem_handle: unsafe extern "C" fn(DevPtr) -> CuResult,
    event_create: unsafe extern "C" fn(*mut Event, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(Event, Stream) -> CuResult,
    event_synchronize: unsafe extern "C" fn(Event) -> CuResult,
    event_destroy: unsafe extern "C" fn(Event) -> CuResult,
    ipc_get_event_handle: unsafe extern "C" fn(*mut IpcHandle, Event) -> CuResult,
    ipc_open_event_handle: unsafe extern "C" fn(*mut Event, IpcHandle) -> CuResult,
    stream_wait_event: unsafe extern "C" fn(Stream, Event, c_uint) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(Stream) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

/// The virtual memory management calls (CUDA 10.2 and later; PyTorch's expandable segments),
/// for segmented (VMM) exports and imports. A driver without them still shares `cuMemAlloc`
/// memory.
struct VmmFns {
    mem_address_reserve: unsafe extern "C" fn(*mut DevPtr, usize, usize, DevPtr, u64) -> CuResult,
    mem_address_free: unsafe extern "C" fn(DevPtr, usize) -> CuResult,
    mem_map: unsafe extern "C" fn(DevPtr, usize, usize, MemHandle, u64) -> CuResult,
    mem_unmap: unsafe extern "C" fn(DevPtr, usize) -> CuResult,
    mem_set_access: unsafe extern "C" fn(DevPtr, usize, *const MemAccessDesc, usize) -> CuResult,
    mem_release: unsafe extern "C" fn(MemHandle) -> CuResult,
    mem_export_to_shareable_handle: unsafe extern "C" fn(*mut c_void, MemHandle, c_int, u64) -> CuResult,
    mem_import_from_shareable_handle: unsafe extern "C" fn(*mut MemHandle, *mut c_void, c_int) -> CuResult,
    mem_retain_allocation_handle: unsafe extern "C" fn(*mut MemHandle, *mut c_void) -> CuResult,
    mem_get_allocation_granularity: unsafe extern "C" fn(*mut usize, *const MemAllocationProp, c_int) -> CuResult,
}

/// The loaded, initialised driver.
pub(crate) struct CudaApi {
    name: String,
    driver_version: c_int,
    fns: Fns,
    vmm: Optional<VmmFns>,
    /// Keeps the functions above loaded.
    _lib: libloading::Library,
}

impl CudaApi {
    /// Load the driver, read its symbols, `cuInit` it and read its version.
    pub(crate) fn load() -> Result<CudaApi> {
        let lib = Symbols::open("DEVSHARE_CUDA_LIBRARY", &["libcuda.so.1".to_string()])?;
        // SAFETY: each function's type (the field's, or the one written out) is the C signature
        // of the symbol named next to it, from `cuda.h`; where several names are tried, they are
        // versions of one call with that signature.
        let (init, get_version, fns, vmm) = unsafe {
            let init: unsafe extern "C" fn(c_uint) -> CuResult = lib.required("cuInit")?;
            let get_version: unsafe extern "C" fn(*mut c_int) -> CuResult = lib.required("cuDriverGetVersion")?;
            let vmm = Optional::load("this CUDA driver has no VMM calls (CUDA 10.2 or later is needed)", || {
                Ok(VmmFns {
                    mem_address_reserve: lib.required("cuMemAddressReserve")?,
                    mem_address_free: lib.required("cuMemAddressFree")?,
                    mem_map: lib.required("cuMemMap")?,
                    mem_unmap: lib.required("cuMemUnmap")?,
                    mem_set_access: lib.required("cuMemSetAccess")?,
                    mem_release: lib.required("cuMemRelease")?,
                    mem_export_to_shareable_handle: lib.required("cuMemExportToShareableHandle")?,
                    mem_import_from_shareable_handle: lib.required("cuMemImportFromShareableHandle")?,
                    mem_retain_allocation_handle: lib.required("cuMemRetainAllocationHandle")?,
                    mem_get_allocation_granularity: lib.required("cuMemGetAllocationGranularity")?,
                })
            });
            let fns = Fns {
                device_get_count: lib.required("cuDeviceGetCount")?,
                device_get: lib.required("cuDeviceGet")?,
                device_get_uuid: lib.first_of(&["cuDeviceGetUuid_v2", "cuDeviceGetUuid"])?,
                device_primary_ctx_retain: lib.required("cuDevicePrimaryCtxRetain")?,
                ctx_get_current: lib.required("cuCtxGetCurrent")?,
                ctx_set_current: lib.required("cuCtxSetCurrent")?,
                ctx_synchronize: lib.required("cuCtxSynchronize")?,
                // The plain name is the old 32-bit ABI: only the _v2 symbol has this signature.
                mem_get_address_range: lib.required("cuMemGetAddressRange_v2")?,
                mem_alloc: lib.required("cuMemAlloc_v2")?,
                mem_free: lib.required("cuMemFree_v2")?,
                memcpy_dtoh: lib.required("cuMemcpyDtoH_v2")?,
                memcpy_htod: lib.required("cuMemcpyHtoD_v2")?,
                // The plain name is the old ABI: only the _v2 symbol has this signature.
                mem_host_register: lib.required("cuMemHostRegister_v2")?,
                mem_host_unregister: lib.required("cuMemHostUnregister")?,
                pointer_get_attribute: lib.required("cuPointerGetAttribute")?,
                ipc_get_mem_handle: lib.required("cuIpcGetMemHandle")?,
                ipc_open_mem_handle: lib.first_of(&["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"])?,
                ipc_close_mem_handle: lib.required("cuIpcCloseMemHandle")?,
                event_create: lib.required("cuEventCreate")?,
                event_record: lib.required("cuEventRecord")?,
                event_synchronize: lib.required("cuEventSynchronize")?,
                event_destroy: lib.first_of(&["cuEventDestroy_v2", "cuEventDestroy"])?,
                ipc_get_event_handle: lib.required("cuIpcGetEventHandle")?,
                ipc_open_event_handle: lib.required("cuIpcOpenEventHandle")?,
                stream_wait_event: lib.required("cuStreamWaitEvent")?,
                stream_synchronize: lib.required("cuStreamSynchronize")?,
                get_error_name: lib.required("cuGetErrorName")?,
                get_error_string: lib.required("cuGetErrorString")?,
            };
            (init, get_version, fns, vmm)
        };
        let mut api = CudaApi { name: lib.name().to_string(), driver_version: 0, fns, vmm, _lib: lib.into_library() };
        // SAFETY: plain call.
        api.check("cuInit", unsafe { init(0) })?;
        let mut version = 0;
        // SAFETY: valid out pointer.
        api.check("cuDriverGetVersion", unsafe { get_version(&mut version) })?;
        api.driver_version = version;
        Ok(api)
    }

    /// The name the driver loaded by.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `cuDriverGetVersion`, read at load.
    pub(crate) fn driver_version(&self) -> c_int {
        self.driver_version
    }

    /// A vendor error for `call`: the driver's name and text for the code.
    pub(crate) fn error(&self, call: &str, code: CuResult) -> Error {
        let (mut name, mut text): (*const c_char, *const c_char) = (std::ptr::null(), std::ptr::null());
        // SAFETY: valid out pointers; the driver returns static strings (or leaves NULL), which
        // are copied at once.
        let meaning = unsafe {
            (self.fns.get_error_name)(code, &mut name);
            (self.fns.get_error_string)(code, &mut text);
            format!("{}: {}", c_text(name), c_text(text))
        };
        let hint = match (call, code) {
            ("cuMemExportToShareableHandle", 1) => {
                "only the handle types requested when the memory was created can be exported: create it with \
                 prop.requestedHandleTypes including CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (or \
                 CU_MEM_HANDLE_TYPE_FABRIC for DEVSHARE_EXPORT_FABRIC)"
            }
            ("cuMemExportToShareableHandle" | "cuMemImportFromShareableHandle", 800 | 801) => {
                "for fabric handles: they need a multi-node NVLink system whose IMEX channel both processes \
                 may use; share POSIX fds instead"
            }
            (_, 201 | 709) => "a CUDA IPC handle cannot be opened in the process that exported it",
            _ => "",
        };
        loader::vendor_error(call, code, &meaning, hint, "", &self.name)
    }

    fn check(&self, call: &str, code: CuResult) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    /// `cuDeviceGetCount`: the visible devices.
    pub(crate) fn device_get_count(&self) -> Result<c_int> {
        let mut n = 0;
        // SAFETY: valid out pointer.
        self.check("cuDeviceGetCount", unsafe { (self.fns.device_get_count)(&mut n) })?;
        Ok(n)
    }

    /// `cuDeviceGet`: the device with this ordinal.
    pub(crate) fn device_get(&self, ordinal: c_int) -> Result<Device> {
        let mut dev = 0;
        // SAFETY: valid out pointer; the driver checks the ordinal.
        self.check("cuDeviceGet", unsafe { (self.fns.device_get)(&mut dev, ordinal) })?;
        Ok(dev)
    }

    /// `cuDeviceGetUuid`.
    pub(crate) fn device_get_uuid(&self, dev: Device) -> Result<[u8; 16]> {
        let mut uuid = [0u8; 16];
        // SAFETY: valid 16-byte out buffer; the driver checks the device.
        self.check("cuDeviceGetUuid", unsafe { (self.fns.device_get_uuid)(&mut uuid, dev) })?;
        Ok(uuid)
    }

    /// `cuDevicePrimaryCtxRetain`: the device's primary context, retained (once per call).
    pub(crate) fn device_primary_ctx_retain(&self, dev: Device) -> Result<Context> {
        let mut ctx = Context::NULL;
        // SAFETY: valid out pointer; the driver checks the device.
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.fns.device_primary_ctx_retain)(&mut ctx, dev) })?;
        Ok(ctx)
    }

    /// `cuCtxGetCurrent`: the thread's context, null when it has none.
    pub(crate) fn ctx_get_current(&self) -> Result<Context> {
        let mut ctx = Context::NULL;
        // SAFETY: valid out pointer.
        self.check("cuCtxGetCurrent", unsafe { (self.fns.ctx_get_current)(&mut ctx) })?;
        Ok(ctx)
    }

    /// `cuCtxSetCurrent` (null: none).
    pub(crate) fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        // SAFETY: null or a context the driver handed out.
        self.check("cuCtxSetCurrent", unsafe { (self.fns.ctx_set_current)(ctx) })
    }

    /// `cuCtxSynchronize`: wait for all work in the current context.
    pub(crate) fn ctx_synchronize(&self) -> Result<()> {
        // SAFETY: plain call.
        self.check("cuCtxSynchronize", unsafe { (self.fns.ctx_synchronize)() })
    }

    /// `cuMemGetAddressRange`: the base and size of the allocation that contains `ptr`.
    pub(crate) fn mem_get_address_range(&self, ptr: DevPtr) -> Result<(DevPtr, usize)> {
        let (mut base, mut size): (DevPtr, usize) = (0, 0);
        // SAFETY: valid out pointers; `ptr` is a device address, which the driver checks.
        self.check("cuMemGetAddressRange", unsafe { (self.fns.mem_get_address_range)(&mut base, &mut size, ptr) })?;
        Ok((base, size))
    }

    /// `cuMemAlloc`: `size` bytes of device memory in the current context.
    pub(crate) fn mem_alloc(&self, size: u64) -> Result<DevPtr> {
        let mut ptr: DevPtr = 0;
        // SAFETY: valid out pointer; the driver checks the size.
        self.check("cuMemAlloc", unsafe { (self.fns.mem_alloc)(&mut ptr, size as usize) })?;
        Ok(ptr)
    }

    /// `cuMemFree` of a [`Self::mem_alloc`] block.
    pub(crate) fn mem_free(&self, ptr: DevPtr) -> Result<()> {
        // SAFETY: the caller's own block, freed once.
        self.check("cuMemFree", unsafe { (self.fns.mem_free)(ptr) })
    }

    /// `cuMemcpyDtoH`: `len` bytes from device memory to host memory, synchronously.
    ///
    /// # Safety
    /// `dst` is `len` writable bytes of host memory.
    pub(crate) unsafe fn memcpy_dtoh(&self, dst: *mut u8, src: DevPtr, len: usize) -> Result<()> {
        // SAFETY: the caller's promise; the driver checks `src`.
        self.check("cuMemcpyDtoH", unsafe { (self.fns.memcpy_dtoh)(dst.cast(), src, len) })
    }

    /// `cuMemcpyHtoD`: `len` bytes from host memory to device memory, synchronously.
    ///
    /// # Safety
    /// `src` is `len` readable bytes of host memory.
    pub(crate) unsafe fn memcpy_htod(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller's promise; the driver checks `dst`.
        self.check("cuMemcpyHtoD", unsafe { (self.fns.memcpy_htod)(dst, src.cast(), len) })
    }

    /// `cuMemHostRegister`: page-lock `len` bytes of host memory at `ptr` for the current
    /// context's device, so that copies to and from it run without the driver's own staging.
    ///
    /// # Safety
    /// `ptr..ptr + len` is host memory that stays mapped until [`Self::mem_host_unregister`].
    pub(crate) unsafe fn mem_host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller's promise; flags 0 (portable to the current context only).
        self.check("cuMemHostRegister", unsafe { (self.fns.mem_host_register)(ptr.cast(), len, 0) })
    }

    /// `cuMemHostUnregister` of what [`Self::mem_host_register`] pinned at `ptr`.
    ///
    /// # Safety
    /// `ptr` is the start of a registered range of this process.
    pub(crate) unsafe fn mem_host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller's promise.
        self.check("cuMemHostUnregister", unsafe { (self.fns.mem_host_unregister)(ptr.cast()) })
    }

    /// `cuPointerGetAttribute` for an int-sized attribute.
    pub(crate) fn pointer_get_attribute(&self, attr: IntPointerAttribute, ptr: DevPtr) -> Result<u32> {
        // 8 zeroed bytes leave room to spare for the int or bool the driver writes.
        let mut v: u64 = 0;
        // SAFETY: every IntPointerAttribute makes the driver write at most 4 bytes, into an
        // 8-byte buffer; `ptr` is a device address, which the driver checks.
        let rc = unsafe { (self.fns.pointer_get_attribute)((&mut v as *mut u64).cast(), attr as c_int, ptr) };
        self.check("cuPointerGetAttribute", rc)?;
        // Little-endian: an int or a bool lands in the low bytes.
        Ok(v as u32)
    }

    /// `cuIpcGetMemHandle`: the handle of the `cuMemAlloc` block at `base`.
    pub(crate) fn ipc_get_mem_handle(&self, base: DevPtr) -> Result<[u8; HANDLE_LEN]> {
        let mut h = IpcHandle { reserved: [0; HANDLE_LEN] };
        // SAFETY: valid out pointer; `base` is a device address, which the driver checks.
        self.check("cuIpcGetMemHandle", unsafe { (self.fns.ipc_get_mem_handle)(&mut h, base) })?;
        Ok(h.reserved)
    }

    /// `cuIpcOpenMemHandle`: another process's block mapped in the current context.
    pub(crate) fn ipc_open_mem_handle(&self, handle: [u8; HANDLE_LEN], flags: c_uint) -> Result<DevPtr> {
        let mut base: DevPtr = 0;
        // SAFETY: handle by value; valid out pointer.
        self.check("cuIpcOpenMemHandle", unsafe {
            (self.fns.ipc_open_mem_handle)(&mut base, IpcHandle { reserved: handle }, flags)
        })?;
        Ok(base)
    }

    /// `cuIpcCloseMemHandle`.
    pub(crate) fn ipc_close_mem_handle(&self, base: DevPtr) -> Result<()> {
        // SAFETY: a device address, which the driver checks against its opened handles.
        self.check("cuIpcCloseMemHandle", unsafe { (self.fns.ipc_close_mem_handle)(base) })
    }

    /// `cuEventCreate`.
    pub(crate) fn event_create(&self, flags: c_uint) -> Result<Event> {
        let mut ev = Event::NULL;
        // SAFETY: valid out pointer.
        self.check("cuEventCreate", unsafe { (self.fns.event_create)(&mut ev, flags) })?;
        Ok(ev)
    }

    /// `cuEventRecord`.
    pub(crate) fn event_record(&self, ev: Event, stream: Stream) -> Result<()> {
        // SAFETY: an event of this driver; the caller's stream (null: the default stream).
        self.check("cuEventRecord", unsafe { (self.fns.event_record)(ev, stream) })
    }

    /// `cuEventSynchronize`.
    pub(crate) fn event_synchronize(&self, ev: Event) -> Result<()> {
        // SAFETY: an event of this driver.
        self.check("cuEventSynchronize", unsafe { (self.fns.event_synchronize)(ev) })
    }

    /// `cuEventDestroy`.
    pub(crate) fn event_destroy(&self, ev: Event) -> Result<()> {
        // SAFETY: an event of this driver; the callers destroy each one once.
        self.check("cuEventDestroy", unsafe { (self.fns.event_destroy)(ev) })
    }

    /// `cuIpcGetEventHandle`: the bytes another process opens `ev` by.
    pub(crate) fn ipc_get_event_handle(&self, ev: Event) -> Result<[u8; HANDLE_LEN]> {
        let mut h = IpcHandle { reserved: [0; HANDLE_LEN] };
        // SAFETY: valid out pointer; an event of this driver.
        self.check("cuIpcGetEventHandle", unsafe { (self.fns.ipc_get_event_handle)(&mut h, ev) })?;
        Ok(h.reserved)
    }

    /// `cuIpcOpenEventHandle`.
    pub(crate) fn ipc_open_event_handle(&self, handle: [u8; HANDLE_LEN]) -> Result<Event> {
        let mut ev = Event::NULL;
        // SAFETY: valid out pointer; handle by value.
        self.check("cuIpcOpenEventHandle", unsafe {
            (self.fns.ipc_open_event_handle)(&mut ev, IpcHandle { reserved: handle })
        })?;
        Ok(ev)
    }

    /// `cuStreamWaitEvent`.
    pub(crate) fn stream_wait_event(&self, stream: Stream, ev: Event, flags: c_uint) -> Result<()> {
        // SAFETY: the caller's stream and an event of this driver.
        self.check("cuStreamWaitEvent", unsafe { (self.fns.stream_wait_event)(stream, ev, flags) })
    }

    /// `cuStreamSynchronize`.
    pub(crate) fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        // SAFETY: the caller's stream.
        self.check("cuStreamSynchronize", unsafe { (self.fns.stream_synchronize)(stream) })
    }

    // -----------------------------------------------------------------------------------------
    // Virtual memory management (the `vmm` group)

    /// `cuMemGetAllocationGranularity` (minimum) for pinned memory on the device with this
    /// ordinal: what segment sizes and mapped addresses must be multiples of.
    pub(crate) fn mem_get_allocation_granularity(&self, ordinal: c_int) -> Result<u64> {
        let f = self.vmm.get()?;
        let prop = MemAllocationProp {
            kind: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location: MemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        };
        let mut granularity = 0usize;
        // SAFETY: valid out pointer; `prop` is a complete `CUmemAllocationProp` (layout checked
        // above) that lives across the call.
        self.check("cuMemGetAllocationGranularity", unsafe {
            (f.mem_get_allocation_granularity)(&mut granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })?;
        Ok(granularity as u64)
    }

    /// `cuMemAddressReserve(&va, size, 0, 0, 0)`: `size` bytes of device address space
    /// (default alignment, no fixed address).
    pub(crate) fn mem_address_reserve(&self, size: u64) -> Result<DevPtr> {
        let f = self.vmm.get()?;
        let mut va: DevPtr = 0;
        // SAFETY: valid out pointer; the driver checks the size.
        self.check("cuMemAddressReserve", unsafe { (f.mem_address_reserve)(&mut va, size as usize, 0, 0, 0) })?;
        Ok(va)
    }

    /// `cuMemAddressFree`: give back a whole reservation.
    pub(crate) fn mem_address_free(&self, va: DevPtr, size: u64) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: plain values; the driver checks that they name a live reservation.
        self.check("cuMemAddressFree", unsafe { (f.mem_address_free)(va, size as usize) })
    }

    /// `cuMemMap(va, size, 0, handle, 0)`: the first `size` bytes of a physical allocation at
    /// `va`, inside a reservation.
    pub(crate) fn mem_map(&self, va: DevPtr, size: u64, handle: MemHandle) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: plain values; the driver checks the range and the handle. Mapping changes no
        // memory this process accesses as Rust data.
        self.check("cuMemMap", unsafe { (f.mem_map)(va, size as usize, 0, handle, 0) })
    }

    /// `cuMemUnmap`.
    pub(crate) fn mem_unmap(&self, va: DevPtr, size: u64) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: plain values; the driver checks that they are whole mappings. Callers unmap
        // only ranges they mapped and no longer hand out.
        self.check("cuMemUnmap", unsafe { (f.mem_unmap)(va, size as usize) })
    }

    /// `cuMemSetAccess` of one device (by ordinal) over `[va, va + size)`.
    pub(crate) fn mem_set_access(&self, va: DevPtr, size: u64, ordinal: c_int, access: MemAccess) -> Result<()> {
        let f = self.vmm.get()?;
        let desc = MemAccessDesc {
            location: MemLocation { kind: CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
            flags: access as c_int,
        };
        // SAFETY: one complete `CUmemAccessDesc` (layout checked above) that lives across the
        // call, count 1; the driver checks the range.
        self.check("cuMemSetAccess", unsafe { (f.mem_set_access)(va, size as usize, &desc, 1) })
    }

    /// `cuMemRelease`: drop one reference to a physical allocation handle.
    pub(crate) fn mem_release(&self, handle: MemHandle) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: a plain value, which the driver checks; callers release each reference they
        // took once.
        self.check("cuMemRelease", unsafe { (f.mem_release)(handle) })
    }

    /// `cuMemRetainAllocationHandle`: the handle of the allocation mapped at `addr`, with one
    /// more reference (pair it with [`Self::mem_release`]).
    pub(crate) fn mem_retain_allocation_handle(&self, addr: DevPtr) -> Result<MemHandle> {
        let f = self.vmm.get()?;
        let mut handle: MemHandle = 0;
        // SAFETY: valid out pointer; `addr` is only looked up by the driver, never dereferenced.
        self.check("cuMemRetainAllocationHandle", unsafe {
            (f.mem_retain_allocation_handle)(&mut handle, addr as usize as *mut c_void)
        })?;
        Ok(handle)
    }

    /// `cuMemExportToShareableHandle(&fd, handle, POSIX_FILE_DESCRIPTOR, 0)`: a new file
    /// descriptor of the allocation, owned by the caller, marked close-on-exec (an exec'd child
    /// must not keep the device memory alive).
    pub(crate) fn mem_export_fd(&self, handle: MemHandle) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let f = self.vmm.get()?;
        let mut fd: c_int = -1;
        // SAFETY: for this type the driver writes one `int` through the pointer, into `fd`.
        self.check("cuMemExportToShareableHandle", unsafe {
            (f.mem_export_to_shareable_handle)(
                (&mut fd as *mut c_int).cast(),
                handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::Internal(format!("cuMemExportToShareableHandle succeeded but returned fd {fd}")));
        }
        // SAFETY: the driver returned a new descriptor that the caller owns (it must close it);
        // nothing else owns it.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| Error::Internal(format!("fcntl(F_SETFD, FD_CLOEXEC) on an exported fd: {e}")))?;
        Ok(fd)
    }

    /// `cuMemExportToShareableHandle(&fabric, handle, FABRIC, 0)`: the allocation's 64-byte
    /// `CUmemFabricHandle`.
    pub(crate) fn mem_export_fabric(&self, handle: MemHandle) -> Result<[u8; FABRIC_HANDLE_LEN]> {
        let f = self.vmm.get()?;
        let mut fabric = [0u8; FABRIC_HANDLE_LEN];
        // SAFETY: for this type the driver writes one 64-byte `CUmemFabricHandle` into `fabric`.
        self.check("cuMemExportToShareableHandle", unsafe {
            (f.mem_export_to_shareable_handle)(fabric.as_mut_ptr().cast(), handle, CU_MEM_HANDLE_TYPE_FABRIC, 0)
        })?;
        Ok(fabric)
    }

    /// `cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, POSIX_FILE_DESCRIPTOR)`: a
    /// handle (one reference) of the allocation behind an fd of this process. The driver keeps
    /// its own reference to the memory: the caller may close `fd` afterwards.
    pub(crate) fn mem_import_fd(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<MemHandle> {
        use std::os::fd::AsRawFd;
        let f = self.vmm.get()?;
        let mut handle: MemHandle = 0;
        // SAFETY: valid out pointer; for this type the pointer argument carries the fd number
        // itself and is never dereferenced; the fd is open for the whole call (borrowed).
        self.check("cuMemImportFromShareableHandle", unsafe {
            (f.mem_import_from_shareable_handle)(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(handle)
    }

    /// `cuMemImportFromShareableHandle(&h, &fabric, FABRIC)`: a handle (one reference) of the
    /// allocation a `CUmemFabricHandle` names.
    pub(crate) fn mem_import_fabric(&self, fabric: &[u8; FABRIC_HANDLE_LEN]) -> Result<MemHandle> {
        let f = self.vmm.get()?;
        let mut handle: MemHandle = 0;
        let mut bytes = *fabric;
        // SAFETY: valid out pointer; for this type the driver reads 64 bytes at the pointer, a
        // local copy of the handle that lives across the call.
        self.check("cuMemImportFromShareableHandle", unsafe {
            (f.mem_import_from_shareable_handle)(&mut handle, bytes.as_mut_ptr().cast(), CU_MEM_HANDLE_TYPE_FABRIC)
        })?;
        Ok(handle)
    }
}

/// Every device's primary context, retained once for the life of the process.
impl DeviceContexts for CudaApi {
    fn make_context(&self, ordinal: i32) -> Result<Context> {
        let count = self.device_get_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist here ({count} visible device(s))"
            )));
        }
        self.device_primary_ctx_retain(self.device_get(ordinal)?)
    }

    /// The thread's context, null included: restoring null leaves the thread with none again.
    fn context_to_restore(&self) -> Result<Option<Context>> {
        self.ctx_get_current().map(Some)
    }

    fn make_current(&self, ctx: Context) -> Result<()> {
        self.ctx_set_current(ctx)
    }
}

impl IpcEvents for CudaApi {
    fn create_ipc_event(&self) -> Result<Event> {
        self.event_create(CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)
    }
    fn record_on(&self, ev: Event, stream: Stream) -> Result<()> {
        self.event_record(ev, stream)
    }
    fn ipc_handle_of(&self, ev: Event) -> Result<[u8; DEVSHARE_EVENT_HANDLE_SIZE]> {
        self.ipc_get_event_handle(ev)
    }
    fn open_ipc_handle(&self, handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE]) -> Result<Event> {
        self.ipc_open_event_handle(handle)
    }
    fn host_wait(&self, ev: Event) -> Result<()> {
        self.event_synchronize(ev)
    }
    fn stream_wait(&self, stream: Stream, ev: Event) -> Result<()> {
        self.stream_wait_event(stream, ev, 0)
    }
    fn destroy(&self, ev: Event) -> Result<()> {
        self.event_destroy(ev)
    }
    fn sync_stream(&self, stream: Stream) -> Result<()> {
        self.stream_synchronize(stream)
    }
    fn sync_device(&self) -> Result<()> {
        self.ctx_synchronize()
    }
}
