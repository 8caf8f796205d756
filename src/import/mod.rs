//! Importing handles, and the per-process import registry.
//!
//! The registry caches mappings by allocation — (backend, device, key, access) — not by tensor,
//! because many tensors share one allocation: importing the same allocation twice maps it once,
//! and the mapping goes away when the last import of it is released. (Memory known only by its
//! producer's fd numbers, a segmented CUDA export's, is mapped once per channel connection that
//! receives it, and once for the process's plain imports: `ImportRequest::scope`.) It also tracks the
//! ref-counter reference each handle carries (its "ticket": ref-counter name and slot): a ticket
//! held by several imports in this process is returned to the producer exactly once, when the
//! last of them is released. Imports and releases may happen on any thread.
//!
//! **Locking.** The tables are behind one mutex, held only while they are read or updated: the
//! vendor calls — opening an allocation, the device synchronisation and the vendor close of its
//! last release — run without it. An allocation's entry is *opening* while its first import maps
//! it, *open* while imports use it, and *closing* while its last release unmaps it. An import that
//! finds it opening or closing waits (a condition variable) and then takes the new mapping, or
//! maps the allocation afresh once the close is done: a backend never sees a second open of an
//! allocation under one key before its close (CUDA refuses a second open of an IPC handle), while
//! imports, cache hits and releases of other allocations go on. In the same way, the first import of a reference in this process (which
//! checks the producer's record and claims an in-flight reference) makes other imports of that
//! reference wait until it succeeded or failed.
//!
//! **In-flight references** (`DEVSHARE_HANDLE_FLAG_INFLIGHT`) are checked against the record the
//! producer keeps in its ref-counter (see [`crate::refcounter`]): a handle whose flag differs is
//! refused, and the first import takes the reference over by clearing the record's bit, so it is
//! taken over once even when a handle reaches several processes.
//!
//! **fork.** A child forked after imports inherits the registry and the mappings, but the
//! counts and references they stand for are the parent's. A `pthread_atfork` child handler
//! (installed on first use of [`crate::fork::Stamp`]) starts a new generation: the child's registry
//! forgets every inherited import without unmapping, decrementing or unlinking anything (the
//! child's copies of the mappings are leaked until it exits), and releasing an inherited
//! [`Import`] in the child does nothing. The prepare handler takes the registry lock around
//! `fork`, so the child never inherits it held by a thread it does not have.

use crate::backend::{self, ImportRequest, Mapping};
use crate::error::{Error, Result};
use crate::fork::Stamp;
use crate::handle::{validate, DevshareHandle, Validated};
use crate::handle::{DEVSHARE_KEY_CAPACITY, DEVSHARE_REF_NAME_CAPACITY};
use crate::refcounter::{self, Watched};
use rustc_hash::FxHashMap;

use std::sync::Arc;

mod kept;
mod registry;
use kept::close_evicted;
pub(crate) use kept::{keep_limits, pin, retire, retire_all, KeptKey, PinnedWindow};
pub use kept::{kept_idle, pinned};
use registry::*;

/// Number of allocations currently mapped by imports in this process.
pub fn cached_allocations() -> usize {
    registry().allocs.len()
}

/// Return the reference a handle carries without using it (validated first). A host handle
/// in flight also owes the count in its object's header: an import takes that over and its
/// release returns both, so it is imported and released at once. The flag is checked against
/// the producer's record either way.
pub fn discard_handle(h: &DevshareHandle) -> Result<()> {
    crate::handle::validate(h)?;
    if h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT != 0 {
        import(h, ImportRequest::default())?.release();
        return Ok(());
    }
    discard(h.ref_name_bytes(), h.ref_slot)
}

/// Return a reference without importing: decrement the ref-counter slot `slot` of `name` once
/// (a consumer that received a handle or a PyTorch tuple and will not use it). Refused while an
/// import in this process holds that reference: its release returns it.
pub fn discard(name: &[u8], slot: u64) -> Result<()> {
    if name.is_empty() {
        return Ok(()); // no ref-counter: nothing to return
    }
    if name.len() > DEVSHARE_REF_NAME_CAPACITY || !crate::handle::is_shm_name(name) {
        return Err(Error::InvalidArgument(format!(
            "ref-counter name {:?} is not a shm name of at most {DEVSHARE_REF_NAME_CAPACITY} bytes",
            String::from_utf8_lossy(name)
        )));
    }
    if slot >= crate::handle::DEVSHARE_REF_SLOTS {
        return Err(Error::InvalidArgument(format!(
            "slot {slot} is beyond the {} slots",
            crate::handle::DEVSHARE_REF_SLOTS
        )));
    }
    let mut t = Ticket { name_len: name.len() as u32, name: [0; DEVSHARE_REF_NAME_CAPACITY], slot };
    t.name[..name.len()].copy_from_slice(name);
    let reg = registry();
    if reg.tickets.contains_key(&t) {
        return Err(Error::Busy(
            "an import in this process holds this reference; releasing that import returns it".into(),
        ));
    }
    let Some(rc) = Watched::open(name)? else {
        return Ok(()); // the producer is gone
    };
    rc.check(slot)?;
    // Not a handle with an in-flight reference (those are imported and released): the
    // producer must not have recorded one for this slot.
    rc.check_inflight(slot, false)?;
    rc.release(slot);
    Ok(())
}

/// What a delivery layer (the channel) attaches to an import it handed over: the reference
/// that goes back to the producer — when the last clone of the import is released (dropping it
/// gives it back), or earlier with [`Import::give_back`]. The import layer knows this contract
/// only; the channel implements it.
pub trait Lease: Send + Sync {
    /// Give the reference back now. Once: later calls, and the drop, send nothing.
    fn give_back(&self);
    /// The pool and slot, when the import is a pool item.
    fn pool_slot(&self) -> Option<(u32, u32)> {
        None
    }
    /// The name its sender gave the reference (a channel lease's), if any.
    fn name(&self) -> Option<&std::ffi::CStr> {
        None
    }
    /// The lease as `Any`, for its implementer to find its own kind again (the channel gives
    /// back many leases of one connection in one message); `None`: not offered.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
    /// An import holding `self` was cloned ([`Import::clone_ref`]): the clone holds it too (its
    /// `Arc` is counted already; a lease that counts its holders itself counts one more).
    fn held(&self) {}
    /// How many imports hold `self`, when the lease counts them itself; `None`: each holds an
    /// `Arc` of it and nothing else does (its strong count).
    fn holders(&self) -> Option<usize> {
        None
    }
    /// The import holding `self` is released (`husk`: its box, emptied, when it was boxed):
    /// drop it (the last holder's drop gives the reference back). A lease may instead give back
    /// and keep itself, and the husk, for its next use when this was the last holder, so that
    /// an item allocates neither again ([`Import::derive`] takes the husk).
    fn done(self: Arc<Self>, husk: Option<Box<Import>>) {
        // The lease first, then the husk (a pool item's keeps its parent, the mapping).
        drop(self);
        drop(husk);
    }
}

