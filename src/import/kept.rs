//! Allocations kept mapped for a channel connection whose producer registered them: an
//! allocation no import uses stays mapped (the registry's idle state) until the producer retires
//! it, the connection ends, or the bounds of what a process keeps evict it, least recently used
//! first. The channel marks imports to keep ([`Import::keep_for`]) and retires them
//! ([`retire`], [`retire_all`]); the release path of `mod.rs` turns a kept allocation idle
//! instead of unmapping it.

use super::registry::{registry, AllocKey, Registry, Slot};
use super::{CloseDone, Import};
use crate::backend::Mapping;
use std::sync::Arc;

/// How many idle allocations, and how many bytes of them, this process keeps mapped at most
/// (`DEVSHARE_KEEP_MAPPINGS`, `DEVSHARE_KEEP_MAPPINGS_BYTES`, read once; a count of 0 keeps
/// none). Defaults: 4096 allocations, 64 GiB.
pub(crate) fn keep_limits() -> (usize, u64) {
    static LIMITS: std::sync::OnceLock<(usize, u64)> = std::sync::OnceLock::new();
    *LIMITS.get_or_init(|| {
        let read = |name: &str, default: u64| {
            std::env::var(name).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(default)
        };
        let count = read("DEVSHARE_KEEP_MAPPINGS", 4096);
        (usize::try_from(count).unwrap_or(usize::MAX), read("DEVSHARE_KEEP_MAPPINGS_BYTES", 64 << 30))
    })
}

/// Windows of registered exports that channel connections keep open for their later leases
/// (pinned), and the bytes of the allocations they keep mapped (each allocation once, however
/// many windows of it are pinned: a window keeps its whole allocation mapped, so that is what
/// counts): they count against the same bounds as idle allocations, so that what a process
/// keeps mapped for its producers, idle or pinned, stays within them.
pub(super) static PINNED_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
pub(super) static PINNED_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A window counted as pinned ([`pin`]) until this is dropped.
pub(crate) struct PinnedWindow {
    key: AllocKey,
    bytes: u64,
    /// The process it was counted in (a forked child's copy counts nothing there).
    generation: crate::fork::Stamp,
}

/// Count a window of `imp`'s allocation as pinned, when the bounds have room for it beside
/// the other pinned ones (idle allocations past the bounds then are unmapped, least recently
/// used first); `None`: no room, nothing counted. The allocation's whole mapping counts once
/// for all the windows of it that are pinned.
pub(crate) fn pin(imp: &Import) -> Option<PinnedWindow> {
    use std::sync::atomic::Ordering::SeqCst;
    let (count, limit) = keep_limits();
    let bytes = imp.mapping().map_or(imp.handle().alloc_size, |m| m.size());
    let evicted = {
        let mut reg = registry();
        // Changed only under the registry's lock (read without it by `pinned`).
        let windows = reg.pinned.get(&imp.key).copied().unwrap_or(0);
        let added = if windows == 0 { bytes } else { 0 };
        if PINNED_COUNT.load(SeqCst) + 1 > count || PINNED_BYTES.load(SeqCst).saturating_add(added) > limit {
            return None;
        }
        reg.pinned.insert(imp.key.clone(), windows + 1);
        PINNED_COUNT.fetch_add(1, SeqCst);
        PINNED_BYTES.fetch_add(added, SeqCst);
        evict_over_limits(&mut reg)
    };
    close_evicted(evicted);
    Some(PinnedWindow { key: imp.key.clone(), bytes, generation: crate::fork::Stamp::now() })
}

impl Drop for PinnedWindow {
    /// No longer pinned; the allocation's bytes stop counting with its last pinned window.
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.generation.is_current() {
            return; // a forked child's copy of its parent's: counted there, not here
        }
        let mut reg = registry();
        match reg.pinned.get_mut(&self.key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                reg.pinned.remove(&self.key);
                PINNED_BYTES.fetch_sub(self.bytes, SeqCst);
            }
            None => return, // a forked child's copy of its parent's: counted there, not here
        }
        PINNED_COUNT.fetch_sub(1, SeqCst);
    }
}

/// How many windows of registered exports this process keeps pinned for channel connections
/// (each a view of an allocation it maps), and the bytes of those allocations (each once).
pub fn pinned() -> (usize, u64) {
    use std::sync::atomic::Ordering::SeqCst;
    (PINNED_COUNT.load(SeqCst), PINNED_BYTES.load(SeqCst))
}

