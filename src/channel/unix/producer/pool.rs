//! Pools: acquiring a free slot (with backpressure, spinning if asked), sending and releasing
//! it, and the slots that come back — by `RETURN` message, from a peer's ring, or when a peer
//! goes.

use super::serve::Untimed;
use super::*;

impl LocalPool {
    fn with<T>(&self, f: impl FnOnce(&mut Core, &mut PoolState) -> Result<T>) -> Result<T> {
        self.with_then(f, |_, r| r)
    }

    /// [`Self::with`], then `then` with the outcome, under the same lock.
    fn with_then<T>(
        &self,
        f: impl FnOnce(&mut Core, &mut PoolState) -> Result<T>,
        then: impl FnOnce(&mut Core, Result<T>) -> Result<T>,
    ) -> Result<T> {
        let mut core = self.shared.lock()?;
        // The pools are set aside while `f` works on the core (nothing it calls looks at them):
        // one lookup, no remove and re-insert per call.
        let mut pools = std::mem::take(&mut core.pools);
        let r = match pools.get_mut(&self.id) {
            Some(p) => f(&mut core, p),
            None => Err(Error::Closed("the pool is closed".into())),
        };
        core.pools = pools;
        // A peer a send found gone or past its queue bounds goes now (its slots come back).
        core.sweep(self.shared.epoll.as_fd());
        then(&mut core, r)
    }

