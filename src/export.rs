//! The exporter: one exported allocation, the handles handed out for tensors in it, and the
//! ref-counter that tells when their consumers let go.

use crate::backend::{self, host, ExportOptions, Exported, IpcEvent};
use crate::dtype::DevshareDType;
use crate::error::{Error, Result};
use crate::fork::Stamp;
use crate::handle::{validate, DevshareHandle, DEVSHARE_MAX_NDIM};
use crate::refcounter::RefCounter;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Most descriptors passed next to one handle (the kernel's `SCM_MAX_FD`); a segmented export
/// with more leaves its consumers to take them with `pidfd_getfd`.
pub(crate) const MAX_PASSED_FDS: usize = 253;

/// Something that returns an export's leases when it is served: a delivery layer (the channel)
/// implements it, and [`Exporter::wait`] serves it while waiting for the leases.
pub(crate) trait LeaseServer: Send + Sync {
    /// Take what arrived (returned leases included), waiting at most `pause` for something.
    fn serve(&self, pause: Duration) -> Result<()>;

    /// How long a wait for its returns may poll ([`Self::poll`]) before it sleeps (zero: not
    /// at all; the channel's `set_spin`).
    fn spin(&self) -> Duration {
        Duration::ZERO
    }

    /// Take the returns that already arrived, without waiting and without asking to be woken
    /// for the next one (unless the look took a wake-up meant for whoever serves the
    /// delivery layer, which is then asked for again); `sockets`: look at the peers' sockets
    /// too (a system call), not only at what needs none.
    fn poll(&self, _sockets: bool) -> Result<()> {
        self.serve(Duration::ZERO)
    }

    /// How long a wait for its returns may poll now although no spin was set: the delivery
    /// layer's own judgement (the channel's adaptive spin: a consumer awake on another CPU is
    /// likely to answer before a wake-up would arrive; the channel asks whether any of its
    /// consumers is, not which holds the lease). Asked once per wait of every server the
    /// export was leased through, only where none of them has a spin of its own; zero: not
    /// now. Each nonzero answer is followed by one [`Self::adaptive_done`].
    fn adaptive_spin(&self) -> Duration {
        Duration::ZERO
    }

    /// The poll that [`Self::adaptive_spin`] allowed is over: `found`, every lease came back
    /// during it.
    fn adaptive_done(&self, _found: bool) {}

    /// A wait for its returns is about to sleep, with `left` to go (`None`: no time limit):
    /// give the CPU to a consumer that is awake on this thread's CPU (it may release while
    /// this thread is still awake), if the delivery layer judges it worth it. Whether it did
    /// (the wait then looks again before it sleeps). Asked once per wait.
    fn hand_over(&self, _left: Option<Duration>) -> bool {
        false
    }

    /// Export `export`, which this server listens to ([`LeaseBook::listen`]), is being dropped:
    /// its memory and descriptors go right after this returns, and a later export may get the
    /// same descriptor numbers. A server whose consumers keep the export mapped between leases
    /// must tell them before it hands out any later export. Called from the export's drop, on
    /// whatever thread drops it, perhaps one holding the server's own lock: it must not take
    /// a lock such a thread may hold.
    fn export_closed(&self, _export: u64) {}
}

/// An adaptive poll for returns ([`LeaseServer::adaptive_spin`]) yields the CPU once every this
/// many turns (as the channel's own adaptive spins do): with more threads ready than CPUs, a
/// poll that keeps finding its return soon enough would otherwise take the CPU from the others.
const ADAPTIVE_YIELD_EVERY: u32 = 32;

/// The servers a wait polls before it sleeps, for how long, and which of them allowed an
/// adaptive poll (told how it went).
struct Spinners {
    servers: Vec<Arc<dyn LeaseServer>>,
    budget: Duration,
    adaptive: Vec<Arc<dyn LeaseServer>>,
}

/// The leases of one export: references handed out by a delivery layer (counted in
/// [`Exporter::outstanding`]) and the servers that take them back.
#[derive(Default)]
pub struct LeaseBook {
    count: AtomicU64,
    servers: Mutex<Vec<Weak<dyn LeaseServer>>>,
}

impl LeaseBook {
    /// References leased and not returned.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    /// One more lease, handed out through `server`.
    pub(crate) fn add<S: LeaseServer + 'static>(&self, server: &Arc<S>) {
        self.count.fetch_add(1, Ordering::AcqRel);
        self.listen(server);
    }

    /// `server` takes this export's leases back and is told when the export is dropped
    /// ([`LeaseServer::export_closed`]), whether or not it has leased it yet.
    pub(crate) fn listen<S: LeaseServer + 'static>(&self, server: &Arc<S>) {
        let mut servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
        servers.retain(|w| w.strong_count() > 0);
        if !servers.iter().any(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(server))) {
            let weak: Weak<dyn LeaseServer> = Arc::downgrade(server) as Weak<dyn LeaseServer>;
            servers.push(weak);
        }
    }

    /// `n` leases came back.
    pub(crate) fn sub(&self, n: u64) {
        self.count.fetch_sub(n, Ordering::AcqRel);
    }

    /// Serve the servers of this export's leases, waiting at most `pause` on the first; false
    /// when there are none (the caller sleeps instead).
    pub(crate) fn serve(&self, pause: Duration) -> bool {
        let mut served = false;
        for (i, s) in self.live().iter().enumerate() {
            served |= s.serve(if i == 0 { pause } else { Duration::ZERO }).is_ok();
        }
        served
    }

    /// The servers of this export's leases and how long a wait polls them before it sleeps:
    /// the longest spin set on one of them, or else the longest adaptive poll they allow now;
    /// `None` when neither.
    fn spinners(&self) -> Option<Spinners> {
        let servers = self.live();
        let set = servers.iter().map(|s| s.spin()).max().unwrap_or_default();
        if !set.is_zero() {
            return Some(Spinners { servers, budget: set, adaptive: Vec::new() });
        }
        let mut budget = Duration::ZERO;
        let mut adaptive = Vec::new();
        for s in &servers {
            let b = s.adaptive_spin();
            if !b.is_zero() {
                budget = budget.max(b);
                adaptive.push(s.clone());
            }
        }
        (!budget.is_zero()).then_some(Spinners { servers, budget, adaptive })
    }

    /// The servers of this export's leases that are still there.
    fn live(&self) -> Vec<Arc<dyn LeaseServer>> {
        let servers = self.servers.lock().unwrap_or_else(|p| p.into_inner());
        servers.iter().filter_map(Weak::upgrade).collect()
    }

    /// Take what already arrived at every server (its sockets included: every wait reads
    /// them at least once, so that what travels only there, a consumer's acceptance of a pin
    /// offer or a hang-up, is not left unread by waits that end in their polls), without
    /// waiting and without arming anything.
    fn look(&self) {
        for s in self.live() {
            let _ = s.poll(true);
        }
    }

    /// Before a wait sleeps: whether a server handed the CPU to a consumer on it (then what
    /// came back meanwhile is taken, as [`Self::look`] does).
    fn hand_over(&self, left: Option<Duration>) -> bool {
        let servers = self.live();
        let handed = servers.iter().any(|s| s.hand_over(left));
        if handed {
            for s in &servers {
                let _ = s.poll(false);
            }
        }
        handed
    }
}

