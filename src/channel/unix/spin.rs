//! The adaptive spin: how long a side that would sleep first polls its ring while the other
//! side is awake on another CPU.
//!
//! A blocking wait between two CPUs pays a wake-up: the sleeper's CPU must be woken (on a VM,
//! its virtual CPU scheduled again), which costs tens of microseconds where the other side's
//! answer, a slot back or the next item, often comes sooner. So a pool `acquire` that found no
//! free slot, and a `recv` that found no item, whose peer is awake (its ring's `pending` word
//! set) and said it runs on another CPU (ring.rs, "Handing the CPU over"), first poll the ring
//! for up to [`budget`] (50 µs unless `DEVSHARE_ADAPTIVE_SPIN_US` says otherwise; 0 turns it
//! off), then sleep as before. While a side polls it has not armed its ring, so the other side
//! sends or returns without writing its eventfd either.
//!
//! The spin adapts ([`Backoff`]): one that ran out without finding anything makes the next
//! 1, 3, 7, ... up to 1023 waits of that pool or connection sleep at once; one that found what
//! it waited for ends the penalty. A side whose peer keeps it waiting (or a hostile peer that
//! claims to be awake and sends nothing) therefore costs it at most one budget per doubling
//! run of waits, not one per wait. Nothing spins on the peer's CPU (that side yields instead),
//! nor in a call with a zero timeout, nor past a call's timeout.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The budget unless `DEVSHARE_ADAPTIVE_SPIN_US` sets one.
const DEFAULT_US: u64 = 50;
/// The most a side waits out after spins that found nothing (in waits).
const MAX_PENALTY: u32 = 1023;

/// How long a side polls before it sleeps while its peer is awake on another CPU (zero: not at
/// all). `DEVSHARE_ADAPTIVE_SPIN_US` (read once per process, at most
/// [`super::MAX_SPIN`]) overrides the default of 50 µs.
pub(crate) fn budget() -> Duration {
    static BUDGET: OnceLock<Duration> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let us = std::env::var("DEVSHARE_ADAPTIVE_SPIN_US").ok().and_then(|v| v.trim().parse::<u64>().ok());
        Duration::from_micros(us.unwrap_or(DEFAULT_US)).min(super::MAX_SPIN)
    })
}

/// One pool's or connection's record of how its adaptive spins went.
#[derive(Default)]
pub(crate) struct Backoff {
    /// Waits left that sleep at once.
    skip: AtomicU32,
    /// What the next spin that finds nothing sets `skip` to, less one, halved.
    penalty: AtomicU32,
}

impl Backoff {
    /// Whether this wait may spin (else it counts one of the waits that sleep at once).
    pub(crate) fn may_spin(&self) -> bool {
        let skip = self.skip.load(Ordering::Relaxed);
        if skip == 0 {
            return true;
        }
        self.skip.store(skip - 1, Ordering::Relaxed);
        false
    }

    /// How a spin ended: `found`, what it waited for came; else it ran out.
    pub(crate) fn spun(&self, found: bool) {
        if found {
            self.penalty.store(0, Ordering::Relaxed);
            self.skip.store(0, Ordering::Relaxed);
        } else {
            let p = (self.penalty.load(Ordering::Relaxed) * 2 + 1).min(MAX_PENALTY);
            self.penalty.store(p, Ordering::Relaxed);
            self.skip.store(p, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_that_find_nothing_make_ever_more_waits_sleep_at_once_and_one_that_finds_ends_that() {
        let b = Backoff::default();
        assert!(b.may_spin());
        // Each spin that runs out doubles the run of waits that do not spin: 1, 3, 7, ...
        let mut skipped = Vec::new();
        for _ in 0..12 {
            b.spun(false);
            let mut n = 0;
            while !b.may_spin() {
                n += 1;
            }
            skipped.push(n);
        }
        assert_eq!(skipped, [1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 1023, 1023]);
        // A spin that found what it waited for: the next wait spins, and so does the one after.
        b.spun(true);
        assert!(b.may_spin() && b.may_spin());
        b.spun(false);
        assert!(!b.may_spin(), "the penalty starts again from one");
        assert!(b.may_spin());
    }
}
