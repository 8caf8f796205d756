//! What the vendor backends share, written once: finding a runtime library and its symbols
//! ([`load`], `Symbols`, `Optional`), loading it on first use (`OnDemand`), binding a device's
//! context on the calling thread around a call (`Runtime::bind`), interprocess-event plumbing
//! (`prepare_share`, `wait_event`) and the text of vendor errors (`vendor_error`).
//!
//! Each vendor has one typed wrapper (`acl/api.rs`, `cuda/api.rs`): the only caller of its raw
//! symbols. It implements `DeviceContexts` and `IpcEvents` with its typed calls, and what is
//! here is written against those two traits.

use super::IpcEvent;
use crate::error::{Error, Result};
use crate::fork::Stamp;
use crate::handle::DEVSHARE_EVENT_HANDLE_SIZE;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock, Weak};

// ---------------------------------------------------------------------------------------------
// Runtime handles

/// A runtime context (`aclrtContext`, `CUcontext`); null is "none".
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Context(pub(crate) *mut c_void);

/// A runtime stream (`aclrtStream`, `CUstream`), the caller's; null is the default stream.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stream(pub(crate) *mut c_void);

/// A runtime event (`aclrtEvent`, `CUevent`).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Event(pub(crate) *mut c_void);

impl Context {
    pub(crate) const NULL: Context = Context(std::ptr::null_mut());
    pub(crate) fn is_null(self) -> bool {
        self.0.is_null()
    }
}

impl Stream {
    pub(crate) fn is_null(self) -> bool {
        self.0.is_null()
    }
}

impl Event {
    pub(crate) const NULL: Event = Event(std::ptr::null_mut());
    pub(crate) fn is_null(self) -> bool {
        self.0.is_null()
    }
}

// SAFETY: a context is a process-wide token; ACL and CUDA let any thread make it current.
unsafe impl Send for Context {}
// SAFETY: as for Send; the token is only copied, never dereferenced here.
unsafe impl Sync for Context {}
// SAFETY: an event is a process-wide token, usable from any thread that binds its device.
unsafe impl Send for Event {}
// SAFETY: as for Send; the token is only copied, never dereferenced here.
unsafe impl Sync for Event {}

// ---------------------------------------------------------------------------------------------
// Loading