/// One import of one handle. Release it with [`Import::release`] (dropping it releases too).
pub struct Import {
    /// What returns this import's reference over a channel (its last clone drops it); `None`
    /// for imports whose reference lives in a ref-counter (or nowhere).
    lease: Option<Arc<dyn Lease>>,
    key: AllocKey,
    ticket: Option<Ticket>,
    /// The ticket's ref-counter mapping (shared with the other imports holding references in it).
    watch: Option<Arc<Watched>>,
    mapping: Option<Arc<dyn Mapping>>,
    /// Boxed: an import moves through a few results on a channel item's path, and the handle is
    /// most of its size.
    handle: Box<DevshareHandle>,
    validated: Validated,
    /// A view of another import's allocation ([`Import::derive`], a pool item): that import,
    /// which holds the registry's count, the ticket, the ref-counter and the mapping for it
    /// (`mapping` is `None` here), kept until this one (and its clones) go. Such an import never
    /// takes the registry's lock.
    parent: Option<Arc<Import>>,
    /// The fork generation at import: released in a forked child, it gives back nothing.
    generation: Stamp,
    /// The import this one's handle and validation were last derived from ([`Import::derive`]),
    /// kept with its husk: an item of the same layout from the same pool import is its handle
    /// and validation again. A `Weak`, so that its address is never another import's.
    derived_from: std::sync::Weak<Import>,
}

/// Where an import lies in this process's memory.
#[derive(Clone, Copy, Debug)]
pub struct ImportView {
    /// The tensor's first element.
    pub data: *mut u8,
    /// The storage's first byte.
    pub storage: *mut u8,
    /// The allocation's first byte.
    pub base: *mut u8,
    /// Whether the mapping is read-only.
    pub read_only: bool,
    /// Device the allocation was imported on.
    pub device: i32,
}

/// Import the allocation a handle names (or take another reference to the cached mapping).
pub fn import(h: &DevshareHandle, req: ImportRequest) -> Result<Import> {
    import_full(h, None, req)
}

/// [`import`] for a segmented handle whose segment table travelled next to it (`table`).
pub fn import_full(h: &DevshareHandle, table: Option<&[u8]>, req: ImportRequest) -> Result<Import> {
    import_from(h, table, req, None, None, None)
}

/// An allocation that arrived next to its handle (a memfd over a channel) instead of being opened
/// by the handle's key.
pub(crate) struct Attached<'a> {
    /// Registry key of the allocation, computed by the receiver from what it received (never
    /// taken from the handle), so that two allocations can never share a cache entry.
    pub key: &'a [u8],
    /// Maps it, on a cache miss.
    pub open: &'a mut dyn FnMut() -> Result<Box<dyn Mapping>>,
}

/// Import `h` (with its segment table when it is not inline), whose allocation came with it
/// when `attached` says so, or whose segments' descriptors came with it (`passed`), holding
/// `lease` until the import and its clones are released.
pub(crate) fn import_attached(
    h: &DevshareHandle,
    table: Option<&[u8]>,
    req: ImportRequest,
    attached: Option<Attached<'_>>,
    passed: Option<&crate::backend::PassedFds>,
    lease: Option<Arc<dyn Lease>>,
) -> Result<Import> {
    let mut imp = import_from(h, table, req, attached, passed, None)?;
    imp.lease = lease;
    Ok(imp)
}

/// Another import of `h`, a view of the allocation a channel connection keeps (`kept`: the
/// allocation a received share of the same export was opened from, with its descriptors): taken
/// from the registry's open or idle entry of that allocation, never opened anew by what `h`
/// claims. `NotFound` when the allocation is no longer mapped here (evicted); `Mismatch` when
/// `h` names another allocation.
pub(crate) fn import_kept(kept: &KeptKey, h: &DevshareHandle, table: Option<&[u8]>) -> Result<Import> {
    let key = &kept.0;
    let mut miss = || -> Result<Box<dyn crate::backend::Mapping>> { Err(kept_gone()) };
    let attached = (h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_CHANNEL != 0)
        .then(|| Attached { key: &key.key[..key.key_len as usize], open: &mut miss });
    let req = ImportRequest { scope: key.scope, ..ImportRequest::default() };
    import_from(h, table, req, attached, None, Some(key))
}

/// What [`import_kept`] finds when its allocation was unmapped here since (evicted).
fn kept_gone() -> Error {
    Error::NotFound("the kept allocation is no longer mapped in this process".into())
}

