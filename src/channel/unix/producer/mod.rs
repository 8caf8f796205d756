//! The producer end of a Unix channel: its state (the types here) and [`LocalChannel`], the
//! listening socket's API. The work is split by job:
//!
//! - `peers.rs`: accepting, the handshake and its deadline, a peer's messages and error budget,
//!   disconnecting;
//! - `queue.rs`: the bounded send queue (and posting pool items to a peer's ring);
//! - `pool.rs`: [`LocalPool`]: slot state, acquire, send, release, and the slots that come back;
//! - `serve.rs`: the channel's lock and the serve loop (epoll);
//! - `events.rs`: the interprocess events of device shares, one per stream of a send, reused.

mod events;
mod peers;
mod pool;
mod queue;
mod serve;
#[cfg(test)]
mod tests;

use events::{ChannelEvent, EventPool};
use queue::{check_len, Queued};
use serve::Arm;

use super::ring::{self, ProducerRing};
use super::spin_ns;
use crate::channel::admission::Admission;
use crate::channel::item::{pool_fits, slot_desc};
use crate::channel::limits::*;
use crate::channel::peers::{serve_wait, wait_peers, PeerInfo, PeerSet};
use crate::channel::wire::{self, ItemLayout, Message, Received};
use crate::error::{Error, Result};
use crate::export::{Exporter, TensorDesc};
use crate::export::{LeaseBook, LeaseServer};
use rustc_hash::{FxHashMap, FxHashSet};
use rustix::event::epoll;
use rustix::net::SocketFlags;
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Messages taken from one peer per service pass: a peer that floods the channel cannot keep
/// the others' messages waiting (epoll reports it again on the next pass).
const PEER_BATCH: usize = 64;

/// A reference out with a peer: its export's book, and the event recorded for the share (one
/// for every share of its send on the same stream).
type Lease = (Arc<LeaseBook>, Option<Arc<ChannelEvent>>);

struct Peer {
    info: PeerInfo,
    fd: OwnedFd,
    ready: bool,
    /// When the connection was accepted (its handshake deadline counts from here).
    accepted: Instant,
    /// Messages the socket had no room for, oldest first; sent when it becomes writable.
    queue: VecDeque<Queued>,
    queued_bytes: usize,
    queued_fds: usize,
    /// Since when the queue has not moved (none of it taken by the kernel); None when empty.
    stalled_since: Option<Instant>,
    /// Why the peer is to be disconnected at the end of the current call.
    doomed: Option<String>,
    /// Leases out with the peer: the export's book, and the event recorded for the share (kept
    /// until the lease comes back).
    leases: FxHashMap<u64, Lease>,
    attached: FxHashMap<u32, Arc<LeaseBook>>,
    /// The `wire::FEATURE_*` bits its handshake announced.
    features: u16,
    /// Messages posted to it since the handshake (sent or queued): what its ring records count.
    posted: u64,
    /// The shared-memory ring its host pool items travel in, made on its first such item.
    ring: Option<ProducerRing>,
    /// Making its ring failed once: its items go over the socket.
    no_ring: bool,
    /// Registered exports (by id) it was told it may keep mapped; told again when retired.
    kept: FxHashSet<u64>,
    /// Registered exports (by id) offered to it (`PIN_SHARES`): the offer's number, and whether it
    /// answered `PINNED` (then their leases go as `LEASE`, in its ring).
    pins: FxHashMap<u64, (u64, bool)>,
}

/// Epoll data of a peer's ring wake-up (its id with this bit set).
const RING_EVENT: u64 = 1 << 63;
/// Epoll data of the channel's nudge (see [`ChannelShared::untimed`]); no peer has id 0.
const NUDGE_EVENT: u64 = RING_EVENT;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SlotState {
    Free,
    Acquired,
    Sent(u64),
    /// Free, set aside for an acquire that takes it without the channel's lock
    /// ([`PoolState::next`]); acquired once it is no longer there.
    Reserved,
}

struct PoolState {
    exporter: Arc<Exporter>,
    slot_size: u64,
    count: u32,
    slots: Vec<SlotState>,
    /// The event recorded for each slot out with a consumer (kept until the slot comes back,
    /// then back to the channel's pool of events).
    events: Vec<Option<Arc<ChannelEvent>>>,
    free: Vec<u32>,
    /// How many slots are out with consumers.
    out: u32,
    /// The last item description, validated per slot (`send` describes a repeat of it once).
    described: pool::Described,
    /// A free slot set aside (`Reserved`) for the next acquire, plus one (0: none): taken
    /// without the channel's lock ([`LocalPool::acquire`]), filled only under it (by `send`).
    next: Arc<AtomicU64>,
}

