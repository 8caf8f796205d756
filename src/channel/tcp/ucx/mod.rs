//! UCX's UCP API (`libucp.so.0`, which brings `libucs.so.0`), loaded at run time, as safe types:
//! [`Context`], [`Worker`], [`Endpoint`], [`MemRegion`], [`RemoteKey`], and [`probe`].
//!
//! `Ucp` is the only caller of UCX's raw symbols: one method per UCP call, named after it
//! (`ucp_put_nbx` → `Ucp::put_nbx`); every status that is not `UCS_OK` becomes an
//! [`Error::Vendor`] naming the call and saying what `ucs_status_string` says. It is loaded once
//! per process (`OnDemand`, as the vendor runtimes of `backend/` are) from
//! `DEVSHARE_UCX_LIBRARY` (the full path of a `libucp.so.0`, e.g. the one the `libucx-cu12`
//! wheel puts in `site-packages/libucx/lib/`), else by the loader's search for `libucp.so.0`,
//! then `libucp.so`.
//!
//! # Versions
//!
//! The structs below are written out with the layout of the UCX 1.13 headers, and every one has
//! a `field_mask` (`op_attr_mask`) in which only the fields devshare fills are set: UCX reads no
//! field whose bit is clear, which is what lets a struct of 1.13's size work with any later UCX
//! (1.22 has grown `ucp_params_t`, `ucp_mem_map_params_t` and `ucp_request_param_t` at their
//! ends). `ucp_init_version` only *warns* when the library is older than the API version asked
//! for, so [`Context::new`] checks `ucp_get_version` itself and refuses anything before 1.13.
//! `ucs_status_t` is a packed enum: one signed byte, in arguments and return values.
//! `tests/remote_ucx.rs` compares [`c_layout`] with `offsetof` in the real headers.
//!
//! # Threads
//!
//! The context is made with `mt_workers_shared` (its memory registrations may be made and
//! packed from any thread), so [`Context`] and [`MemRegion`] are `Send + Sync`. Workers are made
//! with `UCS_THREAD_MODE_SERIALIZED`: a pool's data path is driven by one thread at a time, so
//! [`Worker`] is `Send` but not `Sync`, and its endpoints and remote keys borrow it (they cannot
//! leave the thread that holds it). `SINGLE` would tie the worker to the thread that made it,
//! which Rust cannot express for a `Send` type; `MULTI` would take a lock in every call for
//! sharing that the types rule out.
//!
//! # Waiting
//!
//! Nothing here spins. A wait (a put, a flush, a close) progresses the worker until
//! `ucp_worker_progress` returns 0, arms it, and sleeps in `poll` on its event fd, for at most
//! the endpoint's time limit. A consumer drives its own worker the same way with
//! [`Worker::progress`], [`Worker::arm`] and [`Worker::efd`], next to its other descriptors.
//! Software transports (`tcp`) need the *target* to progress too: a put or flush towards a
//! consumer that does not progress its worker does not complete.

mod api;
mod ffi;

use crate::error::{Error, Result};
use crate::loader::{c_text, vendor_error, OnDemand, Symbols};
use api::*;
use ffi::*;
pub use ffi::{c_constants, c_layout};
use static_assertions::const_assert_eq;
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CString};
use std::mem::{offset_of, size_of};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The environment variable naming the `libucp.so.0` to load.
pub const LIBRARY_ENV: &str = "DEVSHARE_UCX_LIBRARY";

/// The oldest UCX devshare speaks (the layouts below are 1.13's).
const MIN_VERSION: (u32, u32) = (1, 13);

/// How long a put, flush or close waits by default ([`Endpoint::set_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest single sleep in `poll` while waiting, so that a lost wake-up costs a second and
/// not the whole time limit.
const MAX_SLEEP: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// The safe types

/// `"UCX <version> at <path>"` when a UCX devshare can use loads, else why not
/// ([`Error::BackendUnavailable`]: not found, not UCX, or older than 1.13).
pub fn probe() -> Result<String> {
    let api = api()?;
    Ok(format!("UCX {} at {}", api.version, api.path))
}

/// The loaded UCX's version (`ucp_get_version_string`), loading it if need be.
pub fn version() -> Result<String> {
    Ok(api()?.version.clone())
}