    /// The slot a send set aside for this acquire, taken without the channel's lock (a read
    /// first: a pool with none set aside costs no locked instruction here).
    fn take_next(&self) -> Option<(u32, *mut u8)> {
        if self.next.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return None;
        }
        let v = self.next.swap(0, std::sync::atomic::Ordering::Acquire);
        let s = u32::try_from(v.checked_sub(1)?).ok()?;
        // SAFETY: a set-aside slot is one of the pool's (s < count), and count x slot_size fits
        // the export (checked at creation), whose address `base` is.
        Some((s, unsafe { (self.base as *mut u8).add((u64::from(s) * self.slot_size) as usize) }))
    }

    /// A free slot, under the channel's lock: one from the free list (after taking the returns
    /// that came through a ring, when it is empty), else the one set aside for an acquire
    /// without the lock. `untimed` is given up when several items are out (see `acquire`).
    pub(super) fn take_free(&self, untimed: &mut Option<Untimed<'_>>) -> Result<Option<(u32, *mut u8)>> {
        let mut core = self.shared.lock()?;
        if core.pools.get(&self.id).is_some_and(|p| p.free.is_empty()) {
            core.drain_rings(Arm::No);
        }
        let p = core.pools.get_mut(&self.id).ok_or_else(|| Error::Closed("the pool is closed".into()))?;
        if p.free.is_empty() && p.out > 1 {
            // Several items in flight: a pipeline, whose consumer is still busy with the
            // others when the first comes back. Its wait keeps the timer: pipelines
            // measured more items per second with it (on one CPU the consumer then takes
            // more returns per switch), while one item in flight comes back sooner to a
            // wait without it (BENCHMARKS.md, "What bounds the rest").
            *untimed = None;
        }
        let slot = p.free.pop().or_else(|| {
            // Set aside by a send and not taken: this acquire's (a thread waiting for a slot
            // must not miss it).
            let v = p.next.swap(0, std::sync::atomic::Ordering::Acquire);
            v.checked_sub(1).and_then(|s| u32::try_from(s).ok())
        });
        Ok(slot.map(|s| {
            p.slots[s as usize] = SlotState::Acquired;
            // SAFETY: s < count and count x slot_size fits the export (checked at creation).
            (s, unsafe { p.exporter.ptr().add((u64::from(s) * p.slot_size) as usize) })
        }))
    }

    /// A free slot and its address; serves the channel while every slot is out.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<(u32, *mut u8)> {
        // A slot the last send set aside: no lock (a forked child's copy takes nothing).
        self.shared.generation.check("channel")?;
        if let Some(got) = self.take_next() {
            return Ok(got);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let spin = self.spin_ns.load(std::sync::atomic::Ordering::Relaxed);
        let mut spin_until = (spin > 0).then(|| Instant::now() + Duration::from_nanos(spin));
        let mut last_look = false;
        let mut spins = 0u32;
        // The first look claims nothing: a slot it finds is taken without the claim below (most
        // acquires find one), and one that finds none waits only after the next look.
        let mut first = true;
        let mut yielded = false;
        // Whether this acquire considered the adaptive spin (once), and is in it now.
        let (mut adapted, mut adaptive) = (false, false);
        loop {
            // Without a time limit (and not spinning), the wait below may be the channel's one
            // wait without a timer: claimed before the look that decides to wait (see `Locked`).
            let mut untimed =
                if !first && deadline.is_none() && spin_until.is_none() { self.shared.claim_untimed() } else { None };
            // A free slot, after the returns that came through a ring (taken without a system
            // call), under one lock: the path a spinning acquire turns on.
            if let Some(g) = self.take_free(&mut untimed)? {
                if adaptive {
                    self.backoff.tried(true);
                }
                return Ok(g);
            }
            if std::mem::take(&mut first) && deadline.is_none() && spin_until.is_none() {
                continue; // look again, claiming the wait without a timer first
            }
            if last_look {
                return Err(Error::Timeout("every slot of the pool is still out".into()));
            }
            if let Some(until) = spin_until {
                // Spinning (opt-in, for a stage that owns a core): take what arrived without
                // sleeping, until the spin or the timeout is over.
                // The clock is read every 16th turn (a read costs more than a look at the rings).
                let over = spins % 16 == 0 && {
                    let now = Instant::now();
                    now >= until || deadline.is_some_and(|d| now >= d)
                };
                if !over {
                    // The rings are looked at on every turn (above); the socket every 64th.
                    spins += 1;
                    if spins % 64 == 0 {
                        self.shared.serve(Some(Duration::ZERO), Arm::No, None)?;
                    }
                    if adaptive && spins % super::super::spin::YIELD_EVERY == 0 {
                        ring::yield_cpu(); // let another thread ready here run (spin.rs)
                    }
                    std::hint::spin_loop();
                    continue;
                }
                spin_until = None;
                if std::mem::take(&mut adaptive) {
                    self.backoff.tried(false);
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // A consumer awake on this CPU gets it before this thread sleeps: it returns slots
            // while this producer is still awake (no wake-up to pay either way). Once per
            // acquire, and only one with time to spare.
            if !yielded && left.map_or(true, |l| l > ring::YIELD_LEFT) {
                yielded = true;
                if self.yields.may_yield() && self.shared.lock()?.consumer_awake_on(true) {
                    let began = Instant::now();
                    ring::yield_cpu();
                    self.yields.yielded(began);
                    continue;
                }
            }
            // A consumer awake on another CPU may return a slot before a wake-up would even
            // reach this one: poll for a while first (spin.rs; once per acquire, not where the
            // caller's own spin was on).
            if !adapted && spin == 0 && !left.is_some_and(|l| l.is_zero()) {
                adapted = true;
                let budget = super::super::spin::budget();
                if !budget.is_zero() && self.shared.lock()?.consumer_awake_on(false) && self.backoff.may_try() {
                    spin_until = Some(Instant::now() + budget);
                    (adaptive, spins) = (true, 1);
                    continue;
                }
            }
            // Once the time is up, take the returns that already arrived (without waiting) and
            // look once more: a zero timeout polls. Another thread may be the one serving the
            // channel: look again at least every 5 ms, unless this is the wait without a timer
            // (which what other threads change wakes).
            last_look = left.is_some_and(|l| l.is_zero());
            let wait = left.map_or(Duration::from_millis(5), |l| l.min(Duration::from_millis(5)));
            // A timed wait looks again within 5 ms: its consumers may put a return's wake-up off.
            let (wait, arm) = if untimed.is_some() { (None, Arm::Now) } else { (Some(wait), Arm::Patient) };
            self.shared.serve(wait, arm, untimed)?;
        }
    }

    /// Let [`Self::acquire`] poll for a returned slot for up to `spin` before it sleeps (for a
    /// producer that owns a core: a return is taken within a microsecond or so instead of after
    /// a wake-up); zero (the default) adds no spin of its own (the adaptive one, `spin.rs`,
    /// still applies). At most [`super::super::MAX_SPIN`].
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        self.spin_ns.store(spin_ns(spin)?, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Give back an acquired slot without sending it.
    pub fn release(&self, slot: u32) -> Result<()> {
        self.with(|core, p| {
            acquired(p, slot, "released")?;
            p.slots[slot as usize] = SlotState::Free;
            p.free.push(slot);
            core.stir = true;
            Ok(())
        })
    }

    /// Send an acquired slot to `peer`, describing the tensor in it (`desc.storage_offset` is
    /// relative to the slot, `storage_size` `None` means the rest of the slot).
    pub fn send(&self, slot: u32, peer: u64, desc: &TensorDesc<'_>) -> Result<()> {
        // (One call site of `send_item`: the pool's send stays one function.)
        let mut synced = false;
        loop {
            match self.send_item(slot, peer, desc, synced)? {
                None => return Ok(()),
                // Every event of this consumer on the device is out with it: the stream is
                // synchronised instead, outside the channel's lock, and the item goes without one.
                Some(exporter) => {
                    exporter.synchronize(desc.stream)?;
                    synced = true;
                }
            }
        }
    }

    /// [`Self::send`]; `synced`: the caller synchronised the stream (no event, no
    /// synchronisation here). Returns the export to synchronise, having sent nothing, when the
    /// item asks for an event and none is left for this consumer.
    #[inline(always)]
    fn send_item(&self, slot: u32, peer: u64, desc: &TensorDesc<'_>, synced: bool) -> Result<Option<Arc<Exporter>>> {
        let shared = &self.shared;
        let id = self.id;
        let epfd = self.shared.epoll.as_fd();
        self.with_then(
            |core, p| {
                acquired(p, slot, "sent")?;
                let (rel_size, abs) = slot_desc(desc, slot, p.slot_size)?;
                core.peers.get(peer)?;
                // Describes and validates the tensor (once per slot while the description repeats);
                // synchronises the producing stream, or records an event on it
                // (DEVSHARE_SHARE_EVENT): one of the channel's reused events.
                let mut described = None;
                let layout = match p.described.get(slot, desc) {
                    Some(layout) => layout,
                    None => &*described.insert(
                        p.exporter.describe_leased_with(&abs, |h| ItemLayout::of(h, desc.storage_offset, rel_size))?,
                    ),
                };
                let event = match abs.event && !synced {
                    true => match shared.events.record(peer, &p.exporter, abs.stream)? {
                        Some(e) => Some(e),
                        None => return Ok(Some(p.exporter.clone())), // (synchronised by the caller)
                    },
                    false => None,
                };
                if !abs.event {
                    p.exporter.synchronize(abs.stream)?;
                }
                if !core.peers.get(peer)?.attached.contains_key(&id) {
                    crate::channel::limits::room_for_a_pool(peer, core.peers.get(peer)?.attached.len())?;
                    // (Registered exports closed meanwhile first: this handle may reuse their
                    // descriptor numbers.)
                    shared.retire_closed(core);
                    core.allow(peer, &p.exporter)?;
                    let whole = p.slot_size * u64::from(p.count);
                    let shape = [whole as i64];
                    let (base, _) = p.exporter.share_leased(&TensorDesc {
                        shape: &shape,
                        storage_size: Some(whole),
                        ..Default::default()
                    })?;
                    let mut enc = Vec::new();
                    crate::handle::encode::encode_full_into(&base, p.exporter.external_table(), &mut enc)?;
                    let m = check_len(
                        Message::Attach { pool: id, slot_size: p.slot_size, count: p.count, handle: &enc }.encode(),
                    )?;
                    let fds = p.exporter.channel_fds();
                    let idx = core.index(peer)?;
                    core.post(idx, &m, &fds, epfd)?;
                    let book = p.exporter.leases().clone();
                    book.add(shared);
                    core.peers[idx].attached.insert(id, book);
                }
                let event_handle = event.as_ref().map(|e| e.handle());
                let m = Message::encode_item_into(
                    id,
                    slot,
                    layout,
                    event_handle.as_ref(),
                    std::mem::take(&mut core.item_buf),
                );
                if let Some(layout) = described {
                    if let Some(k) = DescKey::of(desc) {
                        p.described.put(slot, k, layout);
                    }
                }
                let idx = core.index(peer);
                let posted = idx.and_then(|idx| core.post_item(idx, &m, epfd));
                core.item_buf = m;
                posted?;
                p.slots[slot as usize] = SlotState::Sent(peer);
                p.out += 1;
                p.events[slot as usize] = event;
                // The next acquire's slot, set aside now, under this lock: that acquire takes
                // no lock. (Only this lock's holder fills the cell, so a cell read empty here
                // stays empty until this store.)
                if p.next.load(std::sync::atomic::Ordering::Relaxed) == 0 {
                    if let Some(s) = p.free.pop() {
                        p.slots[s as usize] = SlotState::Reserved;
                        p.next.store(u64::from(s) + 1, std::sync::atomic::Ordering::Release);
                    }
                }
                Ok(None)
            },
            |core, sent| {
                // A peer this send found past its limits is gone now, and its slots are free again.
                if sent.is_ok() && core.index(peer).is_err() {
                    return Err(Error::Closed(format!("peer {peer} was disconnected: it does not read its messages")));
                }
                sent
            },
        )
    }

    /// The pool's id on its channel (what consumers see with their items).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u64 {
        self.slot_size
    }

    /// Slot size, slot count and free slots (the one set aside for the next acquire included).
    pub fn info(&self) -> Result<(u64, u32, u32)> {
        self.with(|_, p| {
            let next = p.next.load(std::sync::atomic::Ordering::Acquire) != 0;
            Ok((p.slot_size, p.count, p.free.len() as u32 + u32::from(next)))
        })
    }
}

impl Drop for LocalPool {
    fn drop(&mut self) {
        self.next.store(0, std::sync::atomic::Ordering::SeqCst);
        let Ok(mut core) = self.shared.lock() else { return };
        if core.pools.remove(&self.id).is_none() {
            return;
        }
        core.stir = true;
        let m = Message::PoolClosed { pool: self.id }.encode();
        let epfd = self.shared.epoll.as_fd();
        for i in 0..core.peers.len() {
            if core.peers[i].attached.contains_key(&self.id) {
                let _ = core.post(i, &m, &[], epfd);
            }
        }
        core.sweep(epfd);
    }
}

/// An item's description, every field that describing it reads (all but the stream), in full:
/// two equal keys describe the same tensor in a slot.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct DescKey {
    dtype: crate::dtype::DevshareDType,
    ndim: usize,
    shape: [i64; crate::handle::DEVSHARE_MAX_NDIM],
    /// `None`: C-contiguous; else its length and entries.
    strides: Option<(usize, [i64; crate::handle::DEVSHARE_MAX_NDIM])>,
    storage_offset: u64,
    storage_size: Option<u64>,
    tensor_offset: i64,
    inflight: bool,
    event: bool,
}

