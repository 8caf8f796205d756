//! The per-process import registry: the allocations mapped in this process (by allocation, not
//! by tensor), the references held (tickets), the ref-counters watched, their states and the
//! lock around them, and the registry's part in `fork`. See the parent module for the rules.

use crate::backend::Mapping;
use crate::error::Result;
use crate::fork::Stamp;
use crate::handle::{DEVSHARE_KEY_CAPACITY, DEVSHARE_REF_NAME_CAPACITY};
use crate::refcounter::Watched;
use rustc_hash::FxHashMap;
use std::cell::{Cell, RefCell};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};

/// Registry key of an allocation. Fixed-size (no heap allocation on the cache-hit path); the
/// bytes beyond `key_len` are zero, as validation guarantees for the handle.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(super) struct AllocKey {
    pub(super) backend: u16,
    pub(super) read_only: bool,
    pub(super) device: i32,
    pub(super) key_len: u32,
    pub(super) key: [u8; DEVSHARE_KEY_CAPACITY],
    /// Segmented allocations: segment size, kind, producer pid and the whole table (the key
    /// area holds at most part of it). `None` for single allocations (no heap on their path).
    pub(super) segments: Option<Arc<SegmentsKey>>,
    /// 0: the allocation is one mapping for the whole process. Else the channel connection
    /// (owner id) it is mapped for alone: an allocation known by its producer's fd numbers,
    /// which name other memory once the producer closed them, and only that connection learns
    /// when (its producer's `RETIRE` comes before any later share on it).
    pub(super) scope: u64,
}

/// What identifies a segmented allocation: segment size, table kind, producer pid, table.
pub(super) type SegmentsKey = (u64, u16, i32, Vec<u8>);

/// A handle's reference: ref-counter name and slot (fixed-size, like [`AllocKey`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(super) struct Ticket {
    pub(super) name_len: u32,
    pub(super) name: [u8; DEVSHARE_REF_NAME_CAPACITY],
    pub(super) slot: u64,
}

impl Ticket {
    pub(super) fn name(&self) -> &[u8] {
        &self.name[..self.name_len as usize]
    }

    pub(super) fn ref_counter(&self) -> RefName {
        RefName { len: self.name_len, name: self.name }
    }
}

/// A ref-counter object's name (fixed-size, like [`AllocKey`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(super) struct RefName {
    pub(super) len: u32,
    pub(super) name: [u8; DEVSHARE_REF_NAME_CAPACITY],
}

/// A ref-counter mapping shared by the imports that hold references in it (`None`: the object
/// is gone, the producer stopped tracking).
pub(super) struct WatchEntry {
    pub(super) rc: Option<Arc<Watched>>,
    pub(super) users: usize,
}

/// An allocation in the registry.
pub(super) enum Slot {
    /// Its first import is mapping it (a vendor call, made without the registry lock): imports of
    /// the same allocation wait for the outcome.
    Opening,
    /// Mapped, for `users` imports. `kept`: the channel connection (its id) that may keep it
    /// mapped once no import uses it ([`Slot::Idle`]), until it retires it.
    Open { mapping: Arc<dyn Mapping>, users: usize, kept: Option<u64> },
    /// Mapped for no import: kept by connection `owner` for its producer's next lease of it, until
    /// the producer retires it, the connection closes, or the bounds of what may be kept evict
    /// it (least recently used first).
    /// `since`: when it became idle (the registry's `idle_seq` then), which tells its entry in
    /// the registry's `idle` queue from older entries of the same allocation.
    Idle { mapping: Arc<dyn Mapping>, owner: u64, since: u64 },
    /// Its last import is unmapping it (synchronisation and vendor close, without the lock):
    /// imports of the same allocation wait until it is gone, then map it afresh.
    Closing,
}