struct ContextInner {
    api: &'static Ucp,
    context: Handle,
    /// The stamp of the process that made it.
    generation: crate::fork::Stamp,
}

/// A UCP context for RMA with wake-ups (`ucp_init_version`), cleaned up when its last clone,
/// worker and registration are gone. Clones share it.
#[derive(Clone)]
pub struct Context(Arc<ContextInner>);

// SAFETY: the context is made with `mt_workers_shared`: UCX makes its calls on it (registrations,
// packing keys, cleanup) safe from any thread.
unsafe impl Send for ContextInner {}
// SAFETY: as for Send.
unsafe impl Sync for ContextInner {}

impl Context {
    /// Load UCX if need be and make a context. `settings` are UCX configuration entries by their
    /// names without the `UCX_` prefix, e.g. `[("TLS", "tcp")]`, applied over the `UCX_*`
    /// environment.
    pub fn new(settings: &[(&str, &str)]) -> Result<Context> {
        let api = api()?;
        let context = api.init(settings)?;
        Ok(Context(Arc::new(ContextInner { api, context, generation: crate::fork::Stamp::now() })))
    }

    /// `"UCX <version> at <path>"`, as [`probe`] says.
    pub fn describe(&self) -> String {
        format!("UCX {} at {}", self.0.api.version, self.0.api.path)
    }

    fn api(&self) -> &'static Ucp {
        self.0.api
    }

    fn handle(&self) -> Handle {
        self.0.context
    }

    /// Whether this process was forked from the one that made the context: then it must not
    /// touch it (UCX objects do not survive `fork`), only forget it.
    fn inherited(&self) -> bool {
        !self.0.generation.is_current()
    }

    fn live(&self) -> Result<()> {
        if self.inherited() {
            return Err(Error::Unsupported(
                "this UCX context was made before fork(): a forked child must make its own".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if self.generation.is_current() {
            // SAFETY: the last owner: every worker and registration held a clone.
            unsafe { self.api.cleanup(self.context) }
        }
    }
}

/// Whether [`Worker::arm`] armed the event fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arm {
    /// Armed: sleep on [`Worker::efd`] until it is readable, then progress.
    Armed,
    /// Events are pending (`UCS_ERR_BUSY`): progress, then arm again.
    Busy,
}

/// A UCP worker (`ucp_worker_create`, `UCS_THREAD_MODE_SERIALIZED`): the progress engine of
/// its endpoints. `Send` (one thread at a time), not `Sync`.
pub struct Worker {
    context: Context,
    worker: Handle,
    efd: RawFd,
}

// SAFETY: the worker is made serialized: any thread may call it, one at a time, which `!Sync`
// and the borrows of its endpoints and keys ensure.
unsafe impl Send for Worker {}

impl Worker {
    /// A worker of `context`, with its event fd.
    pub fn new(context: &Context) -> Result<Worker> {
        context.live()?;
        let api = context.api();
        // SAFETY: the context is live (held by the clone the worker keeps).
        let worker = unsafe { api.worker_create(context.handle()) }?;
        // SAFETY: the worker was just made.
        match unsafe { api.worker_get_efd(worker) } {
            Ok(efd) => Ok(Worker { context: context.clone(), worker, efd }),
            Err(e) => {
                // SAFETY: made above, nothing uses it.
                unsafe { api.worker_destroy(worker) };
                Err(e)
            }
        }
    }

    /// The bytes a peer connects to this worker by ([`Endpoint::connect`]).
    pub fn address(&self) -> Result<Vec<u8>> {
        self.context.live()?;
        // SAFETY: our live worker.
        unsafe { self.context.api().worker_address(self.worker) }
    }

    /// The worker's event fd (`ucp_worker_get_efd`): readable after [`Worker::arm`] returned
    /// [`Arm::Armed`] and something happened. Owned by the worker.
    pub fn efd(&self) -> BorrowedFd<'_> {
        // SAFETY: UCX keeps the fd open until the worker is destroyed, which the borrow outlives
        // not.
        unsafe { BorrowedFd::borrow_raw(self.efd) }
    }

    /// `ucp_worker_arm`: call after [`Worker::progress`] returned 0, before sleeping on the fd.
    pub fn arm(&self) -> Result<Arm> {
        self.context.live()?;
        // SAFETY: our live worker; `!Sync` keeps other threads out.
        unsafe { self.context.api().worker_arm(self.worker) }
    }

    /// `ucp_worker_progress`: the number of events it handled (0 in a forked child).
    pub fn progress(&self) -> u32 {
        if self.context.inherited() {
            return 0;
        }
        // SAFETY: our live worker; `!Sync` keeps other threads out.
        unsafe { self.context.api().worker_progress(self.worker) }
    }

    /// Progress until `done` or `deadline`, sleeping on the event fd between events. Whether
    /// `done` became true.
    fn drive(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> Result<bool> {
        loop {
            if done() {
                return Ok(true);
            }
            if self.progress() > 0 {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(done());
            }
            if self.arm()? == Arm::Armed {
                sleep_on(self.efd(), (deadline - now).min(MAX_SLEEP))?;
            }
        }
    }

    /// Wait for `request` to complete; its final status, or `None` at `deadline` (it is freed
    /// either way).
    fn finish(&self, request: *mut c_void, deadline: Instant) -> Result<Option<Status>> {
        let api = self.context.api();
        let mut status = UCS_INPROGRESS;
        let waited = self.drive(deadline, || {
            // SAFETY: a request of this worker, freed only below.
            status = unsafe { api.request_check_status(request) };
            status != UCS_INPROGRESS
        });
        // SAFETY: as above; not used after this (a running request is freed when it completes).
        unsafe { api.request_free(request) };
        Ok(if waited? { Some(status) } else { None })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if !self.context.inherited() {
            // SAFETY: our worker; its endpoints and keys borrowed it, so they are gone.
            unsafe { self.context.api().worker_destroy(self.worker) }
        }
    }
}

/// Sleep until `fd` is readable or `timeout` passed.
fn sleep_on(fd: BorrowedFd<'_>, timeout: Duration) -> Result<()> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    match poll(&mut fds, Some(&ts)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(Error::Os { call: "poll".into(), errno: e.raw_os_error(), message: e.to_string() }),
    }
}

