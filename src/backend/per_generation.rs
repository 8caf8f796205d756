//! Process-wide caches of the segmented (VMM) backends that a forked child gets afresh.
//!
//! The caches of exported and imported segment pages are held across vendor calls (an export,
//! an import, a `pidfd_getfd`), so that two threads never export or import the same page twice.
//! A `fork` from another thread during such a call would give the child the lock held by a
//! thread it does not have: its first segmented export or import would wait forever. And the
//! entries are the parent's (its handles, its fds), which the child's runtime does not know.
//!
//! So each cache belongs to one fork generation (its [`Stamp`]; a new generation starts in
//! every forked child, from a `pthread_atfork` child handler): the first use in a new
//! generation makes a new, empty cache with its own lock, and the parent's cache is forgotten
//! (leaked, never unlocked, read or dropped in the child; nothing in it is released or
//! unexported). Switching caches is one atomic compare-and-swap, with no lock that a fork could
//! leave held.

use crate::fork::Stamp;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One generation's cache.
struct Slot<T> {
    generation: Stamp,
    cache: Mutex<T>,
}

/// A `Mutex<T>` per process generation (see the module documentation).
pub(crate) struct PerGeneration<T> {
    /// The current generation's slot, or null before the first use. Every non-null pointer
    /// stored here comes from `Box::into_raw` and is never freed.
    current: AtomicPtr<Slot<T>>,
    /// Send and Sync exactly when `Mutex<T>` is (an `AtomicPtr` alone would always be).
    _cache: PhantomData<Mutex<T>>,
}

impl<T: Default + 'static> PerGeneration<T> {
    pub(crate) const fn new() -> Self {
        PerGeneration { current: AtomicPtr::new(std::ptr::null_mut()), _cache: PhantomData }
    }

    /// This generation's cache, made (empty) on its first use.
    pub(crate) fn get(&self) -> &'static Mutex<T> {
        loop {
            let cur = self.current.load(Ordering::Acquire);
            // SAFETY: a non-null pointer here came from `Box::into_raw` and is never freed (see
            // `current`), so it is valid for the rest of the program.
            if let Some(slot) = unsafe { cur.as_ref() } {
                if slot.generation.is_current() {
                    return &slot.cache;
                }
            }
            let new = Box::into_raw(Box::new(Slot { generation: Stamp::now(), cache: Mutex::new(T::default()) }));
            match self.current.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                // SAFETY: `new` is now the stored pointer, never freed (see `current`). The
                // previous slot (another generation's) is leaked on purpose.
                Ok(_) => return unsafe { &(*new).cache },
                Err(_) => {
                    // SAFETY: `new` came from `Box::into_raw` above and was never shared (the
                    // swap failed): this is its only owner. Another thread installed a slot;
                    // look again.
                    drop(unsafe { Box::from_raw(new) });
                }
            }
        }
    }

    /// This generation's cache, locked. Every update of the caches is a single
    /// insert/remove/increment, so a poisoned lock is still consistent.
    pub(crate) fn lock(&self) -> MutexGuard<'static, T> {
        self.get().lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::{Duration, Instant};

    /// Wait for `pid` at most `limit`; its exit status, or None when it had to be killed.
    fn wait_for(pid: libc::pid_t, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            let mut st = 0;
            // SAFETY: pid is our child; st a valid out-parameter.
            let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
            assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
            if r == pid {
                return libc::WIFEXITED(st).then(|| libc::WEXITSTATUS(st));
            }
            if start.elapsed() > limit {
                // SAFETY: pid is our child, not yet waited for.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut st, 0);
                }
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A fork while another thread holds the cache (as during a slow vendor call): the child
    /// gets a fresh, empty, unlocked cache; the parent keeps its own, with its entries.
    #[test]
    fn a_forked_child_gets_a_fresh_unlocked_cache() {
        static CACHE: PerGeneration<HashMap<u64, u64>> = PerGeneration::new();
        CACHE.lock().insert(1, 10);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let g = CACHE.lock();
            held_tx.send(()).unwrap();
            // Holds the lock until the parent has forked.
            let _ = done_rx.recv();
            drop(g);
        });
        held_rx.recv().unwrap();
        // SAFETY: the child only takes the cache's lock, checks it and leaves with _exit (no
        // destructors, no atexit handlers); the allocation it may make is fork-safe in glibc.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let mut c = CACHE.lock();
            let fresh = c.is_empty();
            c.insert(2, 20);
            let code = if fresh && c.len() == 1 { 0 } else { 1 };
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(code) };
        }
        let status = wait_for(pid, Duration::from_secs(10));
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(status, Some(0), "the child deadlocked (None) or saw the parent's entries");
        let c = CACHE.lock();
        assert_eq!(c.get(&1), Some(&10));
        assert_eq!(c.len(), 1);
    }
}