impl DescKey {
    /// `None` for a description that does not fit a key (more dimensions than a handle holds:
    /// describing it fails anyway).
    pub(super) fn of(d: &TensorDesc<'_>) -> Option<DescKey> {
        fn dims(v: &[i64]) -> Option<[i64; crate::handle::DEVSHARE_MAX_NDIM]> {
            if v.len() > crate::handle::DEVSHARE_MAX_NDIM {
                return None;
            }
            // Element by element: a call to copy a few words costs more than the words.
            let mut a = [0; crate::handle::DEVSHARE_MAX_NDIM];
            for (x, y) in a.iter_mut().zip(v) {
                *x = *y;
            }
            Some(a)
        }
        let strides = match d.strides {
            Some(s) => Some((s.len(), dims(s)?)),
            None => None,
        };
        Some(DescKey {
            dtype: d.dtype,
            ndim: d.shape.len(),
            shape: dims(d.shape)?,
            strides,
            storage_offset: d.storage_offset,
            storage_size: d.storage_size,
            tensor_offset: d.tensor_offset,
            inflight: d.inflight,
            event: d.event,
        })
    }

    /// Whether `d`'s key is this one (`DescKey::of(d) == Some(*self)`), compared field by field
    /// where `d` lies, without making its key (a send that repeats a description copies
    /// nothing).
    pub(super) fn matches(&self, d: &TensorDesc<'_>) -> bool {
        // The entries in use, element by element (a call to compare a few words costs more than
        // the words); the key's entries past them are zero, as `of` writes them.
        fn same(a: &[i64; crate::handle::DEVSHARE_MAX_NDIM], n: usize, v: &[i64]) -> bool {
            v.len() == n && a[..n].iter().zip(v).all(|(x, y)| x == y)
        }
        let strides = match (&self.strides, d.strides) {
            (None, None) => true,
            (Some((n, a)), Some(v)) => same(a, *n, v),
            _ => false,
        };
        self.dtype == d.dtype
            && same(&self.shape, self.ndim, d.shape)
            && strides
            && self.storage_offset == d.storage_offset
            && self.storage_size == d.storage_size
            && self.tensor_offset == d.tensor_offset
            && self.inflight == d.inflight
            && self.event == d.event
    }
}