/// A tensor inside an exported allocation, as the exporter describes it.
#[derive(Clone, Debug)]
pub struct TensorDesc<'a> {
    pub dtype: DevshareDType,
    /// Shape in elements (at most `DEVSHARE_MAX_NDIM` entries).
    pub shape: &'a [i64],
    /// Strides in elements; `None` for C-contiguous.
    pub strides: Option<&'a [i64]>,
    /// Byte offset of the storage in the allocation.
    pub storage_offset: u64,
    /// Storage size in bytes; `None` for "to the end of the allocation".
    pub storage_size: Option<u64>,
    /// Element offset of the tensor in the storage.
    pub tensor_offset: i64,
    /// Count the receiver in before the handle travels (host only; see
    /// `DEVSHARE_HANDLE_FLAG_INFLIGHT`).
    pub inflight: bool,
    /// Device backends: record an interprocess event on `stream` for the consumer to wait on,
    /// instead of synchronising `stream` before the handle is returned.
    pub event: bool,
    /// Device backends: the stream that produced the data (null: the device's default work).
    pub stream: *mut std::ffi::c_void,
}

impl Default for TensorDesc<'_> {
    fn default() -> Self {
        TensorDesc {
            dtype: DevshareDType::new(crate::dtype::code::UINT, 8, 1),
            shape: &[],
            strides: None,
            storage_offset: 0,
            storage_size: None,
            tensor_offset: 0,
            inflight: false,
            event: false,
            stream: std::ptr::null_mut(),
        }
    }
}

pub use crate::handle::contiguous_strides;

/// An event recorded for one share, kept until that share's slot is released.
struct SentEvent {
    /// Index of the ref-counter in `Shared::refs`.
    rc: usize,
    slot: u64,
    _event: Box<dyn IpcEvent>,
}

#[derive(Default)]
struct Shared {
    refs: Vec<RefCounter>,
    events: Vec<SentEvent>,
    /// The pids channels whitelisted this export for ([`Exporter::allow_pid_once`]).
    allowed: Vec<i32>,
}

/// One exported allocation.
pub struct Exporter {
    // Field order is drop order: events and ref-counters go before the export itself.
    shared: Mutex<Shared>,
    /// References leased over channels (see [`crate::channel`]).
    leases: Arc<LeaseBook>,
    /// Unique in this process, for channels to remember which exports a peer may import.
    id: u64,
    backend: u16,
    alloc: Box<dyn Exported>,
    /// For an adopted handle: the reference it carried, given back when the exporter goes.
    adopted: Option<AdoptedRef>,
    /// The first leased share's handle, fully validated: later leased shares that differ from
    /// it only in their layout (every pool item) check only that (`validate_layout`).
    leased_template: std::sync::OnceLock<DevshareHandle>,
}

/// Which allocation a ref-counter's references keep alive: what a share's handle names (its
/// backend, and its key or segment table).
#[derive(Clone, PartialEq, Eq)]
struct AllocId {
    backend: u16,
    key: Vec<u8>,
    segments: Option<(u64, u16, Vec<u8>)>,
}

impl AllocId {
    /// The allocation a validated handle names (`segments`: its table, when segmented).
    fn of_handle(h: &DevshareHandle, segments: Option<&crate::handle::segments::SegmentTable<'_>>) -> AllocId {
        match segments {
            Some(t) => AllocId {
                backend: h.backend,
                key: Vec::new(),
                segments: Some((t.seg.segment_size, t.seg.kind, t.table.to_vec())),
            },
            None => AllocId { backend: h.backend, key: h.key_bytes().to_vec(), segments: None },
        }
    }
}

/// A live exporter's ref-counter: the allocation its references belong to, and the fork
/// generation that made it (a forked child's copies of its parent's exporters own nothing).
type Owner = (AllocId, Stamp);

/// A reference: ref-counter name and slot.
type RefSlot = (Vec<u8>, u64);

/// The ref-counters of this process's live exporters, by name.
static OWN_REF_COUNTERS: LazyLock<Mutex<FxHashMap<Vec<u8>, Owner>>> = LazyLock::new(Mutex::default);

