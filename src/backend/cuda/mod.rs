//! The cuda backend: NVIDIA GPU memory shared with legacy CUDA IPC memory handles
//!, the driver API (`libcuda.so.1`) loaded at run time.
//!
//! - Export: the whole `cuMemAlloc` block around the caller's pointer (`cuMemGetAddressRange`),
//!   its handle fetched once per block per process (`cuIpcGetMemHandle`, cached while any
//!   exporter of the block lives); handles carry the caller's offset and the device UUID.
//! - Import: `cuIpcOpenMemHandle` with lazy peer access once per handle per process — the import
//!   registry caches it, because the driver refuses a second open — on the device whose UUID the
//!   handle names; `cuIpcCloseMemHandle` when the last import is released.
//! - Every driver call runs with the device's primary context current on the calling thread; the
//!   thread's previous context is made current again afterwards.

use super::runtime::{self, c_text, sym, sym_any};
use super::{Backend, ExportOptions, Exported, ImportRequest, IpcEvent, Mapping, PeerAccess, Probe};
use crate::error::{Error, Result};
use crate::handle::{DevshareHandle, Validated, DEVSHARE_BACKEND_CUDA, DEVSHARE_EVENT_HANDLE_SIZE};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Size of a `CUipcMemHandle`.
pub(crate) const HANDLE_LEN: usize = 64;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_EVENT_INTERPROCESS: c_uint = 4;
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;

type CuResult = c_int;
type Context = *mut c_void;
type Stream = *mut c_void;
type Event = *mut c_void;
type DevPtr = u64;

#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; HANDLE_LEN],
}

struct Api {
    _lib: libloading::Library,
    name: String,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    device_get_uuid: unsafe extern "C" fn(*mut [u8; 16], c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Context, c_int) -> CuResult,
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
    driver_version: c_int,
    /// Each visible device's UUID, by ordinal (read once: they do not change in a process).
    uuids: OnceLock<Vec<[u8; 16]>>,
    /// Primary context per device ordinal, retained once for the life of the process.
    contexts: Mutex<HashMap<c_int, usize>>,
}

impl Api {
    fn load() -> Result<Api> {
        let (lib, name) = runtime::load("DEVSHARE_CUDA_LIBRARY", &["libcuda.so.1".to_string()])?;
        let n = name.as_str();
        let init: unsafe extern "C" fn(c_uint) -> CuResult = sym(&lib, n, "cuInit")?;
        let get_version: unsafe extern "C" fn(*mut c_int) -> CuResult = sym(&lib, n, "cuDriverGetVersion")?;
        let api = Api {
            device_get_count: sym(&lib, n, "cuDeviceGetCount")?,
            device_get: sym(&lib, n, "cuDeviceGet")?,
            device_get_uuid: sym_any(&lib, n, &["cuDeviceGetUuid_v2", "cuDeviceGetUuid"])?,
            primary_ctx_retain: sym(&lib, n, "cuDevicePrimaryCtxRetain")?,
            ctx_get_current: sym(&lib, n, "cuCtxGetCurrent")?,
            ctx_set_current: sym(&lib, n, "cuCtxSetCurrent")?,
            ctx_synchronize: sym(&lib, n, "cuCtxSynchronize")?,
            // The plain name is the old 32-bit ABI: only the _v2 symbol has this signature.
            mem_get_address_range: sym(&lib, n, "cuMemGetAddressRange_v2")?,
            pointer_get_attribute: sym(&lib, n, "cuPointerGetAttribute")?,
            ipc_get_mem_handle: sym(&lib, n, "cuIpcGetMemHandle")?,
            ipc_open_mem_handle: sym_any(&lib, n, &["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"])?,
            ipc_close_mem_handle: sym(&lib, n, "cuIpcCloseMemHandle")?,
            event_create: sym(&lib, n, "cuEventCreate")?,
            event_record: sym(&lib, n, "cuEventRecord")?,
            event_synchronize: sym(&lib, n, "cuEventSynchronize")?,
            event_destroy: sym_any(&lib, n, &["cuEventDestroy_v2", "cuEventDestroy"])?,
            ipc_get_event_handle: sym(&lib, n, "cuIpcGetEventHandle")?,
            ipc_open_event_handle: sym(&lib, n, "cuIpcOpenEventHandle")?,
            stream_wait_event: sym(&lib, n, "cuStreamWaitEvent")?,
            stream_synchronize: sym(&lib, n, "cuStreamSynchronize")?,
            get_error_name: sym(&lib, n, "cuGetErrorName")?,
            get_error_string: sym(&lib, n, "cuGetErrorString")?,
            driver_version: 0,
            uuids: OnceLock::new(),
            contexts: Mutex::new(HashMap::new()),
            _lib: lib,
            name,
        };
        // SAFETY: plain calls.
        api.check("cuInit", unsafe { init(0) })?;
        let mut version = 0;
        // SAFETY: valid out pointer.
        api.check("cuDriverGetVersion", unsafe { get_version(&mut version) })?;
        Ok(Api { driver_version: version, ..api })
    }

