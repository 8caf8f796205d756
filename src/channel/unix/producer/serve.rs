//! The serve loop: the channel's lock (and the nudge of the one thread that waits without a time
//! limit), and `service`, which waits in the epoll set and takes what is ready — connections,
//! messages, hang-ups, ring returns — under the lock.

use super::*;

/// This thread's token for [`ChannelShared::untimed`]: the address of a thread-local (not 0,
/// and distinct among the threads alive).
pub(super) fn thread_token() -> u64 {
    thread_local!(static TOKEN: u8 = const { 0 });
    TOKEN.with(|t| t as *const u8 as u64)
}

/// The channel's lock, held: on release, a change a thread waiting without a time limit must
/// see ([`Core::stir`]) nudges that thread (after the unlock: it takes the lock to look).
pub(super) struct Locked<'a> {
    guard: std::mem::ManuallyDrop<MutexGuard<'a, Core>>,
    shared: &'a ChannelShared,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Registered exports dropped while this lock was held (by its holder, or by a thread
        // that found it taken) are retired before it is let go: their consumers' mappings of
        // freed memory go now, not with the channel's next send.
        if self.shared.exports_closed.load(Ordering::Relaxed) && !self.guard.closed {
            self.shared.retire_closed(&mut self.guard);
            self.guard.sweep(self.shared.epoll.as_fd());
        }
        let stirred = std::mem::take(&mut self.guard.stir);
        // Closed after the unlock: a descriptor a peer sent may take long to close. Likewise
        // the idle events of peers that went (destroying one is a driver call).
        let unwanted = std::mem::take(&mut self.guard.unwanted_fds);
        let gone = std::mem::take(&mut self.guard.gone_peers);
        // SAFETY: dropped once, here; not used after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.guard) };
        drop(unwanted);
        for peer in gone {
            self.shared.events.forget(peer);
        }
        // Paired with the waiter's claim (`claim_untimed`, then the lock): either the waiter
        // took the lock after this unlock and sees the change, or this load sees its claim.
        // (Its own changes it sees: no nudge.)
        if stirred {
            let waiter = self.shared.untimed.load(Ordering::SeqCst);
            if waiter != 0 && waiter != thread_token() {
                self.shared.nudge();
            }
        }
    }
}

/// The claim of the one wait without a time limit; given up when dropped.
pub(super) struct Untimed<'a>(&'a AtomicU64);

impl Drop for Untimed<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::SeqCst);
    }
}

/// Whether a look at the rings asks their consumers to wake the channel for the next return.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Arm {
    /// No (a spinner looks at the rings itself); but a serve that takes a ring's wake-up off
    /// the epoll set arms the rings again (see [`ChannelShared::serve`]).
    No,
    /// Yes, at once.
    Now,
    /// Yes; the waiter looks again within 5 ms by itself, so a consumer on its CPU may put
    /// the wake-up off while it has more items to take (see `ring`, "put-off returns").
    Patient,
}

impl LeaseServer for ChannelShared {
    fn serve(&self, pause: Duration) -> Result<()> {
        self.service(Some(pause))
    }

    fn spin(&self) -> Duration {
        Duration::from_nanos(self.spin_ns.load(Ordering::Relaxed))
    }

    fn poll(&self, sockets: bool) -> Result<()> {
        // Not armed: a spinner looks at the rings itself (the sleep after the spin arms them;
        // so does the look at the sockets, where it takes a ring's wake-up off the epoll set).
        if sockets {
            self.serve(Some(Duration::ZERO), Arm::No, None)
        } else {
            self.lock()?.drain_rings(Arm::No);
            Ok(())
        }
    }

    /// The adaptive spin (spin.rs) of a wait for lease returns: while a consumer is awake on
    /// another CPU, unless the channel's backoff says to sleep at once.
    fn adaptive_spin(&self) -> Duration {
        let budget = super::super::spin::budget();
        let awake = !budget.is_zero() && self.lock().is_ok_and(|core| core.consumer_awake_on(false));
        if awake && self.lease_backoff.may_try() {
            budget
        } else {
            Duration::ZERO
        }
    }

    fn adaptive_done(&self, found: bool) {
        self.lease_backoff.tried(found);
    }