/// The references live adoptions in this process hold.
static ADOPTED_REFS: LazyLock<Mutex<FxHashSet<RefSlot>>> = LazyLock::new(Mutex::default);

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The one reference an adopted handle carried (a ref-counter slot), taken over at adoption and
/// returned once, when the exporter that adopted it is dropped (in the fork generation that
/// adopted it).
///
/// PyTorch's protocol: each share of a storage takes a fresh slot of its producer's ref-counter
/// set to 1, the one reference its tuple stands for; whoever holds the tuple holds that
/// reference and decrements the slot once when done, and the producer frees the memory when
/// the slot reads 0. Adoption takes the tuple's reference over like any consumer, so it may
/// only ever return a reference that is the tuple's own: a forged tuple naming another
/// exporter's slot (which that exporter's consumer holds) would otherwise take the reference
/// from that consumer when the adoption closes. [`AdoptedRef::take`] therefore checks, before
/// anything is adopted, that the reference belongs to the memory the handle names and that
/// nothing else in this process holds it:
///
/// - a devshare ref-counter must be one of a live exporter of this process, exporting the very
///   allocation the handle names (same backend, key or segment table);
/// - a PyTorch ref-counter (`/torch_<pid>_...`, named after the process that made it) must be
///   this process's: an adopted handle is a share made here;
/// - no other adoption, and no import, in this process may hold the same slot;
/// - the slot must still be outstanding and not in flight.
///
/// What cannot be told from the shared memory is which holder of a genuine share's tuple is
/// which: a copy of a share's own tuple, adopted while its real consumer also holds it, is the
/// same double use as discarding a copy (`devshare_handle_discard`), and stays the caller's
/// to avoid. The mapping checked at adoption is the one the reference is returned through: the
/// name is not looked up again.
struct AdoptedRef {
    name: Vec<u8>,
    slot: u64,
    rc: crate::refcounter::Watched,
    generation: Stamp,
}

impl AdoptedRef {
    /// Check and claim the reference `h` carries (see the type's doc). `Ok(None)` when the
    /// handle names no ref-counter, or the ref-counter is gone (there is nothing to return).
    fn take(
        h: &DevshareHandle,
        segments: Option<&crate::handle::segments::SegmentTable<'_>>,
    ) -> Result<Option<AdoptedRef>> {
        if h.ref_name_len == 0 {
            return Ok(None);
        }
        let (name, slot) = (h.ref_name_bytes(), h.ref_slot);
        let shown = String::from_utf8_lossy(name);
        if crate::shm::is_devshare_name(name, crate::shm::RC_PREFIX) {
            let owner = locked(&OWN_REF_COUNTERS).get(name).filter(|(_, g)| g.is_current()).map(|(id, _)| id.clone());
            match owner {
                None => {
                    return Err(Error::Untrusted(format!(
                        "the handle's ref-counter {shown} is devshare's, but no live exporter of this process \
                         made it: an adopted handle is a share made in this process, and its reference is \
                         its exporter's"
                    )))
                }
                Some(id) if id != AllocId::of_handle(h, segments) => {
                    return Err(Error::Untrusted(format!(
                        "the handle's ref-counter {shown} belongs to an exporter of other memory than the \
                         handle names: slot {slot} is another share's reference, held by that share's \
                         consumer, and an adoption returns only its own"
                    )))
                }
                Some(_) => {}
            }
        } else if let Some(pid) = crate::shm::torch_name_pid(name) {
            let me = crate::fork::pid();
            if pid != me as u64 {
                return Err(Error::Untrusted(format!(
                    "the handle's ref-counter {shown} was made by process {pid}, not by this one ({me}): \
                     PyTorch names a share's ref-counter after the process that shares it, and an adopted \
                     handle is a share made in this process"
                )));
            }
        }
        let key = (name.to_vec(), slot);
        let mut adopted = locked(&ADOPTED_REFS);
        if adopted.contains(&key) {
            return Err(Error::Busy(format!(
                "slot {slot} of ref-counter {shown} is held by another adoption in this process: a \
                 reference is adopted once"
            )));
        }
        if crate::refcounter::held_here(name, slot) {
            return Err(Error::Busy(format!(
                "slot {slot} of ref-counter {shown} is held by an import in this process: its release \
                 returns it, so it cannot be adopted as well"
            )));
        }
        let Some(rc) = crate::refcounter::Watched::open(name)? else {
            return Ok(None); // the producer is gone: nothing to return
        };
        rc.check(slot)?;
        rc.check_inflight(slot, false)?;
        adopted.insert(key);
        Ok(Some(AdoptedRef { name: name.to_vec(), slot, rc, generation: Stamp::now() }))
    }
}

impl Drop for AdoptedRef {
    fn drop(&mut self) {
        let mut adopted = locked(&ADOPTED_REFS);
        adopted.remove(&(std::mem::take(&mut self.name), self.slot));
        if adopted.is_empty() {
            *adopted = FxHashSet::default(); // as for OWN_REF_COUNTERS
        }
        drop(adopted);
        if !self.generation.is_current() {
            return;
        }
        // The consumer's release order (refcounter.rs); a slot that is no longer ours to
        // decrement (returned, or in flight) is left alone.
        if self.rc.check(self.slot).is_ok() && self.rc.check_inflight(self.slot, false).is_ok() {
            self.rc.release(self.slot);
        }
    }
}

impl Exporter {
    /// Allocate `size` bytes of shareable host memory and export it.
    pub fn host_alloc(size: u64) -> Result<Exporter> {
        Ok(Exporter::new(crate::handle::DEVSHARE_BACKEND_HOST, host::alloc(size)?))
    }

    /// Export an existing host object in PyTorch's `file_system` layout (e.g. a PyTorch CPU
    /// storage shared with `_share_filename_cpu_`), `size` data bytes of it.
    pub fn host_adopt(name: &[u8], size: u64) -> Result<Exporter> {
        Ok(Exporter::new(crate::handle::DEVSHARE_BACKEND_HOST, host::adopt(name, size)?))
    }