/// `expect`: the registry key the allocation must have, and only its registry entry is used
/// (a miss is `NotFound`; [`import_kept`]).
fn import_from(
    h: &DevshareHandle,
    table: Option<&[u8]>,
    req: ImportRequest,
    mut attached: Option<Attached<'_>>,
    passed: Option<&crate::backend::PassedFds>,
    expect: Option<&AllocKey>,
) -> Result<Import> {
    let generation = Stamp::now();
    let validated = check_importable(h, attached.as_ref())?;
    let segments = crate::handle::segments::SegmentTable::of(h, table)?;
    check_host(h)?;
    let backend = backend::get(h.backend)?;
    let device = backend.import_device(h, &req)?;
    let req = ImportRequest { device: Some(device), ..req };
    // The producer's event first, before anything is registered: a failed wait leaves nothing
    // to undo, and the handle's reference stays with the caller (who may retry).
    wait_for_producer(h, &req)?;
    let mut key = alloc_key(h, attached.as_ref(), segments.as_ref(), device, req.read_only);
    // An allocation known by its producer's fd numbers is mapped for whom the request says
    // (`ImportRequest::scope`: a channel connection alone, or the whole process).
    if key.segments.as_ref().is_some_and(|s| s.2 != 0) {
        key.scope = req.scope;
    }
    if expect.is_some_and(|e| *e != key) {
        return Err(Error::Mismatch("the handle names another allocation than the one kept for it".into()));
    }
    // A key from the handle alone (no descriptor arrived with it) is never opened here.
    let lookup_only = expect.is_some() && attached.is_none();
    let (ticket, inflight) = ticket_of(h)?;
    let mut pending = Pending::new(&key, ticket.as_ref(), inflight, h.backend, device);
    pending.claim_reference()?;
    let mapping = pending.map(h, &validated, || {
        Ok(match (segments.as_ref(), attached.as_mut()) {
            _ if lookup_only => return Err(kept_gone()),
            (_, Some(a)) => (a.open)()?.into(),
            (Some(t), None) => backend.import_segmented(h, t, &validated, &req, passed)?.into(),
            (None, None) => backend.import(h, &validated, &req)?.into(),
        })
    })?;
    if pending.first && inflight {
        mapping.take_over_inflight();
        if let Some(w) = &pending.watch {
            w.drop_inflight_count();
        }
    }
    let watch = pending.commit();
    Ok(Import {
        lease: None,
        key,
        ticket,
        watch,
        mapping: Some(mapping),
        handle: Box::new(*h),
        validated,
        parent: None,
        generation,
        derived_from: std::sync::Weak::new(),
    })
}

/// Step 1: the handle is valid, and importable by this path (a channel memfd handle only with
/// its descriptor; an attached allocation's key fits the registry).
fn check_importable(h: &DevshareHandle, attached: Option<&Attached<'_>>) -> Result<Validated> {
    let validated = validate(h)?;
    if h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_CHANNEL != 0 && attached.is_none() {
        return Err(Error::Unsupported(
            "this handle describes host memory passed over a devshare channel (a sealed memfd that \
             travels next to it): it cannot be imported on its own; devshare_connection_recv opens it"
                .into(),
        ));
    }
    if attached.is_some_and(|a| a.key.is_empty() || a.key.len() > DEVSHARE_KEY_CAPACITY) {
        return Err(Error::Internal("an attached allocation's key must be 1..=128 bytes".into()));
    }
    Ok(validated)
}

/// Step 2: the handle was made on this machine (when both sides know their boot id).
fn check_host(h: &DevshareHandle) -> Result<()> {
    let local = crate::hostid::host_id();
    if h.host_id != [0; 16] && local != [0; 16] && h.host_id != local {
        return Err(Error::WrongHost(format!(
            "the handle's host_id {} is not this machine's boot id {}: handles only work on the \
             machine that made them",
            hex(&h.host_id),
            hex(&local)
        )));
    }
    Ok(())
}

/// The one place an import waits for its producer's work: the interprocess event a handle (or a
/// pool item) carries, opened, waited on by `req.stream` (or this thread), destroyed. Not for a
/// handle whose reference was already returned: its producer may have destroyed the event.
pub(crate) fn wait_for_producer(h: &DevshareHandle, req: &ImportRequest) -> Result<()> {
    if !carries_event(h)? {
        return Ok(());
    }
    backend::get(h.backend)?.wait_event(h, req)
}

/// Whether `h` carries an event to wait on (an error for a handle whose reference was already
/// returned: its producer may have destroyed the event).
pub(crate) fn carries_event(h: &DevshareHandle) -> Result<bool> {
    if h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_EVENT == 0 {
        return Ok(false);
    }
    if h.ref_name_len > 0 {
        refcounter::check_outstanding(h.ref_name_bytes(), h.ref_slot)?;
    }
    Ok(true)
}

/// Step 3: the registry key of the allocation: by what arrived with the handle when the
/// allocation was attached (never what the handle claims), else by its key, with the whole
/// segment table for segmented allocations.
fn alloc_key(
    h: &DevshareHandle,
    attached: Option<&Attached<'_>>,
    segments: Option<&crate::handle::segments::SegmentTable<'_>>,
    device: i32,
    read_only: bool,
) -> AllocKey {
    let (key_len, key) = match attached {
        Some(a) => {
            let mut k = [0u8; DEVSHARE_KEY_CAPACITY];
            k[..a.key.len()].copy_from_slice(a.key);
            (a.key.len() as u32, k)
        }
        None => (h.key_len, h.key),
    };
    AllocKey {
        backend: h.backend,
        device,
        read_only,
        key_len,
        key,
        segments: segments.map(|t| {
            // fd numbers mean something only in their producer; shareable and fabric
            // handles are global, so the same pages from a tuple (no pid) and from a
            // devshare handle share one mapping.
            let pid = if t.seg.kind == crate::handle::segments::DEVSHARE_SEGMENTS_CUDA_FD { t.producer_pid } else { 0 };
            Arc::new((t.seg.segment_size, t.seg.kind, pid, t.table.to_vec()))
        }),
        scope: 0,
    }
}

/// Step 4: the reference the handle carries (its ticket), and whether it is in flight.
fn ticket_of(h: &DevshareHandle) -> Result<(Option<Ticket>, bool)> {
    let ticket =
        (h.ref_name_len > 0).then_some(Ticket { name_len: h.ref_name_len, name: h.ref_name, slot: h.ref_slot });
    let inflight = h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT != 0;
    if inflight && ticket.is_none() {
        return Err(Error::Untrusted(
            "the handle says it carries an in-flight reference but names no ref-counter: devshare \
             records every in-flight share in its producer's ref-counter, and this one has no record"
                .into(),
        ));
    }
    Ok((ticket, inflight))
}

impl<'a> Pending<'a> {
    fn new(key: &'a AllocKey, ticket: Option<&'a Ticket>, inflight: bool, backend: u16, device: i32) -> Self {
        Pending {
            reg: registry(),
            key,
            ticket,
            inflight,
            backend,
            device,
            watch: None,
            watched: false,
            counted: false,
            first: false,
            opening: false,
            committed: false,
        }
    }