    /// A registered export is being dropped: retired now when the channel's lock is free, else
    /// as its holder lets it go (this thread may be the holder: an export can go with a pool
    /// closed under the lock), and always before the channel sends another handle.
    fn export_closed(&self, export: u64) {
        // (Registered with none: nothing to retire. A forked child's copy of the channel is
        // its parent's to serve: it touches nothing of it.)
        if self.registered.load(Ordering::Acquire) == 0 || !self.generation.is_current() {
            return;
        }
        match self.try_lock() {
            Some(mut core) => {
                self.retire(&mut core, [export]);
                core.sweep(self.epoll.as_fd());
            }
            None => {
                self.closed_exports.lock().unwrap_or_else(|p| p.into_inner()).push(export);
                self.exports_closed.store(true, Ordering::Release);
                // The holder retires it as it lets the lock go, if it saw the flag. It may have
                // looked just before: one more try (whose own letting go retires it), else a
                // thread waiting in the epoll set without a time limit looks (its serve
                // retires), else the channel's next send or registration does, before it sends.
                match self.try_lock() {
                    Some(core) => drop(core),
                    None => self.nudge(),
                }
            }
        }
    }

    /// The hand-over of the CPU (ring.rs, "Handing the CPU over") before a wait for lease
    /// returns sleeps: to a consumer awake on this CPU, with the same guards as an acquire's.
    fn hand_over(&self, left: Option<Duration>) -> bool {
        if left.is_some_and(|l| l <= ring::YIELD_LEFT) || !self.lease_yields.may_yield() {
            return false;
        }
        if !self.lock().is_ok_and(|core| core.consumer_awake_on(true)) {
            return false;
        }
        let began = Instant::now();
        ring::yield_cpu();
        self.lease_yields.yielded(began);
        true
    }
}

