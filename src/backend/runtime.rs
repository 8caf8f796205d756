//! What the vendor backends share, written once: binding a device's context on the calling
//! thread around a call (`Runtime::bind`), interprocess-event plumbing (`prepare_share`,
//! `wait_event`) and the export caches' pruning. Loading the runtime library itself is
//! `crate::loader`'s (shared with UCX).
//!
//! Each vendor has one typed wrapper (`acl/api.rs`, `cuda/api.rs`): the only caller of its raw
//! symbols. It implements `DeviceContexts` and `IpcEvents` with its typed calls, and what is
//! here is written against those two traits.

use super::IpcEvent;
use crate::error::Result;
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
}

impl<A> Runtime<A> {
    /// A loaded runtime with no context made yet.
    pub(crate) fn new(api: A) -> Runtime<A> {
        Runtime { api, contexts: Mutex::new(HashMap::new()) }
    }
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

    fn record_again(&self, stream: *mut c_void) -> Result<()> {
        let _g = self.rt.bind(self.device)?;
        self.rt.record_on(self.ev, Stream(stream))
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

/// An event another process recorded, opened here once and waited on for each of its records
/// ([`OpenedEvent`](super::OpenedEvent)); destroyed, with its device bound, when dropped.
struct KeptOpen<A: IpcEvents + 'static> {
    rt: &'static Runtime<A>,
    ev: Event,
    device: i32,
}

impl<A: IpcEvents + Send + Sync + 'static> super::OpenedEvent for KeptOpen<A> {
    fn wait(&self, stream: *mut c_void) -> Result<()> {
        let _g = self.rt.bind(self.device)?;
        if stream.is_null() {
            self.rt.host_wait(self.ev)
        } else {
            self.rt.stream_wait(Stream(stream), self.ev)
        }
    }
}

impl<A: IpcEvents + 'static> Drop for KeptOpen<A> {
    fn drop(&mut self) {
        // A stream may still wait on it: destroying it then is allowed, its resources go once
        // the wait completed.
        if let Ok(_g) = self.rt.bind(self.device) {
            let _ = self.rt.destroy(self.ev);
        }
    }
}

/// [`Backend::open_event`](super::Backend::open_event) for a device backend: the exporter's
/// event opened on `device`, kept open.
pub(crate) fn open_event<A: IpcEvents + Send + Sync + 'static>(
    rt: &'static Runtime<A>,
    device: i32,
    handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
) -> Result<Box<dyn super::OpenedEvent>> {
    rt.events_available()?;
    let _g = rt.bind(device)?;
    let ev = rt.open_ipc_handle(handle)?;
    Ok(Box::new(KeptOpen { rt, ev, device }))
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
        let rt = Runtime { api: NoContexts, contexts: Mutex::new(HashMap::new()) };
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
