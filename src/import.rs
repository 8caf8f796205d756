//! Importing handles, and the per-process import registry.
//!
//! The registry caches mappings by allocation — (backend, device, key, access) — not by tensor,
//! because many tensors share one allocation: importing the same allocation twice maps it once,
//! and the mapping goes away when the last import of it is released. It also tracks the
//! ref-counter reference each handle carries (its "ticket": ref-counter name and slot): a ticket
//! held by several imports in this process is returned to the producer exactly once, when the
//! last of them is released. All of it is behind one mutex, so imports and releases may happen on
//! any thread.

use crate::backend::{self, ImportRequest, Mapping};
use crate::error::{Error, Result};
use crate::handle::{validate, DevshareHandle, Validated};
use crate::refcounter::{self, Watched};
use crate::handle::{DEVSHARE_KEY_CAPACITY, DEVSHARE_REF_NAME_CAPACITY};
use rustc_hash::FxHashMap;
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

#[derive(Default)]
struct Registry {
    allocs: FxHashMap<AllocKey, Entry>,
    tickets: FxHashMap<Ticket, usize>,
    watched: FxHashMap<RefName, WatchEntry>,
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

fn registry() -> MutexGuard<'static, Registry> {
    // A panic while holding the lock cannot leave the maps half-updated (every update is a single
    // insert/remove/increment), so a poisoned lock is still consistent.
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Number of allocations currently mapped by imports in this process.
pub fn cached_allocations() -> usize {
    registry().allocs.len()
}

/// Return the reference a handle carries without using it (validated first). A host handle
/// in flight also owes the count in its object's header: an import takes that over and its
/// release returns both, so it is imported and released at once.
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
            .map(|t| Arc::new((t.seg.segment_size, t.seg.kind, t.producer_pid, t.table.to_vec()))),
    };
    let ticket = (h.ref_name_len > 0).then_some(Ticket {
        name_len: h.ref_name_len,
        name: h.ref_name,
        slot: h.ref_slot,
    });

    let mut reg = registry();
    // The ref-counter, and whether this import is the first in this process to hold the
    // handle's reference (then the reference must still be outstanding).
    let (watch, first_holder) = match &ticket {
        None => (None, true),
        Some(t) => {
            let watch = reg.watch(t)?;
            let first = !reg.tickets.contains_key(t);
            if first {
                if let Some(Err(e)) = watch.as_ref().map(|w| w.check(t.slot)) {
                    reg.unwatch(t);
                    return Err(e);
                }
            }
            (watch, first)
        }
    };
    let mapping = match map_allocation(&mut reg, &key, h, segments.as_ref(), &validated, &req, backend) {
        Ok(m) => m,
        Err(e) => {
            if let Some(t) = &ticket {
                reg.unwatch(t);
            }
            return Err(e);
        }
    };
    if let Some(t) = &ticket {
        *reg.tickets.entry(t.clone()).or_insert(0) += 1;
    }
    if first_holder && h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT != 0 {
        mapping.take_over_inflight();
    }
    Ok(Import { key, ticket, watch, mapping: Some(mapping), handle: *h, validated })
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
        let mut reg = registry();
        reg.allocs.get_mut(&self.key).expect("an unreleased import has a registry entry").users += 1;
        if let Some(t) = &self.ticket {
            *reg.tickets.get_mut(t).expect("an unreleased import holds its ticket") += 1;
            reg.watched.get_mut(&t.ref_counter()).expect("an unreleased import watches its ref-counter").users += 1;
        }
        Import {
            key: self.key.clone(),
            ticket: self.ticket.clone(),
            watch: self.watch.clone(),
            mapping: self.mapping.clone(),
            handle: self.handle,
            validated: self.validated,
        }
    }

    /// Release this import, in PyTorch's order: drop the mapping (unmapping it when this was the
    /// last user in the process), then return the handle's ref-counter reference when this was
    /// the last import holding it.
    pub fn release(mut self) {
        self.release_inner();
    }

    fn release_inner(&mut self) {
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
                    *n -= 1;
                    if *n == 0 {
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
