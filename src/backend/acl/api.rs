//! The ACL runtime (`libascendcl.so`, loaded at run time) as safe, typed calls.
//!
//! [`AclApi`] is the only caller of the runtime's raw symbols. Each method is one ACL call,
//! named after it (`aclrtIpcMemClose` → [`AclApi::ipc_mem_close`]); it returns `Result`, with a
//! failure formatted once ([`AclApi::error`]). At the end, the wrapper is bound into the shared
//! plumbing of `backend/runtime.rs`: per-thread contexts and IPC events.
//!
//! Calls that only some CANN versions have come in [`Optional`] groups: the runtime loads
//! without them and their methods fail with `Unsupported`. The IPC event calls are one, the VMM
//! calls (`VmmFns`) another. To add another group:
//! 1. a struct of its raw signatures (`struct VmmFns { malloc_physical: unsafe extern "C"
//!    fn(...) -> AclError, ... }`) and a field `vmm: Optional<VmmFns>` in [`AclApi`];
//! 2. in [`AclApi::load`], inside its `unsafe` block (whose SAFETY line covers every signature):
//!    `let vmm = Optional::load("this ACL runtime has no VMM calls", || Ok(VmmFns {
//!    malloc_physical: lib.required("aclrtMallocPhysical")?, ... }));`
//! 3. one method per call, starting with `let f = self.vmm.get()?;`, then one `unsafe` call of
//!    `(f.malloc_physical)(...)` with its own SAFETY line, checked with `self.check(...)`.
//!
//! A required call goes into `Fns` the same way, read with `lib.required` and called as
//! `(self.fns.name)(...)`; a single optional function can also be an `Option` field read with
//! `lib.optional` (as `aclGetRecentErrMsg` is).

use crate::backend::runtime::{Context, DeviceContexts, Event, IpcEvents, Stream};
use crate::error::{Error, Result};
use crate::handle::{ACL_KEY_LEN, DEVSHARE_EVENT_HANDLE_SIZE};
use crate::loader::{self, c_text, Optional, Symbols};
use std::ffi::{c_char, c_void, CStr};

/// `ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION`: any process may import the key.
pub(crate) const EXPORT_FLAG_DISABLE_PID_VALIDATION: u64 = 1;
/// `ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS`: the runtime enables P2P for a cross-device
/// import.
pub(crate) const IMPORT_FLAG_ENABLE_PEER_ACCESS: u64 = 1;
/// `ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION`: any process may import the shareable handle.
pub(crate) const VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION: u64 = 1;
/// `ACL_ERROR_INVALID_PARAM`: what `aclrtMemExportToShareableHandle` returns for a second export
/// of the same physical handle (CANN keeps physical and shareable handle 1:1 in a process; the
/// stand-in runtime models it with this code).
pub(crate) const ACL_ERROR_INVALID_PARAM: i64 = 100_000;
/// `ACL_DDR_MEM` (`aclrtMemAttr`): all DDR memory of the device, huge and normal pages.
pub(crate) const MEM_ATTR_DDR: i32 = 0;
/// `ACL_HBM_MEM` (`aclrtMemAttr`): all HBM memory of the device, huge and normal pages.
pub(crate) const MEM_ATTR_HBM: i32 = 1;
/// `ACL_MEM_HANDLE_TYPE_NONE`: the only shareable-handle type of the VMM export.
const ACL_MEM_HANDLE_TYPE_NONE: i32 = 0;
/// `ACL_EVENT_IPC`: an event another process can open.
const ACL_EVENT_IPC: u32 = 0x40;
/// `aclInit` called again in a process (e.g. torch_npu initialised ACL already): fine.
const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100_002;

type AclError = i32;

/// `aclrtIpcEventHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcEventHandle {
    reserved: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
}