/// The open allocation `key`, whose last import just went, becomes idle, kept for connection
/// `owner`; returns what that pushed past the limits (see [`evict_over_limits`]). Nothing
/// changes unless its slot is open.
pub(super) fn make_idle(reg: &mut Registry, key: &AllocKey, owner: u64) -> Vec<(AllocKey, Arc<dyn Mapping>)> {
    let since = reg.idle_seq + 1;
    let Some(slot) = reg.allocs.get_mut(key) else { return Vec::new() };
    let Slot::Open { mapping, .. } = std::mem::replace(slot, Slot::Closing) else {
        unreachable!("only an open allocation's last import makes it idle")
    };
    let bytes = mapping.size();
    *slot = Slot::Idle { mapping, owner, since };
    reg.idle_seq = since;
    reg.idle_count += 1;
    reg.idle_bytes += bytes;
    reg.idle.push_back((key.clone(), since));
    evict_over_limits(reg)
}

/// Idle allocation `key` used again by an import: open for that one import (still kept for its
/// connection), its mapping returned; `None` when it is not idle. Its entry in the idle queue
/// is stale from now on.
pub(super) fn reuse_idle(reg: &mut Registry, key: &AllocKey) -> Option<Arc<dyn Mapping>> {
    let slot = reg.allocs.get_mut(key)?;
    let Slot::Idle { mapping, owner, .. } = slot else { return None };
    let mapping = mapping.clone();
    *slot = Slot::Open { mapping: mapping.clone(), users: 1, kept: Some(*owner) };
    reg.idle_count -= 1;
    reg.idle_bytes -= mapping.size();
    Some(mapping)
}

/// Idle allocations past the limits, oldest first, taken out of the registry (their slots say
/// closing): the caller closes them with [`close_evicted`] once the lock is let go.
pub(super) fn evict_over_limits(reg: &mut Registry) -> Vec<(AllocKey, Arc<dyn Mapping>)> {
    let (count, bytes) = keep_limits();
    let (pinned, pinned_bytes) = pinned();
    evict_over(reg, count.saturating_sub(pinned), bytes.saturating_sub(pinned_bytes))
}

/// [`evict_over_limits`] for the limits `count` and `bytes`.
fn evict_over(reg: &mut Registry, count: usize, bytes: u64) -> Vec<(AllocKey, Arc<dyn Mapping>)> {
    let mut out = Vec::new();
    while reg.idle_count > count || reg.idle_bytes > bytes {
        let Some((key, since)) = reg.idle.pop_front() else { break };
        if let Some(m) = take_idle(reg, &key, Some(since)) {
            out.push((key, m));
        }
    }
    if reg.idle.len() > 2 * reg.idle_count + 64 {
        // Stale entries (allocations in use again, idle again since, or gone): drop them, so
        // that the queue holds at most one entry per idle allocation afterwards and its length
        // stays within a constant factor of the idle count (an allocation leased and released
        // again and again adds one entry per release).
        let allocs = &reg.allocs;
        let mut idle = std::mem::take(&mut reg.idle);
        idle.retain(|(k, since)| is_idle_since(allocs.get(k), *since));
        reg.idle = idle;
    }
    out
}

/// Whether `slot` is idle since `since` (the entry of the idle queue that says so is current).
fn is_idle_since(slot: Option<&Slot>, since: u64) -> bool {
    matches!(slot, Some(Slot::Idle { since: s, .. }) if *s == since)
}

/// The mapping of idle allocation `key`, its slot now closing; `None` when it is not idle, or
/// (`since` given) not idle since then.
fn take_idle(reg: &mut Registry, key: &AllocKey, since: Option<u64>) -> Option<Arc<dyn Mapping>> {
    let slot = reg.allocs.get_mut(key)?;
    let current = match since {
        Some(since) => is_idle_since(Some(slot), since),
        None => matches!(slot, Slot::Idle { .. }),
    };
    if !current {
        return None;
    }
    let Slot::Idle { mapping, .. } = std::mem::replace(slot, Slot::Closing) else { unreachable!() };
    reg.idle_count -= 1;
    reg.idle_bytes -= mapping.size();
    Some(mapping)
}

/// Close what [`evict_over_limits`] or a retirement took out, without the registry lock.
pub(super) fn close_evicted(evicted: Vec<(AllocKey, Arc<dyn Mapping>)>) {
    for (key, mapping) in evicted {
        let closed = CloseDone(&key);
        drop(mapping);
        drop(closed);
    }
}

/// An allocation a channel connection keeps mapped for its producer ([`Import::keep_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeptKey(pub(super) AllocKey);

impl Import {
    /// Keep this import's allocation mapped for connection `owner` once no import uses it, until
    /// [`retire`] (the producer retired it) or [`retire_all`] (the connection closed).
    pub(crate) fn keep_for(&self, owner: u64) -> KeptKey {
        if self.generation.is_current() {
            if let Some(Slot::Open { kept, .. }) = registry().allocs.get_mut(&self.key) {
                *kept = Some(owner);
            }
        }
        KeptKey(self.key.clone())
    }
}