/// The imports in this process holding one reference, and whether the handle they came from
/// carried an in-flight reference (every later import of it must say the same).
pub(super) struct TicketUse {
    /// Imports holding the reference, including ones still mapping their allocation.
    pub(super) users: usize,
    pub(super) inflight: bool,
    /// The first import of the reference in this process is still under way (it checked the
    /// producer's record and claimed an in-flight reference, and is mapping): other imports of
    /// the reference wait until it succeeded (then they share it) or failed (then they check
    /// afresh).
    pub(super) claiming: bool,
}

#[derive(Default)]
pub(super) struct Registry {
    pub(super) allocs: FxHashMap<AllocKey, Slot>,
    pub(super) tickets: FxHashMap<Ticket, TicketUse>,
    pub(super) watched: FxHashMap<RefName, WatchEntry>,
    /// The fork generation the entries belong to (`None` before the first use).
    pub(super) generation: Option<Stamp>,
    /// The idle allocations in the order they became idle (oldest first), each with the
    /// `since` it became idle at: an entry whose slot is no longer idle, or became idle again
    /// later (another `since`), is stale and skipped. How many and how large the idle ones are,
    /// and the count `since` is taken from.
    pub(super) idle: std::collections::VecDeque<(AllocKey, u64)>,
    pub(super) idle_seq: u64,
    pub(super) idle_count: usize,
    pub(super) idle_bytes: u64,
    /// The allocations channel connections pin windows of, and how many windows each
    /// (`kept::pin`).
    pub(super) pinned: FxHashMap<AllocKey, u32>,
}

impl Registry {
    /// The ref-counter mapping for `t`, opened on first use; one more user.
    pub(super) fn watch(&mut self, t: &Ticket) -> Result<Option<Arc<Watched>>> {
        let name = t.ref_counter();
        if let Some(e) = self.watched.get_mut(&name) {
            e.users += 1;
            return Ok(e.rc.clone());
        }
        let rc = Watched::open(t.name())?.map(Arc::new);
        self.watched.insert(name, WatchEntry { rc: rc.clone(), users: 1 });
        Ok(rc)
    }

    /// One user fewer; the mapping (returned, to be dropped outside the lock) goes with the last.
    pub(super) fn unwatch(&mut self, t: &Ticket) -> Option<Arc<Watched>> {
        let name = t.ref_counter();
        let e = self.watched.get_mut(&name)?;
        e.users -= 1;
        if e.users > 0 {
            return None;
        }
        let rc = self.watched.remove(&name).and_then(|e| e.rc);
        if self.watched.is_empty() {
            self.watched = FxHashMap::default();
        }
        rc
    }
}

pub(super) static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);

/// From the registry's first use on, its lock is held across every fork (see RegistryFork), and
/// adoptions ask it which references imports hold (see ImportHolders). The hooks are registered
/// before the registry is first touched, never inside its initialiser, so a fork can never see
/// the registry half made.
static HOOK: std::sync::Once = std::sync::Once::new();

/// Signalled whenever an allocation stops opening or closing, or a reference stops being
/// claimed: the imports waiting for one of those look again.
pub(super) static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// Whether this thread holds the registry lock (then `fork` must not wait for it).
    static HOLDS_REGISTRY: Cell<bool> = const { Cell::new(false) };
    /// The registry lock, taken by the atfork prepare handler of the thread that forks.
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, Registry>>> = const { RefCell::new(None) };
}