/// The calls every ACL runtime with IPC memory has.
struct Fns {
    set_device: unsafe extern "C" fn(i32) -> AclError,
    get_current_context: unsafe extern "C" fn(*mut Context) -> AclError,
    set_current_context: unsafe extern "C" fn(Context) -> AclError,
    get_device_count: unsafe extern "C" fn(*mut u32) -> AclError,
    ipc_mem_get_export_key: unsafe extern "C" fn(*mut c_void, usize, *mut c_char, usize, u64) -> AclError,
    ipc_mem_set_import_pid: unsafe extern "C" fn(*const c_char, *mut i32, usize) -> AclError,
    ipc_mem_import_by_key: unsafe extern "C" fn(*mut *mut c_void, *const c_char, u64) -> AclError,
    ipc_mem_close: unsafe extern "C" fn(*const c_char) -> AclError,
    device_get_bare_tgid: unsafe extern "C" fn(*mut i32) -> AclError,
    device_enable_peer_access: unsafe extern "C" fn(i32, u32) -> AclError,
    synchronize_stream: unsafe extern "C" fn(Stream) -> AclError,
    synchronize_device: unsafe extern "C" fn() -> AclError,
    get_mem_info: unsafe extern "C" fn(i32, *mut usize, *mut usize) -> AclError,
}

/// The IPC event calls: Atlas A2/A3 runtimes have them; a runtime without them still shares
/// memory, and only event shares and waits are refused.
struct EventFns {
    create_event_ex_with_flag: unsafe extern "C" fn(*mut Event, u32) -> AclError,
    record_event: unsafe extern "C" fn(Event, Stream) -> AclError,
    ipc_get_event_handle: unsafe extern "C" fn(Event, *mut IpcEventHandle) -> AclError,
    ipc_open_event_handle: unsafe extern "C" fn(IpcEventHandle, *mut Event) -> AclError,
    stream_wait_event: unsafe extern "C" fn(Stream, Event) -> AclError,
    synchronize_event: unsafe extern "C" fn(Event) -> AclError,
    destroy_event: unsafe extern "C" fn(Event) -> AclError,
}

/// A physical memory handle (`aclrtDrvMemHandle`, a pointer the runtime hands out and never
/// lets us dereference). Plain data: the backend owns the imports it makes and frees each once.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DrvMemHandle(pub(crate) *mut c_void);

// SAFETY: an opaque value the runtime interprets; it is never dereferenced in this process.
unsafe impl Send for DrvMemHandle {}
// SAFETY: as for Send.
unsafe impl Sync for DrvMemHandle {}

/// The VMM calls (CANN >= 8.x, what torch_npu's expandable segments use): a runtime without
/// them still shares `aclrtMalloc` memory by key; only segmented memory is refused.
/// `aclrtMallocPhysical` is not here: devshare never allocates physical memory (producers do).
struct VmmFns {
    free_physical: unsafe extern "C" fn(DrvMemHandle) -> AclError,
    reserve_mem_address: unsafe extern "C" fn(*mut *mut c_void, usize, usize, *mut c_void, u64) -> AclError,
    release_mem_address: unsafe extern "C" fn(*mut c_void) -> AclError,
    map_mem: unsafe extern "C" fn(*mut c_void, usize, usize, DrvMemHandle, u64) -> AclError,
    unmap_mem: unsafe extern "C" fn(*mut c_void) -> AclError,
    mem_export_to_shareable_handle: unsafe extern "C" fn(DrvMemHandle, i32, u64, *mut u64) -> AclError,
    mem_set_pid_to_shareable_handle: unsafe extern "C" fn(u64, *mut i32, usize) -> AclError,
    mem_import_from_shareable_handle: unsafe extern "C" fn(u64, i32, *mut DrvMemHandle) -> AclError,
}

/// The loaded, initialised ACL runtime.
pub(crate) struct AclApi {
    name: String,
    fns: Fns,
    events: Optional<EventFns>,
    vmm: Optional<VmmFns>,
    recent_err_msg: Option<unsafe extern "C" fn() -> *const c_char>,
    /// Keeps the functions above loaded.
    _lib: libloading::Library,
}