/// The producer of connection `owner` retired `key`: unmapped now when idle, when its last
/// import goes otherwise.
pub(crate) fn retire(owner: u64, key: &KeptKey) {
    let evicted = {
        let mut reg = registry();
        match reg.allocs.get_mut(&key.0) {
            Some(Slot::Open { kept, .. }) if *kept == Some(owner) => {
                *kept = None;
                None
            }
            Some(Slot::Idle { owner: o, .. }) if *o == owner => {
                take_idle(&mut reg, &key.0, None).map(|m| (key.0.clone(), m))
            }
            _ => None,
        }
    };
    close_evicted(evicted.into_iter().collect());
}

/// Connection `owner` closed: nothing stays mapped for it.
pub(crate) fn retire_all(owner: u64) {
    let evicted = {
        let mut reg = registry();
        let mut idle = Vec::new();
        for (k, slot) in reg.allocs.iter_mut() {
            match slot {
                Slot::Open { kept, .. } if *kept == Some(owner) => *kept = None,
                Slot::Idle { owner: o, .. } if *o == owner => idle.push(k.clone()),
                _ => {}
            }
        }
        idle.into_iter().filter_map(|k| take_idle(&mut reg, &k, None).map(|m| (k, m))).collect()
    };
    close_evicted(evicted);
}

/// How many allocations this process keeps mapped for channel connections while no import uses
/// them, and how many bytes they are.
pub fn kept_idle() -> (usize, u64) {
    let reg = registry();
    (reg.idle_count, reg.idle_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::DEVSHARE_KEY_CAPACITY;

    /// A mapping of `size` bytes at no address: the idle bookkeeping never touches memory.
    struct Bytes(u64);

    impl Mapping for Bytes {
        fn base(&self) -> *mut u8 {
            std::ptr::null_mut()
        }
        fn size(&self) -> u64 {
            self.0
        }
    }

    fn key(n: u8) -> AllocKey {
        let mut key = [0; DEVSHARE_KEY_CAPACITY];
        key[0] = n;
        AllocKey { backend: 1, read_only: false, device: 0, key_len: 1, key, segments: None, scope: 0 }
    }

    /// `key` mapped for one import kept for connection 1, as the open path leaves it.
    fn open(reg: &mut Registry, key: &AllocKey) {
        let mapping: Arc<dyn Mapping> = Arc::new(Bytes(4096));
        reg.allocs.insert(key.clone(), Slot::Open { mapping, users: 0, kept: Some(1) });
    }

    #[test]
    fn one_allocation_leased_again_and_again_keeps_the_idle_queue_short() {
        let mut reg = Registry::default();
        let k = key(1);
        open(&mut reg, &k);
        for _ in 0..10_000 {
            make_idle(&mut reg, &k, 1);
            assert!(reuse_idle(&mut reg, &k).is_some(), "an idle allocation is used again");
            if let Some(Slot::Open { users, .. }) = reg.allocs.get_mut(&k) {
                *users = 0;
            }
        }
        make_idle(&mut reg, &k, 1);
        assert_eq!((reg.idle_count, reg.idle_bytes), (1, 4096));
        // Before stale entries were told apart, every release's entry stayed: 10,000 of them,
        // each hashed on every later release.
        assert!(reg.idle.len() <= 2 * reg.idle_count + 65, "idle queue of {} entries", reg.idle.len());
    }

    #[test]
    fn eviction_takes_the_least_recently_idle_allocation() {
        let mut reg = Registry::default();
        let (a, b) = (key(1), key(2));
        open(&mut reg, &a);
        open(&mut reg, &b);
        make_idle(&mut reg, &a, 1);
        make_idle(&mut reg, &b, 1);
        // a is used and released again: now b is the older idle one.
        reuse_idle(&mut reg, &a).unwrap();
        if let Some(Slot::Open { users, .. }) = reg.allocs.get_mut(&a) {
            *users = 0;
        }
        make_idle(&mut reg, &a, 1);
        let evicted = evict_over(&mut reg, 1, u64::MAX);
        let gone: Vec<u8> = evicted.iter().map(|(k, _)| k.key[0]).collect();
        assert_eq!(gone, [2], "the allocation idle the longest goes first");
        assert!(matches!(reg.allocs.get(&a), Some(Slot::Idle { .. })), "the recent one stays");
        assert_eq!((reg.idle_count, reg.idle_bytes), (1, 4096));
    }
}