    fn error(&self, call: &str, code: CuResult) -> Error {
        let (mut name, mut text): (*const c_char, *const c_char) = (std::ptr::null(), std::ptr::null());
        // SAFETY: valid out pointers; the driver returns static strings.
        unsafe {
            (self.get_error_name)(code, &mut name);
            (self.get_error_string)(code, &mut text);
        }
        let mut message = format!("{}: {}", c_text(name), c_text(text));
        if code == 201 || code == 709 {
            message.push_str(" (a CUDA IPC handle cannot be opened in the process that exported it)");
        }
        Error::Vendor { call: call.into(), code: code.into(), message }
    }

    fn check(&self, call: &str, code: CuResult) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    fn device_count(&self) -> Result<c_int> {
        let mut n = 0;
        // SAFETY: valid out pointer.
        self.check("cuDeviceGetCount", unsafe { (self.device_get_count)(&mut n) })?;
        Ok(n)
    }

    fn uuid(&self, ordinal: c_int) -> Result<[u8; 16]> {
        let mut dev = 0;
        // SAFETY: valid out pointers.
        self.check("cuDeviceGet", unsafe { (self.device_get)(&mut dev, ordinal) })?;
        let mut uuid = [0u8; 16];
        self.check("cuDeviceGetUuid", unsafe { (self.device_get_uuid)(&mut uuid, dev) })?;
        Ok(uuid)
    }

    fn context(&self, ordinal: c_int) -> Result<Context> {
        let mut contexts = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&c) = contexts.get(&ordinal) {
            return Ok(c as Context);
        }
        let count = self.device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist here ({count} visible device(s))"
            )));
        }
        let mut dev = 0;
        // SAFETY: valid out pointers.
        self.check("cuDeviceGet", unsafe { (self.device_get)(&mut dev, ordinal) })?;
        let mut ctx: Context = std::ptr::null_mut();
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.primary_ctx_retain)(&mut ctx, dev) })?;
        contexts.insert(ordinal, ctx as usize);
        Ok(ctx)
    }

    /// Make `device`'s primary context current on this thread for the life of the guard.
    fn bind(&self, device: c_int) -> Result<CtxGuard<'_>> {
        let ctx = self.context(device)?;
        let mut current: Context = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        self.check("cuCtxGetCurrent", unsafe { (self.ctx_get_current)(&mut current) })?;
        if current == ctx {
            return Ok(CtxGuard { api: self, restore: None });
        }
        // SAFETY: a retained primary context.
        self.check("cuCtxSetCurrent", unsafe { (self.ctx_set_current)(ctx) })?;
        Ok(CtxGuard { api: self, restore: Some(current) })
    }
}

struct CtxGuard<'a> {
    api: &'a Api,
    restore: Option<Context>,
}

impl Drop for CtxGuard<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.restore {
            // SAFETY: the context that was current before (or NULL).
            unsafe { (self.api.ctx_set_current)(c) };
        }
    }
}