    /// Step 5, the reference: this import is the first in this process to hold it (then it must
    /// still be outstanding, the in-flight flag must match the producer's record, and an
    /// in-flight reference is claimed now), or shares it with the imports holding it. It counts
    /// from here on, so that a release of the others meanwhile leaves the reference to this
    /// import.
    fn claim_reference(&mut self) -> Result<()> {
        let Some(t) = self.ticket else { return Ok(()) };
        while self.reg.tickets.get(t).is_some_and(|u| u.claiming) {
            self.reg.wait();
        }
        self.watch = self.reg.watch(t)?;
        self.watched = true;
        match self.reg.tickets.get(t) {
            Some(held) if held.inflight != self.inflight => {
                return Err(Error::Untrusted(format!(
                    "an import in this process holds this reference from a handle {} the in-flight \
                     flag, and this handle says otherwise: one of them was altered",
                    if held.inflight { "with" } else { "without" }
                )));
            }
            Some(_) => {}
            None => {
                first_check(self.watch.as_deref(), t, self.inflight)?;
                self.first = true;
            }
        }
        let first = self.first;
        let held = self.reg.tickets.entry(t.clone()).or_insert(TicketUse {
            users: 0,
            inflight: self.inflight,
            claiming: false,
        });
        held.users += 1;
        held.claiming = first;
        self.counted = true;
        Ok(())
    }

    /// Step 6, the allocation: the cached mapping (one more user), or mapped now by `open`,
    /// without the lock; a mapping that does not hold the handle's storage is refused.
    fn map(
        &mut self,
        h: &DevshareHandle,
        validated: &Validated,
        open: impl FnOnce() -> Result<Arc<dyn Mapping>>,
    ) -> Result<Arc<dyn Mapping>> {
        let mut open = Some(open);
        loop {
            match self.reg.allocs.get_mut(self.key) {
                Some(Slot::Open { mapping, users, .. }) => {
                    check_view(mapping.as_ref(), h, validated)?;
                    *users += 1;
                    return Ok(mapping.clone());
                }
                Some(Slot::Idle { mapping, .. }) => {
                    // Kept mapped since its last import went: used again as it is.
                    check_view(mapping.as_ref(), h, validated)?;
                    return Ok(kept::reuse_idle(&mut self.reg, self.key).expect("the slot is idle"));
                }
                Some(Slot::Opening | Slot::Closing) => self.reg.wait(),
                None => {
                    self.reg.allocs.insert(self.key.clone(), Slot::Opening);
                    self.opening = true;
                    self.reg.unlock();
                    let open = open.take().expect("an allocation is opened once per import");
                    // A mapping that does not hold the handle's storage is undone here, still
                    // without the lock.
                    let opened = open().and_then(|m| check_view(m.as_ref(), h, validated).map(|()| m));
                    self.reg.relock();
                    let mapping = opened?;
                    self.reg
                        .allocs
                        .insert(self.key.clone(), Slot::Open { mapping: mapping.clone(), users: 1, kept: None });
                    self.opening = false;
                    CHANGED.notify_all();
                    return Ok(mapping);
                }
            }
        }
    }
}

/// An import under way: the registry (locked, or let go around the vendor open) and what the
/// import registered so far. Dropped before [`Pending::commit`] — an error, or a panic in a
/// backend — it undoes exactly that and wakes the imports waiting on it.
struct Pending<'a> {
    reg: RegistryGuard,
    key: &'a AllocKey,
    ticket: Option<&'a Ticket>,
    inflight: bool,
    backend: u16,
    device: i32,
    /// The ticket's ref-counter mapping.
    watch: Option<Arc<Watched>>,
    /// One more user of the ticket's ref-counter mapping is registered.
    watched: bool,
    /// This import counts among the ticket's users.
    counted: bool,
    /// This import is the first holder of the reference (it checked and claimed it).
    first: bool,
    /// The allocation's slot says `Opening` on this import's behalf.
    opening: bool,
    committed: bool,
}

impl Pending<'_> {
    /// The import succeeded: its registrations stand; the reference, if this import claimed it,
    /// is now shared with the imports that waited. Returns the ref-counter mapping.
    fn commit(mut self) -> Option<Arc<Watched>> {
        if let (Some(t), true) = (self.ticket, self.first) {
            if let Some(held) = self.reg.tickets.get_mut(t) {
                held.claiming = false;
            }
            CHANGED.notify_all();
        }
        self.committed = true;
        self.watch.take()
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        self.reg.relock();
        let mut changed = false;
        if self.opening {
            self.reg.allocs.remove(self.key);
            if self.reg.allocs.is_empty() {
                self.reg.allocs = FxHashMap::default();
            }
            changed = true;
        }
        let mut give_back = None;
        let mut last_watch = None;
        if let Some(t) = self.ticket {
            if self.counted {
                if let Some(held) = self.reg.tickets.get_mut(t) {
                    held.users -= 1;
                    if self.first {
                        held.claiming = false;
                        changed = true;
                    }
                    if held.users == 0 {
                        self.reg.tickets.remove(t);
                        if self.reg.tickets.is_empty() {
                            self.reg.tickets = FxHashMap::default();
                        }
                        // A first holder that failed leaves the reference with the caller (who
                        // may retry). A later import that failed after every import it shared
                        // the reference with was released returns it for them.
                        if !self.first {
                            give_back = Some(t.slot);
                        }
                    }
                }
            }
            if self.first && self.inflight {
                if let Some(w) = &self.watch {
                    w.unclaim_inflight(t.slot);
                }
            }
            if self.watched {
                last_watch = self.reg.unwatch(t);
            }
        }
        self.reg.unlock();
        if changed {
            CHANGED.notify_all();
        }
        if let Some(slot) = give_back {
            if let Ok(b) = backend::get(self.backend) {
                b.synchronize(self.device);
            }
            if let Some(w) = &self.watch {
                w.release(slot);
            }
        }
        drop(last_watch);
    }
}

/// Whether a mapping holds the handle's allocation: it is at least `alloc_size` bytes (for an
/// ACL key import: the device memory bounding it), and the storage and tensor lie inside it at
/// addresses that do not wrap ([`view_pointers`]).
fn check_view(m: &dyn Mapping, h: &DevshareHandle, v: &Validated) -> Result<()> {
    if m.size() < h.alloc_size {
        return Err(Error::Mismatch(format!(
            "the {} mapping of this allocation is {} bytes but the handle's alloc_size is {}",
            h.backend_name(),
            m.size(),
            h.alloc_size
        )));
    }
    if view_pointers(m.base(), m.size(), h, v).is_none() {
        return Err(Error::StorageOutOfBounds(format!(
            "storage_offset {} + storage_size {} (tensor at byte {}) does not fit the {}-byte mapping at {:p}",
            h.storage_offset,
            h.storage_size,
            v.data_offset,
            m.size(),
            m.base()
        )));
    }
    Ok(())
}