struct Core {
    listener: OwnedFd,
    /// The socket file this channel created (path, device, inode), removed on close if it is
    /// still the same file.
    path: Option<(std::path::PathBuf, u64, u64)>,
    uids: Vec<u32>,
    pids: Vec<i32>,
    /// Whitelist a peer's announced pid even where it is not the kernel's (containers).
    trust_announced: bool,
    peers: PeerSet<Peer>,
    next_peer: u64,
    next_lease: u64,
    pools: FxHashMap<u32, PoolState>,
    next_pool: u32,
    /// Exports (by id) registered with the channel ([`LocalChannel::register`]), each with its
    /// lease book (an export's drop retires it: [`ChannelShared::retire_closed`]).
    registered: FxHashMap<u64, std::sync::Weak<LeaseBook>>,
    /// The number of the next pin offer (`PIN_SHARES`).
    next_pin: u64,
    buf: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// Descriptors a peer sent (consumers send none), closed once the lock is let go: closing
    /// one can block (a socket lingering over unsent data, a file whose flush waits), and
    /// nothing a peer sends may hold up the channel's other callers ([`Locked`]).
    unwanted_fds: Vec<OwnedFd>,
    /// Peers dropped under this lock: their idle events are destroyed after it ([`Locked`]).
    gone_peers: Vec<u64>,
    /// A pool item's message is encoded here (its memory kept from one send to the next).
    item_buf: Vec<u8>,
    closed: bool,
    /// Something changed that a thread waiting without a time limit must look at (a slot
    /// became free, a pool or the channel closed, a deadline began): the lock's guard nudges
    /// it on the way out ([`Locked`]).
    stir: bool,
}

pub(crate) struct ChannelShared {
    core: Mutex<Core>,
    epoll: OwnedFd,
    generation: crate::fork::Stamp,
    /// The thread ([`thread_token`]; 0: none) that waits in the epoll set without a time limit
    /// (an acquire with none and at most one item out: no timer to arm and cancel, about 0.3 µs
    /// a wait on the machine BENCHMARKS.md describes). At most one at a time: the others look
    /// again at least every 5 ms. What other threads
    /// change that it must see ([`Core::stir`]) writes `nudge`, an eventfd in the epoll set
    /// (edge triggered, never read).
    untimed: AtomicU64,
    /// How many exports are registered ([`Core::registered`]'s size, kept under the lock): a
    /// send looks here first, so that a channel with none pays no second lock per send.
    registered: AtomicU64,
    /// Registered exports dropped while this channel's lock was taken (their ids), and whether
    /// there are any: retired by the lock's next holder that sends a handle or serves
    /// ([`ChannelShared::retire_closed`]).
    closed_exports: Mutex<Vec<u64>>,
    exports_closed: std::sync::atomic::AtomicBool,
    nudge: OwnedFd,
    /// The idle interprocess events of this channel's device shares (`events.rs`).
    events: Arc<EventPool>,
    /// How long a wait for this channel's lease returns polls the rings before it sleeps, in
    /// ns ([`LocalChannel::set_spin`]; 0: not at all).
    spin_ns: AtomicU64,
    /// How the adaptive spins of waits for this channel's lease returns went, and the yields
    /// of those waits to a consumer on the same CPU (spin.rs).
    lease_backoff: super::spin::Backoff,
    lease_yields: super::spin::YieldGuard,
}

/// The producer end of a channel. Dropping it closes it.
pub struct LocalChannel {
    shared: Arc<ChannelShared>,
}

/// A lease posted (or about to be) to a peer: its number, its export and its event.
type PendingLease<'e> = (u64, &'e Exporter, Option<Arc<ChannelEvent>>);

/// The leases of a send that found the peer's ring full, in [`wire::LEASES`] messages: each
/// counted (see [`book`]) once its message is posted.
struct Overflow<'e> {
    out: wire::LeasesOut,
    pending: Vec<PendingLease<'e>>,
}

impl<'e> Overflow<'e> {
    fn new() -> Self {
        Overflow { out: wire::LeasesOut::new(), pending: Vec::new() }
    }

    /// Add a `LEASE`'s encoding (its lease goes into `pending` after), posting the message
    /// first when it is full.
    fn push(
        &mut self,
        core: &mut Core,
        shared: &Arc<ChannelShared>,
        idx: usize,
        m: &[u8],
        epfd: BorrowedFd<'_>,
    ) -> Result<()> {
        if !self.out.push(m) {
            self.flush(core, shared, idx, epfd)?;
            assert!(self.out.push(m), "one lease fits an empty LEASES message");
        }
        Ok(())
    }

