//! `fork`: the one home of the fork rules.
//!
//! A child process inherits the parent's mappings, registries and sockets but holds none of the
//! counts, references or connections they stand for. So:
//!
//! - **Generations.** [`generation`] is 0 in a process that was not forked after devshare was
//!   first used and one more in each child after each `fork` (a `pthread_atfork` child handler,
//!   installed by the first call). Everything that counts itself somewhere (host mappings,
//!   ref-counters, imports, runtime caches, channels) remembers the generation it was made in
//!   (a [`Stamp`]) and, used or dropped in another generation, gives nothing back and refuses
//!   to work.
//! - **Hooks.** A module that holds a lock another thread may hold during `fork` (the import
//!   registry) implements [`ForkHook`] and [`register`]s it: `prepare` runs in the forking
//!   thread before `fork` (take the lock), `parent` after it in the parent, `child` after it in
//!   the child (the generation has already changed). This module calls no one above it: the
//!   others register with it.

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once};

/// What a module does around `fork` (see the module documentation).
pub(crate) trait ForkHook: Sync {
    /// In the forking thread, before `fork`.
    fn prepare(&self);
    /// In the parent, after `fork`.
    fn parent(&self);
    /// In the child, after `fork` (the generation has changed).
    fn child(&self);
}

static GENERATION: AtomicU64 = AtomicU64::new(0);
/// This process's pid, once asked (0: not yet, or a forked child that has not asked).
static PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// Most hooks (the crate registers one); a fixed table, so that the library holds no heap
/// memory it never frees.
const MAX_HOOKS: usize = 4;
type Hooks = [Option<&'static dyn ForkHook>; MAX_HOOKS];
static HOOKS: Mutex<Hooks> = Mutex::new([None; MAX_HOOKS]);

thread_local! {
    /// The hook list, held by the forking thread from `prepare` to `parent` / `child`, so that
    /// no hook registers half-way through a fork.
    static HELD: std::cell::RefCell<Option<MutexGuard<'static, Hooks>>> =
        const { std::cell::RefCell::new(None) };
}

/// The fork generation of this process (see the module documentation).
fn generation() -> u64 {
    static HANDLERS: Once = Once::new();
    HANDLERS.call_once(|| {
        // SAFETY: the three handlers are plain functions that live as long as the library (and
        // glibc unregisters them when a dlopen'ed copy is unloaded: pthread_atfork passes the
        // object's __dso_handle).
        let rc = unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
        // ENOMEM is the only documented failure; without handlers a forked child could give back
        // its parent's counts, so refuse to go on rather than risk it.
        assert_eq!(rc, 0, "pthread_atfork failed");
    });
    GENERATION.load(Ordering::SeqCst)
}

/// The fork generation something was made in (see the module documentation): kept by what
/// counts itself somewhere, asked before that is used or given back.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stamp(u64);

impl Stamp {
    /// This process's generation, now.
    pub(crate) fn now() -> Stamp {
        Stamp(generation())
    }

    /// Whether this process is the one the stamp was taken in (not a child forked since).
    pub(crate) fn is_current(&self) -> bool {
        self.0 == generation()
    }

    /// `Ok` in the process the stamp was taken in; in a forked child, the refusal of an
    /// inherited `what` (`"channel"`, `"connection"`): `Unsupported`, "this `what` was inherited
    /// through fork: only the process that opened it may use it".
    pub(crate) fn check(&self, what: &str) -> Result<()> {
        if self.is_current() {
            return Ok(());
        }
        Err(Error::Unsupported(format!(
            "this {what} was inherited through fork: only the process that opened it may use it"
        )))
    }
}

/// This process's pid (`getpid()`), asked once per process: the fork handlers forget it in a
/// child (it is asked on the hot path of every share).
pub(crate) fn pid() -> i32 {
    generation(); // the handlers are installed before a pid is kept
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id() as i32;
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}

/// Run `hook` around every later `fork` of this process.
pub(crate) fn register(hook: &'static dyn ForkHook) {
    generation(); // the handlers are installed
    let mut hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
    let free = hooks.iter_mut().find(|h| h.is_none());
    debug_assert!(free.is_some(), "more than {MAX_HOOKS} fork hooks");
    if let Some(slot) = free {
        *slot = Some(hook);
    }
}

extern "C" fn fork_prepare() {
    let hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
    for h in hooks.iter().flatten() {
        h.prepare();
    }
    HELD.with(|held| *held.borrow_mut() = Some(hooks));
}

extern "C" fn fork_parent() {
    if let Some(hooks) = HELD.with(|held| held.borrow_mut().take()) {
        for h in hooks.iter().rev().flatten() {
            h.parent();
        }
    }
}

extern "C" fn fork_child() {
    PID.store(0, Ordering::SeqCst);
    GENERATION.fetch_add(1, Ordering::SeqCst);
    if let Some(hooks) = HELD.with(|held| held.borrow_mut().take()) {
        for h in hooks.iter().rev().flatten() {
            h.child();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stamp is current in the process that took it and not in a child forked since, where
    /// `check` refuses with the channel's message; a stamp taken in the child is current there.
    #[test]
    fn a_stamp_is_current_only_in_the_process_that_took_it() {
        let parent = Stamp::now();
        assert!(parent.is_current());
        assert!(parent.check("channel").is_ok());
        // SAFETY: the child only reads the generation, formats one message and leaves with
        // _exit (no destructors, no atexit handlers); the allocation it makes is fork-safe in
        // glibc.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let refused = matches!(
                parent.check("connection"),
                Err(Error::Unsupported(m))
                    if m == "this connection was inherited through fork: only the process that opened it may use it"
            );
            let ok = !parent.is_current() && refused && Stamp::now().is_current();
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut st = 0;
        // SAFETY: pid is our child; st a valid out-parameter.
        assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
        assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "child status {st:#x}");
        assert!(parent.is_current(), "the parent's generation is unchanged");
    }
}