/// The storage's and the tensor's first byte in a mapping of `size` bytes at `base`, or `None`
/// unless the storage lies inside the mapping, the tensor's first byte inside the storage (its
/// end included, for an empty tensor), and `base + storage end` does not wrap the address
/// space. Nothing is formed before those checks, and only with wrapping arithmetic, so no
/// pointer outside the mapping ever exists.
fn view_pointers(base: *mut u8, size: u64, h: &DevshareHandle, v: &Validated) -> Option<(*mut u8, *mut u8)> {
    let storage_end = h.storage_offset.checked_add(h.storage_size)?;
    if storage_end > size || v.data_offset < h.storage_offset || v.data_offset > storage_end {
        return None;
    }
    (base as usize).checked_add(usize::try_from(storage_end).ok()?)?;
    Some((base.wrapping_add(h.storage_offset as usize), base.wrapping_add(v.data_offset as usize)))
}

/// The first import of a reference in this process: it must still be outstanding, and the
/// handle's in-flight flag must be what the producer recorded; an in-flight reference is claimed
/// (its record bit cleared) here, before anything else is touched.
fn first_check(watch: Option<&Watched>, t: &Ticket, inflight: bool) -> Result<()> {
    match watch {
        None if inflight => Err(Error::NotFound(format!(
            "ref-counter {} does not exist, so the in-flight reference the handle claims cannot be \
             checked against its producer's record (it was already taken over, or the exporter \
             closed with DEVSHARE_CLOSE_UNLINK)",
            String::from_utf8_lossy(t.name())
        ))),
        None => Ok(()), // the producer stopped tracking: nothing to check or return
        Some(w) => {
            w.check(t.slot)?;
            if inflight {
                w.claim_inflight(t.slot)
            } else {
                w.check_inflight(t.slot, false)
            }
        }
    }
}

impl Import {
    /// The handle this import was made from.
    pub fn handle(&self) -> &DevshareHandle {
        &self.handle
    }

    /// What validation derived from the handle.
    pub fn validated(&self) -> &Validated {
        &self.validated
    }

    /// Pointers into this process's mapping.
    ///
    /// Checked against the mapping's size (for an ACL key import: the device memory bounding
    /// it): the import checked it already (`check_view`), and a storage outside the mapping
    /// panics here rather than forming a pointer outside it.
    pub fn view(&self) -> ImportView {
        let m = self.mapping().expect("mapping present until release");
        let base = m.base();
        let (storage, data) = view_pointers(base, m.size(), &self.handle, &self.validated)
            .expect("an import's storage lies inside its mapping (checked when it was imported)");
        ImportView { data, storage, base, read_only: self.key.read_only, device: self.device() }
    }

    /// The device the allocation is mapped on.
    pub fn device(&self) -> i32 {
        self.mapping().and_then(|m| m.device()).unwrap_or(self.key.device)
    }

    /// The mapping: this import's, or for a pool item its parent's.
    fn mapping(&self) -> Option<&Arc<dyn Mapping>> {
        match &self.parent {
            Some(p) => p.mapping(),
            None => self.mapping.as_ref(),
        }
    }

    /// Another import of the same handle: shares this one's mapping and reference (both must be
    /// released; the reference is returned when the last is). Costs a registry lock (none for a
    /// pool item), no mapping.
    pub fn clone_ref(&self) -> Import {
        let lease = self.lease.clone();
        if let Some(l) = &lease {
            l.held();
        }
        self.clone_with(self.handle.clone(), self.validated, lease)
    }

    /// [`Self::clone_ref`] with another handle (of the same allocation), its validation and lease.
    fn clone_with(&self, handle: Box<DevshareHandle>, validated: Validated, lease: Option<Arc<dyn Lease>>) -> Import {
        let clone = Import {
            lease,
            key: self.key.clone(),
            ticket: self.ticket.clone(),
            watch: self.watch.clone(),
            mapping: self.mapping.clone(),
            handle,
            validated,
            parent: self.parent.clone(),
            generation: self.generation,
            derived_from: std::sync::Weak::new(),
        };
        if !self.generation.is_current() || clone.parent.is_some() {
            // A forked child's copy of its parent's import: the clone is as inert as it is. A
            // pool item's clone: its parent holds the counts.
            return clone;
        }
        let mut reg = registry();
        match reg.allocs.get_mut(&self.key) {
            Some(Slot::Open { users, .. }) => *users += 1,
            _ => unreachable!("an unreleased import's allocation is open"),
        }
        if let Some(t) = &self.ticket {
            reg.tickets.get_mut(t).expect("an unreleased import holds its ticket").users += 1;
            reg.watched.get_mut(&t.ref_counter()).expect("an unreleased import watches its ref-counter").users += 1;
        }
        clone
    }

    /// Which pool slot this import is, when it is a pool item received over a channel.
    pub fn pool_slot(&self) -> Option<(u32, u32)> {
        self.lease.as_ref()?.pool_slot()
    }

    /// The name the producer gave this lease (`devshare_channel_send_named`), if any.
    pub fn name(&self) -> Option<&std::ffi::CStr> {
        self.lease.as_ref()?.name()
    }

    /// What gives this import's reference back over a channel, if it came over one.
    pub(crate) fn lease(&self) -> Option<&Arc<dyn Lease>> {
        self.lease.as_ref()
    }