    /// Post what the message holds and count its leases.
    fn flush(&mut self, core: &mut Core, shared: &Arc<ChannelShared>, idx: usize, epfd: BorrowedFd<'_>) -> Result<()> {
        if !self.out.is_empty() {
            let full = std::mem::replace(&mut self.out, wire::LeasesOut::new());
            core.post(idx, &full.finish(), &[], epfd)?;
        }
        book(core, shared, idx, self.pending.drain(..));
        Ok(())
    }
}

/// Record `leases`, posted to peer `idx`: each is counted in its export's lease book (served
/// by `shared`) until it comes back.
fn book<'e>(core: &mut Core, shared: &Arc<ChannelShared>, idx: usize, leases: impl Iterator<Item = PendingLease<'e>>) {
    for (lease, exp, event) in leases {
        let book = exp.leases().clone();
        book.add(shared);
        core.peers[idx].leases.insert(lease, (book, event));
    }
}

impl LocalChannel {
    /// Listen on `address` (a path, or `@name` for an abstract socket).
    pub fn listen(address: &str) -> Result<LocalChannel> {
        let addr = wire::address(address)?;
        let listener = super::seqpacket_socket()?;
        rustix::net::bind(&listener, &addr).map_err(|e| match e {
            rustix::io::Errno::ADDRINUSE => Error::Busy(format!(
                "channel address {address:?} is in use (a file exists there, or another channel listens on it); \
                 devshare never removes a file it did not create"
            )),
            e => wire::os(&format!("bind to {address:?}"), e),
        })?;
        let mut path = None;
        if !address.starts_with('@') {
            // Only this user may connect through the file system (SO_PEERCRED is checked anyway);
            // set before listen(), so no connection can come before it.
            rustix::fs::chmod(address, rustix::fs::Mode::from_raw_mode(0o600))
                .map_err(|e| wire::os(&format!("chmod of {address:?}"), e))?;
            let st = rustix::fs::stat(address).map_err(|e| wire::os(&format!("stat of {address:?}"), e))?;
            path = Some((std::path::PathBuf::from(address), st.st_dev, st.st_ino));
        }
        let cleanup = |path: &Option<(std::path::PathBuf, u64, u64)>| {
            if let Some((p, ..)) = path {
                let _ = std::fs::remove_file(p);
            }
        };
        if let Err(e) = rustix::net::listen(&listener, 128) {
            cleanup(&path);
            return Err(wire::os("listen", e));
        }
        let ep = match epoll::create(epoll::CreateFlags::CLOEXEC) {
            Ok(ep) => ep,
            Err(e) => {
                cleanup(&path);
                return Err(wire::os("epoll_create", e));
            }
        };
        if let Err(e) = epoll::add(&ep, &listener, epoll::EventData::new_u64(0), epoll::EventFlags::IN) {
            cleanup(&path);
            return Err(wire::os("epoll_ctl", e));
        }
        let core = Core {
            listener,
            path,
            uids: vec![rustix::process::geteuid().as_raw()],
            pids: Vec::new(),
            trust_announced: false,
            peers: PeerSet::default(),
            next_peer: 1,
            next_lease: 1,
            pools: FxHashMap::default(),
            next_pool: 1,
            registered: FxHashMap::default(),
            next_pin: 1,
            buf: Vec::new(),
            fds: Vec::new(),
            unwanted_fds: Vec::new(),
            gone_peers: Vec::new(),
            item_buf: Vec::new(),
            closed: false,
            stir: false,
        };
        let nudge = match rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        ) {
            Ok(fd) => fd,
            Err(e) => {
                cleanup(&core.path);
                return Err(wire::os("eventfd", e));
            }
        };
        let flags = epoll::EventFlags::IN | epoll::EventFlags::ET;
        if let Err(e) = epoll::add(&ep, &nudge, epoll::EventData::new_u64(NUDGE_EVENT), flags) {
            cleanup(&core.path);
            return Err(wire::os("epoll_ctl", e));
        }
        Ok(LocalChannel {
            shared: Arc::new(ChannelShared {
                core: Mutex::new(core),
                epoll: ep,
                generation: crate::fork::Stamp::now(),
                untimed: AtomicU64::new(0),
                registered: AtomicU64::new(0),
                closed_exports: Mutex::default(),
                exports_closed: Default::default(),
                events: Arc::default(),
                nudge,
                spin_ns: AtomicU64::new(0),
                lease_backoff: Default::default(),
                lease_yields: Default::default(),
            }),
        })
    }

    /// The descriptor a caller's event loop polls: readable when [`Self::service`] has work.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.epoll.as_fd()
    }

    /// Replace the uids that may connect (empty: keep the current set) and, when `pids` is not
    /// empty, admit only those pids. Connected peers are not affected.
    pub fn restrict(&self, uids: &[u32], pids: &[i32]) -> Result<()> {
        if let Some(p) = pids.iter().find(|&&p| p <= 0) {
            return Err(Error::InvalidArgument(format!("pid {p} is not a process id")));
        }
        let mut core = self.shared.lock()?;
        if !uids.is_empty() {
            core.uids = uids.to_vec();
        }
        if !pids.is_empty() {
            core.pids = pids.to_vec();
        }
        Ok(())
    }

    /// Whether ACL exports sent to a peer are whitelisted for the pid it announced even when that
    /// is not its pid as the kernel reports it (`SO_PEERCRED`). A consumer in another pid
    /// namespace — a container — announces its host pid (its bare tgid), which this process
    /// cannot check; by default such a peer's kernel pid is whitelisted instead, so that an
    /// admitted peer cannot get memory whitelisted for a process [`Self::restrict`] did not admit.
    pub fn trust_announced_pids(&self, trust: bool) -> Result<()> {
        self.shared.lock()?.trust_announced = trust;
        Ok(())
    }

    /// Accept peers, take their messages, notice hang-ups; wait at most `timeout` for something
    /// to happen (`None`: until something does).
    pub fn service(&self, timeout: Option<Duration>) -> Result<()> {
        self.shared.service(timeout)
    }

    /// Let a wait for this channel's lease returns ([`Exporter::wait`] of an export leased
    /// through it) poll the peers' rings for up to `spin` before it sleeps: for a producer
    /// thread that owns a core, a release is then taken within a microsecond or so instead of
    /// after a wake-up. Zero (the default) sleeps at once. At most [`super::super::MAX_SPIN`].
    /// A wait for an export also leased through other channels polls them all meanwhile, for
    /// the longest spin among them.
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        self.shared.spin_ns.store(spin_ns(spin)?, Ordering::Relaxed);
        Ok(())
    }

    /// Serve until `n` peers are connected (handshake done).
    pub fn wait_peers(&self, n: usize, timeout: Option<Duration>) -> Result<()> {
        wait_peers(n, timeout, || Ok(self.shared.lock()?.peers.ready_count()), |t| self.shared.service(t))
    }

    /// Ids of the connected peers, oldest first.
    pub fn peer_ids(&self) -> Result<Vec<u64>> {
        Ok(self.shared.lock()?.peers.ready_ids())
    }

    /// What is known about a connected peer.
    pub fn peer_info(&self, id: u64) -> Result<PeerInfo> {
        let core = self.shared.lock()?;
        let p = core.peers.get(id)?;
        let mut info = p.info.clone();
        info.leases = (p.leases.len() + p.attached.len()) as u64;
        info.slots = core
            .pools
            .values()
            .map(|pool| pool.slots.iter().filter(|s| **s == SlotState::Sent(id)).count() as u64)
            .sum();
        Ok(info)
    }

    /// Send `peer` one leased reference to a tensor in `exp`: counted in `exp`'s outstanding
    /// references until the peer releases it or disconnects.
    ///
    /// Never waits for the peer: a message its socket has no room for waits in its queue
    /// (bounded: [`DEVSHARE_CHANNEL_SEND_QUEUE`]); a peer past that bound, or whose queue does
    /// not move for [`DEVSHARE_CHANNEL_SEND_PATIENCE_MS`], is disconnected (`Closed`).
    pub fn send(&self, peer: u64, exp: &Exporter, desc: &TensorDesc<'_>) -> Result<()> {
        // A share with an event takes one of the channel's reused events (send_batch's); while
        // anything is registered, send_batch tells registered exports from the others.
        if desc.event || self.shared.registered.load(Ordering::Acquire) > 0 {
            return self.send_batch(peer, &[(exp, desc.clone())]);
        }
        let (h, event) = exp.share_leased(desc)?;
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        let r = (|| {
            core.allow(peer, exp)?;
            let lease = core.next_lease;
            core.next_lease += 1;
            let mut enc = Vec::new();
            crate::handle::encode::encode_full_into(&h, exp.external_table(), &mut enc)?;
            let msg = check_len(Message::Share { lease, handle: &enc }.encode())?;
            let fds = exp.channel_fds();
            let idx = core.index(peer)?;
            core.post(idx, &msg, &fds, epfd)?;
            let book = exp.leases().clone();
            book.add(&self.shared);
            debug_assert!(event.is_none(), "a share with an event goes through send_batch");
            core.peers[idx].leases.insert(lease, (book, None));
            Ok(())
        })();
        core.sweep(epfd);
        // A peer this call found past its limits is gone now, and so is the lease just queued.
        if r.is_ok() && core.index(peer).is_err() {
            return Err(Error::Closed(format!("peer {peer} was disconnected: it does not read its messages")));
        }
        r
    }

    /// Send `peer` one leased reference to each tensor of `items` (an export and a tensor in
    /// it), in order, as [`Self::send`] does for one: to a consumer that reads several shares
    /// per message (1.4 and later), in as few messages as the message size and descriptor
    /// limits allow; to older consumers one message each. Every share is made (and validated,
    /// its event recorded) before anything is sent: a refused description sends nothing.
    pub fn send_batch(&self, peer: u64, items: &[(&Exporter, TensorDesc<'_>)]) -> Result<()> {
        self.send_named(peer, items, &[])
    }

    /// [`Self::send_batch`], each lease with its name (`names`: empty, or one per item, `None`
    /// for a lease without one). A consumer that reads names (1.11 and later) gets them in a
    /// `NAMES` message right before the shares they name; an older one gets the shares alone.
    pub fn send_named(&self, peer: u64, items: &[(&Exporter, TensorDesc<'_>)], names: &[Option<&str>]) -> Result<()> {
        let sent = self.send_named_once(peer, items, names);
        let gone = || self.shared.lock().is_ok_and(|core| core.peers.get(peer).is_err());
        if sent.is_err() && items.iter().any(|(_, d)| d.event) && gone() {
            // The peer went while this send made its events (they came back with the failed
            // send): destroyed now, not left in the channel's pool until it closes.
            self.shared.events.forget(peer);
        }
        sent
    }

    fn send_named_once(&self, peer: u64, items: &[(&Exporter, TensorDesc<'_>)], names: &[Option<&str>]) -> Result<()> {
        if !names.is_empty() && names.len() != items.len() {
            return Err(Error::InvalidArgument(format!("{} names for {} tensors", names.len(), items.len())));
        }
        for (i, name) in names.iter().enumerate() {
            if let Some(n) = name {
                wire::check_name(n.as_bytes()).map_err(|why| Error::InvalidArgument(format!("names[{i}]: {why}")))?;
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        if items.iter().any(|(_, d)| d.event) {
            // Events are made for a connected consumer only: one made for a peer that is gone
            // would wait in the channel's pool until the channel closes.
            self.shared.lock()?.peers.get(peer)?;
        }
        let mut shares = Vec::new();
        shares.try_reserve_exact(items.len()).map_err(|_| Error::bad_size("count", "too many shares"))?;
        // One event (or one synchronisation) per backend, device and stream of the batch, made
        // before any share of that stream is described: every tensor's work was queued before
        // this call, so one record covers them all.
        // (backend and device, stream, with an event) -> the event (None: synchronised)
        type Synced = (((u16, i32), usize, bool), Option<Arc<ChannelEvent>>);
        let mut synced: Vec<Synced> = Vec::new();
        for (exp, desc) in items {
            let mut h = exp.describe_leased_with(desc, |h| *h)?;
            let key = (exp.event_key(), desc.stream as usize, desc.event);
            let event = match synced.iter().find(|s| s.0 == key) {
                Some(s) => s.1.clone(),
                None => {
                    // (All of this consumer's events on the device out: synchronised instead.)
                    let event = match desc.event {
                        true => self.shared.events.record(peer, exp, desc.stream)?,
                        false => None,
                    };
                    if event.is_none() {
                        exp.synchronize(desc.stream)?;
                    }
                    synced.push((key, event.clone()));
                    event
                }
            };
            match &event {
                Some(e) => h.event_handle = e.handle(),
                // Synchronised (asked for no event, or none left for this consumer).
                None => h.flags &= !crate::handle::DEVSHARE_HANDLE_FLAG_EVENT,
            }
            // What a `LEASE` of it carries when the peer pinned its export: the layout within
            // the export's window.
            let layout = ItemLayout::of(&h, desc.storage_offset, h.storage_size);
            shares.push((*exp, h, event, layout));
        }
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        // Registered exports closed meanwhile are retired first: these handles may reuse
        // their descriptor numbers.
        self.shared.retire_closed(&mut core);
        let r = (|| {
            for (exp, ..) in &shares {
                core.allow(peer, exp)?;
            }
            let idx = core.index(peer)?;
            let features = core.peers.get(peer)?.features;
            let batched = features & wire::FEATURE_SHARES != 0;
            let named = features & wire::FEATURE_NAMES != 0 && names.iter().any(Option::is_some);
            let mut sent = 0usize; // shares posted so far (where the next chunk's names start)
                                   // A consumer that keeps registered exports mapped is told which shares are of one.
            let keeps = features & wire::FEATURE_KEEP != 0 && !core.registered.is_empty();
            // A consumer that reads PIN_SHARES is offered each registered export's window once; once
            // it took the offer, a lease of that export is one LEASE, in its ring.
            let pins = keeps && features & wire::FEATURE_PIN != 0;
            // Such leases that find the ring full go in LEASES messages where the consumer reads them.
            let leases_batched = pins && features & wire::FEATURE_LEASES != 0;
            // Every share that goes as a handle is encoded before anything is posted (a handle
            // too long for a message sends nothing); a lease of a pinned export needs none.
            let mut encoded = Vec::new();
            encoded.try_reserve_exact(shares.len()).map_err(|_| Error::bad_size("count", "too many shares"))?;
            for (exp, h, event, layout) in shares {
                let pinned = pins && core.peers[idx].pins.get(&exp.id()).is_some_and(|p| p.1);
                let mut enc = Vec::new();
                if !pinned {
                    crate::handle::encode::encode_full_into(&h, exp.external_table(), &mut enc)?;
                    enc = check_len(enc)?;
                }
                encoded.push((exp, enc, event, layout, pinned));
            }
            // The event records this send's LEASEs carried so far: a later lease of the send
            // with the same one says so (its consumer waited on it already).
            let mut leased_events: Vec<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]> = Vec::new();
            let mut shares = encoded.into_iter().peekable();
            while let Some(&(.., pinned)) = shares.peek() {
                if pinned {
                    // A run of leases of pinned exports (at most a message's worth of names):
                    // their names in one NAMES message first, then one LEASE each.
                    let mut run = Vec::new();
                    while let Some(item) = shares.next_if(|s| s.4) {
                        run.push(item);
                        if run.len() == wire::MAX_SHARES {
                            break;
                        }
                    }
                    let first_lease = core.next_lease;
                    let mine = if named { &names[sent..sent + run.len()] } else { &[][..] };
                    if mine.iter().any(Option::is_some) {
                        for m in names_messages(first_lease, mine) {
                            core.post(idx, &check_len(m)?, &[], epfd)?;
                        }
                    }
                    sent += run.len();
                    // Once the ring is full, the rest of the run goes over the socket: in LEASES
                    // messages to a consumer that reads them (booked once each is posted), else
                    // one message each.
                    let mut overflow: Option<Overflow> = None;
                    for (exp, _, event, layout, _) in run {
                        let lease = core.next_lease;
                        let handle = event.as_ref().map(|e| e.handle());
                        let again = handle.is_some_and(|h| leased_events.contains(&h));
                        let m = Message::Lease { export: exp.id(), lease, layout, event: handle, again }
                            .encode_into(std::mem::take(&mut core.item_buf));
                        let in_ring = overflow.is_none()
                            && if leases_batched {
                                core.ring_item(idx, &m, epfd)?
                            } else {
                                core.post_item(idx, &m, epfd).map(|()| true)?
                            };
                        if !in_ring {
                            overflow.get_or_insert_with(Overflow::new).push(&mut core, &self.shared, idx, &m, epfd)?;
                        }
                        core.item_buf = m;
                        leased_events.extend(handle.filter(|_| !again));
                        core.next_lease += 1;
                        match overflow.as_mut() {
                            Some(o) if !in_ring => o.pending.push((lease, exp, event)),
                            _ => book(&mut core, &self.shared, idx, [(lease, exp, event)].into_iter()),
                        }
                    }
                    if let Some(mut o) = overflow {
                        o.flush(&mut core, &self.shared, idx, epfd)?;
                    }
                    continue;
                }
                // One message: as many shares as fit its size and descriptor limits (one at
                // least), or one per message for a consumer that reads only SHARE; it ends at
                // a lease of a pinned export.
                let first_lease = core.next_lease;
                let mut chunk = Vec::new();
                let (mut bytes, mut nfds) = (4 + 4 + 8, 0usize);
                while let Some((exp, enc, .., pinned)) = shares.peek() {
                    if *pinned {
                        break;
                    }
                    let fds = exp.channel_fds().len();
                    let entry = if pins {
                        40
                    } else if keeps {
                        16
                    } else {
                        8
                    };
                    let fits = bytes + entry + enc.len() <= wire::MAX_MESSAGE
                        && nfds + fds <= wire::MAX_FDS
                        && chunk.len() < wire::MAX_SHARES;
                    if !chunk.is_empty() && (!batched || !fits) {
                        break;
                    }
                    bytes += entry + enc.len();
                    nfds += fds;
                    chunk.push(shares.next().expect("peeked"));
                }
                // The registered exports of the chunk offered to be pinned (once per registration):
                // (export, offer), recorded as offered once the message is posted.
                let mut offers: Vec<(u64, wire::Offer)> = Vec::new();
                let msg = if pins {
                    let entries = chunk
                        .iter()
                        .map(|(exp, enc, ..)| {
                            let id = exp.id();
                            let mut offer = wire::Offer::NONE;
                            if !core.registered.contains_key(&id) {
                                return (exp.channel_fds().len() as u32, 0, offer, &enc[..]);
                            }
                            if !core.peers[idx].pins.contains_key(&id) && !offers.iter().any(|o| o.0 == id) {
                                let (window_offset, window_size) = exp.window();
                                offer = wire::Offer { pin: core.next_pin, window_offset, window_size };
                                core.next_pin += 1;
                                offers.push((id, offer));
                            }
                            (exp.channel_fds().len() as u32, id, offer, &enc[..])
                        })
                        .collect();
                    Message::PinShares { first_lease, entries }.encode()
                } else if keeps {
                    let registered = &core.registered;
                    let entries = chunk
                        .iter()
                        .map(|(exp, enc, ..)| {
                            let id = if registered.contains_key(&exp.id()) { exp.id() } else { 0 };
                            (exp.channel_fds().len() as u32, id, &enc[..])
                        })
                        .collect();
                    Message::KeptShares { first_lease, entries }.encode()
                } else if batched {
                    let entries =
                        chunk.iter().map(|(exp, enc, ..)| (exp.channel_fds().len() as u32, &enc[..])).collect();
                    Message::Shares { first_lease, entries }.encode()
                } else {
                    Message::Share { lease: first_lease, handle: &chunk[0].1 }.encode()
                };
                let msg = check_len(msg)?;
                let fds: Vec<BorrowedFd<'_>> = chunk.iter().flat_map(|(exp, ..)| exp.channel_fds()).collect();
                if named {
                    let mine = &names[sent..sent + chunk.len()];
                    for m in names_messages(first_lease, mine) {
                        core.post(idx, &check_len(m)?, &[], epfd)?;
                    }
                }
                sent += chunk.len();
                core.post(idx, &msg, &fds, epfd)?;
                core.next_lease += chunk.len() as u64;
                for (id, offer) in offers {
                    core.peers[idx].pins.insert(id, (offer.pin, false));
                }
                for (i, (exp, _, event, ..)) in chunk.into_iter().enumerate() {
                    if keeps && core.registered.contains_key(&exp.id()) {
                        core.peers[idx].kept.insert(exp.id());
                    }
                    let book = exp.leases().clone();
                    book.add(&self.shared);
                    core.peers[idx].leases.insert(first_lease + i as u64, (book, event));
                }
            }
            Ok(())
        })();
        core.sweep(epfd);
        if r.is_ok() && core.index(peer).is_err() {
            return Err(Error::Closed(format!("peer {peer} was disconnected: it does not read its messages")));
        }
        r
    }

    /// Register `exp` with this channel: its leases tell consumers (1.10 and later) that they
    /// may keep its allocation mapped between leases, so that the next lease of it is a lookup.
    /// [`Self::unregister`] (or the channel's close) tells every consumer that kept it to
    /// unmap it once it holds no lease; so does the export's close: a consumer is told before
    /// any handle sent after the close reaches it (a later export may reuse the closed one's
    /// descriptor numbers, which is how a segmented CUDA export's mapping is known).
    pub fn register(&self, exp: &Exporter) -> Result<()> {
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        self.shared.retire_closed(&mut core);
        exp.leases().listen(&self.shared);
        core.registered.insert(exp.id(), Arc::downgrade(exp.leases()));
        self.shared.registered.store(core.registered.len() as u64, Ordering::Release);
        core.sweep(epfd);
        Ok(())
    }

    /// Undo [`Self::register`]: every consumer that kept the allocation mapped is told to let it
    /// go (`RETIRE`). Whether it was registered: `NotFound` when not.
    pub fn unregister(&self, exp: &Exporter) -> Result<()> {
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        self.shared.retire_closed(&mut core);
        let id = exp.id();
        if core.registered.remove(&id).is_none() {
            return Err(Error::NotFound(format!("export {id} is not registered with this channel")));
        }
        self.shared.registered.store(core.registered.len() as u64, Ordering::Release);
        core.retire(id, epfd);
        core.sweep(epfd);
        Ok(())
    }

    /// Disconnect one peer now, as if it had died: its leases and pool slots come back at once
    /// and it sees `Closed`. `NotFound` when no such peer is connected.
    pub fn disconnect(&self, peer: u64) -> Result<()> {
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        let idx = core.index(peer)?;
        core.flush(idx, epfd); // what its socket takes now still reaches it
        core.drop_peer(idx, epfd);
        Ok(())
    }

    /// Close: every peer is disconnected (and sees `Closed`), their leases stop being counted,
    /// the socket file (if any) is removed.
    pub fn close(&self) {
        self.shared.close();
    }

    /// Make a pool of `count` slots of `slot_size` bytes at the start of `exp`'s range.
    pub fn pool(&self, exp: Arc<Exporter>, slot_size: u64, count: u32) -> Result<LocalPool> {
        if slot_size == 0 {
            return Err(Error::InvalidArgument("slot_size is 0".into()));
        }
        if count == 0 {
            return Err(Error::InvalidArgument("count is 0: a pool needs at least one slot".into()));
        }
        if count > DEVSHARE_POOL_MAX_SLOTS {
            return Err(Error::bad_size(
                "count",
                format!("{count} slots is above the maximum of {DEVSHARE_POOL_MAX_SLOTS} slots per pool"),
            ));
        }
        pool_fits(&exp, slot_size, count)?;
        // The bookkeeping, allocated fallibly: a failure is a status, never an abort.
        let n = count as usize;
        let mut slots = Vec::new();
        let mut events = Vec::new();
        let mut free = Vec::new();
        let oom = |_| Error::bad_size("count", format!("no memory for the bookkeeping of {count} slots"));
        slots.try_reserve_exact(n).map_err(oom)?;
        events.try_reserve_exact(n).map_err(oom)?;
        free.try_reserve_exact(n).map_err(oom)?;
        slots.resize(n, SlotState::Free);
        events.resize_with(n, || None);
        free.extend((0..count).rev());
        let described = pool::Described::new(count)?;
        let next = Arc::new(AtomicU64::new(0));
        let base = exp.ptr() as usize;
        let mut core = self.shared.lock()?;
        let id = core.next_pool;
        core.next_pool = core.next_pool.checked_add(1).ok_or_else(|| Error::Busy("pool ids are exhausted".into()))?;
        let state =
            PoolState { exporter: exp, slot_size, count, slots, events, free, out: 0, described, next: next.clone() };
        core.pools.insert(id, state);
        Ok(LocalPool {
            shared: self.shared.clone(),
            id,
            slot_size,
            spin_ns: Default::default(),
            backoff: Default::default(),
            yields: Default::default(),
            next,
            base,
        })
    }
}

impl Drop for LocalChannel {
    fn drop(&mut self) {
        self.shared.close();
    }
}

/// A pool of fixed-address slots on a channel.
pub struct LocalPool {
    shared: Arc<ChannelShared>,
    id: u32,
    /// Bytes per slot (fixed for the pool's life: read without the lock).
    slot_size: u64,
    /// How long [`Pool::acquire`] polls for a returned slot before it sleeps (ns; 0: not).
    spin_ns: std::sync::atomic::AtomicU64,
    /// How this pool's adaptive spins went (spin.rs).
    backoff: super::spin::Backoff,
    /// How its yields to a consumer on the same CPU went (spin.rs).
    yields: super::spin::YieldGuard,
    /// The slot set aside for the next acquire ([`PoolState::next`]).
    next: Arc<AtomicU64>,
    /// The address of slot 0 in this process (the export's, fixed for the pool's life).
    base: usize,
}

impl Core {
    /// Export `id` is no longer registered: every peer that kept or pinned it is told to let it
    /// go (`RETIRE`), and its offers are withdrawn.
    fn retire(&mut self, id: u64, epfd: BorrowedFd<'_>) {
        let msg = Message::Retire { export: id }.encode();
        for i in 0..self.peers.len() {
            self.peers[i].pins.remove(&id);
            if self.peers[i].kept.remove(&id) {
                // A peer that cannot be told (gone, past its limits, or a transient failure of
                // the send) is disconnected by sweep: a consumer that missed a RETIRE could be
                // served its old mapping for a later share, and one whose connection ended
                // keeps nothing.
                if let Err(e) = self.post(i, &msg, &[], epfd) {
                    self.peers[i].doomed.get_or_insert_with(|| format!("a RETIRE could not be sent to it: {e}"));
                }
            }
        }
    }
}

/// The `NAMES` messages for leases `first_lease..` named `names` (one each; `None`: no name):
/// as few as fit the message size.
fn names_messages(first_lease: u64, names: &[Option<&str>]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < names.len() {
        let (mut end, mut bytes) = (start, 4 + 4 + 8);
        while end < names.len() {
            let len = 2 + names[end].map_or(0, str::len);
            if end > start && bytes + len > wire::MAX_MESSAGE {
                break;
            }
            bytes += len;
            end += 1;
        }
        let chunk = names[start..end].iter().map(|n| n.unwrap_or("")).collect();
        out.push(Message::Names { first_lease: first_lease + start as u64, names: chunk }.encode());
        start = end;
    }
    out
}
