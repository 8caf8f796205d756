//! The acl backend: Ascend NPU memory shared with ACL IPC keys, the runtime
//! (`libascendcl.so`) loaded at run time.
//!
//! - Export: one key per exported range per process (`aclrtIpcMemGetExportKey`, cached while
//!   any exporter of it lives), with pid validation unless asked otherwise; the exporter closes
//!   the key (`aclrtIpcMemClose`) when its last exporter goes, which `Exporter::check_close`
//!   allows only once every reference was released.
//! - Import: `aclrtIpcMemImportByKey` once per (key, device) per process — the import registry
//!   caches it — and `aclrtIpcMemClose` when the last import of it is released, after a device
//!   synchronisation, so closes equal imports.
//! - ACL contexts are per thread: every call runs with the device bound on the calling thread
//!   (`aclrtSetDevice`), and the thread's previous device is bound again afterwards.

use super::runtime::{self, c_text, sym};
use super::{Backend, ExportOptions, Exported, ImportRequest, IpcEvent, Mapping, PeerAccess, Probe};
use crate::error::{Error, Result};
use crate::handle::{DevshareHandle, Validated, DEVSHARE_BACKEND_ACL, DEVSHARE_EVENT_HANDLE_SIZE};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_void};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Size of an ACL IPC key buffer, NUL included.
pub(crate) const KEY_LEN: usize = 65;
const EXPORT_FLAG_DISABLE_PID_VALIDATION: u64 = 1;
const IMPORT_FLAG_ENABLE_PEER_ACCESS: u64 = 1;
const ACL_EVENT_IPC: u32 = 0x40;
const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100_002;
/// Smallest page size of device memory; exported ranges must be whole pages.
const PAGE: u64 = 4096;

#[repr(C)]
#[derive(Clone, Copy)]
struct IpcEventHandle {
    reserved: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
}

type Stream = *mut c_void;
type Event = *mut c_void;

type Context = *mut c_void;

/// The IPC event calls: Atlas A2/A3 runtimes have them; a runtime without them still shares
/// memory, and only event shares and waits are refused.
struct EventApi {
    create_event_ex: unsafe extern "C" fn(*mut Event, u32) -> i32,
    record_event: unsafe extern "C" fn(Event, Stream) -> i32,
    ipc_get_event_handle: unsafe extern "C" fn(Event, *mut IpcEventHandle) -> i32,
    ipc_open_event_handle: unsafe extern "C" fn(IpcEventHandle, *mut Event) -> i32,
    stream_wait_event: unsafe extern "C" fn(Stream, Event) -> i32,
    synchronize_event: unsafe extern "C" fn(Event) -> i32,
    destroy_event: unsafe extern "C" fn(Event) -> i32,
}

struct Api {
    _lib: libloading::Library,
    name: String,
    set_device: unsafe extern "C" fn(i32) -> i32,
    get_current_context: unsafe extern "C" fn(*mut Context) -> i32,
    set_current_context: unsafe extern "C" fn(Context) -> i32,
    get_device_count: unsafe extern "C" fn(*mut u32) -> i32,
    get_export_key: unsafe extern "C" fn(*mut c_void, usize, *mut c_char, usize, u64) -> i32,
    set_import_pid: unsafe extern "C" fn(*const c_char, *mut i32, usize) -> i32,
    import_by_key: unsafe extern "C" fn(*mut *mut c_void, *const c_char, u64) -> i32,
    mem_close: unsafe extern "C" fn(*const c_char) -> i32,
    bare_tgid: unsafe extern "C" fn(*mut i32) -> i32,
    enable_peer_access: unsafe extern "C" fn(i32, u32) -> i32,
    events: Result<EventApi>,
    synchronize_stream: unsafe extern "C" fn(Stream) -> i32,
    synchronize_device: unsafe extern "C" fn() -> i32,
    recent_err_msg: Option<unsafe extern "C" fn() -> *const c_char>,
    /// Each device's default context, made once per process by `aclrtSetDevice`.
    contexts: Mutex<HashMap<i32, usize>>,
}

// SAFETY: the function pointers and the library are immutable after loading; the context table
// is behind a mutex; ACL contexts may be made current on any thread.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