    fn new(backend: u16, alloc: Box<dyn Exported>) -> Exporter {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Exporter {
            shared: Mutex::new(Shared::default()),
            leases: Arc::default(),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            backend,
            alloc,
            adopted: None,
            leased_template: std::sync::OnceLock::new(),
        }
    }

    /// Adopt one reference of a device handle that another exporter in this process made —
    /// PyTorch's or torch_npu's share of a storage (`reduce_tensor`, converted by
    /// `torch::handle_from_args`) — as an export whose handles name tensors inside that storage
    /// (`desc.storage_offset` is relative to it). `table`: the segment table when it travels
    /// outside the handle. The handle's event is not used: shares record their own. The
    /// reference is given back (its ref-counter slot decremented once) when the exporter is
    /// dropped, so the caller keeps the storage alive until then and lets it go after.
    ///
    /// The reference must be the handle's own (see `AdoptedRef`): a devshare ref-counter of
    /// another allocation, another process's PyTorch ref-counter, or a slot another adoption or
    /// an import in this process holds is refused before anything is adopted.
    pub fn adopt(h: &DevshareHandle, table: Option<&[u8]>) -> Result<Exporter> {
        validate(h)?;
        let segments = crate::handle::segments::SegmentTable::of(h, table)?;
        let alloc = backend::get(h.backend)?.adopt(h, segments.as_ref())?;
        // Last: once the reference is taken nothing fails, so a failed adoption leaves it with
        // the caller.
        let reference = AdoptedRef::take(h, segments.as_ref())?;
        let mut e = Exporter::new(h.backend, alloc);
        e.adopted = reference;
        Ok(e)
    }

    /// Allocate `size` bytes of host memory as a sealed memfd, shareable only over a channel.
    pub fn channel_host_alloc(size: u64) -> Result<Exporter> {
        Ok(Exporter::new(crate::handle::DEVSHARE_BACKEND_HOST, crate::backend::memfd::alloc(size)?))
    }

    /// Unique id of this export in this process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The channel leases of this export.
    pub(crate) fn leases(&self) -> &Arc<LeaseBook> {
        &self.leases
    }