/// A pool's last item description and the layout it was described as, and which slots it was
/// described and validated for (`Exporter::describe_leased_with`, a function of the description
/// and the slot): a send that repeats both takes the layout instead of describing the tensor
/// again. Another description replaces it (and every slot describes that one once).
pub(super) struct Described {
    last: Option<(DescKey, ItemLayout)>,
    /// Which description `last` is (from 1); per slot, the one it was described for (0: none).
    epoch: u64,
    slots: Vec<u64>,
}

impl Described {
    pub(super) fn new(count: u32) -> Result<Described> {
        let mut slots = Vec::new();
        slots
            .try_reserve_exact(count as usize)
            .map_err(|_| Error::bad_size("count", format!("no memory for the bookkeeping of {count} slots")))?;
        slots.resize(count as usize, 0);
        Ok(Described { last: None, epoch: 1, slots })
    }

    /// The layout of description `d` in `slot`, when it was described for that slot (its key is
    /// the last one's: [`DescKey::matches`]).
    pub(super) fn get(&self, slot: u32, d: &TensorDesc<'_>) -> Option<&ItemLayout> {
        match &self.last {
            Some((k, layout)) if self.slots.get(slot as usize) == Some(&self.epoch) && k.matches(d) => Some(layout),
            _ => None,
        }
    }