/// Where the runtime may be: `DEVSHARE_ACL_LIBRARY` (read by [`runtime::load`]), the toolkit
/// roots, the default loader path, then the newer `libacl_rt.so` in the same places.
fn candidates() -> Vec<String> {
    let mut dirs: Vec<String> = Vec::new();
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Ok(root) = std::env::var(var) {
            if !root.is_empty() {
                dirs.push(format!("{root}/lib64"));
            }
        }
    }
    dirs.push("/usr/local/Ascend/ascend-toolkit/latest/lib64".into());
    dirs.push("/usr/local/Ascend/cann/lib64".into());
    let mut out = Vec::new();
    for lib in ["libascendcl.so", "libacl_rt.so"] {
        out.extend(dirs.iter().map(|d| format!("{d}/{lib}")));
        out.push(lib.into());
    }
    out
}

impl Api {
    fn load() -> Result<Api> {
        let (lib, name) = runtime::load("DEVSHARE_ACL_LIBRARY", &candidates())?;
        let n = name.as_str();
        let init: unsafe extern "C" fn(*const c_char) -> i32 = sym(&lib, n, "aclInit")?;
        let events = (|| {
            Ok(EventApi {
                create_event_ex: sym(&lib, n, "aclrtCreateEventExWithFlag")?,
                record_event: sym(&lib, n, "aclrtRecordEvent")?,
                ipc_get_event_handle: sym(&lib, n, "aclrtIpcGetEventHandle")?,
                ipc_open_event_handle: sym(&lib, n, "aclrtIpcOpenEventHandle")?,
                stream_wait_event: sym(&lib, n, "aclrtStreamWaitEvent")?,
                synchronize_event: sym(&lib, n, "aclrtSynchronizeEvent")?,
                destroy_event: sym(&lib, n, "aclrtDestroyEvent")?,
            })
        })()
        .map_err(|e: Error| Error::Unsupported(format!("this ACL runtime has no IPC events: {e}")));
        let api = Api {
            set_device: sym(&lib, n, "aclrtSetDevice")?,
            get_current_context: sym(&lib, n, "aclrtGetCurrentContext")?,
            set_current_context: sym(&lib, n, "aclrtSetCurrentContext")?,
            get_device_count: sym(&lib, n, "aclrtGetDeviceCount")?,
            get_export_key: sym(&lib, n, "aclrtIpcMemGetExportKey")?,
            set_import_pid: sym(&lib, n, "aclrtIpcMemSetImportPid")?,
            import_by_key: sym(&lib, n, "aclrtIpcMemImportByKey")?,
            mem_close: sym(&lib, n, "aclrtIpcMemClose")?,
            bare_tgid: sym(&lib, n, "aclrtDeviceGetBareTgid")?,
            enable_peer_access: sym(&lib, n, "aclrtDeviceEnablePeerAccess")?,
            events,
            synchronize_stream: sym(&lib, n, "aclrtSynchronizeStream")?,
            synchronize_device: sym(&lib, n, "aclrtSynchronizeDevice")?,
            recent_err_msg: sym(&lib, n, "aclGetRecentErrMsg").ok(),
            contexts: Mutex::new(HashMap::new()),
            _lib: lib,
            name,
        };
        // SAFETY: aclInit with no config file; a repeat call (someone else initialised ACL in
        // this process, e.g. torch_npu) returns 100002, which is fine.
        let rc = unsafe { init(std::ptr::null()) };
        if rc != 0 && rc != ACL_ERROR_REPEAT_INITIALIZE {
            return Err(api.error("aclInit", rc));
        }
        Ok(api)
    }