/// Load the first library that opens: the path in `env_var` if set, else each candidate (a
/// path, or a bare name looked up on the default loader path). Returns the library and the name
/// that loaded; when none loads, the error lists every attempt.
pub fn load(env_var: &str, candidates: &[String]) -> Result<(libloading::Library, String)> {
    let mut tried = Vec::new();
    let mut names: Vec<String> = Vec::new();
    if let Ok(path) = std::env::var(env_var) {
        if !path.is_empty() {
            names.push(path);
        }
    }
    names.extend(candidates.iter().cloned());
    for name in names {
        // SAFETY: loading a vendor runtime runs its initialisers; that is the documented way to
        // use these libraries and the reason devshare loads them only on demand.
        match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => return Ok((lib, name)),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(Error::BackendUnavailable(format!(
        "no runtime library could be loaded (set {env_var} to its full path); tried {}",
        tried.join("; ")
    )))
}

/// A loaded runtime library, read by a typed wrapper while it fills its tables of function
/// pointers; the wrapper keeps it ([`Symbols::into_library`]) for as long as it keeps them.
pub(crate) struct Symbols {
    lib: libloading::Library,
    name: String,
}

impl Symbols {
    /// [`load`] the runtime.
    pub(crate) fn open(env_var: &str, candidates: &[String]) -> Result<Symbols> {
        let (lib, name) = load(env_var, candidates)?;
        Ok(Symbols { lib, name })
    }

    /// The name the library loaded by.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A function the wrapper cannot do without: missing, the runtime is unavailable.
    ///
    /// # Safety
    /// `T` must be the C signature of `name` (an `unsafe extern "C" fn`).
    pub(crate) unsafe fn required<T: Copy>(&self, name: &str) -> Result<T> {
        // SAFETY: the caller names the symbol with its C signature as `T`.
        unsafe { self.lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| Error::BackendUnavailable(format!("{} has no {name}: {e}", self.name)))
    }

    /// The first of several names the library exports (e.g. `cuEventDestroy_v2`, then
    /// `cuEventDestroy`); the error is the last name's.
    ///
    /// # Safety
    /// `T` must be the C signature of every name.
    pub(crate) unsafe fn first_of<T: Copy>(&self, names: &[&str]) -> Result<T> {
        let mut last = None;
        for name in names {
            // SAFETY: the caller's promise covers every name.
            match unsafe { self.required(name) } {
                Ok(f) => return Ok(f),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one name"))
    }

    /// A single function that some versions of the runtime lack.
    ///
    /// # Safety
    /// `T` must be the C signature of `name`.
    pub(crate) unsafe fn optional<T: Copy>(&self, name: &str) -> Option<T> {
        // SAFETY: the caller's promise.
        unsafe { self.required(name) }.ok()
    }

    /// The library, to keep loaded while its functions are used.
    pub(crate) fn into_library(self) -> libloading::Library {
        self.lib
    }
}

/// A group of functions that only some versions of a runtime export (the ACL IPC event calls;
/// the VMM calls): loaded together, or absent with the reason, which every typed call of the
/// group then returns as `Unsupported`. A runtime without the group still loads.
pub(crate) struct Optional<T>(std::result::Result<T, Error>);

impl<T> Optional<T> {
    /// Fill the group with `fill` (which reads every symbol of it with [`Symbols::required`]);
    /// when one is missing, the group is absent and its calls fail with `missing: <why>`, e.g.
    /// "this ACL runtime has no IPC events: libascendcl.so has no aclrtIpcGetEventHandle".
    pub(crate) fn load(missing: &str, fill: impl FnOnce() -> Result<T>) -> Optional<T> {
        Optional(fill().map_err(|e| Error::Unsupported(format!("{missing}: {e}"))))
    }

    /// The group's functions, or why the runtime has none.
    pub(crate) fn get(&self) -> Result<&T> {
        self.0.as_ref().map_err(Clone::clone)
    }
}

/// A runtime loaded on first use, with the contexts devshare made in it.
pub(crate) struct OnDemand<A> {
    cell: OnceLock<Runtime<A>>,
    load: fn() -> Result<A>,
}

impl<A> OnDemand<A> {
    /// A runtime that `load` loads (and initialises) on first use.
    pub(crate) const fn new(load: fn() -> Result<A>) -> OnDemand<A> {
        OnDemand { cell: OnceLock::new(), load }
    }

    /// Whether the runtime was loaded (and initialised) by a process this one was forked from:
    /// then this process must not call it.
    pub(crate) fn inherited(&self) -> bool {
        self.cell.get().is_some_and(|rt| !rt.generation.is_current())
    }

    /// The loaded runtime. Only success is kept: a failed load is tried again next time (the
    /// library may have been installed or `DEVSHARE_*_LIBRARY` set meanwhile), and leaves nothing
    /// allocated. Two threads loading at once both succeed; one result is kept.
    pub(crate) fn get(&self) -> Result<&Runtime<A>> {
        if let Some(rt) = self.cell.get() {
            return Ok(rt);
        }
        let api = (self.load)()?;
        Ok(self.cell.get_or_init(|| Runtime { api, contexts: Mutex::new(HashMap::new()), generation: Stamp::now() }))
    }
}

/// Text from a C string returned by a vendor runtime (empty for NULL).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that stays valid during this call.
pub(crate) unsafe fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's promise; the text is copied out before returning.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------------------------------------
// Errors

/// The one form of a vendor runtime error: `call` failed with `code`. The message is what the
/// code means (`meaning`: from the vendor's documentation, or its own error-name call), a `hint`
/// at the usual cause in parentheses, and what the runtime said most recently (`recent`); when
/// all three are empty, it points at the runtime's log.
pub(crate) fn vendor_error(call: &str, code: i32, meaning: &str, hint: &str, recent: &str, lib_name: &str) -> Error {
    let mut message = meaning.to_string();
    if !hint.is_empty() {
        if message.is_empty() {
            message.push_str(hint);
        } else {
            message = format!("{message} ({hint})");
        }
    }
    if !recent.is_empty() {
        if !message.is_empty() {
            message.push_str("; ");
        }
        message.push_str("runtime says: ");
        message.push_str(recent.trim());
    }
    if message.is_empty() {
        message = format!("see the {lib_name} log");
    }
    Error::Vendor { call: call.into(), code: code.into(), message }
}

// ---------------------------------------------------------------------------------------------
// Per-thread contexts

/// How a runtime binds a device to the calling thread, in its typed calls. [`Runtime::bind`] is
/// written once on top of it.
pub(crate) trait DeviceContexts {
    /// The context devshare uses on `device`. Called once per device per process, under a lock;
    /// [`Runtime`] keeps the result.
    fn make_context(&self, device: i32) -> Result<Context>;
    /// What to make current again when a binding ends; `None` when nothing needs to be.
    fn context_to_restore(&self) -> Result<Option<Context>>;
    /// Make `ctx` current on the calling thread.
    fn make_current(&self, ctx: Context) -> Result<()>;
}

/// A loaded runtime (its typed wrapper, reached through `Deref`) and each device's context.
pub(crate) struct Runtime<A> {
    api: A,
    contexts: Mutex<HashMap<i32, Context>>,
    /// The fork generation of the process that loaded it (a forked child inherits the loaded
    /// runtime, not its initialisation).
    generation: Stamp,
}

impl<A> std::ops::Deref for Runtime<A> {
    type Target = A;
    fn deref(&self) -> &A {
        &self.api
    }
}

impl<A: DeviceContexts> Runtime<A> {
    fn context(&self, device: i32) -> Result<Context> {
        let mut contexts = self.contexts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&c) = contexts.get(&device) {
            return Ok(c);
        }
        let ctx = self.api.make_context(device)?;
        contexts.insert(device, ctx);
        Ok(ctx)
    }

    /// Make `device`'s context current on the calling thread for the life of the guard, then
    /// the thread's previous one again. A thread that already has it current changes nothing.
    pub(crate) fn bind(&self, device: i32) -> Result<Bound<'_, A>> {
        let ctx = self.context(device)?;
        let previous = self.api.context_to_restore()?;
        if previous == Some(ctx) {
            return Ok(Bound { api: &self.api, restore: None });
        }
        self.api.make_current(ctx)?;
        Ok(Bound { api: &self.api, restore: previous })
    }
}

/// A device bound on this thread by [`Runtime::bind`]; dropping it restores the thread's
/// previous context.
pub(crate) struct Bound<'a, A: DeviceContexts> {
    api: &'a A,
    restore: Option<Context>,
}