    /// The descriptors a channel passes next to this export's handles: the memfd, or a CUDA
    /// segmented export's fds (each once, in table order) when they fit one message.
    pub(crate) fn channel_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        if let Some(fd) = self.alloc.channel_fd() {
            return vec![fd];
        }
        let fds = self.alloc.segment_fds();
        if fds.len() > MAX_PASSED_FDS {
            return Vec::new(); // too many for one message: consumers take them with pidfd_getfd
        }
        fds
    }

    /// Export existing memory on a backend.
    pub fn export(backend_id: u16, device: i32, ptr: *mut u8, size: u64, opts: &ExportOptions) -> Result<Exporter> {
        if size == 0 {
            return Err(Error::InvalidArgument("size is 0: there is nothing to export".into()));
        }
        let alloc = backend::get(backend_id)?.export(device, ptr, size, opts)?;
        Ok(Exporter::new(backend_id, alloc))
    }

    /// Export a C producer's segmented (VMM) allocation: `physical.len()` segments of
    /// `segment_size` bytes mapped back to back at `base` on `device`.
    pub fn export_segments(
        backend_id: u16,
        device: i32,
        mem: &backend::SegmentedMemory<'_>,
        opts: &ExportOptions,
    ) -> Result<Exporter> {
        use crate::handle::segments::{DEVSHARE_MAX_SEGMENTS, DEVSHARE_SEGMENT_GRANULARITY};
        if mem.base.is_null() {
            return Err(Error::NullArgument("base"));
        }
        if mem.physical.is_empty() {
            return Err(Error::InvalidArgument("zero segments: there is nothing to export".into()));
        }
        if mem.physical.len() > DEVSHARE_MAX_SEGMENTS as usize {
            return Err(Error::bad_size(
                "count",
                format!("{} segments is above the maximum {DEVSHARE_MAX_SEGMENTS}", mem.physical.len()),
            ));
        }
        if mem.segment_size == 0 || mem.segment_size % DEVSHARE_SEGMENT_GRANULARITY != 0 {
            return Err(Error::bad_size(
                "segment_size",
                format!(
                    "{} is not a positive multiple of the {DEVSHARE_SEGMENT_GRANULARITY}-byte granularity",
                    mem.segment_size
                ),
            ));
        }
        mem.segment_size
            .checked_mul(mem.physical.len() as u64)
            .filter(|&t| t <= i64::MAX as u64)
            .ok_or_else(|| Error::bad_size("segment_size", "count x segment_size overflows 2^63-1"))?;
        let alloc = backend::get(backend_id)?.export_segments(device, mem, opts)?;
        Ok(Exporter::new(backend_id, alloc))
    }

    /// The segment table that handles of this export need next to them when it does not fit
    /// the handle struct (more than 128 bytes of records); `None` otherwise.
    pub fn external_table(&self) -> Option<&[u8]> {
        self.alloc.segments().map(|(_, _, t)| t).filter(|t| t.len() > crate::handle::DEVSHARE_KEY_CAPACITY)
    }

    /// Start of the exported range in this process (what the caller exported; for host memory
    /// the data bytes).
    pub fn ptr(&self) -> *mut u8 {
        let base = self.alloc.ptr();
        if base.is_null() {
            return base; // an adopted export: the address is its allocator's (not known here)
        }
        // SAFETY: the window lies inside the allocation.
        unsafe { base.add(self.alloc.window().0 as usize) }
    }

    /// Size of the exported range in bytes.
    pub fn size(&self) -> u64 {
        self.alloc.window().1
    }

    /// The exported window: its first byte's offset in the allocation, and its size.
    pub(crate) fn window(&self) -> (u64, u64) {
        self.alloc.window()
    }

    /// Device index of this export in this process (0 for host memory).
    pub fn device(&self) -> i32 {
        self.alloc.device_index()
    }

    /// Backend id of this export.
    pub fn backend(&self) -> u16 {
        self.backend
    }

    /// Let the importer with this pid import (ACL pid whitelist; other backends: no effect).
    pub fn allow_pid(&self, pid: i32) -> Result<()> {
        if pid <= 0 {
            return Err(Error::InvalidArgument(format!("pid {pid} is not a process id")));
        }
        self.alloc.allow_pid(pid)
    }

    /// [`Self::allow_pid`] once per pid for the export's life (what a channel asks for each
    /// consumer it sends the export to: remembered here, so it goes with the export).
    pub(crate) fn allow_pid_once(&self, pid: i32) -> Result<()> {
        let mut shared = self.shared();
        if !shared.allowed.contains(&pid) {
            self.allow_pid(pid)?;
            shared.allowed.push(pid);
        }
        Ok(())
    }

    fn shared(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Make a handle for a tensor in this allocation. The handle carries a fresh ref-counter
    /// slot set to 1: it is one reference, owed one release by one consumer.
    pub fn share(&self, desc: &TensorDesc<'_>) -> Result<DevshareHandle> {
        if self.alloc.channel_fd().is_some() {
            return Err(Error::Unsupported(
                "this export is a sealed memfd (devshare_channel_host_alloc): it has no name to put in \
                 a handle and travels only over a channel (devshare_channel_send, devshare_pool_create)"
                    .into(),
            ));
        }
        let mut h = self.describe(desc)?;
        if desc.inflight {
            h.flags |= crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT;
        }
        if desc.event {
            if self.backend == crate::handle::DEVSHARE_BACKEND_HOST {
                return Err(Error::Unsupported("host memory has no interprocess events (DEVSHARE_SHARE_EVENT)".into()));
            }
            h.flags |= crate::handle::DEVSHARE_HANDLE_FLAG_EVENT;
        }
        validate(&h)?;
        self.finish_share(h, desc)
    }

    /// A handle for a tensor in this allocation without a ref-counter slot: its reference is
    /// leased to a channel connection, which counts it in [`Self::outstanding`]. With
    /// `desc.event` an interprocess event is recorded on `desc.stream` and returned (keep it until
    /// the lease comes back; the handle carries it); otherwise the stream is synchronised first.
    pub(crate) fn share_leased(&self, desc: &TensorDesc<'_>) -> Result<(DevshareHandle, Option<Box<dyn IpcEvent>>)> {
        let mut h = self.leased_handle(desc)?;
        let event = self.alloc.prepare_share(desc.stream, desc.event)?;
        if let Some(e) = &event {
            h.event_handle = e.handle();
        }
        Ok((h, event))
    }

    /// The handle of a leased share, described and validated, without its event or
    /// synchronisation: what [`Self::share_leased`] makes them for, or a caller that made them
    /// for several shares at once (one per stream of a channel's batch: [`Self::record_event`],
    /// or [`Self::synchronize`]) and sets `event_handle` of a handle with `desc.event` itself.
    pub(crate) fn leased_handle(&self, desc: &TensorDesc<'_>) -> Result<DevshareHandle> {
        if desc.inflight {
            return Err(Error::InvalidArgument(
                "a share over a channel is leased to the connection: in-flight references \
                 (DEVSHARE_SHARE_INFLIGHT) do not apply"
                    .into(),
            ));
        }
        let mut h = self.describe(desc)?;
        if self.alloc.channel_fd().is_some() {
            h.flags |= crate::handle::DEVSHARE_HANDLE_FLAG_CHANNEL;
        }
        if desc.event {
            if self.backend == crate::handle::DEVSHARE_BACKEND_HOST {
                return Err(Error::Unsupported("host memory has no interprocess events (DEVSHARE_SHARE_EVENT)".into()));
            }
            h.flags |= crate::handle::DEVSHARE_HANDLE_FLAG_EVENT;
        }
        match self.leased_template.get() {
            Some(t) => {
                crate::handle::validate_layout(&h, t)?;
            }
            None => {
                validate(&h)?;
                let _ = self.leased_template.set(h);
            }
        }
        Ok(h)
    }

    /// A new interprocess event of this allocation's device, recorded on `stream` (what
    /// [`Self::share_leased`] records for one share), for shares made with
    /// [`Self::leased_handle`]. Host memory: `Unsupported`.
    pub(crate) fn record_event(&self, stream: *mut std::ffi::c_void) -> Result<Box<dyn IpcEvent>> {
        self.alloc
            .prepare_share(stream, true)?
            .ok_or_else(|| Error::Unsupported("this allocation records no interprocess events".into()))
    }

    /// Synchronise `stream` (null: the whole device) as [`Self::share_leased`] does for a share
    /// without an event; host memory: nothing to do.
    pub(crate) fn synchronize(&self, stream: *mut std::ffi::c_void) -> Result<()> {
        self.alloc.prepare_share(stream, false).map(|_| ())
    }

    /// What an interprocess event of this allocation belongs to: its backend and device (an
    /// event recorded for one allocation can be recorded again for another with the same key).
    pub(crate) fn event_key(&self) -> (u16, i32) {
        (self.backend, self.alloc.device_index())
    }

    /// [`Self::share_leased`] without its event or synchronisation (the caller makes them:
    /// [`Self::record_event`] or [`Self::synchronize`]), with what the caller needs of the
    /// handle read by `f` where the handle lies (a pool item's message takes its layout; the
    /// handle, which has no event handle, is not returned). Once a leased share was described and
    /// validated, a later one of a plain (unsegmented) allocation starts from that first handle
    /// and sets only the layout (and the pid and the event flag) instead of describing the
    /// allocation again: every pool item after the first.
    pub(crate) fn describe_leased_with<R>(
        &self,
        desc: &TensorDesc<'_>,
        f: impl FnOnce(&DevshareHandle) -> R,
    ) -> Result<R> {
        let template = match self.leased_template.get() {
            Some(t) if !desc.inflight && self.alloc.segments().is_none() => t,
            _ => return Ok(f(&self.leased_handle(desc)?)),
        };
        if desc.event && self.backend == crate::handle::DEVSHARE_BACKEND_HOST {
            return Err(Error::Unsupported("host memory has no interprocess events (DEVSHARE_SHARE_EVENT)".into()));
        }
        let mut h = *template;
        self.set_layout(desc, &mut h)?;
        h.producer_pid = crate::fork::pid();
        let event_flag = crate::handle::DEVSHARE_HANDLE_FLAG_EVENT;
        h.flags = (template.flags & !event_flag) | if desc.event { event_flag } else { 0 };
        crate::handle::validate_written_layout(&h, template)?;
        Ok(f(&h))
    }

    /// The handle fields for a tensor in this allocation: layout and key, no lifetime fields.
    fn describe(&self, desc: &TensorDesc<'_>) -> Result<DevshareHandle> {
        let mut h = DevshareHandle {
            backend: self.backend,
            device_index: self.alloc.device_index(),
            device_uuid: self.alloc.device_uuid(),
            host_id: crate::hostid::host_id(),
            producer_pid: crate::fork::pid(),
            alloc_size: self.alloc.size(),
            ..Default::default()
        };
        self.set_layout(desc, &mut h)?;
        match self.alloc.segments() {
            Some((segment_size, kind, table)) => {
                crate::handle::segments::set_segments(&mut h, segment_size, kind, table)?;
            }
            None => h.set_key(self.alloc.key()),
        }
        Ok(h)
    }

    /// The layout fields of `h` (dtype, ndim, shape, strides, storage range, tensor offset) for
    /// the tensor `desc` describes in this allocation, checked against the exported window.
    fn set_layout(&self, desc: &TensorDesc<'_>, h: &mut DevshareHandle) -> Result<()> {
        if desc.shape.len() > DEVSHARE_MAX_NDIM {
            return Err(Error::BadNdim(format!(
                "{} dimensions is above the maximum {DEVSHARE_MAX_NDIM}",
                desc.shape.len()
            )));
        }
        let (win_offset, win_len) = self.alloc.window();
        let storage_size = storage_within(desc, win_len, || format!("{win_len} exported bytes"))?;
        h.ndim = desc.shape.len() as u32;
        h.storage_offset = win_offset + desc.storage_offset;
        h.storage_size = storage_size;
        h.tensor_offset = desc.tensor_offset;
        h.dtype = desc.dtype;
        // Entries at and beyond ndim are zero (h may hold another layout's).
        h.shape = [0; DEVSHARE_MAX_NDIM];
        h.shape[..desc.shape.len()].copy_from_slice(desc.shape);
        h.strides = [0; DEVSHARE_MAX_NDIM];
        match desc.strides {
            Some(s) if s.len() != desc.shape.len() => {
                return Err(Error::InvalidArgument(format!("{} strides for {} dimensions", s.len(), desc.shape.len())))
            }
            Some(s) => h.strides[..s.len()].copy_from_slice(s),
            None => crate::handle::contiguous_strides_into(desc.shape, &mut h.strides[..desc.shape.len()]),
        }
        Ok(())
    }

    /// The allocation this export's handles name (what `describe` puts in them).
    fn alloc_id(&self) -> AllocId {
        match self.alloc.segments() {
            Some((size, kind, table)) => {
                AllocId { backend: self.backend, key: Vec::new(), segments: Some((size, kind, table.to_vec())) }
            }
            None => AllocId { backend: self.backend, key: self.alloc.key().to_vec(), segments: None },
        }
    }

    /// Take a ref-counter slot (and record the event) for a described, validated handle.
    fn finish_share(&self, mut h: DevshareHandle, desc: &TensorDesc<'_>) -> Result<DevshareHandle> {
        // Event or synchronisation first (outside the lock: it may wait for the device), and a
        // failure there must not leave a slot set to 1.
        let event = self.alloc.prepare_share(desc.stream, desc.event)?;
        let mut shared = self.shared();
        // Drop the events of shares already released (PyTorch keeps at most 1000 alive).
        let Shared { refs, events, .. } = &mut *shared;
        events.retain(|e| refs[e.rc].slot_value(e.slot) > 0);
        if refs.last().map_or(true, |rc| !rc.has_free_slot()) {
            let rc = RefCounter::create()?;
            let id = self.alloc_id();
            locked(&OWN_REF_COUNTERS).insert(rc.name().to_vec(), (id, Stamp::now()));
            refs.push(rc);
        }
        if desc.inflight {
            self.alloc.add_inflight()?;
        }
        let rc = refs.len() - 1;
        let slot = refs[rc].take_slot(desc.inflight).expect("a ref-counter with a free slot");
        h.set_ref(refs[rc].name(), slot);
        if let Some(event) = event {
            h.event_handle = event.handle();
            events.push(SentEvent { rc, slot, _event: event });
        }
        Ok(h)
    }

    /// Share the whole allocation as a 1-D `uint8` tensor.
    pub fn share_bytes(&self) -> Result<DevshareHandle> {
        let shape = [self.size() as i64];
        self.share(&TensorDesc { shape: &shape, ..Default::default() })
    }

    /// References handed out and not yet released by their consumers. A slot holding anything
    /// but 0 or 1 was written by something else: `Untrusted`, naming it (never summed).
    pub fn outstanding(&self) -> Result<u64> {
        let leased = self.leases.count();
        self.shared().refs.iter().try_fold(leased, |n, rc| Ok(n + rc.outstanding()?))
    }

    /// Value of one handle's ref-counter slot (1 while held, 0 once released).
    pub fn slot_value(&self, h: &DevshareHandle) -> Option<i64> {
        self.shared().refs.iter().find(|rc| rc.name() == h.ref_name_bytes()).map(|rc| rc.slot_value(h.ref_slot))
    }

    /// Wait until no reference is outstanding, or `timeout` passes (`None`: forever). Fails
    /// at once when [`Self::outstanding`] does.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        // What already arrived is taken first: a wait whose leases are back by now ends here,
        // before any poll, yield or sleep.
        if self.leases.count() > 0 {
            self.leases.look();
            if self.outstanding()? == 0 {
                return Ok(());
            }
        }
        self.spin_for_returns(start, timeout)?;
        let mut pause = Duration::from_micros(20);
        let (mut last_look, mut handed) = (false, false);
        loop {
            let n = self.outstanding()?;
            if n == 0 {
                return Ok(());
            }
            // A consumer awake on this CPU may be the one to release: it gets the CPU once
            // before this thread sleeps (the channel decides; see `LeaseServer::hand_over`).
            if !std::mem::replace(&mut handed, true) && self.leases.count() > 0 {
                let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
                if self.leases.hand_over(left) {
                    continue;
                }
            }
            if let Some(t) = timeout {
                let elapsed = start.elapsed();
                if elapsed >= t && !last_look && self.leases.serve(Duration::ZERO) {
                    // Time is up: take the returns that already arrived, then look once more.
                    last_look = true;
                    continue;
                }
                if elapsed >= t {
                    return Err(Error::Timeout(format!(
                        "{n} reference(s) still outstanding after {} ms",
                        t.as_millis()
                    )));
                }
                pause = pause.min(t - elapsed);
            }
            // Leases come back through their channels: serve them while waiting (a return wakes
            // this at once); otherwise poll the ref-counters.
            if !self.leases.serve(pause) {
                std::thread::sleep(pause);
            }
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    /// The spinning part of [`Self::wait`]: when a channel this export was leased through spins
    /// (`set_spin`), or else allows an adaptive poll now ([`LeaseServer::adaptive_spin`]), poll
    /// the returns of every channel it was leased through (a lease out on one that does not
    /// spin comes back as soon as on one that does) for the longest of their spins, never past
    /// `timeout` from `start` (and not at all with a zero timeout), before the wait sleeps.
    /// Returns when nothing is outstanding any more or the spin is over.
    fn spin_for_returns(&self, start: Instant, timeout: Option<Duration>) -> Result<()> {
        if self.leases.count() == 0 || timeout.is_some_and(|t| t.is_zero()) {
            return Ok(()); // (only ref-counters to watch, or no time: nothing to poll)
        }
        let Some(Spinners { servers: mut spinners, budget, adaptive }) = self.leases.spinners() else {
            return Ok(());
        };
        let spin = timeout.map_or(budget, |t| budget.min(t));
        let until = start + spin;
        let mut turns = 0u32;
        let found: Result<bool> = loop {
            turns = turns.wrapping_add(1);
            // The rings on every turn; the sockets (a system call) every 64th; the clock (a
            // read costs more than a look at the rings) every 16th.
            // (A channel that cannot be served any more, closed, is left to the sleeping wait.)
            let sockets = turns % 64 == 0;
            spinners.retain(|s| s.poll(sockets).is_ok());
            // (What this turn's poll took counts before the clock: a spin that found the last
            // return on its last turn found it.)
            match self.outstanding() {
                Ok(0) => break Ok(true),
                Ok(_) => {}
                Err(e) => break Err(e),
            }
            if spinners.is_empty() || (turns % 16 == 0 && Instant::now() >= until) {
                break Ok(false);
            }
            if !adaptive.is_empty() && turns % ADAPTIVE_YIELD_EVERY == 0 {
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        };
        for s in &adaptive {
            s.adaptive_done(matches!(found, Ok(true)));
        }
        found.map(drop)
    }

    /// Remove the shm names of the allocation (host) and of the ref-counters now, whoever still
    /// maps them. Never do this while a PyTorch process may map either: PyTorch aborts when a
    /// name it expects to unlink is gone.
    pub fn unlink_names(&self) {
        self.alloc.unlink();
        for rc in self.shared().refs.iter() {
            rc.unlink();
        }
    }

    /// Prepare to close: refused with `Busy` (nothing changes) while references are
    /// outstanding on a backend whose importers cannot keep the memory alive, unless `force`;
    /// with `unlink`, the shm names go now. The caller then drops the exporter.
    pub fn prepare_close(&self, force: bool, unlink: bool) -> Result<()> {
        self.check_close(force)?;
        if unlink {
            self.unlink_names();
        }
        Ok(())
    }

    /// Whether the export may be closed now. Refused with `Busy` while references are
    /// outstanding on a backend whose importers cannot keep the memory alive, unless `force`.
    /// Closing is dropping the exporter.
    pub fn check_close(&self, force: bool) -> Result<()> {
        if !force && !self.alloc.survives_exporter_close() {
            let n = self.outstanding()?;
            if n > 0 {
                return Err(Error::Busy(format!(
                    "{n} reference(s) outstanding; wait for them or close with DEVSHARE_CLOSE_FORCE"
                )));
            }
        }
        Ok(())
    }
}

impl Drop for Exporter {
    /// Its servers are told first, while its memory and descriptors are still there
    /// ([`LeaseServer::export_closed`]). Then its ref-counters no longer stand for a live export
    /// of this process: an adoption naming one is refused from now on (see `AdoptedRef`).
    fn drop(&mut self) {
        for server in self.leases.live() {
            server.export_closed(self.id);
        }
        let shared = self.shared.get_mut().unwrap_or_else(|p| p.into_inner());
        if shared.refs.is_empty() {
            return;
        }
        let mut own = locked(&OWN_REF_COUNTERS);
        for rc in &shared.refs {
            own.remove(rc.name());
        }
        if own.is_empty() {
            // Give the table back too: a process-wide map kept at its largest size looks like a
            // leak to a leak checker at exit (and is one, of its peak).
            *own = FxHashMap::default();
        }
    }
}

/// The storage size of `desc` (`None`: the rest of `len`), checked to lie within `len` bytes
/// from its `storage_offset`; `room` names the `len` bytes in the error ("4096 exported bytes",
/// "4096-byte slot"). Used for an export's window and for a pool's slot.
pub(crate) fn storage_within(desc: &TensorDesc<'_>, len: u64, room: impl Fn() -> String) -> Result<u64> {
    let storage_size = match desc.storage_size {
        Some(s) => s,
        None => len.checked_sub(desc.storage_offset).ok_or_else(|| {
            Error::StorageOutOfBounds(format!("storage_offset {} is beyond the {}", desc.storage_offset, room()))
        })?,
    };
    if desc.storage_offset.checked_add(storage_size).map_or(true, |end| end > len) {
        return Err(Error::StorageOutOfBounds(format!(
            "storage_offset {} + storage_size {storage_size} exceeds the {}",
            desc.storage_offset,
            room()
        )));
    }
    Ok(storage_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DevshareDType;
    use proptest::prelude::*;

    /// A delivery layer whose one lease came back through what needs no system call (a ring):
    /// a look without the sockets takes it; it counts the looks at its sockets.
    struct RingReturn {
        book: Arc<LeaseBook>,
        back: std::sync::atomic::AtomicBool,
        socket_looks: AtomicU64,
    }

    impl LeaseServer for RingReturn {
        fn serve(&self, _pause: Duration) -> Result<()> {
            self.poll(true)
        }

        fn poll(&self, sockets: bool) -> Result<()> {
            if sockets {
                self.socket_looks.fetch_add(1, Ordering::SeqCst);
            }
            if !self.back.swap(true, Ordering::SeqCst) {
                self.book.sub(1);
            }
            Ok(())
        }
    }

    #[test]
    fn a_wait_whose_lease_is_already_back_in_a_ring_still_reads_the_sockets_once() {
        // What travels only on a channel's socket (a consumer's acceptance of a pin offer, a
        // hang-up) must not go unread by waits that all end at once: every wait for leases
        // looks at the sockets at least once.
        let exp = Exporter::channel_host_alloc(4096).unwrap();
        let server = Arc::new(RingReturn {
            book: exp.leases().clone(),
            back: Default::default(),
            socket_looks: AtomicU64::new(0),
        });
        exp.leases().add(&server);
        assert_eq!(exp.outstanding().unwrap(), 1);
        exp.wait(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(exp.outstanding().unwrap(), 0);
        assert!(server.socket_looks.load(Ordering::SeqCst) >= 1, "the wait never looked at the sockets");
    }

    /// A layout inside a 4096-byte allocation, valid or not.
    #[derive(Debug, Clone)]
    struct Layout {
        bits: u8,
        shape: Vec<i64>,
        strides: Option<Vec<i64>>,
        storage_offset: u64,
        storage_size: Option<u64>,
        tensor_offset: i64,
    }

    impl Layout {
        fn desc(&self) -> TensorDesc<'_> {
            TensorDesc {
                dtype: DevshareDType::new(crate::dtype::code::INT, self.bits, 1),
                shape: &self.shape,
                strides: self.strides.as_deref(),
                storage_offset: self.storage_offset,
                storage_size: self.storage_size,
                tensor_offset: self.tensor_offset,
                ..Default::default()
            }
        }
    }

    fn layouts() -> impl Strategy<Value = Layout> {
        (0usize..=3).prop_flat_map(|n| {
            (
                prop_oneof![Just(8u8), Just(16), Just(32), Just(64)],
                prop::collection::vec(0i64..20, n),
                prop::option::of(prop::collection::vec(-4i64..40, n)),
                0u64..5000,
                prop::option::of(0u64..5000),
                -2i64..50,
            )
                .prop_map(|(bits, shape, strides, storage_offset, storage_size, tensor_offset)| Layout {
                    bits,
                    shape,
                    strides,
                    storage_offset,
                    storage_size,
                    tensor_offset,
                })
        })
    }

    proptest! {
        /// After the first leased share, describe_leased_with starts from that share's handle
        /// instead of describing the allocation again: for any layout it must see exactly the
        /// handle share_leased makes, or refuse exactly when share_leased refuses.
        #[test]
        fn the_leased_share_from_the_template_is_the_described_one(first in layouts(), then in layouts()) {
            let exp = Exporter::channel_host_alloc(4096).unwrap();
            // Whether or not the first share passes, the template is the first that does.
            let _ = exp.share_leased(&first.desc());
            let _ = exp.share_leased(&TensorDesc { shape: &[4096], ..Default::default() });
            prop_assert!(exp.leased_template.get().is_some());
            let full = exp.share_leased(&then.desc()).map(|(h, _)| h);
            let fast = exp.describe_leased_with(&then.desc(), |h| *h);
            match (full, fast) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(a), Err(b)) => prop_assert_eq!(a.status(), b.status()),
                (a, b) => prop_assert!(false, "share_leased ok: {}, describe_leased_with ok: {}", a.is_ok(), b.is_ok()),
            }
        }
    }
}