    /// A vendor error for `call`, with the runtime's own message and what the code means.
    fn error(&self, call: &str, code: i32) -> Error {
        // SAFETY: no arguments; returns NULL or a thread-local C string.
        let recent = self.recent_err_msg.map(|f| c_text(unsafe { f() })).unwrap_or_default();
        let meaning = match code {
            100_000 => "invalid parameter",
            207_000 => "feature not supported (IPC needs CANN >= 8.3.RC1 and HDK >= 25.3.RC1)",
            207_001 => "memory allocation failed",
            207_006 => {
                "no permission: this pid is not on the key's whitelist (the exporter must call \
                 devshare_exporter_allow_pid with the pid devshare_local_pid reports here, or \
                 export with DEVSHARE_EXPORT_NO_PID_CHECK)"
            }
            507_899 => "driver internal error (cross-device import without peer access, or a PCIe box without P2P)",
            107_002 => "no context: no device bound on this thread",
            _ => "",
        };
        let mut message = meaning.to_string();
        if !recent.is_empty() {
            if !message.is_empty() {
                message.push_str("; ");
            }
            message.push_str("runtime says: ");
            message.push_str(recent.trim());
        }
        if message.is_empty() {
            message = format!("see the {} log", self.name);
        }
        Error::Vendor { call: call.into(), code: code.into(), message }
    }

    fn check(&self, call: &str, code: i32) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    fn events(&self) -> Result<&EventApi> {
        self.events.as_ref().map_err(Clone::clone)
    }

    /// The calling thread's current context, if it has one.
    fn current_context(&self) -> Option<Context> {
        let mut ctx: Context = std::ptr::null_mut();
        // SAFETY: valid out pointer; fails when the thread has no context.
        (unsafe { (self.get_current_context)(&mut ctx) } == 0 && !ctx.is_null()).then_some(ctx)
    }

    /// `device`'s default context: made once per process with `aclrtSetDevice` (which also
    /// holds the device open for the process), then reused, so repeated binds add no device
    /// references.
    fn context(&self, device: i32) -> Result<Context> {
        let mut contexts = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&c) = contexts.get(&device) {
            return Ok(c as Context);
        }
        let previous = self.current_context();
        // SAFETY: plain call; it makes the device's default context current on this thread.
        self.check("aclrtSetDevice", unsafe { (self.set_device)(device) })?;
        let ctx = self.current_context();
        if let Some(p) = previous {
            // SAFETY: the context this thread had before.
            unsafe { (self.set_current_context)(p) };
        }
        let ctx = ctx.ok_or_else(|| Error::Internal("aclrtSetDevice left no current context".into()))?;
        contexts.insert(device, ctx as usize);
        Ok(ctx)
    }

    /// Make `device`'s default context current on the calling thread for the life of the
    /// guard, then the thread's previous context again (if it had one).
    fn bind(&self, device: i32) -> Result<DeviceGuard<'_>> {
        let ctx = self.context(device)?;
        let previous = self.current_context();
        if previous == Some(ctx) {
            return Ok(DeviceGuard { api: self, restore: None });
        }
        // SAFETY: a context of this process.
        self.check("aclrtSetCurrentContext", unsafe { (self.set_current_context)(ctx) })?;
        Ok(DeviceGuard { api: self, restore: previous })
    }
}

struct DeviceGuard<'a> {
    api: &'a Api,
    restore: Option<Context>,
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.restore {
            // SAFETY: the context this thread had before.
            unsafe { (self.api.set_current_context)(c) };
        }
    }
}

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

/// The NUL-terminated key with zeros after the NUL (the form handles carry).
type Key = [u8; KEY_LEN];

fn key_from(bytes: &[u8]) -> Result<Key> {
    let mut key = [0u8; KEY_LEN];
    let n = bytes.iter().take(KEY_LEN).position(|&b| b == 0).ok_or_else(|| {
        Error::BadKey("ACL IPC key has no NUL terminator in its 65 bytes".into())
    })?;
    if n == 0 {
        return Err(Error::BadKey("ACL IPC key is empty".into()));
    }
    key[..n].copy_from_slice(&bytes[..n]);
    Ok(key)
}

fn key_text(key: &Key) -> String {
    let n = key.iter().position(|&b| b == 0).unwrap_or(KEY_LEN);
    String::from_utf8_lossy(&key[..n]).into_owned()
}

// ---------------------------------------------------------------------------------------------
// Export

/// One exported range and its key; shared by every exporter of the same range in this process.
/// The last one to go closes the key.
struct KeyEntry {
    key: Key,
    device: i32,
    ptr: usize,
    size: u64,
    no_pid_check: bool,
}

