//! What travels with an item, for both transports, and the one answer to "where does a lease
//! come back?".
//!
//! The way back, end to end:
//! 1. The producer books every reference it sends: a lease in the export's `LeaseBook`
//!    (`crate::export`), a pool slot in the pool's slot state (`unix::producer`,
//!    `tcp::producer`); [`slot_desc`] places a pool item's tensor in its slot.
//! 2. The consumer's import holds a token ([`LeaseToken`], [`SlotToken`], and [`AttachToken`] for
//!    a pool's whole mapping) as its `crate::import::Lease`: the import registry gives it back
//!    when the last import holding it is released (or earlier, on `give_back`). [`open`] and
//!    [`narrow`] make those imports.
//! 3. A token tells its connection through [`Teller`]: a `RELEASE`, `RETURN` or `DETACH`
//!    message, or a slot pushed on the shared-memory ring (`unix::ring`); a Unix connection
//!    never waits on the producer for it (its backlog, `unix::consumer`).
//! 4. The producer takes it back while it serves its channel (`take_return` and the lease
//!    handling in each transport's producer), and a connection that closes for any reason
//!    returns everything it still held.

use super::wire::{self, Message};
use crate::backend::ImportRequest;
use crate::error::{Error, Result};
use crate::export::TensorDesc;
use crate::import::{import_attached, Attached, Import, Lease};
use std::cell::UnsafeCell;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Whether a consumer's connection may be used: made in this process (not inherited through
/// fork) and not closed.
pub(crate) fn usable(stamp: &crate::fork::Stamp, closed: &AtomicBool) -> Result<()> {
    stamp.check("connection")?;
    if closed.load(Ordering::Acquire) {
        return Err(Error::Closed("the connection is closed".into()));
    }
    Ok(())
}

/// Where a consumer's pool tokens send their messages: a Unix connection (`ConnShared`) or a
/// remote one.
pub(crate) trait Teller: Send + Sync {
    /// Send a consumer message; a producer that is gone learns everything from the hang-up.
    fn tell(&self, msg: Message<'_>);

    /// Give a pool slot back (a `RETURN`, unless the connection has a faster way).
    fn give_back_slot(&self, pool: u32, slot: u32) {
        self.tell(Message::Return { pool, slot });
    }

    /// Give a lease back (a `RELEASE`, unless the connection has a faster way).
    fn give_back_lease(&self, lease: u64) {
        self.tell(Message::Release { lease });
    }

    /// Give leases back (a `RELEASE` each, unless the connection has a faster way).
    fn tell_releases(&self, leases: &[u64]) {
        for &lease in leases {
            self.tell(Message::Release { lease });
        }
    }
}

/// Give back the leases of `imports` (channel leases and pool items; anything else is skipped):
/// the leases of one connection in as few messages as it allows (one `RELEASES` per
/// [`MAX_RELEASES`](crate::channel::wire::MAX_RELEASES) leases to a producer that reads them),
/// in the order given; what was given back before sends nothing.
pub(crate) fn give_back_all<'a>(imports: impl IntoIterator<Item = &'a crate::import::Import>) {
    // (connection, its leases), in the order the connections first appear.
    let mut by_conn: Vec<(Arc<dyn Teller>, Vec<u64>)> = Vec::new();
    for imp in imports {
        let Some(lease) = imp.lease() else { continue };
        let Some(token) = lease.as_any().and_then(|a| a.downcast_ref::<LeaseToken>()) else {
            lease.give_back(); // a pool item: its slot goes back through the ring
            continue;
        };
        if token.given.swap(true, Ordering::AcqRel) {
            continue;
        }
        match by_conn.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &token.conn)) {
            Some((_, leases)) => leases.push(token.lease),
            None => by_conn.push((token.conn.clone(), vec![token.lease])),
        }
    }
    for (conn, leases) in by_conn {
        conn.tell_releases(&leases);
    }
}

/// A leased reference: released (one `RELEASE` message) when the last import holding it goes,
/// or when given back earlier.
pub(crate) struct LeaseToken {
    conn: Arc<dyn Teller>,
    lease: u64,
    given: AtomicBool,
    /// The name the producer gave the lease (`NAMES`), if any.
    pub(crate) name: Option<std::ffi::CString>,
}