/// A connection to a remote worker (`ucp_ep_create`, peer error handling), for puts. Closed on
/// drop: flushed, or forced when it failed, within its time limit.
pub struct Endpoint<'w> {
    worker: &'w Worker,
    ep: Handle,
    /// Set by UCX's error handler to the endpoint's error status (0: none).
    failed: Box<AtomicI8>,
    /// `None` while open; once closed, whether UCX finished the close in time.
    closed: Cell<Option<bool>>,
    timeout: Duration,
}

impl<'w> Endpoint<'w> {
    /// Connect `worker` to the worker whose [`Worker::address`] is `remote_address`. Wire-up
    /// finishes as the workers progress.
    ///
    /// # Safety
    /// `remote_address` is a whole address from [`Worker::address`] of a UCX of the same 1.x
    /// family, unchanged: UCX parses it without a length (`ucp_ep_params_t` has none), so a
    /// truncated or forged address is undefined behaviour. Check its length and origin first.
    pub unsafe fn connect(worker: &'w Worker, remote_address: &[u8]) -> Result<Endpoint<'w>> {
        worker.context.live()?;
        if remote_address.is_empty() {
            return Err(Error::InvalidArgument("empty UCX worker address".into()));
        }
        let failed = Box::new(AtomicI8::new(0));
        // SAFETY: our live worker; the address is the caller's promise; the flag is boxed and
        // outlives the endpoint (freed after the close completes, else leaked).
        let ep = unsafe { worker.context.api().ep_create(worker.worker, remote_address, &*failed) }?;
        Ok(Endpoint { worker, ep, failed, closed: Cell::new(None), timeout: DEFAULT_TIMEOUT })
    }

    /// How long [`Endpoint::put`], [`Endpoint::flush`] and the close on drop wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Whether the endpoint was closed after a failure (every call then fails).
    pub fn is_closed(&self) -> bool {
        self.closed.get().is_some()
    }

    fn api(&self) -> &'static Ucp {
        self.worker.context.api()
    }