/// Where the runtime may be: `DEVSHARE_ACL_LIBRARY` (read by [`loader::load`]), the toolkit
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

impl AclApi {
    /// Load the runtime, read its symbols, `aclInit` it.
    pub(crate) fn load() -> Result<AclApi> {
        let lib = Symbols::open("DEVSHARE_ACL_LIBRARY", &candidates())?;
        // SAFETY: each function's type (the field's, or the one written out) is the C signature
        // of the symbol named next to it, from the CANN headers (`acl/acl_rt.h`, `acl/acl_base.h`).
        let (init, events, vmm, fns, recent_err_msg) = unsafe {
            let init: unsafe extern "C" fn(*const c_char) -> AclError = lib.required("aclInit")?;
            let events = Optional::load("this ACL runtime has no IPC events", || {
                Ok(EventFns {
                    create_event_ex_with_flag: lib.required("aclrtCreateEventExWithFlag")?,
                    record_event: lib.required("aclrtRecordEvent")?,
                    ipc_get_event_handle: lib.required("aclrtIpcGetEventHandle")?,
                    ipc_open_event_handle: lib.required("aclrtIpcOpenEventHandle")?,
                    stream_wait_event: lib.required("aclrtStreamWaitEvent")?,
                    synchronize_event: lib.required("aclrtSynchronizeEvent")?,
                    destroy_event: lib.required("aclrtDestroyEvent")?,
                })
            });
            let vmm = Optional::load("this ACL runtime has no VMM calls (expandable segments need CANN 8.x)", || {
                Ok(VmmFns {
                    free_physical: lib.required("aclrtFreePhysical")?,
                    reserve_mem_address: lib.required("aclrtReserveMemAddress")?,
                    release_mem_address: lib.required("aclrtReleaseMemAddress")?,
                    map_mem: lib.required("aclrtMapMem")?,
                    unmap_mem: lib.required("aclrtUnmapMem")?,
                    mem_export_to_shareable_handle: lib.required("aclrtMemExportToShareableHandle")?,
                    mem_set_pid_to_shareable_handle: lib.required("aclrtMemSetPidToShareableHandle")?,
                    mem_import_from_shareable_handle: lib.required("aclrtMemImportFromShareableHandle")?,
                })
            });
            let fns = Fns {
                set_device: lib.required("aclrtSetDevice")?,
                get_current_context: lib.required("aclrtGetCurrentContext")?,
                set_current_context: lib.required("aclrtSetCurrentContext")?,
                get_device_count: lib.required("aclrtGetDeviceCount")?,
                ipc_mem_get_export_key: lib.required("aclrtIpcMemGetExportKey")?,
                ipc_mem_set_import_pid: lib.required("aclrtIpcMemSetImportPid")?,
                ipc_mem_import_by_key: lib.required("aclrtIpcMemImportByKey")?,
                ipc_mem_close: lib.required("aclrtIpcMemClose")?,
                device_get_bare_tgid: lib.required("aclrtDeviceGetBareTgid")?,
                device_enable_peer_access: lib.required("aclrtDeviceEnablePeerAccess")?,
                synchronize_stream: lib.required("aclrtSynchronizeStream")?,
                synchronize_device: lib.required("aclrtSynchronizeDevice")?,
                get_mem_info: lib.required("aclrtGetMemInfo")?,
            };
            (init, events, vmm, fns, lib.optional("aclGetRecentErrMsg"))
        };
        let api = AclApi { name: lib.name().to_string(), fns, events, vmm, recent_err_msg, _lib: lib.into_library() };
        // SAFETY: aclInit with no config file.
        let rc = unsafe { init(std::ptr::null()) };
        if rc != 0 && rc != ACL_ERROR_REPEAT_INITIALIZE {
            return Err(api.error("aclInit", rc));
        }
        Ok(api)
    }

