//! The adaptive spin: how long a side that would sleep first polls its ring while the other
//! side is awake on another CPU.
//!
//! A blocking wait between two CPUs pays a wake-up: the sleeper's CPU must be woken (on a VM,
//! its virtual CPU scheduled again), which costs tens of microseconds where the other side's
//! answer, a slot back, a lease given back or the next item, often comes sooner. So a pool
//! `acquire` that found no free slot, a wait for a lease's return (`Exporter::wait`, through
//! the channel's `LeaseServer::adaptive_spin`) and a `recv` that found no item, whose peer is
//! awake and said it runs on another CPU (ring.rs, "Handing the CPU over"), first poll the
//! ring for up to [`budget`] (50 µs unless `DEVSHARE_ADAPTIVE_SPIN_US` says otherwise; 0 turns
//! it off), then sleep as before. A consumer that polls has not armed its ring, so the
//! producer's items need no eventfd write either (a producer's wait re-arms its rings on the
//! way out, so the first return to a producer that slept still writes one).
//!
//! The spin adapts ([`Backoff`]): one that ran out without finding anything makes the next
//! 1, 3, 7, ... up to 1,023 waits of that pool, connection or channel (its lease waits) sleep
//! at once; one that found what
//! it waited for halves that penalty. A side whose peer keeps it waiting (or a hostile peer that
//! claims to be awake and sends nothing) therefore costs it at most one budget per doubling
//! run of waits, not one per wait; a peer that answers in about the budget, sometimes within
//! it and sometimes not, still costs the waiting side up to a few times the CPU a sleep would.
//! A spin yields the CPU every [`YIELD_EVERY`] turns (a no-op unless another thread is ready
//! to run there): with more ready threads than CPUs (many consumers, a CPU quota), a spinner
//! that keeps finding its item soon enough would otherwise take the CPU from the others. No
//! side spins for a peer that said it runs on its own CPU (it yields instead; the words are as
//! fresh as the peer's last 16 items, arm or yield), nor in a call with a zero timeout, nor
//! past a call's timeout.
//!
//! The yield to a peer on the same CPU (ring.rs, "Handing the CPU over") is guarded too
//! ([`YieldGuard`], one per pool, connection, or channel for its lease waits): a yield that
//! took [`SLOW_YIELD`] or more gave the CPU to another thread for its time slice (a CPU shared
//! with a busy thread), which costs milliseconds where a hand-over saves microseconds. The
//! guard judges its side's yields in runs of 16: once two of a run, and a quarter of it so far,
//! were slow, it stops the side's yields for 100 ms, doubling with each such run up to a
//! minute, and back to 100 ms once a run ends without one ten times the current pause after
//! the last. A thread that keeps the CPU busy makes a good share of yields slow (each that
//! picks it instead of the peer), however often or seldom the side yields: two slow yields, at
//! most a few, then the pause. A moment of the machine's (a VM's virtual CPU descheduled, a
//! daemon's burst) makes one slow yield among a pipeline's thousands: before 1.18.1 that alone
//! stopped the yields, and cost a pipeline on one CPU its hand-overs, and half its rate, for
//! the next 100 ms. (A quick yield that brought nothing cost one system call.)

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// An adaptive spin yields the CPU once every this many turns.
pub(crate) const YIELD_EVERY: u32 = 32;

/// A yield to the peer that took this long gave the CPU to some other thread for its time
/// slice (the peer's own work between two waits takes less, or the yield did not pay).
pub(crate) const SLOW_YIELD: Duration = Duration::from_micros(500);
/// Yields are judged in runs of this many...
const RUN: u32 = 16;
/// ... and stopped once two of a run, and a `1 / SLOW_SHARE` of it so far, were slow.
const SLOW_SHARE: u32 = 4;
/// How long a costly run stops a side's yields, at first and at most.
const FIRST_PAUSE_MS: u64 = 100;
const LONGEST_PAUSE_MS: u64 = 60_000;

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

/// One pool's, connection's or channel's (its lease waits) record of how its adaptive spins
/// went.
#[derive(Default)]
pub(crate) struct Backoff {
    /// Waits left that sleep at once.
    skip: AtomicU32,
    /// What the next spin that finds nothing sets `skip` to, less one, halved.
    penalty: AtomicU32,
}

impl Backoff {
    /// Whether this wait may spin (else it counts one of the waits that sleep at once).
    pub(crate) fn may_try(&self) -> bool {
        let skip = self.skip.load(Ordering::Relaxed);
        if skip == 0 {
            return true;
        }
        self.skip.store(skip - 1, Ordering::Relaxed);
        false
    }

    /// How a spin ended: `found`, what it waited for came; else it ran out.
    pub(crate) fn tried(&self, found: bool) {
        if found {
            // Halved, not cleared: a peer that answers within the budget only now and then
            // keeps the spins rare.
            self.penalty.store(self.penalty.load(Ordering::Relaxed) / 2, Ordering::Relaxed);
            self.skip.store(0, Ordering::Relaxed);
        } else {
            let p = self.penalty.load(Ordering::Relaxed).saturating_mul(2).saturating_add(1).min(MAX_PENALTY);
            self.penalty.store(p, Ordering::Relaxed);
            self.skip.store(p, Ordering::Relaxed);
        }
    }
}