impl LeaseToken {
    /// The token of lease `lease`, released through `conn`.
    pub(crate) fn new(conn: Arc<dyn Teller>, lease: u64) -> LeaseToken {
        LeaseToken { conn, lease, given: AtomicBool::new(false), name: None }
    }
}

impl Lease for LeaseToken {
    fn give_back(&self) {
        if !self.given.swap(true, Ordering::AcqRel) {
            self.conn.give_back_lease(self.lease);
        }
    }

    fn name(&self) -> Option<&std::ffi::CStr> {
        self.name.as_deref()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl Drop for LeaseToken {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// A consumer's attachment to a pool: detached (one `DETACH`) when the pool is closed and its
/// last item is released.
pub(crate) struct AttachToken {
    conn: Arc<dyn Teller>,
    pool: u32,
}

impl AttachToken {
    pub(crate) fn new(conn: Arc<dyn Teller>, pool: u32) -> Arc<AttachToken> {
        Arc::new(AttachToken { conn, pool })
    }
}

impl Drop for AttachToken {
    fn drop(&mut self) {
        self.conn.tell(Message::Detach { pool: self.pool });
    }
}

/// An attached pool's slot tokens, one per slot, owned by the pool's state on the receiving
/// side and looked at only by the receive that holds that state (`&mut`): a token whose items
/// were all released rests here, with its last item's husk, for the slot's next item, so that
/// receiving an item allocates no token and takes no lock or count to find one. A resting token
/// keeps its pool's [`AttachToken`], as the pool's state does: both go when the state does
/// (then the last item out detaches, as before).
pub(crate) struct SpareTokens(Box<[Option<Arc<SlotToken>>]>);

impl SpareTokens {
    pub(crate) fn new(count: u32) -> SpareTokens {
        SpareTokens((0..count).map(|_| None).collect())
    }
}

/// A pool slot held by this consumer: given back (one `RETURN`) when the last import holding it
/// goes, or when given back earlier.
///
/// The imports holding it count themselves in `holders` (each holds an `Arc` too, for the
/// memory): 0 means none does. Only the receive that owns the token's [`SpareTokens`] cell
/// makes it 1 again, and only from 0; every other change comes from a holder. So a holder that
/// reads 1 is the last and stays so while it finishes, and a receive that reads 0 is alone with
/// the token until it hands out the next item.
pub(crate) struct SlotToken {
    conn: Arc<dyn Teller>,
    pool: u32,
    slot: u32,
    given: AtomicBool,
    holders: AtomicUsize,
    /// The pool's attachment, which its items keep.
    attach: Arc<AttachToken>,
    /// The box of its last item's import, emptied, for the next (see `Lease::done`). Touched by
    /// the last holder before it lets `holders` go to 0, by the receive that finds it at 0
    /// (which then makes it 1), and by the drop; never by two at once.
    husk: UnsafeCell<Option<Box<Import>>>,
}

// SAFETY: every field but `husk` is Sync; `husk` is only ever touched by one thread at a time
// (see its comment: `holders` hands it from the last holder to the receive with Release /
// Acquire).
unsafe impl Sync for SlotToken {}

impl Lease for SlotToken {
    fn give_back(&self) {
        if !self.given.swap(true, Ordering::AcqRel) {
            self.conn.give_back_slot(self.pool, self.slot);
        }
    }

    fn pool_slot(&self) -> Option<(u32, u32)> {
        Some((self.pool, self.slot))
    }

    fn held(&self) {
        // By a holder (an import cloned): the count is at least 1 and cannot reach 0 meanwhile.
        self.holders.fetch_add(1, Ordering::Relaxed);
    }

    fn holders(&self) -> Option<usize> {
        Some(self.holders.load(Ordering::Acquire))
    }

    /// The last holder gives the slot back, and the token rests (while its pool's state keeps
    /// it) for the slot's next item, with the husk (which keeps the pool's import). Another
    /// holder only counts itself out. A token nobody else keeps goes with this holder's `Arc`:
    /// its drop lets the husk go before the attachment (the mapping before the attachment,
    /// whose last holder detaches).
    fn done(self: Arc<Self>, husk: Option<Box<Import>>) {
        let mut n = self.holders.load(Ordering::Acquire);
        while n > 1 {
            match self.holders.compare_exchange_weak(n, n - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return drop(husk), // another holder: the last one gives back
                Err(now) => n = now,
            }
        }
        // The last holder (n is 1): no other can appear until this one lets the count go.
        if !self.given.load(Ordering::Acquire) {
            self.given.store(true, Ordering::Relaxed);
            self.conn.give_back_slot(self.pool, self.slot);
        }
        // SAFETY: the last holder, before `holders` goes to 0: nobody else touches the husk.
        let old = std::mem::replace(unsafe { &mut *self.husk.get() }, husk);
        self.holders.store(0, Ordering::Release);
        drop(old);
    }
}

impl Drop for SlotToken {
    fn drop(&mut self) {
        self.give_back();
        // A resting husk keeps the pool's import (the mapping): it goes before the attachment.
        *self.husk.get_mut() = None;
    }
}

/// The token of an item of slot `slot` (`slot` < the pool's count), and the husk of an earlier
/// item's import: the slot's token when no import holds it any more (made the item's only
/// holder here), else a new one, which becomes the slot's.
fn slot_token(
    conn: &dyn Fn() -> Arc<dyn Teller>,
    attach: &Arc<AttachToken>,
    spares: &mut SpareTokens,
    pool: u32,
    slot: u32,
) -> (Arc<SlotToken>, Option<Box<Import>>) {
    let cell = spares.0.get_mut(slot as usize);
    if let Some(Some(t)) = cell.as_deref() {
        if t.holders.load(Ordering::Acquire) == 0 {
            // The spares and the attachment are the same pool's.
            debug_assert!(Arc::ptr_eq(&t.attach, attach));
            // SAFETY: at 0 this receive (which owns the cell, `&mut`) is the only one to touch
            // the token's husk and flags until it hands the token out below.
            let husk = unsafe { (*t.husk.get()).take() };
            t.given.store(false, Ordering::Relaxed);
            t.holders.store(1, Ordering::Relaxed);
            return (t.clone(), husk);
        }
    }
    // Still held (a clone of the last item, or the producer sent the slot again before it came
    // back): a token of its own.
    let token = Arc::new(SlotToken {
        conn: conn(),
        pool,
        slot,
        given: AtomicBool::new(false),
        holders: AtomicUsize::new(1),
        attach: attach.clone(),
        husk: UnsafeCell::new(None),
    });
    if let Some(cell) = cell {
        *cell = Some(token.clone());
    }
    (token, None)
}

/// A pool of `count` slots of `slot_size` bytes must fit its export.
pub(crate) fn pool_fits(exp: &crate::export::Exporter, slot_size: u64, count: u32) -> Result<()> {
    slot_size.checked_mul(u64::from(count)).filter(|&t| t <= exp.size()).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{count} slots of {slot_size} bytes do not fit the export's {} bytes",
            exp.size()
        ))
    })?;
    Ok(())
}