    /// For an import that came with a [`Lease`] (a channel item): give its reference back to the
    /// producer now — a lease stops counting, a pool slot may be refilled — while this import
    /// stays mapped until it is released (which then sends nothing). What is read from it after
    /// this is whatever the producer writes there next; it never faults.
    pub fn give_back(&self) -> Result<()> {
        let lease = self.lease.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "this import did not come over a channel: its reference goes back when it is released".into(),
            )
        })?;
        lease.give_back();
        Ok(())
    }

    /// Another view of this import's allocation — its handle with the layout `layout` (and the
    /// producer's `event`, when it sent one), checked against the mapping — holding `lease` until
    /// it and its clones are released. Used for pool slots: the allocation was imported once,
    /// each item is a view of it.
    /// Boxed: a received item's import travels up the receive path and out through the C API
    /// as this box (an import is 320 bytes).
    /// Holds `base` (not the registry): an item takes no registry lock, made or released; made
    /// in `husk` (an earlier item's box, see [`Lease::done`]) when there is one, its handle
    /// written in place. Refused, it releases `lease` as an import holding it would be
    /// ([`Lease::done`]).
    pub(crate) fn derive(
        base: &Arc<Import>,
        layout: &crate::handle::Layout,
        event: Option<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]>,
        lease: Arc<dyn Lease>,
        husk: Option<Box<Import>>,
    ) -> Result<Box<Import>> {
        match Self::derive_view(base, layout, event, husk) {
            Ok(mut imp) => {
                imp.lease = Some(lease);
                Ok(imp)
            }
            Err(e) => {
                lease.done(None);
                Err(e)
            }
        }
    }

    /// [`Self::derive`] but for the lease (`None` here).
    fn derive_view(
        base: &Arc<Import>,
        layout: &crate::handle::Layout,
        event: Option<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]>,
        husk: Option<Box<Import>>,
    ) -> Result<Box<Import>> {
        let m = base.mapping().ok_or_else(|| Error::AlreadyReleased("the pool's import is released".into()))?;
        // An emptied import (nothing to release but the parent it keeps, see `release_boxed`):
        // only its fields are set again.
        let mut imp = match husk.filter(|i| i.mapping.is_none() && i.lease.is_none()) {
            Some(imp) => imp,
            None => Box::new(Import {
                lease: None,
                key: base.key.clone(),
                ticket: None,
                watch: None,
                mapping: None,
                handle: Box::new(*base.handle),
                validated: base.validated,
                parent: None,
                generation: base.generation,
                derived_from: std::sync::Weak::new(),
            }),
        };
        // The pool's handle passed `validate` when it was imported; an item changes its layout
        // only (checked alone), or also carries an event (then the whole handle is checked).
        // A husk last derived from this very import (its handle immutable while it lives), with
        // this layout and no event, holds exactly the handle `relayout` would write, and its
        // validation: kept as they are.
        let h = &mut *imp.handle;
        let same = event.is_none()
            && std::ptr::eq(imp.derived_from.as_ptr(), Arc::as_ptr(base))
            && layout.is_of(h)
            && h.flags == base.handle.flags
            && crate::handle::same(&h.event_handle, &base.handle.event_handle);
        let validated = if same { imp.validated } else { crate::handle::relayout(&base.handle, layout, event, h)? };
        if h.backend != base.handle.backend || h.alloc_size != base.handle.alloc_size {
            return Err(Error::Mismatch("a pool item must describe the pool's own allocation".into()));
        }
        check_view(m.as_ref(), h, &validated)?;
        imp.key.clone_from(&base.key);
        imp.ticket = None;
        imp.watch = None;
        imp.validated = validated;
        // A husk keeps its last item's parent: for the same pool import no count is taken.
        if !imp.parent.as_ref().is_some_and(|p| Arc::ptr_eq(p, base)) {
            imp.parent = Some(base.clone());
        }
        imp.generation = base.generation;
        if !std::ptr::eq(imp.derived_from.as_ptr(), Arc::as_ptr(base)) {
            imp.derived_from = Arc::downgrade(base);
        }
        Ok(imp)
    }

    /// Release a boxed import (what the C API hands out): a pool item's box goes to its lease
    /// ([`Lease::done`]), emptied, for the slot's next item. The husk keeps its parent (the
    /// pool's import, which holds the mapping): the next item of the same pool import takes no
    /// count of it, and whoever drops the husk drops the parent with it.
    pub fn release_boxed(mut imp: Box<Import>) {
        if imp.parent.is_none() || !imp.generation.is_current() {
            return drop(imp);
        }
        let device = imp.device();
        // The order of `release`: the lease (after this process's work on the memory), then the
        // parent (which holds the mapping): a lease's `done` drops the husk after the lease.
        match imp.lease.take() {
            Some(lease) => {
                if last_holder(&lease) {
                    if let Ok(b) = backend::get(imp.key.backend) {
                        b.synchronize(device);
                    }
                }
                lease.done(Some(imp));
            }
            None => drop(imp),
        }
    }

    /// Release this import, in PyTorch's order: drop the mapping (unmapping it when this was the
    /// last user in the process), then return the handle's ref-counter reference when this was
    /// the last import holding it.
    pub fn release(mut self) {
        self.release_inner();
    }

    fn release_inner(&mut self) {
        if !self.generation.is_current() {
            // A forked child's copy of its parent's import: the mapping, its counts and the
            // reference are the parent's. Forget them (the child's copy of the mapping stays
            // until it exits).
            std::mem::forget(self.mapping.take());
            std::mem::forget(self.watch.take());
            std::mem::forget(self.lease.take());
            std::mem::forget(self.parent.take());
            return;
        }
        let device = self.device();
        if let Some(parent) = self.parent.take() {
            // A pool item: its parent holds the registry's count and the mapping; the slot goes
            // back with the last clone, once this process's work on the memory is done.
            self.give_lease_back(device);
            drop(parent);
            return;
        }
        let Some(mapping) = self.mapping.take() else { return };
        let mut return_ticket = false;
        let mut last_watch = None;
        let mut closing = false;
        let mut evicted = Vec::new();
        {
            let mut reg = registry();
            if let Some(slot) = reg.allocs.get_mut(&self.key) {
                let last = match slot {
                    Slot::Open { users, .. } => {
                        *users -= 1;
                        *users == 0
                    }
                    Slot::Opening | Slot::Closing | Slot::Idle { .. } => false,
                };
                let kept = match slot {
                    Slot::Open { kept, .. } => *kept,
                    _ => None,
                };
                if let (true, Some(owner), true) = (last, kept, keep_limits().0 > 0) {
                    // (1') Kept for its producer's next lease: idle, still mapped.
                    evicted = kept::make_idle(&mut reg, &self.key, owner);
                } else if last {
                    // (1) The last user unmaps / closes the vendor import, after letting the lock
                    // go: meanwhile the slot says closing, so an import of the same allocation
                    // waits for the close (CUDA refuses a second open before it) while imports
                    // and releases of other allocations go on.
                    *slot = Slot::Closing;
                    closing = true;
                }
            }
            if let Some(t) = &self.ticket {
                last_watch = reg.unwatch(t);
                if let Some(n) = reg.tickets.get_mut(t) {
                    n.users -= 1;
                    if n.users == 0 {
                        reg.tickets.remove(t);
                        return_ticket = true;
                        if reg.tickets.is_empty() {
                            reg.tickets = FxHashMap::default();
                        }
                    }
                }
            }
        }
        if closing {
            let closed = CloseDone(&self.key);
            // (1) the last reference to the mapping: device synchronisation and vendor close.
            drop(mapping);
            drop(closed);
        } else {
            drop(mapping);
        }
        close_evicted(evicted);
        // (2) finish this process's work on the memory, (3..5) return the reference.
        if return_ticket {
            if let Ok(b) = backend::get(self.key.backend) {
                b.synchronize(device);
            }
            let t = self.ticket.as_ref().expect("ticket present");
            if let Some(w) = &self.watch {
                w.release(t.slot);
            }
        }
        // The ref-counter mapping goes with the last import that held a reference in it.
        self.watch = None;
        drop(last_watch);
        self.give_lease_back(device);
    }

    /// A channel lease goes back with the last clone holding it, once this process's work on
    /// the memory is done.
    fn give_lease_back(&mut self, device: i32) {
        if let Some(lease) = self.lease.take() {
            if last_holder(&lease) {
                if let Ok(b) = backend::get(self.key.backend) {
                    b.synchronize(device);
                }
            }
            lease.done(None);
        }
    }
}