impl Drop for KeyEntry {
    /// Exporter-side destroy, under the cache lock: a concurrent export of the same range then
    /// either finds this entry dead and exports afresh after the close, never a key being closed.
    fn drop(&mut self) {
        let cache = EXPORTS.get().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()));
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                // SAFETY: a key this process exported; exporter-side destroy.
                unsafe { (api.mem_close)(self.key.as_ptr().cast()) };
            }
        }
        if let Some(mut c) = cache {
            c.retain(|_, w| w.strong_count() > 0);
            if c.is_empty() {
                *c = HashMap::new();
            }
        }
    }
}

type ExportCache = Mutex<HashMap<(i32, usize, u64), Weak<KeyEntry>>>;
static EXPORTS: OnceLock<ExportCache> = OnceLock::new();


fn export_key(api: &Api, device: i32, ptr: *mut u8, size: u64, no_pid_check: bool) -> Result<Arc<KeyEntry>> {
    let mut cache = EXPORTS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    let id = (device, ptr as usize, size);
    if let Some(entry) = cache.get(&id).and_then(Weak::upgrade) {
        // Unlock first: if the other exporter closes meanwhile, dropping `entry` here is the
        // last reference, and its drop takes the lock.
        drop(cache);
        if entry.no_pid_check != no_pid_check {
            return Err(Error::InvalidArgument(format!(
                "this range is already exported {} pid validation; export it again with the same \
                 DEVSHARE_EXPORT_NO_PID_CHECK setting",
                if entry.no_pid_check { "without" } else { "with" }
            )));
        }
        return Ok(entry);
    }
    let _g = api.bind(device)?;
    let mut buf = [0u8; KEY_LEN];
    let flags = if no_pid_check { EXPORT_FLAG_DISABLE_PID_VALIDATION } else { 0 };
    // SAFETY: ptr/size describe device memory the caller owns; buf has KEY_LEN bytes.
    let rc = unsafe { (api.get_export_key)(ptr.cast(), size as usize, buf.as_mut_ptr().cast(), KEY_LEN, flags) };
    api.check("aclrtIpcMemGetExportKey", rc)?;
    let key = key_from(&buf).inspect_err(|_| {
        // SAFETY: the runtime returned a key it cannot have meant; destroy what it made.
        unsafe { (api.mem_close)(buf.as_ptr().cast()) };
    })?;
    let entry = Arc::new(KeyEntry { key, device, ptr: ptr as usize, size, no_pid_check });
    cache.retain(|_, w| w.strong_count() > 0);
    cache.insert(id, Arc::downgrade(&entry));
    Ok(entry)
}

struct AclExport {
    entry: Arc<KeyEntry>,
}

impl Exported for AclExport {
    fn ptr(&self) -> *mut u8 {
        self.entry.ptr as *mut u8
    }
    fn size(&self) -> u64 {
        self.entry.size
    }
    fn key(&self) -> &[u8] {
        &self.entry.key
    }
    fn device_index(&self) -> i32 {
        self.entry.device
    }
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn allow_pid(&self, pid: i32) -> Result<()> {
        if self.entry.no_pid_check {
            return Ok(());
        }
        let api = api()?;
        let _g = api.bind(self.entry.device)?;
        let mut pids = [pid];
        // SAFETY: a key this process exported; one pid.
        let rc = unsafe { (api.set_import_pid)(self.entry.key.as_ptr().cast(), pids.as_mut_ptr(), 1) };
        api.check("aclrtIpcMemSetImportPid", rc)
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        let api = api()?;
        let _g = api.bind(self.entry.device)?;
        if !event {
            // SAFETY: the caller's stream (or the whole device).
            let rc = unsafe {
                if stream.is_null() {
                    (api.synchronize_device)()
                } else {
                    (api.synchronize_stream)(stream)
                }
            };
            api.check(if stream.is_null() { "aclrtSynchronizeDevice" } else { "aclrtSynchronizeStream" }, rc)?;
            return Ok(None);
        }
        let ev_api = api.events()?;
        let mut ev: Event = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        api.check("aclrtCreateEventExWithFlag", unsafe { (ev_api.create_event_ex)(&mut ev, ACL_EVENT_IPC) })?;
        // Owned from here on: an error below destroys it.
        let mut owned = AclEvent { ev, device: self.entry.device, handle: [0; DEVSHARE_EVENT_HANDLE_SIZE] };
        // SAFETY: a live event; the caller's stream.
        api.check("aclrtRecordEvent", unsafe { (ev_api.record_event)(ev, stream) })?;
        let mut h = IpcEventHandle { reserved: [0; DEVSHARE_EVENT_HANDLE_SIZE] };
        // SAFETY: a live IPC event; valid out pointer.
        api.check("aclrtIpcGetEventHandle", unsafe { (ev_api.ipc_get_event_handle)(ev, &mut h) })?;
        owned.handle = h.reserved;
        Ok(Some(Box::new(owned)))
    }
}