/// A tensor in slot `slot` of a pool of `slot_size`-byte slots, `desc` relative to the slot
/// (`storage_size` `None`: the rest of the slot): its bytes in the slot, checked to lie inside
/// it, and the description relative to the pool's export.
pub(crate) fn slot_desc<'a>(desc: &TensorDesc<'a>, slot: u32, slot_size: u64) -> Result<(u64, TensorDesc<'a>)> {
    let rel_size = crate::export::storage_within(desc, slot_size, || format!("{slot_size}-byte slot"))?;
    let abs = TensorDesc {
        storage_offset: u64::from(slot) * slot_size + desc.storage_offset,
        storage_size: Some(rel_size),
        ..desc.clone()
    };
    Ok((rel_size, abs))
}

/// What a pool item goes back through: its connection (asked only for a new token), the
/// pool's attachment and its resting tokens.
pub(crate) type ItemConn<'a> = (&'a dyn Fn() -> Arc<dyn Teller>, &'a Arc<AttachToken>, &'a mut SpareTokens);

/// A pool item: slot `slot` of the pool whose whole allocation `base` maps (`count` slots of
/// `slot_size` bytes), narrowed to the item's tensor `l` — the slot and its bytes checked
/// against the pool, the handle validated and checked against the mapping by `derive` — whose
/// lease gives the slot back through `conn` (made only once the slot is in bounds, so that a
/// refused slot is not given back; `conn` is asked only for a new token) and holds the pool's
/// attachment. It does not wait for the producer's `event`: the caller does, before the item is
/// used ([`crate::import::wait_for_producer`] on its handle, or the connection's open events).
#[allow(clippy::too_many_arguments)]
pub(crate) fn narrow(
    base: &Arc<Import>,
    slot_size: u64,
    count: u32,
    pool: u32,
    slot: u32,
    l: &wire::ItemLayout,
    event: Option<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]>,
    (conn, attach, spares): ItemConn<'_>,
) -> Result<Box<Import>> {
    if slot >= count || l.storage_offset.checked_add(l.storage_size).map_or(true, |e| e > slot_size) {
        return Err(Error::Untrusted(format!(
            "pool {pool} item: slot {slot}, bytes {}..+{} is outside the {count} slots of {slot_size} bytes",
            l.storage_offset, l.storage_size
        )));
    }
    let (token, husk) = slot_token(conn, attach, spares, pool, slot);
    // The item's layout in the pool's allocation: its slot's place added.
    let layout = wire::ItemLayout {
        storage_offset: base.handle().storage_offset + u64::from(slot) * slot_size + l.storage_offset,
        ..*l
    };
    Import::derive(base, &layout, event, token, husk)
}

