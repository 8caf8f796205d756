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
pub(super) fn keep_limits() -> (usize, u64) {
    static LIMITS: std::sync::OnceLock<(usize, u64)> = std::sync::OnceLock::new();
    *LIMITS.get_or_init(|| {
        let read = |name: &str, default: u64| {
            std::env::var(name).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(default)
        };
        let count = read("DEVSHARE_KEEP_MAPPINGS", 4096);
        (usize::try_from(count).unwrap_or(usize::MAX), read("DEVSHARE_KEEP_MAPPINGS_BYTES", 64 << 30))
    })
}

/// Idle allocations past the limits, oldest first, taken out of the registry (their slots say
/// closing): the caller closes them with [`close_evicted`] once the lock is let go.
pub(super) fn evict_over_limits(reg: &mut Registry) -> Vec<(AllocKey, Arc<dyn Mapping>)> {
    let (count, bytes) = keep_limits();
    let mut out = Vec::new();
    while reg.idle_count > count || reg.idle_bytes > bytes {
        let Some(key) = reg.idle.pop_front() else { break };
        if let Some(m) = take_idle(reg, &key) {
            out.push((key, m));
        }
    }
    if reg.idle.len() > 2 * reg.idle_count + 64 {
        // Entries of allocations that are in use again or gone: drop them.
        let allocs = &reg.allocs;
        let mut idle = std::mem::take(&mut reg.idle);
        idle.retain(|k| matches!(allocs.get(k), Some(Slot::Idle { .. })));
        reg.idle = idle;
    }
    out
}

/// The mapping of idle allocation `key`, its slot now closing; `None` when it is not idle.
fn take_idle(reg: &mut Registry, key: &AllocKey) -> Option<Arc<dyn Mapping>> {
    let slot = reg.allocs.get_mut(key)?;
    if !matches!(slot, Slot::Idle { .. }) {
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
#[derive(Clone, Debug)]
pub(crate) struct KeptKey(AllocKey);

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
            Some(Slot::Idle { owner: o, .. }) if *o == owner => take_idle(&mut reg, &key.0).map(|m| (key.0.clone(), m)),
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
        idle.into_iter().filter_map(|k| take_idle(&mut reg, &k).map(|m| (k, m))).collect()
    };
    close_evicted(evicted);
}

/// How many allocations this process keeps mapped for channel connections while no import uses
/// them, and how many bytes they are.
pub fn kept_idle() -> (usize, u64) {
    let reg = registry();
    (reg.idle_count, reg.idle_bytes)
}