// SAFETY: the function pointers and the library are immutable after loading; the context table
// is behind a mutex; CUDA contexts may be made current on any thread.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

static API: OnceLock<Api> = OnceLock::new();

/// The loaded runtime. Only success is kept: a failed load is tried again next time (the
/// library may have been installed or `DEVSHARE_*_LIBRARY` set meanwhile), and leaves nothing
/// allocated. Two threads loading at once both succeed; one result is kept.
fn api() -> Result<&'static Api> {
    if let Some(api) = API.get() {
        return Ok(api);
    }
    let api = Api::load()?;
    Ok(API.get_or_init(|| api))
}

// ---------------------------------------------------------------------------------------------
// Export

/// One exported `cuMemAlloc` block and its IPC handle, shared by every exporter of it in this
/// process (the driver hands out the handle once per block; devshare asks once).
struct Block {
    handle: [u8; HANDLE_LEN],
    base: DevPtr,
    size: u64,
    device: c_int,
    uuid: [u8; 16],
}

type BlockCache = Mutex<HashMap<(c_int, DevPtr), Weak<Block>>>;
static BLOCKS: OnceLock<BlockCache> = OnceLock::new();

fn attribute(api: &Api, attr: c_int, ptr: DevPtr, what: &str) -> Result<u32> {
    // The two attributes read here are an int and a bool; 8 zeroed bytes leave room to spare.
    let mut v: u64 = 0;
    // SAFETY: the driver writes at most 4 bytes for these attributes into an 8-byte buffer.
    let rc = unsafe { (api.pointer_get_attribute)((&mut v as *mut u64).cast(), attr, ptr) };
    if rc != 0 {
        let e = api.error("cuPointerGetAttribute", rc);
        return Err(Error::InvalidArgument(format!("{ptr:#x} is not CUDA device memory ({what}): {e}")));
    }
    // Little-endian: an int or a bool lands in the low bytes.
    Ok(v as u32)
}

fn export_block(api: &Api, device: c_int, ptr: DevPtr, size: u64) -> Result<(Arc<Block>, u64)> {
    let _g = api.bind(device)?;
    if attribute(api, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr, "IPC capability")? == 0 {
        return Err(Error::Unsupported(format!(
            "memory at {ptr:#x} cannot be exported with cuIpcGetMemHandle: VMM memory \
             (cuMemCreate, e.g. PyTorch expandable segments) and stream-ordered pool memory \
             (cudaMallocAsync) are not legacy-IPC capable; allocate it with cudaMalloc / cuMemAlloc"
        )));
    }
    let ordinal = attribute(api, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr, "device ordinal")? as c_int;
    if ordinal != device {
        return Err(Error::InvalidArgument(format!("{ptr:#x} is memory of CUDA device {ordinal}, not of device {device}")));
    }
    let (mut base, mut bsize): (DevPtr, usize) = (0, 0);
    // SAFETY: valid out pointers.
    api.check("cuMemGetAddressRange", unsafe { (api.mem_get_address_range)(&mut base, &mut bsize, ptr) })?;
    let offset = ptr - base;
    if offset.checked_add(size).map_or(true, |end| end > bsize as u64) {
        return Err(Error::InvalidArgument(format!(
            "[{ptr:#x}, +{size}) runs past the end of its {bsize}-byte allocation at {base:#x}"
        )));
    }
    let mut cache = BLOCKS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(b) = cache.get(&(device, base)).and_then(Weak::upgrade) {
        return Ok((b, offset));
    }
    let mut h = IpcHandle { reserved: [0; HANDLE_LEN] };
    // SAFETY: the base of a live cuMemAlloc block; valid out pointer.
    api.check("cuIpcGetMemHandle", unsafe { (api.ipc_get_mem_handle)(&mut h, base) })?;
    let block = Arc::new(Block { handle: h.reserved, base, size: bsize as u64, device, uuid: api.uuid(device)? });
    cache.retain(|_, w| w.strong_count() > 0);
    cache.insert((device, base), Arc::downgrade(&block));
    Ok((block, offset))
}