impl ChannelShared {
    pub(super) fn lock(&self) -> Result<Locked<'_>> {
        self.generation.check("channel")?;
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if core.closed {
            return Err(Error::Closed("the channel is closed".into()));
        }
        Ok(Locked { guard: std::mem::ManuallyDrop::new(core), shared: self })
    }

    /// [`Self::lock`] if no thread holds it now (this one included).
    fn try_lock(&self) -> Option<Locked<'_>> {
        if self.generation.check("channel").is_err() {
            return None;
        }
        let core = match self.core.try_lock() {
            Ok(core) => core,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        (!core.closed).then(|| Locked { guard: std::mem::ManuallyDrop::new(core), shared: self })
    }

    /// Retire the registered exports dropped since the last look ([`LeaseServer::export_closed`]):
    /// unregistered, and every consumer that kept one told to let it go (`RETIRE`), in its
    /// connection before anything sent after this.
    pub(super) fn retire_closed(&self, core: &mut Core) {
        if !self.exports_closed.load(Ordering::Relaxed) || !self.exports_closed.swap(false, Ordering::AcqRel) {
            return;
        }
        let ids = std::mem::take(&mut *self.closed_exports.lock().unwrap_or_else(|p| p.into_inner()));
        self.retire(core, ids);
    }

    /// Unregister those of `ids` still registered, telling every consumer that kept one.
    fn retire(&self, core: &mut Core, ids: impl IntoIterator<Item = u64>) {
        let epfd = self.epoll.as_fd();
        for id in ids {
            if core.registered.remove(&id).is_some() {
                core.retire(id, epfd);
            }
        }
        self.registered.store(core.registered.len() as u64, Ordering::Release);
    }

    /// Wake the thread that waits without a time limit (a no-op when none does: an edge no
    /// wait takes is reported to the next one, which then looks once for nothing).
    pub(super) fn nudge(&self) {
        let _ = rustix::io::write(&self.nudge, &1u64.to_ne_bytes());
    }

    /// Claim the one wait without a time limit (`None`: another thread has it). Made before
    /// the look that decides to wait: see [`Locked`]'s drop.
    pub(super) fn claim_untimed(&self) -> Option<Untimed<'_>> {
        let me = thread_token();
        self.untimed.compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst).ok().map(|_| Untimed(&self.untimed))
    }

    /// See [`Channel::service`].
    pub(crate) fn service(&self, timeout: Option<Duration>) -> Result<()> {
        self.serve(timeout, Arm::Now, None)
    }

    /// [`Self::service`]; `arm`: whether to ask the peers to wake the epoll set for their next
    /// ring return ([`Arm`]; not while spinning: a spinner looks at the rings itself, and an
    /// armed ring costs the consumer a system call per return). A serve that takes a ring's
    /// wake-up off the epoll set arms the rings whatever `arm` says: that wake-up was also the
    /// caller's event loop's, and without an arm the next return would wake nobody.
    /// `untimed`: this thread's claim of the wait without a time limit (its wait is `timeout`
    /// then, normally none), given up as soon as the wait is over.
    pub(super) fn serve(&self, timeout: Option<Duration>, arm: Arm, untimed: Option<Untimed<'_>>) -> Result<()> {
        // Returns already in the rings are taken first (and the rings armed: the next return
        // wakes the epoll set); then no sleep. Wake up for the next handshake or send-patience
        // deadline too.
        let (deadline, returned, sleeps) = {
            let mut core = self.lock()?;
            let returned = core.drain_rings(arm);
            // About to sleep: the consumers stop polling or yielding for this producer's items
            // (ring.rs, `P_AWAKE`) until it is out of the wait again.
            let sleeps = returned == 0 && timeout != Some(Duration::ZERO);
            if sleeps {
                core.asleep(true);
            }
            (core.next_deadline(), returned, sleeps)
        };
        let timeout = if returned > 0 { Some(Duration::ZERO) } else { timeout };
        let mut events = [MaybeUninit::<epoll::Event>::uninit(); 32];
        let ts = serve_wait(timeout, deadline);
        // Which sources are ready: 0 is the listener, anything else a peer's id; and whether
        // a peer's socket can take more of its queue.
        let mut ready = [(0u64, false); 32];
        let n = loop {
            match epoll::wait(&self.epoll, &mut events, ts.as_ref()) {
                Ok((evs, _)) => {
                    for (r, e) in ready.iter_mut().zip(evs.iter()) {
                        let flags = e.flags;
                        *r = (e.data.u64(), flags.contains(epoll::EventFlags::OUT));
                    }
                    break evs.len();
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(wire::os("epoll_wait", e)),
            }
        };
        let mine = untimed.is_some();
        drop(untimed);
        // A nudge meant for the thread that waits without a time limit, taken by this wait:
        // pass it on (that thread is still asleep).
        if !mine && ready[..n].iter().any(|&(id, _)| id == NUDGE_EVENT) && self.untimed.load(Ordering::SeqCst) != 0 {
            self.nudge();
        }
        // Level-triggered: what was ready is still ready now (what did not fit in this batch is
        // reported by the next call); take it under the lock, touching nothing else.
        let epfd = self.epoll.as_fd();
        let mut core = self.lock()?;
        if sleeps {
            core.asleep(false);
        }
        // A ring's wake-up taken off the epoll set here is one the caller's event loop will not
        // see: the rings are armed again below even where the caller did not ask for it (a
        // spinner's look), or the next return would wake nobody (its consumer finds `pending`
        // still set by the wake-up just taken).
        let mut rearm = false;
        for &(id, writable) in &ready[..n] {
            if id & RING_EVENT != 0 {
                // A ring's wake-up (or the nudge): its returns are taken below.
                rearm |= id != NUDGE_EVENT;
            } else if id == 0 {
                core.sweep(epfd); // expired handshakes make room first
                let _ = core.accept_all(epfd);
            } else if let Some(i) = core.peers.iter().position(|p| p.info.id == id) {
                if writable {
                    core.flush(i, epfd);
                }
                if !core.drain_peer(i) {
                    core.peers[i].doomed.get_or_insert_with(|| format!("peer {id} hung up"));
                }
            }
        }
        core.drain_rings(if rearm && arm == Arm::No { Arm::Now } else { arm });
        core.sweep(epfd);
        Ok(())
    }

    pub(super) fn close(&self) {
        if !self.generation.is_current() {
            return; // a forked child's copy: the parent's peers and files are not ours
        }
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if core.closed {
            return;
        }
        // Through the guard that nudges a thread waiting without a time limit (it sees Closed).
        let mut core = Locked { guard: std::mem::ManuallyDrop::new(core), shared: self };
        core.closed = true;
        core.stir = true;
        while !core.peers.is_empty() {
            // What each peer's socket takes now still reaches it; the rest of its queue is lost.
            core.flush(0, self.epoll.as_fd());
            core.drop_peer(0, self.epoll.as_fd());
        }
        // A slot set aside for an acquire without the lock is not handed out any more.
        for p in core.pools.values() {
            p.next.store(0, Ordering::SeqCst);
        }
        core.pools.clear();
        self.events.clear();
        if let Some((p, dev, ino)) = core.path.take() {
            if rustix::fs::stat(&p).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino) {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
}