    /// The name the runtime loaded by.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A vendor error for `call`: what the code means and the runtime's own latest message.
    pub(crate) fn error(&self, call: &str, code: AclError) -> Error {
        let recent = match self.recent_err_msg {
            // SAFETY: no arguments; returns NULL or a thread-local C string, copied at once.
            Some(f) => unsafe { c_text(f()) },
            None => String::new(),
        };
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
        loader::vendor_error(call, code, meaning, "", &recent, &self.name)
    }

    fn check(&self, call: &str, code: AclError) -> Result<()> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }

    /// `aclrtSetDevice`: open `device` for the process and make its default context current.
    pub(crate) fn set_device(&self, device: i32) -> Result<()> {
        // SAFETY: plain call; the runtime checks the device number.
        self.check("aclrtSetDevice", unsafe { (self.fns.set_device)(device) })
    }

    /// `aclrtGetCurrentContext`; `None` when the thread has no context (the call fails then).
    pub(crate) fn get_current_context(&self) -> Option<Context> {
        let mut ctx = Context::NULL;
        // SAFETY: valid out pointer.
        let rc = unsafe { (self.fns.get_current_context)(&mut ctx) };
        (rc == 0 && !ctx.is_null()).then_some(ctx)
    }

    /// `aclrtSetCurrentContext`.
    pub(crate) fn set_current_context(&self, ctx: Context) -> Result<()> {
        // SAFETY: a context the runtime handed out; the runtime checks it.
        self.check("aclrtSetCurrentContext", unsafe { (self.fns.set_current_context)(ctx) })
    }

    /// `aclrtGetDeviceCount`.
    pub(crate) fn get_device_count(&self) -> Result<u32> {
        let mut n = 0u32;
        // SAFETY: valid out pointer.
        self.check("aclrtGetDeviceCount", unsafe { (self.fns.get_device_count)(&mut n) })?;
        Ok(n)
    }

    /// `aclrtIpcMemGetExportKey`: the key buffer as the runtime wrote it (bytes after the NUL
    /// unspecified: see [`AclKey::normalize`](crate::handle::AclKey::normalize)).
    pub(crate) fn ipc_mem_get_export_key(
        &self,
        ptr: *mut c_void,
        size: usize,
        flags: u64,
    ) -> Result<[u8; ACL_KEY_LEN]> {
        let mut buf = [0u8; ACL_KEY_LEN];
        // SAFETY: `buf` has the ACL_KEY_LEN bytes the call is told; `ptr` is a device address,
        // never dereferenced here, which the runtime checks against its allocations.
        let rc = unsafe { (self.fns.ipc_mem_get_export_key)(ptr, size, buf.as_mut_ptr().cast(), ACL_KEY_LEN, flags) };
        self.check("aclrtIpcMemGetExportKey", rc)?;
        Ok(buf)
    }

    /// `aclrtIpcMemSetImportPid`: let the processes `pids` import `key`.
    pub(crate) fn ipc_mem_set_import_pid(&self, key: &CStr, pids: &[i32]) -> Result<()> {
        let mut pids = pids.to_vec();
        // SAFETY: a NUL-terminated key; `pids` holds the count passed (the runtime only reads).
        let rc = unsafe { (self.fns.ipc_mem_set_import_pid)(key.as_ptr(), pids.as_mut_ptr(), pids.len()) };
        self.check("aclrtIpcMemSetImportPid", rc)
    }

    /// `aclrtIpcMemImportByKey`: the key's allocation mapped on the bound device.
    pub(crate) fn ipc_mem_import_by_key(&self, key: &CStr, flags: u64) -> Result<*mut c_void> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; a NUL-terminated key.
        let rc = unsafe { (self.fns.ipc_mem_import_by_key)(&mut p, key.as_ptr(), flags) };
        self.check("aclrtIpcMemImportByKey", rc)?;
        Ok(p)
    }

    /// `aclrtIpcMemClose`: close one import of `key`, or (in its exporter) destroy it.
    pub(crate) fn ipc_mem_close(&self, key: &CStr) -> Result<()> {
        // SAFETY: a NUL-terminated key.
        self.check("aclrtIpcMemClose", unsafe { (self.fns.ipc_mem_close)(key.as_ptr()) })
    }

    /// `aclrtDeviceGetBareTgid`: the pid exporters whitelist for this process.
    pub(crate) fn device_get_bare_tgid(&self) -> Result<i32> {
        let mut pid = 0;
        // SAFETY: valid out pointer.
        self.check("aclrtDeviceGetBareTgid", unsafe { (self.fns.device_get_bare_tgid)(&mut pid) })?;
        Ok(pid)
    }

    /// `aclrtDeviceEnablePeerAccess`: let the bound device access `peer`'s memory.
    pub(crate) fn device_enable_peer_access(&self, peer: i32, flags: u32) -> Result<()> {
        // SAFETY: plain call; the runtime checks the device number.
        self.check("aclrtDeviceEnablePeerAccess", unsafe { (self.fns.device_enable_peer_access)(peer, flags) })
    }

    /// `aclrtSynchronizeStream`.
    pub(crate) fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        // SAFETY: the caller's stream (null: the default stream), which the runtime checks.
        self.check("aclrtSynchronizeStream", unsafe { (self.fns.synchronize_stream)(stream) })
    }

    /// `aclrtSynchronizeDevice`: wait for all work on the bound device.
    pub(crate) fn synchronize_device(&self) -> Result<()> {
        // SAFETY: plain call.
        self.check("aclrtSynchronizeDevice", unsafe { (self.fns.synchronize_device)() })
    }

    /// `aclrtGetMemInfo(attr, &free, &total)` on the bound device: `(free, total)` in bytes, the
    /// memory of kind `attr` (`MEM_ATTR_*`) that applications can use. Both are 0 for a kind the
    /// hardware does not have (HBM queries fall back to DDR on devices without HBM).
    pub(crate) fn get_mem_info(&self, attr: i32) -> Result<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two valid out pointers; `attr` is an aclrtMemAttr value (a C enum, int).
        self.check("aclrtGetMemInfo", unsafe { (self.fns.get_mem_info)(attr, &mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    /// `Ok` when the runtime has the VMM calls.
    pub(crate) fn vmm_available(&self) -> Result<()> {
        self.vmm.get().map(|_| ())
    }

    /// `aclrtFreePhysical`: free a physical handle (here: one this process imported).
    pub(crate) fn free_physical(&self, h: DrvMemHandle) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: a handle the runtime returned; the callers free each one once, after unmapping.
        self.check("aclrtFreePhysical", unsafe { (f.free_physical)(h) })
    }

    /// `aclrtReserveMemAddress(&va, size, 0, NULL, 0)`: `size` bytes of device address space.
    pub(crate) fn reserve_mem_address(&self, size: usize) -> Result<*mut c_void> {
        let f = self.vmm.get()?;
        let mut va: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; alignment 0 (the default), no expected address, flags 0.
        let rc = unsafe { (f.reserve_mem_address)(&mut va, size, 0, std::ptr::null_mut(), 0) };
        self.check("aclrtReserveMemAddress", rc)?;
        Ok(va)
    }

    /// `aclrtReleaseMemAddress`: give back a reservation (nothing may be mapped in it).
    pub(crate) fn release_mem_address(&self, va: *mut c_void) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: a reservation's base, never dereferenced here; the runtime checks it.
        self.check("aclrtReleaseMemAddress", unsafe { (f.release_mem_address)(va) })
    }

    /// `aclrtMapMem(va, size, 0, h, 0)`: map the whole physical handle at `va`.
    pub(crate) fn map_mem(&self, va: *mut c_void, size: usize, h: DrvMemHandle) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: a device address inside a reservation of this process and a handle the runtime
        // returned, neither dereferenced here; offset 0 and flags 0 as the reference requires.
        self.check("aclrtMapMem", unsafe { (f.map_mem)(va, size, 0, h, 0) })
    }

    /// `aclrtUnmapMem`: undo one `aclrtMapMem` at `va`.
    pub(crate) fn unmap_mem(&self, va: *mut c_void) -> Result<()> {
        let f = self.vmm.get()?;
        // SAFETY: the address a mapping was made at, never dereferenced here.
        self.check("aclrtUnmapMem", unsafe { (f.unmap_mem)(va) })
    }

    /// `aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_NONE, flags, &out)`. CANN
    /// allows it once per physical handle: callers cache the result.
    pub(crate) fn mem_export_to_shareable_handle(&self, h: DrvMemHandle, flags: u64) -> Result<u64> {
        let f = self.vmm.get()?;
        let mut out = 0u64;
        // SAFETY: the caller's physical handle (checked by the runtime, never dereferenced
        // here); valid out pointer.
        let rc = unsafe { (f.mem_export_to_shareable_handle)(h, ACL_MEM_HANDLE_TYPE_NONE, flags, &mut out) };
        self.check("aclrtMemExportToShareableHandle", rc)?;
        Ok(out)
    }

    /// `aclrtMemSetPidToShareableHandle`: let the processes `pids` import `shareable`.
    pub(crate) fn mem_set_pid_to_shareable_handle(&self, shareable: u64, pids: &[i32]) -> Result<()> {
        let f = self.vmm.get()?;
        let mut pids = pids.to_vec();
        // SAFETY: `pids` holds the count passed (the runtime only reads it).
        let rc = unsafe { (f.mem_set_pid_to_shareable_handle)(shareable, pids.as_mut_ptr(), pids.len()) };
        self.check("aclrtMemSetPidToShareableHandle", rc)
    }

    /// `aclrtMemImportFromShareableHandle`: a physical handle for `shareable` on `device`.
    /// CANN allows one live import per shareable handle per process: callers refcount it.
    pub(crate) fn mem_import_from_shareable_handle(&self, shareable: u64, device: i32) -> Result<DrvMemHandle> {
        let f = self.vmm.get()?;
        let mut h = DrvMemHandle(std::ptr::null_mut());
        // SAFETY: plain values and a valid out pointer.
        let rc = unsafe { (f.mem_import_from_shareable_handle)(shareable, device, &mut h) };
        self.check("aclrtMemImportFromShareableHandle", rc)?;
        Ok(h)
    }

    /// `aclrtCreateEventExWithFlag`.
    pub(crate) fn create_event_ex_with_flag(&self, flag: u32) -> Result<Event> {
        let f = self.events.get()?;
        let mut ev = Event::NULL;
        // SAFETY: valid out pointer.
        self.check("aclrtCreateEventExWithFlag", unsafe { (f.create_event_ex_with_flag)(&mut ev, flag) })?;
        Ok(ev)
    }

    /// `aclrtRecordEvent`.
    pub(crate) fn record_event(&self, ev: Event, stream: Stream) -> Result<()> {
        let f = self.events.get()?;
        // SAFETY: an event of this runtime; the caller's stream; the runtime checks both.
        self.check("aclrtRecordEvent", unsafe { (f.record_event)(ev, stream) })
    }

    /// `aclrtIpcGetEventHandle`: the bytes another process opens `ev` by.
    pub(crate) fn ipc_get_event_handle(&self, ev: Event) -> Result<[u8; DEVSHARE_EVENT_HANDLE_SIZE]> {
        let f = self.events.get()?;
        let mut h = IpcEventHandle { reserved: [0; DEVSHARE_EVENT_HANDLE_SIZE] };
        // SAFETY: an event of this runtime; valid out pointer.
        self.check("aclrtIpcGetEventHandle", unsafe { (f.ipc_get_event_handle)(ev, &mut h) })?;
        Ok(h.reserved)
    }

    /// `aclrtIpcOpenEventHandle`.
    pub(crate) fn ipc_open_event_handle(&self, handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE]) -> Result<Event> {
        let f = self.events.get()?;
        let mut ev = Event::NULL;
        // SAFETY: handle by value; valid out pointer.
        self.check("aclrtIpcOpenEventHandle", unsafe {
            (f.ipc_open_event_handle)(IpcEventHandle { reserved: handle }, &mut ev)
        })?;
        Ok(ev)
    }

    /// `aclrtStreamWaitEvent`.
    pub(crate) fn stream_wait_event(&self, stream: Stream, ev: Event) -> Result<()> {
        let f = self.events.get()?;
        // SAFETY: the caller's stream and an event of this runtime; the runtime checks both.
        self.check("aclrtStreamWaitEvent", unsafe { (f.stream_wait_event)(stream, ev) })
    }

    /// `aclrtSynchronizeEvent`.
    pub(crate) fn synchronize_event(&self, ev: Event) -> Result<()> {
        let f = self.events.get()?;
        // SAFETY: an event of this runtime, which it checks.
        self.check("aclrtSynchronizeEvent", unsafe { (f.synchronize_event)(ev) })
    }

    /// `aclrtDestroyEvent`.
    pub(crate) fn destroy_event(&self, ev: Event) -> Result<()> {
        let f = self.events.get()?;
        // SAFETY: an event of this runtime; the callers destroy each one once.
        self.check("aclrtDestroyEvent", unsafe { (f.destroy_event)(ev) })
    }
}

