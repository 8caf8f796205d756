//! Importing handles, and the per-process import registry.
//!
//! The registry caches mappings by allocation — (backend, device, key, access) — not by tensor,
//! because many tensors share one allocation: importing the same allocation twice maps it once,
//! and the mapping goes away when the last import of it is released. It also tracks the
//! ref-counter reference each handle carries (its "ticket": ref-counter name and slot): a ticket
//! held by several imports in this process is returned to the producer exactly once, when the
//! last of them is released. All of it is behind one mutex, so imports and releases may happen on
//! any thread.
//!
//! **In-flight references** (`DEVSHARE_HANDLE_FLAG_INFLIGHT`) are checked against the record the
//! producer keeps in its ref-counter (see [`crate::refcounter`]): a handle whose flag differs is
//! refused, and the first import takes the reference over by clearing the record's bit, so it is
//! taken over once even when a handle reaches several processes.
//!
//! **fork.** A child forked after imports inherits the registry and the mappings, but the
//! counts and references they stand for are the parent's. A `pthread_atfork` child handler
//! (installed by [`crate::shm::generation`]) starts a new generation: the child's registry
//! forgets every inherited import without unmapping, decrementing or unlinking anything (the
//! child's copies of the mappings are leaked until it exits), and releasing an inherited
//! [`Import`] in the child does nothing. The prepare handler takes the registry lock around
//! `fork`, so the child never inherits it held by a thread it does not have.

use crate::backend::{self, ImportRequest, Mapping};
use crate::error::{Error, Result};
use crate::handle::{validate, DevshareHandle, Validated};
use crate::refcounter::{self, Watched};
use crate::handle::{DEVSHARE_KEY_CAPACITY, DEVSHARE_REF_NAME_CAPACITY};
use rustc_hash::FxHashMap;
use std::cell::{Cell, RefCell};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

/// Registry key of an allocation. Fixed-size (no heap allocation on the cache-hit path); the
/// bytes beyond `key_len` are zero, as validation guarantees for the handle.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct AllocKey {
    backend: u16,
    read_only: bool,
    device: i32,
    key_len: u32,
    key: [u8; DEVSHARE_KEY_CAPACITY],
    /// Segmented allocations: segment size, kind, producer pid and the whole table (the key
    /// area holds at most part of it). `None` for single allocations (no heap on their path).
    segments: Option<Arc<SegmentsKey>>,
}

/// What identifies a segmented allocation: segment size, table kind, producer pid, table.
type SegmentsKey = (u64, u16, i32, Vec<u8>);

/// A handle's reference: ref-counter name and slot (fixed-size, like [`AllocKey`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Ticket {
    name_len: u32,
    name: [u8; DEVSHARE_REF_NAME_CAPACITY],
    slot: u64,
}

impl Ticket {
    fn name(&self) -> &[u8] {
        &self.name[..self.name_len as usize]
    }

    fn ref_counter(&self) -> RefName {
        RefName { len: self.name_len, name: self.name }
    }
}

/// A ref-counter object's name (fixed-size, like [`AllocKey`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct RefName {
    len: u32,
    name: [u8; DEVSHARE_REF_NAME_CAPACITY],
}

/// A ref-counter mapping shared by the imports that hold references in it (`None`: the object
/// is gone, the producer stopped tracking).
struct WatchEntry {
    rc: Option<Arc<Watched>>,
    users: usize,
}

struct Entry {
    mapping: Arc<dyn Mapping>,
    users: usize,
}

/// The imports in this process holding one reference, and whether the handle they came from
/// carried an in-flight reference (every later import of it must say the same).
struct TicketUse {
    users: usize,
    inflight: bool,
}

#[derive(Default)]
struct Registry {
    allocs: FxHashMap<AllocKey, Entry>,
    tickets: FxHashMap<Ticket, TicketUse>,
    watched: FxHashMap<RefName, WatchEntry>,
    /// [`crate::shm::generation`] the entries belong to.
    generation: u64,
}