    /// `key` was described for `slot` as `layout`.
    pub(super) fn put(&mut self, slot: u32, key: DescKey, layout: ItemLayout) {
        if self.last != Some((key, layout)) {
            self.epoch += 1;
            self.last = Some((key, layout));
        }
        if let Some(s) = self.slots.get_mut(slot as usize) {
            *s = self.epoch;
        }
    }
}

/// `slot` of `p` is acquired (what may be `done` to it: "sent", "released"), else why not. A
/// slot set aside for an acquire without the lock is acquired once it is no longer set aside
/// (an acquire took it); while it is, it is free.
fn acquired(p: &PoolState, slot: u32, done: &str) -> Result<()> {
    match p.slots.get(slot as usize) {
        Some(SlotState::Acquired) => Ok(()),
        Some(SlotState::Reserved) if p.next.load(std::sync::atomic::Ordering::Acquire) != u64::from(slot) + 1 => Ok(()),
        Some(s) => {
            Err(Error::InvalidArgument(format!("slot {slot} is {}: only an acquired slot can be {done}", describe(*s))))
        }
        None => Err(Error::InvalidArgument(format!("slot {slot} is beyond the {} slots", p.count))),
    }
}

fn describe(s: SlotState) -> String {
    match s {
        SlotState::Free | SlotState::Reserved => "free".into(),
        SlotState::Acquired => "acquired".into(),
        SlotState::Sent(p) => format!("out with peer {p}"),
    }
}