impl<A: DeviceContexts> Drop for Bound<'_, A> {
    fn drop(&mut self) {
        if let Some(c) = self.restore {
            // Nothing to do about a failure here: the call it wrapped has finished.
            let _ = self.api.make_current(c);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Events and synchronisation

/// A runtime's interprocess events and synchronisation, in its typed calls, with its device
/// bound by the caller. [`prepare_share`], [`wait_event`] and [`Runtime::synchronize`] are
/// written once on top of it.
pub(crate) trait IpcEvents: DeviceContexts {
    /// `Ok` when the runtime has interprocess events (checked before a wait binds its device).
    fn events_available(&self) -> Result<()> {
        Ok(())
    }
    /// A new event that another process can open.
    fn create_ipc_event(&self) -> Result<Event>;
    /// Record `ev` on `stream`.
    fn record_on(&self, ev: Event, stream: Stream) -> Result<()>;
    /// The bytes another process opens `ev` by.
    fn ipc_handle_of(&self, ev: Event) -> Result<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>;
    /// Open an event another process recorded.
    fn open_ipc_handle(&self, handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE]) -> Result<Event>;
    /// Block the calling thread until `ev` completed.
    fn host_wait(&self, ev: Event) -> Result<()>;
    /// Order `stream`'s later work after `ev`.
    fn stream_wait(&self, stream: Stream, ev: Event) -> Result<()>;
    /// Destroy an event this process created or opened.
    fn destroy(&self, ev: Event) -> Result<()>;
    /// Block until `stream` (not null) is idle.
    fn sync_stream(&self, stream: Stream) -> Result<()>;
    /// Block until the bound device (ACL) or context (CUDA) is idle.
    fn sync_device(&self) -> Result<()>;
}

impl<A: IpcEvents> Runtime<A> {
    /// Wait until this process's work on `device` is finished; failures are not reported (the
    /// callers are on release paths).
    pub(crate) fn synchronize(&self, device: i32) {
        if let Ok(_g) = self.bind(device) {
            let _ = self.api.sync_device();
        }
    }
}

/// An interprocess event an exporter recorded for one share; destroyed, with its device bound,
/// when the share is released.
struct SharedEvent<A: IpcEvents + 'static> {
    rt: &'static Runtime<A>,
    ev: Event,
    device: i32,
    handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
}