impl Registry {
    /// The ref-counter mapping for `t`, opened on first use; one more user.
    fn watch(&mut self, t: &Ticket) -> Result<Option<Arc<Watched>>> {
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
    fn unwatch(&mut self, t: &Ticket) -> Option<Arc<Watched>> {
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

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);

thread_local! {
    /// Whether this thread holds the registry lock (then `fork` must not wait for it).
    static HOLDS_REGISTRY: Cell<bool> = const { Cell::new(false) };
    /// The registry lock, taken by the atfork prepare handler of the thread that forks.
    static FORK_GUARD: RefCell<Option<MutexGuard<'static, Registry>>> = const { RefCell::new(None) };
}

/// The locked registry (of this process's generation).
struct RegistryGuard(MutexGuard<'static, Registry>);

impl std::ops::Deref for RegistryGuard {
    type Target = Registry;
    fn deref(&self) -> &Registry {
        &self.0
    }
}

impl std::ops::DerefMut for RegistryGuard {
    fn deref_mut(&mut self) -> &mut Registry {
        &mut self.0
    }
}

impl Drop for RegistryGuard {
    fn drop(&mut self) {
        HOLDS_REGISTRY.with(|h| h.set(false));
    }
}

fn registry() -> RegistryGuard {
    let generation = crate::shm::generation();
    // A panic while holding the lock cannot leave the maps half-updated (every update is a single
    // insert/remove/increment), so a poisoned lock is still consistent.
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    HOLDS_REGISTRY.with(|h| h.set(true));
    if reg.generation != generation {
        // A forked child: the entries are the parent's imports. Forget them without releasing
        // anything (no unmap, no vendor close, no decrement, no unlink): leaked, on purpose.
        std::mem::forget(std::mem::take(&mut reg.allocs));
        std::mem::forget(std::mem::take(&mut reg.tickets));
        std::mem::forget(std::mem::take(&mut reg.watched));
        reg.generation = generation;
    }
    RegistryGuard(reg)
}

/// atfork prepare: hold the registry lock across `fork` (unless this thread already holds it:
/// then it releases it itself, in both processes).
pub(crate) fn fork_prepare() {
    if HOLDS_REGISTRY.with(Cell::get) {
        return;
    }
    let guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    FORK_GUARD.with(|g| *g.borrow_mut() = Some(guard));
}

/// atfork parent: let the lock go.
pub(crate) fn fork_parent() {
    FORK_GUARD.with(|g| drop(g.borrow_mut().take()));
}

/// atfork child (after the generation changed): let the lock go; the next use of the registry
/// forgets the parent's entries.
pub(crate) fn fork_child() {
    FORK_GUARD.with(|g| drop(g.borrow_mut().take()));
}

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
        return Err(Error::InvalidArgument(format!("slot {slot} is beyond the {} slots", crate::handle::DEVSHARE_REF_SLOTS)));
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

/// One import of one handle. Release it with [`Import::release`] (dropping it releases too).
pub struct Import {
    key: AllocKey,
    ticket: Option<Ticket>,
    /// The ticket's ref-counter mapping (shared with the other imports holding references in it).
    watch: Option<Arc<Watched>>,
    mapping: Option<Arc<dyn Mapping>>,
    handle: DevshareHandle,
    validated: Validated,
    /// [`crate::shm::generation`] at import: released in a forked child, it gives back nothing.
    generation: u64,
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
    let generation = crate::shm::generation();
    let validated = validate(h)?;
    let segments = crate::handle::segments::SegmentTable::of(h, table)?;
    let local = crate::hostid::host_id();
    if h.host_id != [0; 16] && local != [0; 16] && h.host_id != local {
        return Err(Error::WrongHost(format!(
            "the handle's host_id {} is not this machine's boot id {}: handles only work on the \
             machine that made them",
            hex(&h.host_id),
            hex(&local)
        )));
    }
    let backend = backend::get(h.backend)?;
    let device = backend.import_device(h, &req)?;
    let req = ImportRequest { device: Some(device), ..req };
    // The producer's event first, before anything is registered: a failed wait leaves nothing
    // to undo, and the handle's reference stays with the caller (who may retry). But not for a
    // handle whose reference was already returned: its producer may have destroyed the event.
    if h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_EVENT != 0 {
        if h.ref_name_len > 0 {
            refcounter::check_outstanding(h.ref_name_bytes(), h.ref_slot)?;
        }
        backend.wait_event(h, &req)?;
    }
    let key = AllocKey {
        backend: h.backend,
        device,
        read_only: req.read_only,
        key_len: h.key_len,
        key: h.key,
        segments: segments
            .as_ref()
            .map(|t| {
                // fd numbers mean something only in their producer; shareable and fabric
                // handles are global, so the same pages from a tuple (no pid) and from a
                // devshare handle share one mapping.
                let pid = if t.seg.kind == crate::handle::segments::DEVSHARE_SEGMENTS_CUDA_FD { t.producer_pid } else { 0 };
                Arc::new((t.seg.segment_size, t.seg.kind, pid, t.table.to_vec()))
            }),
    };
    let ticket = (h.ref_name_len > 0).then_some(Ticket {
        name_len: h.ref_name_len,
        name: h.ref_name,
        slot: h.ref_slot,
    });
    let inflight = h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT != 0;
    if inflight && ticket.is_none() {
        return Err(Error::Untrusted(
            "the handle says it carries an in-flight reference but names no ref-counter: devshare \
             records every in-flight share in its producer's ref-counter, and this one has no record"
                .into(),
        ));
    }

    let mut reg = registry();
    // The ref-counter, and whether this import is the first in this process to hold the
    // handle's reference (then the reference must still be outstanding, the in-flight flag must
    // match the producer's record, and an in-flight reference is claimed now).
    let (watch, first_holder) = match &ticket {
        None => (None, true),
        Some(t) => {
            let watch = reg.watch(t)?;
            let verdict = match reg.tickets.get(t) {
                Some(held) if held.inflight != inflight => Err(Error::Untrusted(format!(
                    "an import in this process holds this reference from a handle {} the in-flight \
                     flag, and this handle says otherwise: one of them was altered",
                    if held.inflight { "with" } else { "without" }
                ))),
                Some(_) => Ok(false),
                None => first_check(watch.as_deref(), t, inflight).map(|()| true),
            };
            match verdict {
                Ok(first) => (watch, first),
                Err(e) => {
                    reg.unwatch(t);
                    return Err(e);
                }
            }
        }
    };
    let mapping = match map_allocation(&mut reg, &key, h, segments.as_ref(), &validated, &req, backend) {
        Ok(m) => m,
        Err(e) => {
            if let Some(t) = &ticket {
                if first_holder && inflight {
                    if let Some(w) = &watch {
                        w.unclaim_inflight(t.slot);
                    }
                }
                reg.unwatch(t);
            }
            return Err(e);
        }
    };
    if let Some(t) = &ticket {
        reg.tickets.entry(t.clone()).or_insert(TicketUse { users: 0, inflight }).users += 1;
    }
    if first_holder && inflight {
        mapping.take_over_inflight();
        if let Some(w) = &watch {
            w.drop_inflight_count();
        }
    }
    Ok(Import { key, ticket, watch, mapping: Some(mapping), handle: *h, validated, generation })
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

/// The cached mapping of the handle's allocation (one more user), or a new one.
fn map_allocation(
    reg: &mut Registry,
    key: &AllocKey,
    h: &DevshareHandle,
    segments: Option<&crate::handle::segments::SegmentTable<'_>>,
    validated: &Validated,
    req: &ImportRequest,
    backend: &dyn backend::Backend,
) -> Result<Arc<dyn Mapping>> {
    Ok(match reg.allocs.get_mut(key) {
        Some(entry) => {
            if entry.mapping.size() < h.alloc_size {
                return Err(Error::Mismatch(format!(
                    "the allocation is {} bytes but the handle's alloc_size is {}",
                    entry.mapping.size(),
                    h.alloc_size
                )));
            }
            entry.users += 1;
            entry.mapping.clone()
        }
        None => {
            let mapping: Arc<dyn Mapping> = match segments {
                Some(t) => backend.import_segmented(h, t, validated, req)?.into(),
                None => backend.import(h, validated, req)?.into(),
            };
            if mapping.size() < h.alloc_size {
                return Err(Error::Mismatch(format!(
                    "{} backend mapped {} bytes but the handle's alloc_size is {}",
                    h.backend_name(),
                    mapping.size(),
                    h.alloc_size
                )));
            }
            reg.allocs.insert(key.clone(), Entry { mapping: mapping.clone(), users: 1 });
            mapping
        }
    })
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
    pub fn view(&self) -> ImportView {
        let base = self.mapping.as_ref().expect("mapping present until release").base();
        // SAFETY: validation guarantees storage_offset + storage_size <= alloc_size <= mapped
        // length, and the tensor lies inside the storage.
        let (storage, data) = unsafe {
            (base.add(self.handle.storage_offset as usize), base.add(self.validated.data_offset as usize))
        };
        ImportView { data, storage, base, read_only: self.key.read_only, device: self.device() }
    }

    /// The device the allocation is mapped on.
    pub fn device(&self) -> i32 {
        self.mapping.as_ref().and_then(|m| m.device()).unwrap_or(self.key.device)
    }

    /// Another import of the same handle: shares this one's mapping and reference (both must be
    /// released; the reference is returned when the last is). Costs a registry lock, no mapping.
    pub fn clone_ref(&self) -> Import {
        if self.generation != crate::shm::generation() {
            // A forked child's copy of its parent's import: the clone is as inert as it is.
            return Import {
                key: self.key.clone(),
                ticket: self.ticket.clone(),
                watch: self.watch.clone(),
                mapping: self.mapping.clone(),
                handle: self.handle,
                validated: self.validated,
                generation: self.generation,
            };
        }
        let mut reg = registry();
        reg.allocs.get_mut(&self.key).expect("an unreleased import has a registry entry").users += 1;
        if let Some(t) = &self.ticket {
            reg.tickets.get_mut(t).expect("an unreleased import holds its ticket").users += 1;
            reg.watched.get_mut(&t.ref_counter()).expect("an unreleased import watches its ref-counter").users += 1;
        }
        Import {
            key: self.key.clone(),
            ticket: self.ticket.clone(),
            watch: self.watch.clone(),
            mapping: self.mapping.clone(),
            handle: self.handle,
            validated: self.validated,
            generation: self.generation,
        }
    }

    /// Release this import, in PyTorch's order: drop the mapping (unmapping it when this was the
    /// last user in the process), then return the handle's ref-counter reference when this was
    /// the last import holding it.
    pub fn release(mut self) {
        self.release_inner();
    }

    fn release_inner(&mut self) {
        if self.generation != crate::shm::generation() {
            // A forked child's copy of its parent's import: the mapping, its counts and the
            // reference are the parent's. Forget them (the child's copy of the mapping stays
            // until it exits).
            std::mem::forget(self.mapping.take());
            std::mem::forget(self.watch.take());
            return;
        }
        let device = self.device();
        let Some(mapping) = self.mapping.take() else { return };
        let mut ours = Some(mapping);
        let mut return_ticket = false;
        let mut last_watch = None;
        {
            let mut reg = registry();
            if let Some(entry) = reg.allocs.get_mut(&self.key) {
                entry.users -= 1;
                if entry.users == 0 {
                    // (1) The last user unmaps / closes the vendor import, under the lock: an
                    // import of the same allocation racing with this release must not open it
                    // again before it is closed (CUDA refuses a second open).
                    let last = reg.allocs.remove(&self.key).map(|e| e.mapping);
                    drop(ours.take());
                    drop(last);
                    if reg.allocs.is_empty() {
                        // Give the table back when nothing is imported, so that leak checkers
                        // see no memory held by an idle library.
                        reg.allocs = FxHashMap::default();
                    }
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
        // (1) drop our mapping (for the last user, the close already ran above).
        drop(ours);
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