/// Whether the import releasing `lease` is the last holding it (then this process's work on the
/// memory is finished before it goes back).
fn last_holder(lease: &Arc<dyn Lease>) -> bool {
    lease.holders().unwrap_or_else(|| Arc::strong_count(lease)) == 1
}

/// Ends an allocation's closing (also when the close unwinds): removes its slot and wakes the
/// imports waiting to map it again.
struct CloseDone<'a>(&'a AllocKey);

impl Drop for CloseDone<'_> {
    fn drop(&mut self) {
        let mut reg = registry();
        if matches!(reg.allocs.get(self.0), Some(Slot::Closing)) {
            reg.allocs.remove(self.0);
        }
        if reg.allocs.is_empty() {
            // Give the table back when nothing is imported, so that leak checkers see no memory
            // held by an idle library.
            reg.allocs = FxHashMap::default();
        }
        drop(reg);
        CHANGED.notify_all();
    }
}

impl Drop for Import {
    fn drop(&mut self) {
        self.release_inner();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapping of `size` bytes at `base`, never dereferenced.
    struct Fake {
        base: *mut u8,
        size: u64,
    }

    // SAFETY: the address is never dereferenced; the fields never change.
    unsafe impl Send for Fake {}
    // SAFETY: as for Send.
    unsafe impl Sync for Fake {}

    impl Mapping for Fake {
        fn base(&self) -> *mut u8 {
            self.base
        }
        fn size(&self) -> u64 {
            self.size
        }
    }

    const GIB: u64 = 1 << 30;

    fn handle(alloc_size: u64, storage_offset: u64, storage_size: u64) -> (DevshareHandle, Validated) {
        let h = DevshareHandle { alloc_size, storage_offset, storage_size, ..Default::default() };
        (h, Validated { element_size: 1, numel: storage_size, data_offset: storage_offset })
    }

    fn import_of(m: Fake, h: DevshareHandle, v: Validated) -> Import {
        Import {
            lease: None,
            key: AllocKey {
                backend: 0,
                read_only: false,
                device: 0,
                key_len: 0,
                key: [0; DEVSHARE_KEY_CAPACITY],
                segments: None,
                scope: 0,
            },
            ticket: None,
            watch: None,
            mapping: Some(Arc::new(m)),
            handle: Box::new(h),
            validated: v,
            parent: None,
            generation: Stamp::now(),
            derived_from: std::sync::Weak::new(),
        }
    }

    /// A lease that keeps the husk it is given back, as a pool's slot token does.
    struct Keep(std::sync::Mutex<Option<Box<Import>>>);

    impl Lease for Keep {
        fn give_back(&self) {}
        fn done(self: Arc<Self>, husk: Option<Box<Import>>) {
            *self.0.lock().unwrap() = husk;
        }
    }

    /// A pool's import of 4096 bytes at `data` (one byte per element).
    fn pool_import(data: &mut [u8]) -> Arc<Import> {
        let (mut h, v) = handle(4096, 0, 4096);
        h.dtype = crate::dtype::DevshareDType::new(1, 8, 1);
        (h.ndim, h.shape[0], h.strides[0]) = (1, 4096, 1);
        Arc::new(import_of(Fake { base: data.as_mut_ptr(), size: 4096 }, h, v))
    }

    /// An item's layout in a pool import of `pool_import`: `n` bytes in a storage of 1024 at
    /// `offset`.
    fn byte_layout(offset: u64, n: i64) -> crate::handle::Layout {
        let mut l = crate::handle::Layout {
            dtype: crate::dtype::DevshareDType::new(1, 8, 1),
            ndim: 1,
            shape: [0; 8],
            strides: [0; 8],
            storage_offset: offset,
            storage_size: 1024,
            tensor_offset: 0,
        };
        (l.shape[0], l.strides[0]) = (n, 1);
        l
    }

    #[test]
    fn an_items_husk_keeps_its_validation_only_for_the_same_pool_import_layout_and_no_event() {
        let mut data = vec![0u8; 4096];
        let (base, other) = (pool_import(&mut data), pool_import(&mut data));
        let layout = byte_layout;
        let keep = Arc::new(Keep(Default::default()));
        let husk = || keep.0.lock().unwrap().take();
        let item = |base: &Arc<Import>, l, event, husk| Import::derive(base, &l, event, keep.clone(), husk);
        Import::release_boxed(item(&base, layout(1024, 1024), None, None).unwrap());
        // The same import and layout: the husk's validation is kept (marked here to see it).
        let mut h = husk().expect("a husk");
        h.validated.numel = 7;
        Import::release_boxed(item(&base, layout(1024, 1024), None, Some(h)).unwrap());
        let h = husk().expect("a husk");
        assert_eq!(h.validated.numel, 7, "kept");
        // Another layout, another import, an event: validated again.
        let imp = item(&base, layout(2048, 1024), None, Some(h)).unwrap();
        assert_eq!((imp.validated.numel, imp.validated.data_offset), (1024, 2048));
        Import::release_boxed(imp);
        let mut h = husk().expect("a husk");
        h.validated.numel = 7;
        let e = item(&base, layout(2048, 1025), None, Some(h)).err().expect("a tensor past its storage");
        assert!(matches!(e, Error::TensorOutOfBounds(_)), "{e}");
        Import::release_boxed(item(&base, layout(0, 1024), None, None).unwrap());
        let mut h = husk().expect("a husk");
        h.validated.numel = 7;
        let imp = item(&other, layout(0, 1024), None, Some(h)).unwrap();
        assert_eq!(imp.validated.numel, 1024, "another pool import");
        Import::release_boxed(imp);
        let mut h = husk().expect("a husk");
        h.validated.numel = 7;
        let imp = item(&other, layout(0, 1024), Some([1; 64]), Some(h));
        // (Host memory has no events: the whole handle is checked, and refused or not, never kept.)
        assert!(imp.as_ref().map_or(true, |i| i.validated.numel == 1024), "an item with an event");
    }

    #[test]
    fn an_items_husk_keeps_its_pool_import_and_the_next_item_of_it_takes_no_count() {
        let mut data = vec![0u8; 4096];
        let (base, other) = (pool_import(&mut data), pool_import(&mut data));
        let l = byte_layout(0, 1024);
        let keep = Arc::new(Keep(Default::default()));
        let husk = || keep.0.lock().unwrap().take();
        let item = |base: &Arc<Import>, husk| Import::derive(base, &l, None, keep.clone(), husk).unwrap();
        Import::release_boxed(item(&base, None));
        assert_eq!(Arc::strong_count(&base), 2, "the husk keeps the pool import");
        for _ in 0..3 {
            let imp = item(&base, husk());
            assert_eq!(Arc::strong_count(&base), 2, "the item holds the husk's count, no other");
            Import::release_boxed(imp);
            assert_eq!(Arc::strong_count(&base), 2);
        }
        // Another pool import's item in this husk: the old parent goes, the new one is held.
        let imp = item(&other, husk());
        assert_eq!((Arc::strong_count(&base), Arc::strong_count(&other)), (1, 2));
        Import::release_boxed(imp);
        drop(husk());
        assert_eq!(Arc::strong_count(&other), 1, "a husk dropped lets its pool import go");
    }

    #[test]
    fn view_pointers_stay_inside_the_mapping() {
        let base = 0x7f00_0000_0000usize as *mut u8;
        let mib2 = 2 << 20;
        // Inside, up to the last byte, and an empty storage at the very end.
        let (h, v) = handle(mib2, 4096, mib2 - 4096);
        let (s, d) = view_pointers(base, mib2, &h, &v).unwrap();
        assert_eq!((s as usize - base as usize, d as usize - base as usize), (4096, 4096));
        let (h, v) = handle(mib2, mib2, 0);
        assert_eq!(view_pointers(base, mib2, &h, &v).unwrap().0 as usize, base as usize + mib2 as usize);
        // One byte beyond the mapping, a storage at 512 GiB of a 2 MiB mapping, sums that wrap
        // u64, a tensor outside its storage.
        let (h, v) = handle(mib2, 4096, mib2 - 4095);
        assert!(view_pointers(base, mib2, &h, &v).is_none());
        let (h, v) = handle(1 << 40, 512 * GIB, 4096);
        assert!(view_pointers(base, mib2, &h, &v).is_none());
        let (h, v) = handle(u64::MAX, u64::MAX - 10, 20);
        assert!(view_pointers(base, u64::MAX, &h, &v).is_none());
        let (h, mut v) = handle(mib2, 0, 4096);
        v.data_offset = 4097;
        assert!(view_pointers(base, mib2, &h, &v).is_none());
        // A mapping "size" that would carry base + offset past the end of the address space.
        let high = (usize::MAX - 4095) as *mut u8;
        let (h, v) = handle(1 << 62, 1 << 61, 4096);
        assert!(view_pointers(high, 1 << 62, &h, &v).is_none());
    }

    #[test]
    fn check_view_refuses_a_mapping_smaller_than_the_handle_says() {
        let m = Fake { base: 0x1000_0000usize as *mut u8, size: 2 << 20 };
        let (h, v) = handle(1 << 40, 512 * GIB, 4096);
        assert_eq!(check_view(&m, &h, &v).unwrap_err().status(), crate::error::Status::Mismatch);
        let (h, v) = handle(2 << 20, 0, 4096);
        check_view(&m, &h, &v).unwrap();
        // A mapping whose end wraps the address space.
        let m = Fake { base: (usize::MAX - 4095) as *mut u8, size: 1 << 62 };
        let (h, v) = handle(1 << 62, 1 << 61, 4096);
        assert_eq!(check_view(&m, &h, &v).unwrap_err().status(), crate::error::Status::StorageOutOfBounds);
    }

    #[test]
    fn view_never_forms_a_pointer_outside_the_mapping() {
        let base = 0x7f00_0000_0000usize as *mut u8;
        let imp = import_of(Fake { base, size: 2 << 20 }, handle(2 << 20, 8192, 4096).0, handle(2 << 20, 8192, 4096).1);
        let view = imp.view();
        assert_eq!(view.storage as usize, base as usize + 8192);
        assert_eq!(view.data as usize, base as usize + 8192);
        drop(imp);
        // An import whose mapping is smaller than its storage (what a trusted 1 TiB alloc_size
        // over a 2 MiB ACL allocation was) refuses to compute the view.
        let (h, v) = handle(1 << 40, 512 * GIB, 4096);
        let imp = import_of(Fake { base, size: 2 << 20 }, h, v);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| imp.view()));
        assert!(r.is_err(), "view() of a storage outside the mapping must not return pointers");
        drop(imp);
        // At 2^62 the offset is not even addressable from a high base.
        let (h, v) = handle(1 << 62, 1 << 61, 4096);
        let imp = import_of(Fake { base: (usize::MAX - 4095) as *mut u8, size: 1 << 62 }, h, v);
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| imp.view())).is_err());
    }
}