    /// `Ok` when the endpoint may be used for `call`.
    fn usable(&self, call: &str) -> Result<()> {
        self.worker.context.live()?;
        if self.closed.get().is_some() {
            return Err(Error::Closed(format!("{call}: the UCX endpoint was closed after an earlier failure")));
        }
        match self.failed.load(Ordering::Acquire) {
            UCS_OK => Ok(()),
            status => Err(self.api().error(&format!("{call} (the endpoint failed earlier)"), status)),
        }
    }

    /// Unpack the remote key a peer packed ([`MemRegion::pack_rkey`]) for its region of
    /// `remote_len` bytes at `remote_base`; puts through it are checked against that range.
    ///
    /// # Safety
    /// `packed` is a whole key from [`MemRegion::pack_rkey`] of a UCX of the same 1.x family,
    /// unchanged: UCX parses it without a length. Check its length and origin first.
    pub unsafe fn unpack_rkey(&self, packed: &[u8], remote_base: u64, remote_len: usize) -> Result<RemoteKey<'_>> {
        self.usable("ucp_ep_rkey_unpack")?;
        if packed.is_empty() {
            return Err(Error::InvalidArgument("empty UCX remote key".into()));
        }
        if remote_base.checked_add(remote_len as u64).is_none() {
            return Err(Error::InvalidArgument(format!(
                "remote region of {remote_len} bytes at {remote_base:#x} overflows"
            )));
        }
        // SAFETY: our live endpoint; the key is the caller's promise.
        let rkey = unsafe { self.api().ep_rkey_unpack(self.ep, packed) }?;
        Ok(RemoteKey { ep: self, rkey, base: remote_base, len: remote_len })
    }

    /// Put `len` bytes at `local` to `remote_addr` of the peer's region of `rkey`
    /// (`ucp_put_nbx`), and wait until the source may be reused (local completion; use
    /// [`Endpoint::flush`] for remote completion). On a timeout the endpoint is closed at once
    /// (forced), which cancels the put, and the call fails with [`Error::Timeout`].
    ///
    /// # Safety
    /// `local..local + len` is memory of this process (host, or device memory this UCX
    /// supports) that stays readable until this call returns, and, when it returns an error,
    /// until the endpoint is dropped.
    pub unsafe fn put(&self, local: *const u8, len: usize, remote_addr: u64, rkey: &RemoteKey<'_>) -> Result<()> {
        self.usable("ucp_put_nbx")?;
        if !std::ptr::eq(rkey.ep, self) {
            return Err(Error::InvalidArgument("the remote key was unpacked on another endpoint".into()));
        }
        rkey.check(remote_addr, len)?;
        if len == 0 {
            return Ok(());
        }
        if local.is_null() {
            return Err(Error::NullArgument("local"));
        }
        // SAFETY: our live endpoint and its live key; the source is the caller's promise, kept
        // until the request completed or the endpoint was force-closed (`complete`).
        let started = unsafe { self.api().put_nbx(self.ep, local, len, remote_addr, rkey.rkey) };
        self.complete("ucp_put_nbx", started)
    }

    /// Wait until every put on this endpoint completed at the target (`ucp_ep_flush_nbx`): after
    /// this, the bytes are in the peer's memory. Fails as [`Endpoint::put`] does.
    pub fn flush(&self) -> Result<()> {
        self.usable("ucp_ep_flush_nbx")?;
        // SAFETY: our live endpoint.
        let started = unsafe { self.api().ep_flush_nbx(self.ep) };
        self.complete("ucp_ep_flush_nbx", started)
    }

    /// Wait for what `call` started; on a failure or timeout, close the endpoint (forced).
    fn complete(&self, call: &str, started: Result<Started>) -> Result<()> {
        let request = match started {
            Ok(Started::Done) => return Ok(()),
            Ok(Started::Pending(r)) => r,
            Err(e) => {
                self.force_close();
                return Err(e);
            }
        };
        match self.worker.finish(request, Instant::now() + self.timeout) {
            Ok(Some(UCS_OK)) => Ok(()),
            Ok(Some(status)) => {
                self.force_close();
                Err(self.api().error(call, status))
            }
            Ok(None) => {
                self.force_close();
                Err(Error::Timeout(format!(
                    "{call} did not complete within {:?} (does the peer progress its worker?); the endpoint was closed",
                    self.timeout
                )))
            }
            Err(e) => {
                self.force_close();
                Err(e)
            }
        }
    }

    /// Close now, cancelling what is outstanding.
    fn force_close(&self) {
        self.close(true);
    }

    /// `ucp_ep_close_nbx` (flushing first, or forced) unless closed already, and wait for it
    /// within the time limit.
    fn close(&self, force: bool) {
        if self.closed.get().is_some() {
            return;
        }
        self.closed.set(Some(false));
        // SAFETY: our live endpoint, marked closed above so nothing uses it again.
        let finished = match unsafe { self.api().ep_close_nbx(self.ep, force) } {
            Ok(Started::Done) => true,
            Ok(Started::Pending(r)) => matches!(self.worker.finish(r, Instant::now() + self.timeout), Ok(Some(_))),
            Err(_) => false,
        };
        self.closed.set(Some(finished));
    }
}