impl Drop for Block {
    fn drop(&mut self) {
        runtime::forget_dead(&BLOCKS);
    }
}

struct CudaExport {
    block: Arc<Block>,
    offset: u64,
    len: u64,
}

impl Exported for CudaExport {
    fn ptr(&self) -> *mut u8 {
        self.block.base as *mut u8
    }
    fn size(&self) -> u64 {
        self.block.size
    }
    fn key(&self) -> &[u8] {
        &self.block.handle
    }
    fn device_index(&self) -> i32 {
        self.block.device
    }
    fn device_uuid(&self) -> [u8; 16] {
        self.block.uuid
    }
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn window(&self) -> (u64, u64) {
        (self.offset, self.len)
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        let api = api()?;
        let _g = api.bind(self.block.device)?;
        if !event {
            // SAFETY: the caller's stream (or the whole context).
            let (call, rc) = unsafe {
                if stream.is_null() {
                    ("cuCtxSynchronize", (api.ctx_synchronize)())
                } else {
                    ("cuStreamSynchronize", (api.stream_synchronize)(stream))
                }
            };
            api.check(call, rc)?;
            return Ok(None);
        }
        let mut ev: Event = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        let rc = unsafe { (api.event_create)(&mut ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS) };
        api.check("cuEventCreate", rc)?;
        let mut owned = CudaEvent { ev, device: self.block.device, handle: [0; DEVSHARE_EVENT_HANDLE_SIZE] };
        // SAFETY: a live event; the caller's stream.
        api.check("cuEventRecord", unsafe { (api.event_record)(ev, stream) })?;
        let mut h = IpcHandle { reserved: [0; HANDLE_LEN] };
        // SAFETY: a live interprocess event; valid out pointer.
        api.check("cuIpcGetEventHandle", unsafe { (api.ipc_get_event_handle)(&mut h, ev) })?;
        owned.handle = h.reserved;
        Ok(Some(Box::new(owned)))
    }
}

/// An interprocess event recorded by an exporter; destroyed when its share is released.
struct CudaEvent {
    ev: Event,
    device: c_int,
    handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
}

// SAFETY: a CUDA event is usable from any thread with its context current.
unsafe impl Send for CudaEvent {}
unsafe impl Sync for CudaEvent {}

impl IpcEvent for CudaEvent {
    fn handle(&self) -> [u8; DEVSHARE_EVENT_HANDLE_SIZE] {
        self.handle
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                // SAFETY: an event this process created, destroyed once.
                unsafe { (api.event_destroy)(self.ev) };
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Import

struct CudaMapping {
    base: DevPtr,
    size: u64,
    device: c_int,
}

impl Mapping for CudaMapping {
    fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn device(&self) -> Option<i32> {
        Some(self.device)
    }
}

impl Drop for CudaMapping {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                // SAFETY: a base this mapping opened, closed once, after this process's work.
                unsafe {
                    (api.ctx_synchronize)();
                    (api.ipc_close_mem_handle)(self.base);
                }
            }
        }
    }
}

/// The device to import on: the caller's choice, else the local device with the handle's UUID
/// (ordinals differ between processes with different `CUDA_VISIBLE_DEVICES`), else the
/// handle's device index.
fn target_device(api: &Api, h: &DevshareHandle, req: &ImportRequest) -> Result<c_int> {
    if let Some(d) = req.device {
        return Ok(d);
    }
    if h.device_uuid == [0; 16] {
        return Ok(h.device_index);
    }
    let uuids = match api.uuids.get() {
        Some(u) => u,
        None => {
            let u = (0..api.device_count()?).map(|d| api.uuid(d)).collect::<Result<Vec<_>>>()?;
            api.uuids.get_or_init(|| u)
        }
    };
    if let Some(d) = uuids.iter().position(|u| *u == h.device_uuid) {
        return Ok(d as c_int);
    }
    Err(Error::Mismatch(format!(
        "no visible CUDA device has the handle's UUID {} (is it hidden by CUDA_VISIBLE_DEVICES?); \
         pass options.device to import on a device of your choice",
        h.device_uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )))
}