impl<A: IpcEvents + Send + Sync + 'static> IpcEvent for SharedEvent<A> {
    fn handle(&self) -> [u8; DEVSHARE_EVENT_HANDLE_SIZE] {
        self.handle
    }
}

impl<A: IpcEvents + 'static> Drop for SharedEvent<A> {
    fn drop(&mut self) {
        if self.ev.is_null() {
            return;
        }
        if let Ok(_g) = self.rt.bind(self.device) {
            let _ = self.rt.destroy(self.ev);
        }
        self.ev = Event::NULL;
    }
}

/// [`Exported::prepare_share`](super::Exported::prepare_share) for a device backend, with
/// `device` bound: record an interprocess event on `stream` and return it, or with
/// `event == false` synchronise `stream` (null: the whole device).
pub(crate) fn prepare_share<A: IpcEvents + Send + Sync + 'static>(
    rt: &'static Runtime<A>,
    device: i32,
    stream: Stream,
    event: bool,
) -> Result<Option<Box<dyn IpcEvent>>> {
    let _g = rt.bind(device)?;
    if !event {
        if stream.is_null() {
            rt.sync_device()?;
        } else {
            rt.sync_stream(stream)?;
        }
        return Ok(None);
    }
    let ev = rt.create_ipc_event()?;
    // Owned from here on: an error below destroys it.
    let mut owned = SharedEvent { rt, ev, device, handle: [0; DEVSHARE_EVENT_HANDLE_SIZE] };
    rt.record_on(ev, stream)?;
    owned.handle = rt.ipc_handle_of(ev)?;
    Ok(Some(Box::new(owned)))
}

/// [`Backend::wait_event`](super::Backend::wait_event) for a device backend, with `device`
/// bound: open the exporter's event, make `stream` wait on it (null: block until it completed),
/// destroy it. The wait's error comes first, then the destroy's.
pub(crate) fn wait_event<A: IpcEvents>(
    rt: &Runtime<A>,
    device: i32,
    handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
    stream: Stream,
) -> Result<()> {
    rt.events_available()?;
    let _g = rt.bind(device)?;
    let ev = rt.open_ipc_handle(handle)?;
    let waited = if stream.is_null() { rt.host_wait(ev) } else { rt.stream_wait(stream, ev) };
    let destroyed = rt.destroy(ev);
    waited?;
    destroyed
}

// ---------------------------------------------------------------------------------------------
// Export caches

/// Drop the entries of an export cache whose export is gone (and the table's memory when
/// none is left, so an idle library holds none).
pub(crate) fn prune<K, V>(cache: &mut HashMap<K, Weak<V>>) {
    cache.retain(|_, w| w.strong_count() > 0);
    if cache.is_empty() {
        *cache = HashMap::new();
    }
}