/// An IPC event recorded by an exporter; destroyed when the share it went with is released.
struct AclEvent {
    ev: Event,
    device: i32,
    handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
}

// SAFETY: an ACL event handle is a plain token usable from any thread with the device bound.
unsafe impl Send for AclEvent {}
unsafe impl Sync for AclEvent {}

impl IpcEvent for AclEvent {
    fn handle(&self) -> [u8; DEVSHARE_EVENT_HANDLE_SIZE] {
        self.handle
    }
}

impl Drop for AclEvent {
    fn drop(&mut self) {
        if self.ev.is_null() {
            return;
        }
        if let Ok(api) = api() {
            if let (Ok(ev_api), Ok(_g)) = (api.events(), api.bind(self.device)) {
                // SAFETY: an event this process created, destroyed once.
                unsafe { (ev_api.destroy_event)(self.ev) };
            }
        }
        self.ev = std::ptr::null_mut();
    }
}

// ---------------------------------------------------------------------------------------------
// Import

struct AclMapping {
    key: Key,
    base: *mut u8,
    device: i32,
}

// SAFETY: the mapping is device memory addressed by a plain pointer; the registry serialises its
// creation and drop.
unsafe impl Send for AclMapping {}
unsafe impl Sync for AclMapping {}

impl Mapping for AclMapping {
    fn base(&self) -> *mut u8 {
        self.base
    }
    /// Unknown: ACL does not say how large an imported allocation is.
    fn size(&self) -> u64 {
        u64::MAX
    }
    fn device(&self) -> Option<i32> {
        Some(self.device)
    }
}

impl Drop for AclMapping {
    /// torch_npu's order: synchronise the device, then close this import of the key.
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                // SAFETY: plain calls; the key was imported once by this mapping.
                unsafe {
                    (api.synchronize_device)();
                    (api.mem_close)(self.key.as_ptr().cast());
                }
            }
        }
    }
}

/// (importing device, peer) pairs for which this process enabled peer access.
static PEERS: OnceLock<Mutex<HashSet<(i32, i32)>>> = OnceLock::new();

fn enable_peer(api: &Api, device: i32, peer: i32) -> Result<()> {
    let mut done = PEERS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if done.contains(&(device, peer)) {
        return Ok(());
    }
    // SAFETY: plain call with the importing device bound (by the caller).
    api.check("aclrtDeviceEnablePeerAccess", unsafe { (api.enable_peer_access)(peer, 0) })?;
    done.insert((device, peer));
    Ok(())
}

pub(crate) struct Acl;
pub(crate) static ACL: Acl = Acl;

impl Backend for Acl {
    fn id(&self) -> u16 {
        DEVSHARE_BACKEND_ACL
    }

    fn probe(&self) -> Probe {
        match api() {
            Err(e) => Probe { usable: false, detail: e.to_string() },
            Ok(api) => {
                let mut n = 0u32;
                // SAFETY: valid out pointer.
                match api.check("aclrtGetDeviceCount", unsafe { (api.get_device_count)(&mut n) }) {
                    Ok(()) if n > 0 => Probe { usable: true, detail: format!("{} loaded, {n} device(s)", api.name) },
                    Ok(()) => Probe { usable: false, detail: format!("{} loaded but it reports no device", api.name) },
                    Err(e) => Probe { usable: false, detail: format!("{} loaded; {e}", api.name) },
                }
            }
        }
    }

