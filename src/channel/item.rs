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
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
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
            self.conn.tell(Message::Release { lease: self.lease });
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

/// An attached pool's slot tokens at rest, one per slot: a token whose item was released waits
/// here for the slot's next item, so that receiving an item allocates no token. The pool's
/// state owns it; a token reaches it only through a `Weak` (a resting token must not keep it).
/// A resting token keeps its pool's [`AttachToken`], as the pool's state does: both go when
/// the state does (then the last item out detaches, as before), and an item takes no count
/// of it.
pub(crate) struct SpareTokens(Box<[AtomicPtr<SlotToken>]>);

impl SpareTokens {
    pub(crate) fn new(count: u32) -> Arc<SpareTokens> {
        Arc::new(SpareTokens((0..count).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect()))
    }

    fn take(&self, slot: u32) -> Option<Arc<SlotToken>> {
        let p = self.0.get(slot as usize)?.swap(std::ptr::null_mut(), Ordering::AcqRel);
        // SAFETY: a non-null pointer here came from Arc::into_raw in `put`, taken out once.
        (!p.is_null()).then(|| unsafe { Arc::from_raw(p) })
    }

    fn put(&self, slot: u32, token: Arc<SlotToken>) {
        let Some(cell) = self.0.get(slot as usize) else { return };
        let p = Arc::into_raw(token).cast_mut();
        if cell.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // SAFETY: p came from Arc::into_raw just above and was not stored.
            drop(unsafe { Arc::from_raw(p) });
        }
    }
}

impl Drop for SpareTokens {
    fn drop(&mut self) {
        for slot in 0..self.0.len() as u32 {
            drop(self.take(slot));
        }
    }
}

/// A pool slot held by this consumer: given back (one `RETURN`) when its import goes, or when
/// given back earlier.
pub(crate) struct SlotToken {
    conn: Arc<dyn Teller>,
    pool: u32,
    slot: u32,
    given: AtomicBool,
    /// The pool's attachment, which its items keep.
    attach: Arc<AttachToken>,
    spares: std::sync::Weak<SpareTokens>,
    /// The box of its last item's import, emptied, for the next (see `Lease::done`).
    husk: Option<Box<Import>>,
}

impl Lease for SlotToken {
    fn give_back(&self) {
        if !self.given.swap(true, Ordering::AcqRel) {
            self.conn.give_back_slot(self.pool, self.slot);
        }
    }

    fn pool_slot(&self) -> Option<(u32, u32)> {
        Some((self.pool, self.slot))
    }

    /// The last holder gives the slot back, and the token rests in its pool's spares (while the
    /// pool is attached) for the slot's next item, with the husk (which keeps the pool's import).
    /// Otherwise the husk goes before the token: the mapping before the attachment, whose last
    /// holder detaches.
    fn done(mut self: Arc<Self>, husk: Option<Box<Import>>) {
        let Some(me) = Arc::get_mut(&mut self) else {
            drop(husk);
            return; // another holder: its drop gives back
        };
        if !std::mem::replace(me.given.get_mut(), true) {
            me.conn.give_back_slot(me.pool, me.slot);
        }
        match me.spares.upgrade() {
            Some(spares) => {
                me.husk = husk;
                spares.put(me.slot, self);
            }
            None => {
                drop(husk);
                drop(self);
            }
        }
    }
}

impl Drop for SlotToken {
    fn drop(&mut self) {
        self.give_back();
        // A resting husk keeps the pool's import (the mapping): it goes before the attachment.
        self.husk = None;
    }
}

/// The token of an item of slot `slot`, and the husk of an earlier item's import: one resting
/// in `spares`, or a new one.
fn slot_token(
    conn: &dyn Fn() -> Arc<dyn Teller>,
    attach: &Arc<AttachToken>,
    spares: &Arc<SpareTokens>,
    pool: u32,
    slot: u32,
) -> (Arc<SlotToken>, Option<Box<Import>>) {
    if let Some(mut t) = spares.take(slot) {
        if let Some(me) = Arc::get_mut(&mut t) {
            // The spares and the attachment are the same pool's.
            debug_assert!(Arc::ptr_eq(&me.attach, attach));
            *me.given.get_mut() = false;
            let husk = me.husk.take();
            return (t, husk);
        }
    }
    let token = SlotToken {
        conn: conn(),
        pool,
        slot,
        given: AtomicBool::new(false),
        attach: attach.clone(),
        spares: Arc::downgrade(spares),
        husk: None,
    };
    (Arc::new(token), None)
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
pub(crate) type ItemConn<'a> = (&'a dyn Fn() -> Arc<dyn Teller>, &'a Arc<AttachToken>, &'a Arc<SpareTokens>);

/// A pool item: slot `slot` of the pool whose whole allocation `base` maps (`count` slots of
/// `slot_size` bytes), narrowed to the item's tensor `l` — the slot and its bytes checked
/// against the pool, the handle validated and checked against the mapping by `derive` — whose
/// lease gives the slot back through `conn` (made only once the slot is in bounds, so that a
/// refused slot is not given back; `conn` is asked only for a new token) and holds the pool's
/// attachment; waits for the producer's `event` first (on `stream`, or on this thread).
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
    stream: *mut std::ffi::c_void,
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
    let imp = Import::derive(base, &layout, event, token, husk)?;
    // The producer's work on the slot may still be running: wait for its event before the item
    // is used (on the connection's stream, or blocking this thread).
    let req = ImportRequest { device: Some(base.device()), stream, ..ImportRequest::default() };
    crate::import::wait_for_producer(imp.handle(), &req)?;
    Ok(imp)
}

/// Open a received handle: a channel memfd by its descriptor, anything else by its key.
pub(crate) fn open(
    h: &crate::handle::DevshareHandle,
    table: Option<&[u8]>,
    mut fds: Vec<OwnedFd>,
    lease: Option<Arc<dyn Lease>>,
    stream: *mut std::ffi::c_void,
) -> Result<Import> {
    let req = ImportRequest { stream, ..ImportRequest::default() };
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
        let mut numbers: Vec<i32> = Vec::new();
        for n in seg.fds() {
            if !numbers.contains(&n) {
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