impl Core {
    /// A slot peer `id` gives back (over the socket or its ring): free again, when the peer
    /// holds it.
    pub(super) fn take_return(&mut self, id: u64, pool: u32, slot: u32) -> Result<()> {
        let Some(p) = self.pools.get_mut(&pool) else {
            return Ok(()); // a closed pool: nothing to give back to
        };
        match p.slots.get(slot as usize) {
            Some(SlotState::Sent(holder)) if *holder == id => {
                p.slots[slot as usize] = SlotState::Free;
                p.out -= 1;
                p.events[slot as usize] = None;
                p.free.push(slot);
                self.stir = true;
                Ok(())
            }
            _ => Err(Error::Untrusted(format!("slot {slot} of pool {pool} is not held by peer {id}"))),
        }
    }

    /// Whether a consumer is awake (its ring says so) on this thread's CPU (`same`: an acquire
    /// about to wait yields it the CPU first, `ring`'s "Handing the CPU over") or on another
    /// (the acquire may poll for its return first, `spin.rs`).
    pub(super) fn consumer_awake_on(&self, same: bool) -> bool {
        self.rings().any(|r| r.consumer_awake_on(same))
    }

    /// The peers' rings (of those that have one).
    fn rings(&self) -> impl Iterator<Item = &ring::ProducerRing> {
        self.peers.iter().filter_map(|p| p.ring.as_ref())
    }

    /// Tell the consumers whether this producer is about to sleep in its wait (`yes`) or is out
    /// of it (ring.rs, `P_AWAKE`).
    pub(super) fn asleep(&self, yes: bool) {
        for r in self.rings() {
            r.asleep(yes);
        }
    }

    /// Take the returns waiting in the peers' rings; with `arm`, first ask each peer to wake
    /// the channel for its next return (before sleeping, or leaving the channel idle). A
    /// return of a slot the peer does not hold counts as a protocol error; a ring whose index
    /// is impossible disconnects its peer. How many slots came back.
    pub(super) fn drain_rings(&mut self, arm: Arm) -> usize {
        let mut got = 0;
        for i in 0..self.peers.len() {
            let Some(mut r) = self.peers[i].ring.take() else { continue };
            if arm != Arm::No {
                r.arm(arm == Arm::Patient);
            }
            let id = self.peers[i].info.id;
            let mut refused = 0;
            let taken = r.take_returns(|back| {
                let taken = match back {
                    ring::Returned::Slot(pool, slot) => self.take_return(id, pool, slot),
                    ring::Returned::Lease(lease) => self.take_release(i, lease),
                    ring::Returned::Torn => Err(Error::Untrusted("a torn lease release".into())),
                };
                match taken {
                    Ok(()) => got += 1,
                    Err(_) => refused += 1,
                }
            });
            let p = &mut self.peers[i];
            p.ring = Some(r);
            p.info.protocol_errors += refused;
            if let Err(e) = taken {
                p.doomed.get_or_insert_with(|| format!("peer {id} broke its ring: {e}"));
            }
        }
        got
    }
}