/// [`prune`] a cache that may not exist yet.
pub(crate) fn forget_dead<K, V>(cache: &OnceLock<Mutex<HashMap<K, Weak<V>>>>) {
    if let Some(cache) = cache.get() {
        prune(&mut cache.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    fn message(e: Error) -> String {
        match e {
            Error::Vendor { message, .. } => message,
            e => panic!("not a vendor error: {e}"),
        }
    }

    #[test]
    fn vendor_errors_say_meaning_then_hint_then_what_the_runtime_said() {
        let e = vendor_error(
            "aclrtIpcMemImportByKey",
            207_006,
            "no permission",
            "",
            " not whitelisted\n",
            "libascendcl.so",
        );
        assert_eq!(e.status(), Status::Vendor);
        assert_eq!(e.vendor_code(), 207_006);
        assert_eq!(message(e), "no permission; runtime says: not whitelisted");
        let e = vendor_error(
            "cuIpcOpenMemHandle",
            201,
            "CUDA_ERROR_INVALID_CONTEXT: invalid context",
            "same process",
            "",
            "libcuda.so.1",
        );
        assert_eq!(message(e), "CUDA_ERROR_INVALID_CONTEXT: invalid context (same process)");
    }

    #[test]
    fn a_vendor_error_with_nothing_to_say_points_at_the_runtime_log() {
        let e = vendor_error("aclrtSetDevice", 1, "", "", "", "libascendcl.so");
        assert_eq!(message(e), "see the libascendcl.so log");
    }

    #[test]
    fn an_absent_optional_group_is_unsupported_and_says_why() {
        let group: Optional<u8> = Optional::load("this runtime has no VMM calls", || {
            Err(Error::BackendUnavailable("libx.so has no xMemMap".into()))
        });
        let e = group.get().unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        assert!(
            e.to_string().contains("this runtime has no VMM calls: backend unavailable: libx.so has no xMemMap"),
            "{e}"
        );
        assert_eq!(*Optional::load("unused", || Ok(7u8)).get().unwrap(), 7);
    }

    #[test]
    fn a_failed_load_is_not_kept() {
        static TRIES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        fn load() -> Result<NoContexts> {
            if TRIES.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                Err(Error::BackendUnavailable("not yet".into()))
            } else {
                Ok(NoContexts)
            }
        }
        static RT: OnDemand<NoContexts> = OnDemand::new(load);
        assert!(RT.get().is_err());
        assert!(RT.get().is_ok());
        assert!(RT.get().is_ok());
        assert_eq!(TRIES.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// A runtime whose threads start with no context; the current one is a thread-local.
    struct NoContexts;
    impl DeviceContexts for NoContexts {
        fn make_context(&self, device: i32) -> Result<Context> {
            Ok(Context((0x1000 + device as usize) as *mut c_void))
        }
        fn context_to_restore(&self) -> Result<Option<Context>> {
            CURRENT.with(|c| Ok(Some(c.get())))
        }
        fn make_current(&self, ctx: Context) -> Result<()> {
            CURRENT.with(|c| c.set(ctx));
            Ok(())
        }
    }
    thread_local! {
        static CURRENT: std::cell::Cell<Context> = const { std::cell::Cell::new(Context::NULL) };
    }

    #[test]
    fn bind_makes_the_device_current_and_restores_the_previous_context_nested_too() {
        let rt = Runtime { api: NoContexts, contexts: Mutex::new(HashMap::new()), generation: Stamp::now() };
        let current = || CURRENT.with(|c| c.get());
        {
            let _a = rt.bind(0).unwrap();
            assert_eq!(current(), Context(0x1000 as *mut c_void));
            {
                let _b = rt.bind(1).unwrap();
                assert_eq!(current(), Context(0x1001 as *mut c_void));
                let _again = rt.bind(1).unwrap();
            }
            assert_eq!(current(), Context(0x1000 as *mut c_void));
        }
        assert_eq!(current(), Context::NULL);
    }
}