/// ACL contexts are per thread. A device's default context is made once per process with
/// `aclrtSetDevice` (which also holds the device open for the process), then reused, so repeated
/// binds add no device references.
impl DeviceContexts for AclApi {
    fn make_context(&self, device: i32) -> Result<Context> {
        let previous = self.get_current_context();
        self.set_device(device)?;
        let ctx = self.get_current_context();
        if let Some(p) = previous {
            // aclrtSetDevice made its context current: the thread gets its own back.
            let _ = self.set_current_context(p);
        }
        ctx.ok_or_else(|| Error::Internal("aclrtSetDevice left no current context".into()))
    }

    /// The thread's context, if it has one (a thread that had none keeps the bound one).
    fn context_to_restore(&self) -> Result<Option<Context>> {
        Ok(self.get_current_context())
    }

    fn make_current(&self, ctx: Context) -> Result<()> {
        self.set_current_context(ctx)
    }
}

impl IpcEvents for AclApi {
    fn events_available(&self) -> Result<()> {
        self.events.get().map(|_| ())
    }
    fn create_ipc_event(&self) -> Result<Event> {
        self.create_event_ex_with_flag(ACL_EVENT_IPC)
    }
    fn record_on(&self, ev: Event, stream: Stream) -> Result<()> {
        self.record_event(ev, stream)
    }
    fn ipc_handle_of(&self, ev: Event) -> Result<[u8; DEVSHARE_EVENT_HANDLE_SIZE]> {
        self.ipc_get_event_handle(ev)
    }
    fn open_ipc_handle(&self, handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE]) -> Result<Event> {
        self.ipc_open_event_handle(handle)
    }
    fn host_wait(&self, ev: Event) -> Result<()> {
        self.synchronize_event(ev)
    }
    fn stream_wait(&self, stream: Stream, ev: Event) -> Result<()> {
        self.stream_wait_event(stream, ev)
    }
    fn destroy(&self, ev: Event) -> Result<()> {
        self.destroy_event(ev)
    }
    fn sync_stream(&self, stream: Stream) -> Result<()> {
        self.synchronize_stream(stream)
    }
    fn sync_device(&self) -> Result<()> {
        self.synchronize_device()
    }
}