/// The locked registry (of this process's generation). It can be let go for a while (around a
/// vendor call, or to wait for another thread's open or close) and taken again.
pub(super) struct RegistryGuard(Option<MutexGuard<'static, Registry>>);

impl std::ops::Deref for RegistryGuard {
    type Target = Registry;
    fn deref(&self) -> &Registry {
        self.0.as_ref().expect("the registry is locked")
    }
}

impl std::ops::DerefMut for RegistryGuard {
    fn deref_mut(&mut self) -> &mut Registry {
        self.0.as_mut().expect("the registry is locked")
    }
}

impl Drop for RegistryGuard {
    fn drop(&mut self) {
        if self.0.take().is_some() {
            HOLDS_REGISTRY.with(|h| h.set(false));
        }
    }
}

impl RegistryGuard {
    /// Let the lock go until another thread's open, close or claim ends, then take it again.
    pub(super) fn wait(&mut self) {
        let guard = self.0.take().expect("the registry is locked");
        HOLDS_REGISTRY.with(|h| h.set(false));
        let guard = CHANGED.wait(guard).unwrap_or_else(|p| p.into_inner());
        HOLDS_REGISTRY.with(|h| h.set(true));
        self.0 = Some(guard);
    }

    /// Let the lock go (for a vendor call).
    pub(super) fn unlock(&mut self) {
        if self.0.take().is_some() {
            HOLDS_REGISTRY.with(|h| h.set(false));
        }
    }

    /// Take the lock again after [`RegistryGuard::unlock`].
    pub(super) fn relock(&mut self) {
        if self.0.is_none() {
            *self = registry();
        }
    }
}

pub(super) fn registry() -> RegistryGuard {
    HOOK.call_once(|| {
        crate::fork::register(&RegistryFork);
        crate::refcounter::register_holders(&ImportHolders);
    });
    // A panic while holding the lock cannot leave the maps half-updated (every update is a single
    // insert/remove/increment), so a poisoned lock is still consistent.
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    HOLDS_REGISTRY.with(|h| h.set(true));
    if !reg.generation.is_some_and(|g| g.is_current()) {
        // A forked child: the entries are the parent's imports (the first use has none). Forget
        // them without releasing anything (no unmap, no vendor close, no decrement, no unlink):
        // leaked, on purpose.
        std::mem::forget(std::mem::take(&mut reg.allocs));
        std::mem::forget(std::mem::take(&mut reg.tickets));
        std::mem::forget(std::mem::take(&mut reg.watched));
        reg.idle = Default::default();
        reg.idle_seq = 0;
        reg.idle_count = 0;
        reg.idle_bytes = 0;
        // The parent's pinned windows are not this process's (their counts changed only under
        // this lock).
        reg.pinned = Default::default();
        super::kept::PINNED_COUNT.store(0, std::sync::atomic::Ordering::SeqCst);
        super::kept::PINNED_BYTES.store(0, std::sync::atomic::Ordering::SeqCst);
        reg.generation = Some(Stamp::now());
    }
    RegistryGuard(Some(reg))
}

/// The references imports in this process hold, for an adoption that must not take one of them
/// over as well ([`crate::refcounter::Holders`]). Before the registry's first use nothing is
/// registered, and no import holds anything.
struct ImportHolders;

impl crate::refcounter::Holders for ImportHolders {
    fn holds(&self, name: &[u8], slot: u64) -> bool {
        if name.is_empty() || name.len() > DEVSHARE_REF_NAME_CAPACITY {
            return false;
        }
        let mut t = Ticket { name_len: name.len() as u32, name: [0; DEVSHARE_REF_NAME_CAPACITY], slot };
        t.name[..name.len()].copy_from_slice(name);
        registry().tickets.contains_key(&t)
    }
}

/// The registry's part in `fork` ([`crate::fork::ForkHook`]): hold its lock across the fork
/// (unless the forking thread holds it already: then it releases it itself, in both
/// processes), so that no other thread holds it in the child; the child's next use forgets the
/// parent's entries (see [`registry`]).
pub(super) struct RegistryFork;

impl crate::fork::ForkHook for RegistryFork {
    fn prepare(&self) {
        if HOLDS_REGISTRY.with(Cell::get) {
            return;
        }
        let guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        FORK_GUARD.with(|g| *g.borrow_mut() = Some(guard));
    }

    fn parent(&self) {
        FORK_GUARD.with(|g| drop(g.borrow_mut().take()));
    }

    fn child(&self) {
        FORK_GUARD.with(|g| drop(g.borrow_mut().take()));
    }
}