impl Drop for Endpoint<'_> {
    fn drop(&mut self) {
        if self.worker.context.inherited() {
            return;
        }
        self.close(self.failed.load(Ordering::Acquire) != UCS_OK);
        if self.closed.get() != Some(true) {
            // UCX may still call the error handler with the flag: leave it to UCX.
            let flag = std::mem::replace(&mut self.failed, Box::new(AtomicI8::new(0)));
            Box::leak(flag);
        }
    }
}

/// A peer's region as this endpoint may put into it (`ucp_ep_rkey_unpack`; `ucp_rkey_destroy`
/// on drop).
pub struct RemoteKey<'e> {
    ep: &'e Endpoint<'e>,
    rkey: Handle,
    base: u64,
    len: usize,
}

impl RemoteKey<'_> {
    /// The region's start in the peer's address space.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `Ok` when `len` bytes at `addr` lie in the region.
    fn check(&self, addr: u64, len: usize) -> Result<()> {
        let inside =
            addr >= self.base && (addr - self.base).checked_add(len as u64).is_some_and(|end| end <= self.len as u64);
        if inside {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "a put of {len} bytes at {addr:#x} leaves the remote region of {} bytes at {:#x}",
                self.len, self.base
            )))
        }
    }
}

impl Drop for RemoteKey<'_> {
    fn drop(&mut self) {
        if !self.ep.worker.context.inherited() {
            // SAFETY: our key; puts through it waited for completion or were cancelled by a
            // forced close.
            unsafe { self.ep.api().rkey_destroy(self.rkey) }
        }
    }
}

/// A buffer of this process registered with UCX (`ucp_mem_map`), so that peers holding its
/// packed key can put into it; unmapped on drop.
pub struct MemRegion {
    context: Context,
    memh: Handle,
    address: u64,
    len: usize,
}

// SAFETY: registrations belong to the context, which is made thread-safe (`mt_workers_shared`).
unsafe impl Send for MemRegion {}
// SAFETY: as for Send; the only call through `&self` is packing a key.
unsafe impl Sync for MemRegion {}

impl MemRegion {
    /// Register the `len` bytes at `address`.
    ///
    /// # Safety
    /// The memory stays allocated until the region is dropped. Peers holding its key write it
    /// whenever a worker of `context` progresses: no Rust reference to those bytes may be held
    /// across progress, and what arrived is known only from the control channel.
    pub unsafe fn map(context: &Context, address: *mut u8, len: usize) -> Result<MemRegion> {
        context.live()?;
        if address.is_null() {
            return Err(Error::NullArgument("address"));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("an empty UCX memory region".into()));
        }
        // SAFETY: live context; the memory is the caller's promise.
        let memh = unsafe { context.api().mem_map(context.handle(), address, len) }?;
        Ok(MemRegion { context: context.clone(), memh, address: address as u64, len })
    }

    /// The key a peer unpacks to put into this region ([`Endpoint::unpack_rkey`]).
    pub fn pack_rkey(&self) -> Result<Vec<u8>> {
        self.context.live()?;
        // SAFETY: our live context and registration.
        unsafe { self.context.api().rkey_pack(self.context.handle(), self.memh) }
    }

    /// Where the region starts, as peers name it.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: [`MemRegion::map`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        if !self.context.inherited() {
            // SAFETY: our registration in our live context; nothing to do about a failure.
            let _ = unsafe { self.context.api().mem_unmap(self.context.handle(), self.memh) };
        }
    }
}
