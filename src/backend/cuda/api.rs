//! The CUDA driver API (`libcuda.so.1`, loaded at run time) as safe, typed calls.
//!
//! [`CudaApi`] is the only caller of the driver's raw symbols. Each method is one driver call,
//! named after it (`cuIpcOpenMemHandle` → [`CudaApi::ipc_open_mem_handle`]); it returns
//! `Result`, with a failure formatted once ([`CudaApi::error`]). At the end, the wrapper is bound
//! into the shared plumbing of `backend/runtime.rs`: per-thread contexts and IPC events.
//!
//! Calls that only some drivers have come in `Optional` groups, as in
//! `acl/api.rs`: a struct of raw signatures (e.g. `VmmFns` for `cuMemCreate`, `cuMemMap`,
//! `cuMemSetAccess`, ...), a field `vmm: Optional<VmmFns>` filled inside the `unsafe` block of
//! [`CudaApi::load`] with `Optional::load("this CUDA driver has no VMM calls", || Ok(VmmFns {
//! mem_create: lib.required("cuMemCreate")?, ... }))`, and one method per call starting with
//! `let f = self.vmm.get()?;`. Required calls go into `Fns`.

use crate::backend::runtime::{self, c_text, Context, DeviceContexts, Event, IpcEvents, Stream, Symbols};
use crate::error::{Error, Result};
use crate::handle::DEVSHARE_EVENT_HANDLE_SIZE;
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

/// The loaded, initialised driver.
pub(crate) struct CudaApi {
    name: String,
    driver_version: c_int,
    fns: Fns,
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
        let (init, get_version, fns) = unsafe {
            let init: unsafe extern "C" fn(c_uint) -> CuResult = lib.required("cuInit")?;
            let get_version: unsafe extern "C" fn(*mut c_int) -> CuResult = lib.required("cuDriverGetVersion")?;
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
            (init, get_version, fns)
        };
        let mut api = CudaApi { name: lib.name().to_string(), driver_version: 0, fns, _lib: lib.into_library() };
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
        let hint = match code {
            201 | 709 => "a CUDA IPC handle cannot be opened in the process that exported it",
            _ => "",
        };
        runtime::vendor_error(call, code, &meaning, hint, "", &self.name)
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