/// Open a received handle: a channel memfd by its descriptor, anything else by its key.
pub(crate) fn open(
    h: &crate::handle::DevshareHandle,
    table: Option<&[u8]>,
    mut fds: Vec<OwnedFd>,
    lease: Option<Arc<dyn Lease>>,
    stream: *mut std::ffi::c_void,
    connection: Option<u64>,
) -> Result<Import> {
    // Memory known by its producer's fd numbers is mapped for this connection alone (its
    // producer's RETIRE orders a close before later shares on it, not on others).
    let req = ImportRequest { stream, scope: connection.unwrap_or(0), ..ImportRequest::default() };
    if h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_CHANNEL != 0 {
        if fds.len() != 1 {
            return Err(Error::Untrusted(format!(
                "a channel memfd handle came with {} descriptors instead of 1",
                fds.len()
            )));
        }
        let fd = fds.pop().expect("one descriptor");
        let key = crate::backend::memfd::identity(&fd)?;
        let alloc_size = h.alloc_size;
        let mut opener = || crate::backend::memfd::open_received(&fd, alloc_size, req.read_only);
        return import_attached(h, None, req, Some(Attached { key: &key, open: &mut opener }), None, lease);
    }
    if !fds.is_empty() {
        // A CUDA segmented export's fds, each once in the order of its first record.
        let seg = crate::handle::segments::SegmentTable::of(h, table)?
            .filter(|t| t.seg.kind == crate::handle::segments::DEVSHARE_SEGMENTS_CUDA_FD)
            .ok_or_else(|| Error::Untrusted("a handle that names its memory came with descriptors".into()))?;
        // Each number once, in the order of its first record (a set for the look-up: a table of
        // tens of thousands of records would otherwise cost their square).
        let (mut numbers, mut seen) = (Vec::<i32>::new(), std::collections::HashSet::new());
        for n in seg.fds() {
            if seen.insert(n) {
                numbers.push(n);
            }
        }
        if numbers.len() != fds.len() {
            return Err(Error::Untrusted(format!(
                "a segmented handle listing {} distinct fds came with {} descriptors",
                numbers.len(),
                fds.len()
            )));
        }
        let pid = seg.producer_pid;
        let passed = numbers.into_iter().map(|n| (pid, n)).zip(fds).collect();
        let passed = crate::backend::PassedFds::new(passed);
        return import_attached(h, table, req, None, Some(&passed), lease);
    }
    import_attached(h, table, req, None, None, lease)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Mutex;

    const SLOT: u64 = 64;
    const SLOTS: u32 = 3;

    /// A connection that records what its tokens tell it: `(pool, slot)` per slot given back,
    /// `(pool, u32::MAX)` per detach.
    #[derive(Default)]
    struct Log(Mutex<Vec<(u32, u32)>>);

    impl Teller for Log {
        fn tell(&self, msg: Message<'_>) {
            match msg {
                Message::Return { pool, slot } => self.0.lock().unwrap().push((pool, slot)),
                Message::Detach { pool } => self.0.lock().unwrap().push((pool, u32::MAX)),
                other => panic!("a pool token told {other:?}"),
            }
        }
    }

    /// A pool's whole allocation, imported as a consumer attaches it.
    fn pool_import() -> Arc<Import> {
        let exp = crate::export::Exporter::channel_host_alloc(SLOT * u64::from(SLOTS)).expect("alloc");
        let whole = [(SLOT * u64::from(SLOTS)) as i64];
        let desc = TensorDesc { shape: &whole, storage_size: Some(SLOT * u64::from(SLOTS)), ..Default::default() };
        let (h, _) = exp.share_leased(&desc).expect("share");
        let fds = exp.channel_fds().iter().map(|f| f.try_clone_to_owned().expect("dup")).collect();
        Arc::new(open(&h, None, fds, None, std::ptr::null_mut(), None).expect("open"))
    }

    /// An attached pool as a consumer's state holds it.
    struct Attached {
        base: Arc<Import>,
        attach: Arc<AttachToken>,
        spares: SpareTokens,
    }

    impl Attached {
        fn new(log: &Arc<Log>, base: &Arc<Import>, pool: u32) -> Attached {
            Attached {
                base: base.clone(),
                attach: AttachToken::new(log.clone(), pool),
                spares: SpareTokens::new(SLOTS),
            }
        }

        /// An item of `slot` (one element more than its storage holds: refused).
        fn item_of(&mut self, log: &Arc<Log>, pool: u32, slot: u32, refused: bool) -> Result<Box<Import>> {
            let mut l = crate::handle::Layout::of(self.base.handle(), 0, SLOT);
            l.shape[0] = SLOT as i64 + i64::from(refused);
            let conn = || log.clone() as Arc<dyn Teller>;
            let c: ItemConn<'_> = (&conn, &self.attach, &mut self.spares);
            narrow(&self.base, SLOT, SLOTS, pool, slot, &l, None, c)
        }

        fn item(&mut self, log: &Arc<Log>, pool: u32, slot: u32) -> Box<Import> {
            self.item_of(log, pool, slot, false).expect("item")
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Recv(u32),
        /// An item of this slot whose layout is refused: its slot goes back at once.
        Refused(u32),
        Clone(usize),
        GiveBack(usize),
        /// Release an import: boxed (what the C API does) or not.
        Release(usize, bool),
        /// The pool closes (its state goes) and is attached again under the next id.
        Reattach,
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            3 => (0..SLOTS).prop_map(Op::Recv),
            1 => (0..SLOTS).prop_map(Op::Refused),
            1 => any::<usize>().prop_map(Op::Clone),
            1 => any::<usize>().prop_map(Op::GiveBack),
            4 => (any::<usize>(), any::<bool>()).prop_map(|(k, b)| Op::Release(k, b)),
            1 => Just(Op::Reattach),
        ];
        proptest::collection::vec(op, 0..60)
    }

    /// Runs `ops`, each received item's token the slot's resting one when it can be (`reuse`)
    /// or always a new one (the full path), and returns what the connection was told, in
    /// order, checked on the way against a model: a slot goes back once per item, when it is
    /// given back or its last import goes, and a pool detaches once, when its state and its
    /// last item are gone.
    fn run(ops: &[Op], reuse: bool) -> Vec<(u32, u32)> {
        let log = Arc::new(Log::default());
        let base = pool_import();
        let mut pool = 1u32;
        let mut state = Some(Attached::new(&log, &base, pool));
        // The imports alive, each with its item's number; per item: pool, slot, given back.
        let mut live: Vec<(Box<Import>, usize)> = Vec::new();
        let mut items: Vec<(u32, u32, bool)> = Vec::new();
        let mut want: Vec<(u32, u32)> = Vec::new();
        for op in ops {
            match *op {
                Op::Recv(slot) => {
                    let st = state.as_mut().expect("attached");
                    if !reuse {
                        st.spares = SpareTokens::new(SLOTS);
                    }
                    let imp = st.item(&log, pool, slot);
                    assert_eq!(imp.pool_slot(), Some((pool, slot)));
                    live.push((imp, items.len()));
                    items.push((pool, slot, false));
                }
                Op::Refused(slot) => {
                    let st = state.as_mut().expect("attached");
                    if !reuse {
                        st.spares = SpareTokens::new(SLOTS);
                    }
                    let e = st.item_of(&log, pool, slot, true).err().expect("refused");
                    assert!(matches!(e, Error::TensorOutOfBounds(_)), "{e}");
                    items.push((pool, slot, true));
                    want.push((pool, slot));
                }
                Op::Clone(k) if !live.is_empty() => {
                    let (imp, item) = &live[k % live.len()];
                    let c = Box::new(imp.clone_ref());
                    let item = *item;
                    live.push((c, item));
                }
                Op::GiveBack(k) if !live.is_empty() => {
                    let (imp, item) = &live[k % live.len()];
                    imp.give_back().expect("a pool item");
                    let it = &mut items[*item];
                    if !std::mem::replace(&mut it.2, true) {
                        want.push((it.0, it.1));
                    }
                }
                Op::Release(k, boxed) if !live.is_empty() => {
                    let (imp, item) = live.swap_remove(k % live.len());
                    if boxed {
                        Import::release_boxed(imp);
                    } else {
                        (*imp).release();
                    }
                    let it = &mut items[item];
                    if !live.iter().any(|(_, i)| *i == item) && !std::mem::replace(&mut it.2, true) {
                        want.push((it.0, it.1));
                    }
                }
                Op::Reattach => {
                    drop(state.take()); // the pool closes first
                    pool += 1;
                    state = Some(Attached::new(&log, &base, pool));
                }
                _ => {}
            }
            // A pool detaches once its state and its last item are gone.
            let got: Vec<_> = log.0.lock().unwrap().iter().copied().filter(|w| w.1 != u32::MAX).collect();
            assert_eq!(got, want, "slots given back, in order");
            let detached: Vec<u32> = log.0.lock().unwrap().iter().filter(|w| w.1 == u32::MAX).map(|w| w.0).collect();
            let gone: Vec<u32> = (1..pool).filter(|p| !live.iter().any(|(_, i)| items[*i].0 == *p)).collect();
            let mut sorted = detached.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, gone, "detached: the closed pools no item holds, once each");
        }
        drop(live);
        drop(state);
        drop(base);
        let all = log.0.lock().unwrap().clone();
        assert_eq!(all.iter().filter(|w| w.1 == u32::MAX).count(), pool as usize, "every pool detached once");
        all
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn a_reused_slot_token_gives_back_and_detaches_exactly_as_a_new_one_would(ops in ops()) {
            prop_assert_eq!(run(&ops, true), run(&ops, false));
        }
    }

    #[test]
    fn clones_of_a_pool_item_released_on_many_threads_give_its_slot_back_once() {
        let log = Arc::new(Log::default());
        let base = pool_import();
        let mut st = Attached::new(&log, &base, 1);
        for round in 0..50 {
            let imp = st.item(&log, 1, 0);
            let clones: Vec<Import> = (0..8).map(|_| imp.clone_ref()).collect();
            std::thread::scope(|s| {
                for (i, c) in clones.into_iter().enumerate() {
                    s.spawn(move || {
                        let more = c.clone_ref();
                        if i % 2 == 0 {
                            Import::release_boxed(Box::new(more));
                            c.release();
                        } else {
                            more.release();
                            Import::release_boxed(Box::new(c));
                        }
                    });
                }
                Import::release_boxed(imp);
            });
            assert_eq!(log.0.lock().unwrap().len(), round + 1, "one return per item");
        }
        assert!(log.0.lock().unwrap().iter().all(|w| *w == (1, 0)));
    }
}