    fn export(&self, device: i32, ptr: *mut u8, size: u64, opts: &ExportOptions) -> Result<Box<dyn Exported>> {
        let api = api()?;
        if ptr as u64 % PAGE != 0 || size % PAGE != 0 {
            return Err(Error::InvalidArgument(format!(
                "ACL exports whole device pages, but [{ptr:p}, +{size}) is not {PAGE}-byte aligned \
                 (and huge-page memory needs 2 MiB alignment): allocate >= 2 MiB with a HUGE \
                 policy (aclrtMalloc with ACL_MEM_MALLOC_HUGE_FIRST) and export the whole allocation"
            )));
        }
        Ok(Box::new(AclExport { entry: export_key(api, device, ptr, size, opts.no_pid_check)? }))
    }

    fn import(&self, h: &DevshareHandle, _: &Validated, req: &ImportRequest) -> Result<Box<dyn Mapping>> {
        if req.read_only {
            return Err(Error::Unsupported("ACL imports cannot be mapped read-only".into()));
        }
        let api = api()?;
        let key = key_from(h.key_bytes())?;
        let device = req.device.unwrap_or(h.device_index);
        let _g = api.bind(device)?;
        let cross = device != h.device_index;
        let flags = match req.peer {
            PeerAccess::ByImportFlag => IMPORT_FLAG_ENABLE_PEER_ACCESS,
            PeerAccess::Explicit => {
                if cross {
                    enable_peer(api, device, h.device_index)?;
                }
                0
            }
            PeerAccess::None => 0,
        };
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; the key is NUL-terminated.
        let rc = unsafe { (api.import_by_key)(&mut p, key.as_ptr().cast(), flags) };
        api.check("aclrtIpcMemImportByKey", rc).map_err(|e| match e {
            Error::Vendor { call, code, message } => Error::Vendor {
                call,
                code,
                message: format!("key {} on device {device}: {message}", key_text(&key)),
            },
            e => e,
        })?;
        if p.is_null() {
            // SAFETY: the import succeeded; close it again.
            unsafe { (api.mem_close)(key.as_ptr().cast()) };
            return Err(Error::Internal("aclrtIpcMemImportByKey returned success and a NULL pointer".into()));
        }
        // ACL does not report an imported allocation's size: the handles' alloc_size is trusted
        // (a PyTorch tuple only tells where its own storage ends; later storages of the same key
        // may lie further in).
        Ok(Box::new(AclMapping { key, base: p.cast(), device }))
    }

    fn wait_event(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<()> {
        let api = api()?;
        let ev_api = api.events()?;
        let _g = api.bind(req.device.unwrap_or(h.device_index))?;
        let mut ev: Event = std::ptr::null_mut();
        let handle = IpcEventHandle { reserved: h.event_handle };
        // SAFETY: handle by value; valid out pointer.
        api.check("aclrtIpcOpenEventHandle", unsafe { (ev_api.ipc_open_event_handle)(handle, &mut ev) })?;
        // SAFETY: a live event; the caller's stream.
        let (call, rc) = unsafe {
            if req.stream.is_null() {
                ("aclrtSynchronizeEvent", (ev_api.synchronize_event)(ev))
            } else {
                ("aclrtStreamWaitEvent", (ev_api.stream_wait_event)(req.stream, ev))
            }
        };
        // SAFETY: the event opened above, destroyed once.
        let destroyed = unsafe { (ev_api.destroy_event)(ev) };
        api.check(call, rc)?;
        api.check("aclrtDestroyEvent", destroyed)
    }

    fn synchronize(&self, device: i32) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(device) {
                // SAFETY: plain call.
                unsafe { (api.synchronize_device)() };
            }
        }
    }

    fn local_pid(&self, device: i32) -> Result<i32> {
        let api = api()?;
        let _g = api.bind(device)?;
        let mut pid = 0;
        // SAFETY: valid out pointer.
        api.check("aclrtDeviceGetBareTgid", unsafe { (api.bare_tgid)(&mut pid) })?;
        Ok(pid)
    }
}