pub(crate) struct Cuda;
pub(crate) static CUDA: Cuda = Cuda;

impl Backend for Cuda {
    fn id(&self) -> u16 {
        DEVSHARE_BACKEND_CUDA
    }

    fn probe(&self) -> Probe {
        match api() {
            Err(e) => Probe { usable: false, detail: e.to_string() },
            Ok(api) => match api.device_count() {
                Ok(n) if n > 0 => Probe {
                    usable: true,
                    detail: format!("{} loaded (driver API {}), {n} device(s)", api.name, api.driver_version),
                },
                Ok(_) => Probe { usable: false, detail: format!("{} loaded but it reports no device", api.name) },
                Err(e) => Probe { usable: false, detail: format!("{} loaded; {e}", api.name) },
            },
        }
    }

    fn export(&self, device: i32, ptr: *mut u8, size: u64, _: &ExportOptions) -> Result<Box<dyn Exported>> {
        let api = api()?;
        let (block, offset) = export_block(api, device, ptr as DevPtr, size)?;
        Ok(Box::new(CudaExport { block, offset, len: size }))
    }

    fn import_device(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<i32> {
        target_device(api()?, h, req)
    }

    fn import(&self, h: &DevshareHandle, _: &Validated, req: &ImportRequest) -> Result<Box<dyn Mapping>> {
        if req.read_only {
            return Err(Error::Unsupported("CUDA imports cannot be mapped read-only".into()));
        }
        if h.producer_pid == std::process::id() as i32 {
            return Err(Error::Unsupported(
                "this process exported the handle, and a CUDA IPC handle cannot be opened in the \
                 process that exported it: use the exporter's own pointer"
                    .into(),
            ));
        }
        let api = api()?;
        let device = target_device(api, h, req)?;
        let _g = api.bind(device)?;
        let flags = if req.peer == PeerAccess::None { 0 } else { CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS };
        let mut handle = IpcHandle { reserved: [0; HANDLE_LEN] };
        handle.reserved.copy_from_slice(h.key_bytes());
        let mut base: DevPtr = 0;
        // SAFETY: handle by value; valid out pointer.
        api.check("cuIpcOpenMemHandle", unsafe { (api.ipc_open_mem_handle)(&mut base, handle, flags) })?;
        let mut mapping = CudaMapping { base, size: 0, device };
        let (mut b, mut size): (DevPtr, usize) = (0, 0);
        // SAFETY: valid out pointers; on error the mapping's drop closes the handle.
        api.check("cuMemGetAddressRange", unsafe { (api.mem_get_address_range)(&mut b, &mut size, base) })?;
        mapping.size = size as u64;
        Ok(Box::new(mapping))
    }

    fn wait_event(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<()> {
        let api = api()?;
        let _g = api.bind(target_device(api, h, req)?)?;
        let mut ev: Event = std::ptr::null_mut();
        let handle = IpcHandle { reserved: h.event_handle };
        // SAFETY: handle by value; valid out pointer.
        api.check("cuIpcOpenEventHandle", unsafe { (api.ipc_open_event_handle)(&mut ev, handle) })?;
        // SAFETY: a live event; the caller's stream.
        let (call, rc) = unsafe {
            if req.stream.is_null() {
                ("cuEventSynchronize", (api.event_synchronize)(ev))
            } else {
                ("cuStreamWaitEvent", (api.stream_wait_event)(req.stream, ev, 0))
            }
        };
        // SAFETY: the event opened above, destroyed once.
        let destroyed = unsafe { (api.event_destroy)(ev) };
        api.check(call, rc)?;
        api.check("cuEventDestroy", destroyed)
    }

    fn synchronize(&self, device: i32) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(device) {
                // SAFETY: plain call.
                unsafe { (api.ctx_synchronize)() };
            }
        }
    }
}