/// Milliseconds since this process first asked (a clock the guards share).
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// One pool's, connection's or channel's (its lease waits) record of how its yields to a peer
/// on the same CPU went. (Several threads may share one: its counts are then approximate.)
pub(crate) struct YieldGuard {
    /// No yield before this ([`now_ms`]).
    paused_until: AtomicU64,
    /// The pause the next costly run starts (ms).
    pause: AtomicU64,
    /// Yields of the current run so far, and how many of them were slow.
    yields: AtomicU32,
    slow: AtomicU32,
}

impl Default for YieldGuard {
    fn default() -> YieldGuard {
        YieldGuard {
            paused_until: AtomicU64::new(0),
            pause: AtomicU64::new(FIRST_PAUSE_MS),
            yields: AtomicU32::new(0),
            slow: AtomicU32::new(0),
        }
    }
}

impl YieldGuard {
    /// Whether this wait may yield to the peer (else it sleeps as it would have).
    pub(crate) fn may_yield(&self) -> bool {
        now_ms() >= self.paused_until.load(Ordering::Relaxed)
    }

    /// A yield that began at `began` is over.
    pub(crate) fn yielded(&self, began: Instant) {
        let is_slow = began.elapsed() >= SLOW_YIELD;
        let n = self.yields.fetch_add(1, Ordering::Relaxed) + 1;
        let k = if is_slow { self.slow.fetch_add(1, Ordering::Relaxed) + 1 } else { self.slow.load(Ordering::Relaxed) };
        let costly = is_slow && k >= 2 && k * SLOW_SHARE >= n;
        if !costly && n < RUN {
            return;
        }
        // The run is over, by a pause or by its length.
        self.yields.store(0, Ordering::Relaxed);
        self.slow.store(0, Ordering::Relaxed);
        let now = now_ms();
        let pause = self.pause.load(Ordering::Relaxed);
        if costly {
            self.paused_until.store(now + pause, Ordering::Relaxed);
            self.pause.store((pause * 2).min(LONGEST_PAUSE_MS), Ordering::Relaxed);
        } else if pause > FIRST_PAUSE_MS && now > self.paused_until.load(Ordering::Relaxed) + 10 * pause {
            self.pause.store(FIRST_PAUSE_MS, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_that_find_nothing_make_ever_more_waits_sleep_at_once_and_one_that_finds_halves_that() {
        let b = Backoff::default();
        assert!(b.may_try());
        // Each spin that runs out doubles the run of waits that do not spin: 1, 3, 7, ...
        let mut skipped = Vec::new();
        for _ in 0..12 {
            b.tried(false);
            let mut n = 0;
            while !b.may_try() {
                n += 1;
            }
            skipped.push(n);
        }
        assert_eq!(skipped, [1, 3, 7, 15, 31, 63, 127, 255, 511, 1023, 1023, 1023]);
        // A spin that found what it waited for: the next wait spins, and so does the one after.
        b.tried(true);
        assert!(b.may_try() && b.may_try());
        // Halved: 1023 -> 511, so the next spin that finds nothing makes 1023 waits sleep.
        b.tried(false);
        let mut n = 0;
        while !b.may_try() {
            n += 1;
        }
        assert_eq!(n, 1023);
    }

    #[test]
    fn a_run_of_yields_two_and_a_quarter_of_them_slow_pauses_yields_for_longer_each_time() {
        let g = YieldGuard::default();
        let slow = || Instant::now() - SLOW_YIELD;
        assert!(g.may_yield());
        // A pipeline's yields with a moment of the machine's in every run of 16: no pause.
        for _ in 0..10 {
            g.yielded(slow());
            for _ in 0..15 {
                g.yielded(Instant::now());
            }
        }
        assert!(g.may_yield(), "one slow yield in each run");
        // Slow yields between quick ones that picked the peer (a busy thread on the CPU and a
        // pipeline): slow, quick, slow pauses.
        g.yielded(slow());
        g.yielded(Instant::now());
        assert!(g.may_yield(), "one slow yield so far");
        g.yielded(slow());
        for _ in 0..1000 {
            assert!(!g.may_yield(), "paused");
        }
        assert_eq!(g.pause.load(Ordering::Relaxed), 2 * FIRST_PAUSE_MS, "the next pause is twice as long");
        std::thread::sleep(Duration::from_millis(FIRST_PAUSE_MS + 20));
        assert!(g.may_yield(), "the pause is over");
        // A side that yields seldom, each yield a busy thread's slice: two, and a pause of 200 ms.
        g.yielded(slow());
        g.yielded(slow());
        let until = g.paused_until.load(Ordering::Relaxed);
        assert!(!g.may_yield(), "paused again");
        assert!(until + 20 >= now_ms() + 2 * FIRST_PAUSE_MS, "the second pause is twice the first");
        assert_eq!(g.pause.load(Ordering::Relaxed), 4 * FIRST_PAUSE_MS, "and the next pause longer still");
    }
}
