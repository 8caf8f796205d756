//! The producer end of a channel: the listening socket, its peers, their leases, and pools.

use super::ring::{self, ProducerRing};
use crate::backend::IpcEvent;
use crate::channel::admission::{self, Admission};
use crate::channel::item::slot_desc;
use crate::channel::limits::*;
use crate::channel::peers::PeerInfo;
use crate::channel::wire::{self, ItemLayout, Message, Received};
use crate::error::{Error, Result};
use crate::export::{Exporter, TensorDesc};
use crate::export::{LeaseBook, LeaseServer};
use rustc_hash::{FxHashMap, FxHashSet};
use rustix::event::epoll;
use rustix::event::Timespec;
use rustix::net::{AddressFamily, SocketFlags, SocketType};
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Messages taken from one peer per service pass: a peer that floods the channel cannot keep
/// the others' messages waiting (epoll reports it again on the next pass).
const PEER_BATCH: usize = 64;

/// A reference out with a peer: its export's book, and the event recorded for the share.
type Lease = (Arc<LeaseBook>, Option<Box<dyn IpcEvent>>);

/// A message waiting for room in a peer's socket buffer, with duplicates of its descriptors.
struct Queued {
    msg: Vec<u8>,
    fds: Vec<OwnedFd>,
}

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
    /// Exports (by id) this peer's tgid was whitelisted on.
    allowed: FxHashSet<u64>,
    /// The `wire::FEATURE_*` bits its handshake announced.
    features: u16,
    /// Messages posted to it since the handshake (sent or queued): what its ring records count.
    posted: u64,
    /// The shared-memory ring its host pool items travel in, made on its first such item.
    ring: Option<ProducerRing>,
    /// Making its ring failed once: its items go over the socket.
    no_ring: bool,
}

/// Whether a look at the rings asks their consumers to wake the channel for the next return.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arm {
    /// No (a spinner looks at the rings itself).
    No,
    /// Yes, at once.
    Now,
    /// Yes; the waiter looks again within 5 ms by itself, so a consumer on its CPU may put
    /// the wake-up off while it has more items to take (see `ring`, "put-off returns").
    Patient,
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
}

struct PoolState {
    exporter: Arc<Exporter>,
    slot_size: u64,
    count: u32,
    slots: Vec<SlotState>,
    /// The event recorded for each slot out with a consumer (kept until the slot comes back).
    events: Vec<Option<Box<dyn IpcEvent>>>,
    free: Vec<u32>,
    /// How many slots are out with consumers.
    out: u32,
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
    peers: Vec<Peer>,
    next_peer: u64,
    next_lease: u64,
    pools: FxHashMap<u32, PoolState>,
    next_pool: u32,
    buf: Vec<u8>,
    fds: Vec<OwnedFd>,
    closed: bool,
    /// Something changed that a thread waiting without a time limit must look at (a slot
    /// became free, a pool or the channel closed, a deadline began): the lock's guard nudges
    /// it on the way out ([`Locked`]).
    stir: bool,
}

pub(crate) struct ChannelShared {
    core: Mutex<Core>,
    epoll: OwnedFd,
    generation: u64,
    /// The thread ([`thread_token`]; 0: none) that waits in the epoll set without a time limit
    /// (an acquire with none and at most one item out: no timer to arm and cancel, about 0.3 µs
    /// a wait on the machine BENCHMARKS.md describes). At most one at a time: the others look
    /// again at least every 5 ms. What other threads
    /// change that it must see ([`Core::stir`]) writes `nudge`, an eventfd in the epoll set
    /// (edge triggered, never read).
    untimed: AtomicU64,
    nudge: OwnedFd,
}

/// This thread's token for [`ChannelShared::untimed`]: the address of a thread-local (not 0,
/// and distinct among the threads alive).
fn thread_token() -> u64 {
    thread_local!(static TOKEN: u8 = const { 0 });
    TOKEN.with(|t| t as *const u8 as u64)
}

/// The channel's lock, held: on release, a change a thread waiting without a time limit must
/// see ([`Core::stir`]) nudges that thread (after the unlock: it takes the lock to look).
struct Locked<'a> {
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
        let stirred = std::mem::take(&mut self.guard.stir);
        // SAFETY: dropped once, here; not used after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.guard) };
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
struct Untimed<'a>(&'a AtomicU64);

impl Drop for Untimed<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::SeqCst);
    }
}

/// The producer end of a channel. Dropping it closes it.
pub struct LocalChannel {
    shared: Arc<ChannelShared>,
}

fn timespec(d: Duration) -> Timespec {
    Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) }
}

impl LocalChannel {
    /// Listen on `address` (a path, or `@name` for an abstract socket).
    pub fn listen(address: &str) -> Result<LocalChannel> {
        let addr = wire::address(address)?;
        let listener = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(|e| wire::os("socket(AF_UNIX, SOCK_SEQPACKET)", e))?;
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
            peers: Vec::new(),
            next_peer: 1,
            next_lease: 1,
            pools: FxHashMap::default(),
            next_pool: 1,
            buf: Vec::new(),
            fds: Vec::new(),
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
                generation: crate::fork::generation(),
                untimed: AtomicU64::new(0),
                nudge,
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

    /// Serve until `n` peers are connected (handshake done).
    pub fn wait_peers(&self, n: usize, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut last_look = false;
        loop {
            let ready = self.shared.lock()?.peers.iter().filter(|p| p.ready).count();
            if ready >= n {
                return Ok(());
            }
            if last_look {
                return Err(Error::Timeout(format!("{ready} of {n} peers connected")));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // Once the time is up, serve what already arrived (without waiting) and look once more.
            last_look = left.is_some_and(|l| l.is_zero());
            self.shared.service(left)?;
        }
    }

    /// Ids of the connected peers, oldest first.
    pub fn peer_ids(&self) -> Result<Vec<u64>> {
        Ok(self.shared.lock()?.peers.iter().filter(|p| p.ready).map(|p| p.info.id).collect())
    }

    /// What is known about a connected peer.
    pub fn peer_info(&self, id: u64) -> Result<PeerInfo> {
        let core = self.shared.lock()?;
        let p = core.peer(id)?;
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
            core.peers[idx].leases.insert(lease, (book, event));
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
        if items.is_empty() {
            return Ok(());
        }
        let mut shares = Vec::new();
        shares.try_reserve_exact(items.len()).map_err(|_| Error::bad_size("count", "too many shares"))?;
        for (exp, desc) in items {
            let (h, event) = exp.share_leased(desc)?;
            let mut enc = Vec::new();
            crate::handle::encode::encode_full_into(&h, exp.external_table(), &mut enc)?;
            check_len(enc.clone())?;
            shares.push((*exp, enc, event));
        }
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        let r = (|| {
            for (exp, _, _) in &shares {
                core.allow(peer, exp)?;
            }
            let batched = core.peer(peer)?.features & wire::FEATURE_SHARES != 0;
            let mut shares = shares.into_iter().peekable();
            while shares.peek().is_some() {
                // One message: as many shares as fit its size and descriptor limits (one at
                // least), or one per message for a consumer that reads only SHARE.
                let first_lease = core.next_lease;
                let mut chunk = Vec::new();
                let (mut bytes, mut nfds) = (4 + 4 + 8, 0usize);
                while let Some((exp, enc, _)) = shares.peek() {
                    let fds = exp.channel_fds().len();
                    let fits = bytes + 8 + enc.len() <= wire::MAX_MESSAGE
                        && nfds + fds <= wire::MAX_FDS
                        && chunk.len() < wire::MAX_SHARES;
                    if !chunk.is_empty() && (!batched || !fits) {
                        break;
                    }
                    bytes += 8 + enc.len();
                    nfds += fds;
                    chunk.push(shares.next().expect("peeked"));
                }
                let msg = if batched {
                    let entries =
                        chunk.iter().map(|(exp, enc, _)| (exp.channel_fds().len() as u32, &enc[..])).collect();
                    Message::Shares { first_lease, entries }.encode()
                } else {
                    Message::Share { lease: first_lease, handle: &chunk[0].1 }.encode()
                };
                let msg = check_len(msg)?;
                let fds: Vec<BorrowedFd<'_>> = chunk.iter().flat_map(|(exp, _, _)| exp.channel_fds()).collect();
                let idx = core.index(peer)?;
                core.post(idx, &msg, &fds, epfd)?;
                core.next_lease += chunk.len() as u64;
                for (i, (exp, _, event)) in chunk.into_iter().enumerate() {
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
        slot_size.checked_mul(u64::from(count)).filter(|&t| t <= exp.size()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{count} slots of {slot_size} bytes do not fit the export's {} bytes",
                exp.size()
            ))
        })?;
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
        let mut core = self.shared.lock()?;
        let id = core.next_pool;
        core.next_pool = core.next_pool.checked_add(1).ok_or_else(|| Error::Busy("pool ids are exhausted".into()))?;
        core.pools.insert(id, PoolState { exporter: exp, slot_size, count, slots, events, free, out: 0 });
        Ok(LocalPool { shared: self.shared.clone(), id, slot_size, spin_ns: Default::default() })
    }
}

impl Drop for LocalChannel {
    fn drop(&mut self) {
        self.shared.close();
    }
}

fn check_len(msg: Vec<u8>) -> Result<Vec<u8>> {
    if msg.len() > wire::MAX_MESSAGE {
        return Err(Error::Unsupported(format!(
            "a handle encoding of {} bytes does not fit one channel message ({} bytes)",
            msg.len(),
            wire::MAX_MESSAGE
        )));
    }
    Ok(msg)
}

impl Core {
    fn peer(&self, id: u64) -> Result<&Peer> {
        self.peers
            .iter()
            .find(|p| p.info.id == id && p.ready)
            .ok_or_else(|| Error::NotFound(format!("peer {id} is not connected to this channel")))
    }

    fn peer_mut(&mut self, id: u64) -> Result<&mut Peer> {
        self.peers
            .iter_mut()
            .find(|p| p.info.id == id && p.ready)
            .ok_or_else(|| Error::NotFound(format!("peer {id} is not connected to this channel")))
    }

    /// The index of a connected peer (handshake done, not being disconnected).
    fn index(&self, id: u64) -> Result<usize> {
        self.peers
            .iter()
            .position(|p| p.info.id == id && p.ready && p.doomed.is_none())
            .ok_or_else(|| Error::NotFound(format!("peer {id} is not connected to this channel")))
    }

    /// Send a message to peer `idx`, or queue it when its socket buffer is full. Never waits.
    /// A peer that is gone, or whose queue is past its bounds, is marked to be disconnected
    /// ([`Self::sweep`]) and the answer is `Closed`.
    fn post(&mut self, idx: usize, msg: &[u8], fds: &[BorrowedFd<'_>], epfd: BorrowedFd<'_>) -> Result<()> {
        // What waits goes first (the peer may have read meanwhile), so that a producer that
        // sends without serving still moves the queue.
        if !self.peers[idx].queue.is_empty() {
            self.flush(idx, epfd);
        }
        let p = &mut self.peers[idx];
        if let Some(why) = &p.doomed {
            return Err(Error::Closed(why.clone()));
        }
        if p.queue.is_empty() {
            match wire::try_send(p.fd.as_fd(), msg, fds) {
                Ok(true) => {
                    p.posted += 1;
                    return Ok(());
                }
                Ok(false) => {}
                Err(e @ Error::Closed(_)) => {
                    p.doomed = Some(format!("peer {} is gone", p.info.id));
                    return Err(e);
                }
                // Out of kernel buffers or descriptors in flight: this send fails, the peer stays.
                Err(e) => return Err(e),
            }
        }
        if p.queue.len() >= DEVSHARE_CHANNEL_SEND_QUEUE
            || p.queued_bytes + msg.len() > DEVSHARE_CHANNEL_SEND_QUEUE_BYTES
            || p.queued_fds + fds.len() > DEVSHARE_CHANNEL_SEND_QUEUE_FDS
        {
            let why = format!(
                "peer {} was disconnected: it does not read its messages ({} waiting, {} bytes; at most \
                 {DEVSHARE_CHANNEL_SEND_QUEUE} messages, {DEVSHARE_CHANNEL_SEND_QUEUE_BYTES} bytes and \
                 {DEVSHARE_CHANNEL_SEND_QUEUE_FDS} descriptors may wait)",
                p.info.id,
                p.queue.len(),
                p.queued_bytes
            );
            p.doomed = Some(why.clone());
            return Err(Error::Closed(why));
        }
        let mut owned = Vec::with_capacity(fds.len());
        for f in fds {
            owned.push(rustix::io::fcntl_dupfd_cloexec(f, 0).map_err(|e| wire::os("dup of a descriptor to queue", e))?);
        }
        if p.queue.is_empty() {
            p.stalled_since = Some(Instant::now());
            // A send-patience deadline begins; tell us when it can take more.
            self.stir = true;
            let _ = epoll::modify(
                epfd,
                &p.fd,
                epoll::EventData::new_u64(p.info.id),
                epoll::EventFlags::IN | epoll::EventFlags::OUT,
            );
        }
        p.queued_bytes += msg.len();
        p.queued_fds += owned.len();
        p.queue.push_back(Queued { msg: msg.to_vec(), fds: owned });
        p.posted += 1;
        Ok(())
    }

    /// Send what waits for peer `idx` while its socket takes it.
    fn flush(&mut self, idx: usize, epfd: BorrowedFd<'_>) {
        let p = &mut self.peers[idx];
        while let Some(q) = p.queue.front() {
            let fds: Vec<BorrowedFd<'_>> = q.fds.iter().map(|f| f.as_fd()).collect();
            match wire::try_send(p.fd.as_fd(), &q.msg, &fds) {
                Ok(true) => {
                    drop(fds);
                    let q = p.queue.pop_front().expect("a queued message");
                    p.queued_bytes -= q.msg.len();
                    p.queued_fds -= q.fds.len();
                    p.stalled_since = Some(Instant::now()); // it moved: patience starts again
                }
                Ok(false) => return,
                Err(Error::Closed(_)) => {
                    p.doomed = Some(format!("peer {} is gone", p.info.id));
                    return;
                }
                // A transient failure (no kernel buffers, too many descriptors in flight): try
                // again on the next writable event; the patience still counts.
                Err(_) => return,
            }
        }
        p.stalled_since = None;
        let _ = epoll::modify(epfd, &p.fd, epoll::EventData::new_u64(p.info.id), epoll::EventFlags::IN);
    }

    /// Disconnect the peers that are marked, past their handshake deadline, past their send
    /// patience, or past their error budget.
    fn sweep(&mut self, epfd: BorrowedFd<'_>) {
        // Nothing to judge (the usual case, on every send): no clock read.
        if self.peers.iter().all(|p| {
            p.ready
                && p.doomed.is_none()
                && p.stalled_since.is_none()
                && p.info.protocol_errors <= DEVSHARE_CHANNEL_ERROR_BUDGET
        }) {
            return;
        }
        let now = Instant::now();
        let handshake = Duration::from_millis(DEVSHARE_CHANNEL_HANDSHAKE_MS);
        let patience = Duration::from_millis(DEVSHARE_CHANNEL_SEND_PATIENCE_MS);
        // Before a deadline is judged, look at the socket: a handshake that arrived, or a queue
        // the peer has made room for meanwhile, is progress (the caller may not have served).
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            if p.doomed.is_some() {
                continue;
            }
            if !p.ready && now.duration_since(p.accepted) >= handshake && !self.drain_peer(i) {
                self.peers[i].doomed.get_or_insert_with(|| "it hung up".into());
            } else if self.peers[i].stalled_since.is_some_and(|t| now.duration_since(t) >= patience) {
                self.flush(i, epfd);
            }
        }
        let mut i = 0;
        while i < self.peers.len() {
            let p = &self.peers[i];
            let out = p.doomed.is_some()
                || (!p.ready && now.duration_since(p.accepted) >= handshake)
                || p.stalled_since.is_some_and(|t| now.duration_since(t) >= patience)
                || p.info.protocol_errors > DEVSHARE_CHANNEL_ERROR_BUDGET;
            if out {
                self.drop_peer(i, epfd);
            } else {
                i += 1;
            }
        }
    }

    /// The next time [`Self::sweep`] has something to do (a handshake or send-patience deadline).
    fn next_deadline(&self) -> Option<Instant> {
        let handshake = Duration::from_millis(DEVSHARE_CHANNEL_HANDSHAKE_MS);
        let patience = Duration::from_millis(DEVSHARE_CHANNEL_SEND_PATIENCE_MS);
        self.peers
            .iter()
            .filter_map(|p| if !p.ready { Some(p.accepted + handshake) } else { p.stalled_since.map(|t| t + patience) })
            .min()
    }

    /// The pid ACL exports sent to `p` are whitelisted for: the one it announced when that is
    /// its kernel pid or announced pids are trusted, else its kernel pid.
    fn whitelist_pid(&self, p: &Peer) -> i32 {
        if p.info.tgid == p.info.pid || self.trust_announced {
            p.info.tgid
        } else {
            p.info.pid
        }
    }

    /// Whitelist the peer on `exp` once (ACL; a no-op elsewhere).
    fn allow(&mut self, peer: u64, exp: &Exporter) -> Result<()> {
        let pid = self.whitelist_pid(self.peer(peer)?);
        let p = self.peer_mut(peer)?;
        if !p.allowed.contains(&exp.id()) {
            exp.allow_pid(pid)?;
            p.allowed.insert(exp.id());
        }
        Ok(())
    }

    fn accept_all(&mut self, epfd: BorrowedFd<'_>) {
        loop {
            let fd = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::INTR) => continue,
                Err(_) => return, // EAGAIN, or a connection that died before we took it
            };
            let cred = match rustix::net::sockopt::socket_peercred(&fd) {
                Ok(c) => c,
                Err(_) => continue,
            };
            let pid = cred.pid.as_raw_nonzero().get();
            let uid = cred.uid.as_raw();
            let refuse = if !self.uids.contains(&uid) {
                Some(format!("uid {uid} may not connect to this channel (allowed: {:?})", self.uids))
            } else if !self.pids.is_empty() && !self.pids.contains(&pid) {
                Some(format!("pid {pid} may not connect to this channel (allowed: {:?})", self.pids))
            } else if self.peers.iter().filter(|p| p.ready).count() >= DEVSHARE_CHANNEL_MAX_PEERS {
                Some(format!("the channel already serves {DEVSHARE_CHANNEL_MAX_PEERS} peers"))
            } else {
                // Limits per process: connections of one process that never say hello cannot
                // keep another's consumer out.
                let waiting = self
                    .peers
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| !p.ready && p.doomed.is_none())
                    .map(|(i, p)| (i, p.info.pid, p.accepted));
                match admission::admit(waiting, pid) {
                    Admission::Admit => None,
                    Admission::Evict(victim) => {
                        self.peers[victim].doomed = Some("its place was given to another process's connection".into());
                        self.drop_peer(victim, epfd);
                        None
                    }
                    Admission::Refuse(why) => Some(why),
                }
            };
            if let Some(why) = refuse {
                let _ = wire::try_send(fd.as_fd(), &Message::Refused { reason: why.as_bytes() }.encode(), &[]);
                continue;
            }
            let id = self.next_peer;
            self.next_peer += 1;
            if epoll::add(epfd, &fd, epoll::EventData::new_u64(id), epoll::EventFlags::IN).is_err() {
                continue;
            }
            self.peers.push(Peer {
                info: PeerInfo { id, pid, uid, gid: cred.gid.as_raw(), ..Default::default() },
                fd,
                ready: false,
                accepted: Instant::now(),
                queue: VecDeque::new(),
                queued_bytes: 0,
                queued_fds: 0,
                stalled_since: None,
                doomed: None,
                leases: FxHashMap::default(),
                attached: FxHashMap::default(),
                allowed: FxHashSet::default(),
                features: 0,
                posted: 0,
                ring: None,
                no_ring: false,
            });
            self.stir = true; // a handshake deadline begins
        }
    }

    /// Take up to [`PEER_BATCH`] queued messages of peer `idx`; false when it is gone or past
    /// its error budget.
    fn drain_peer(&mut self, idx: usize) -> bool {
        let mut buf = std::mem::take(&mut self.buf);
        let mut fds = std::mem::take(&mut self.fds);
        let mut taken = 0;
        let alive = loop {
            if taken == PEER_BATCH {
                break true;
            }
            taken += 1;
            if self.peers[idx].info.protocol_errors > DEVSHARE_CHANNEL_ERROR_BUDGET {
                break false;
            }
            match wire::recv(self.peers[idx].fd.as_fd(), &mut buf, &mut fds) {
                Ok(Received::Empty) => break true,
                Ok(Received::Closed) | Err(_) => break false,
                Ok(Received::Message(n)) => {
                    if !fds.is_empty() {
                        // Consumers send no descriptors: close them, count the error.
                        fds.clear();
                        self.peers[idx].info.protocol_errors += 1;
                        continue;
                    }
                    match self.message(idx, &buf[..n]) {
                        Ok(true) => {}
                        Ok(false) => break false,
                        Err(_) => self.peers[idx].info.protocol_errors += 1,
                    }
                }
            }
        };
        self.buf = buf;
        self.fds = fds;
        alive
    }

    /// Handle one message from peer `idx`; `Ok(false)`: drop the peer.
    fn message(&mut self, idx: usize, b: &[u8]) -> Result<bool> {
        let msg = Message::decode(b)?;
        let peer = &mut self.peers[idx];
        if !peer.ready {
            let Message::Hello { magic, version, features, tgid } = msg else {
                return Ok(false);
            };
            let bad = if magic != wire::MAGIC {
                Some("the handshake is not a devshare channel's".to_string())
            } else if version != wire::VERSION {
                Some(format!("channel protocol version {version} is not this producer's {}", wire::VERSION))
            } else if tgid <= 0 {
                Some(format!("tgid {tgid} is not a process id"))
            } else {
                None
            };
            if let Some(why) = bad {
                let m = Message::Refused { reason: why.as_bytes() }.encode();
                let _ = wire::try_send(peer.fd.as_fd(), &m, &[]);
                return Ok(false);
            }
            peer.info.tgid = tgid;
            peer.features = features;
            let m = Message::Welcome {
                magic: wire::MAGIC,
                version: wire::VERSION,
                peer_id: peer.info.id,
                producer_pid: std::process::id() as i32,
            }
            .encode();
            // A fresh socket has room for it; one that has not is not worth waiting for.
            if !matches!(wire::try_send(peer.fd.as_fd(), &m, &[]), Ok(true)) {
                return Ok(false);
            }
            peer.ready = true;
            return Ok(true);
        }
        match msg {
            Message::Release { lease } => {
                let (book, _event) = peer
                    .leases
                    .remove(&lease)
                    .ok_or_else(|| Error::Untrusted(format!("lease {lease} is not held by this peer")))?;
                book.sub(1);
            }
            Message::Return { pool, slot } => {
                let id = peer.info.id;
                self.take_return(id, pool, slot)?;
            }
            Message::Detach { pool } => {
                let book = peer
                    .attached
                    .remove(&pool)
                    .ok_or_else(|| Error::Untrusted(format!("pool {pool} is not attached by this peer")))?;
                book.sub(1);
            }
            other => return Err(Error::Untrusted(format!("{other:?} is not a message a consumer sends"))),
        }
        Ok(true)
    }

    /// A slot peer `id` gives back (over the socket or its ring): free again, when the peer
    /// holds it.
    fn take_return(&mut self, id: u64, pool: u32, slot: u32) -> Result<()> {
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

    /// Take the returns waiting in the peers' rings; with `arm`, first ask each peer to wake
    /// the channel for its next return (before sleeping, or leaving the channel idle). A
    /// return of a slot the peer does not hold counts as a protocol error; a ring whose index
    /// is impossible disconnects its peer. How many slots came back.
    fn drain_rings(&mut self, arm: Arm) -> usize {
        let mut got = 0;
        for i in 0..self.peers.len() {
            let Some(mut r) = self.peers[i].ring.take() else { continue };
            if arm != Arm::No {
                r.arm(arm == Arm::Patient);
            }
            let id = self.peers[i].info.id;
            let mut refused = 0;
            let taken = r.take_returns(|pool, slot| match self.take_return(id, pool, slot) {
                Ok(()) => got += 1,
                Err(_) => refused += 1,
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

    /// Send pool item `m` to peer `idx`: through its ring when it reads one (and the ring has
    /// room), else over the socket.
    fn post_item(&mut self, idx: usize, m: &[u8], epfd: BorrowedFd<'_>) -> Result<()> {
        let p = &mut self.peers[idx];
        if p.features & wire::FEATURE_RING != 0 && m.len() <= ring::MAX_ITEM && !p.no_ring {
            if p.ring.is_none() {
                match ProducerRing::create() {
                    Ok(r) => {
                        let msg = Message::Ring { capacity: ring::CAPACITY, record: ring::RECORD }.encode();
                        let data = epoll::EventData::new_u64(p.info.id | RING_EVENT);
                        let flags = epoll::EventFlags::IN | epoll::EventFlags::ET;
                        if epoll::add(epfd, r.wake_fd(), data, flags).is_err() {
                            p.no_ring = true;
                        } else {
                            let fds = r.fds();
                            let posted = self.post(idx, &msg, &fds, epfd);
                            let p = &mut self.peers[idx];
                            match posted {
                                Ok(()) => p.ring = Some(r),
                                Err(e) => {
                                    let _ = epoll::delete(epfd, r.wake_fd());
                                    return Err(e);
                                }
                            }
                        }
                    }
                    // No memfd or eventfd to spare: this peer's items go over the socket.
                    Err(_) => p.no_ring = true,
                }
            }
            let p = &mut self.peers[idx];
            if let Some(r) = p.ring.as_mut() {
                match r.push_item(p.posted, m) {
                    Ok(true) => return Ok(()),
                    Ok(false) => {} // full: the socket carries it, in order
                    Err(e) => {
                        let why = format!("peer {} broke its ring: {e}", p.info.id);
                        p.doomed = Some(why.clone());
                        return Err(Error::Closed(why));
                    }
                }
            }
        }
        self.post(idx, m, &[], epfd)
    }

    /// Forget peer `idx`: its leases and attachments stop counting, its slots come back.
    fn drop_peer(&mut self, idx: usize, epfd: BorrowedFd<'_>) {
        let peer = self.peers.remove(idx);
        let _ = epoll::delete(epfd, &peer.fd);
        if let Some(r) = &peer.ring {
            // The consumer holds the same eventfd: the registration would outlive our copy.
            let _ = epoll::delete(epfd, r.wake_fd());
        }
        for book in peer.leases.values().map(|(b, _)| b).chain(peer.attached.values()) {
            book.sub(1);
        }
        for p in self.pools.values_mut() {
            for (i, s) in p.slots.iter_mut().enumerate() {
                if *s == SlotState::Sent(peer.info.id) {
                    *s = SlotState::Free;
                    p.out -= 1;
                    p.events[i] = None;
                    p.free.push(i as u32);
                    self.stir = true;
                }
            }
        }
    }
}

impl LeaseServer for ChannelShared {
    fn serve(&self, pause: Duration) -> Result<()> {
        self.service(Some(pause))
    }
}

impl ChannelShared {
    fn lock(&self) -> Result<Locked<'_>> {
        if self.generation != crate::fork::generation() {
            return Err(Error::Unsupported(
                "this channel was inherited through fork: only the process that opened it may use it".into(),
            ));
        }
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if core.closed {
            return Err(Error::Closed("the channel is closed".into()));
        }
        Ok(Locked { guard: std::mem::ManuallyDrop::new(core), shared: self })
    }

    /// Wake the thread that waits without a time limit (a no-op when none does: an edge no
    /// wait takes is reported to the next one, which then looks once for nothing).
    fn nudge(&self) {
        let _ = rustix::io::write(&self.nudge, &1u64.to_ne_bytes());
    }

    /// Claim the one wait without a time limit (`None`: another thread has it). Made before
    /// the look that decides to wait: see [`Locked`]'s drop.
    fn claim_untimed(&self) -> Option<Untimed<'_>> {
        let me = thread_token();
        self.untimed.compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst).ok().map(|_| Untimed(&self.untimed))
    }

    /// See [`Channel::service`].
    pub(crate) fn service(&self, timeout: Option<Duration>) -> Result<()> {
        self.serve(timeout, Arm::Now, None)
    }

    /// [`Self::service`]; `arm`: whether to ask the peers to wake the epoll set for their next
    /// ring return ([`Arm`]; not while spinning: a spinner looks at the rings itself, and an
    /// armed ring costs the consumer a system call per return).
    /// `untimed`: this thread's claim of the wait without a time limit (its wait is `timeout`
    /// then, normally none), given up as soon as the wait is over.
    fn serve(&self, timeout: Option<Duration>, arm: Arm, untimed: Option<Untimed<'_>>) -> Result<()> {
        // Returns already in the rings are taken first (and the rings armed: the next return
        // wakes the epoll set); then no sleep. Wake up for the next handshake or send-patience
        // deadline too.
        let (deadline, returned) = {
            let mut core = self.lock()?;
            let returned = core.drain_rings(arm);
            (core.next_deadline(), returned)
        };
        let timeout = if returned > 0 { Some(Duration::ZERO) } else { timeout };
        let wait = match (timeout, deadline) {
            (t, None) => t,
            (t, Some(d)) => {
                let left = d.saturating_duration_since(Instant::now());
                Some(t.map_or(left, |t| t.min(left)))
            }
        };
        let mut events = [MaybeUninit::<epoll::Event>::uninit(); 32];
        let ts = wait.map(timespec);
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
        for &(id, writable) in &ready[..n] {
            if id & RING_EVENT != 0 {
                // A ring's wake-up: its returns are taken below.
            } else if id == 0 {
                core.sweep(epfd); // expired handshakes make room first
                core.accept_all(epfd);
            } else if let Some(i) = core.peers.iter().position(|p| p.info.id == id) {
                if writable {
                    core.flush(i, epfd);
                }
                if !core.drain_peer(i) {
                    core.peers[i].doomed.get_or_insert_with(|| format!("peer {id} hung up"));
                }
            }
        }
        core.drain_rings(arm);
        core.sweep(epfd);
        Ok(())
    }

    fn close(&self) {
        if self.generation != crate::fork::generation() {
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
        core.pools.clear();
        if let Some((p, dev, ino)) = core.path.take() {
            if rustix::fs::stat(&p).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino) {
                let _ = std::fs::remove_file(&p);
            }
        }
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
}

/// The longest spin [`Pool::set_spin`] and the connection's accept (one second).
pub const MAX_SPIN: Duration = Duration::from_secs(1);

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
        let mut p = core.pools.remove(&self.id).ok_or_else(|| Error::Closed("the pool is closed".into()))?;
        let r = f(&mut core, &mut p);
        core.pools.insert(self.id, p);
        // A peer a send found gone or past its queue bounds goes now (its slots come back).
        core.sweep(self.shared.epoll.as_fd());
        then(&mut core, r)
    }

    /// A free slot and its address; serves the channel while every slot is out.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<(u32, *mut u8)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let spin = self.spin_ns.load(std::sync::atomic::Ordering::Relaxed);
        let mut spin_until = (spin > 0).then(|| Instant::now() + Duration::from_nanos(spin));
        let mut last_look = false;
        let mut spins = 0u32;
        loop {
            // Without a time limit (and not spinning), the wait below may be the channel's one
            // wait without a timer: claimed before the look that decides to wait (see `Locked`).
            let mut untimed =
                if deadline.is_none() && spin_until.is_none() { self.shared.claim_untimed() } else { None };
            // A free slot, after the returns that came through a ring (taken without a system
            // call), under one lock: the path a spinning acquire turns on.
            let got = {
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
                    untimed = None;
                }
                p.free.pop().map(|s| {
                    p.slots[s as usize] = SlotState::Acquired;
                    // SAFETY: s < count and count x slot_size fits the export (checked at creation).
                    (s, unsafe { p.exporter.ptr().add((u64::from(s) * p.slot_size) as usize) })
                })
            };
            if let Some(g) = got {
                return Ok(g);
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
                    std::hint::spin_loop();
                    continue;
                }
                spin_until = None;
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
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
    /// a wake-up); zero (the default) sleeps at once. At most [`MAX_SPIN`].
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        if spin > MAX_SPIN {
            return Err(Error::InvalidArgument(format!(
                "a spin of {} us is above the maximum of {} us",
                spin.as_micros(),
                MAX_SPIN.as_micros()
            )));
        }
        self.spin_ns.store(spin.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
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
        let shared = self.shared.clone();
        let id = self.id;
        let epfd = self.shared.epoll.as_fd();
        self.with_then(
            |core, p| {
                acquired(p, slot, "sent")?;
                let (rel_size, abs) = slot_desc(desc, slot, p.slot_size)?;
                core.peer(peer)?;
                // Describes and validates the tensor; synchronises the producing stream, or records
                // an event on it (DEVSHARE_SHARE_EVENT).
                let (layout, event) =
                    p.exporter.share_leased_with(&abs, |h| ItemLayout::of(h, desc.storage_offset, rel_size))?;
                if !core.peer(peer)?.attached.contains_key(&id) {
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
                    book.add(&shared);
                    core.peers[idx].attached.insert(id, book);
                }
                let m = Message::Item { pool: id, slot, layout, event: event.as_ref().map(|e| e.handle()) }.encode();
                let idx = core.index(peer)?;
                core.post_item(idx, &m, epfd)?;
                p.slots[slot as usize] = SlotState::Sent(peer);
                p.out += 1;
                p.events[slot as usize] = event;
                Ok(())
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

    /// Slot size, slot count and free slots.
    pub fn info(&self) -> Result<(u64, u32, u32)> {
        self.with(|_, p| Ok((p.slot_size, p.count, p.free.len() as u32)))
    }
}

impl Drop for LocalPool {
    fn drop(&mut self) {
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

/// `slot` of `p` is acquired (what may be `done` to it: "sent", "released"), else why not.
fn acquired(p: &PoolState, slot: u32, done: &str) -> Result<()> {
    match p.slots.get(slot as usize) {
        Some(SlotState::Acquired) => Ok(()),
        Some(s) => {
            Err(Error::InvalidArgument(format!("slot {slot} is {}: only an acquired slot can be {done}", describe(*s))))
        }
        None => Err(Error::InvalidArgument(format!("slot {slot} is beyond the {} slots", p.count))),
    }
}

fn describe(s: SlotState) -> String {
    match s {
        SlotState::Free => "free".into(),
        SlotState::Acquired => "acquired".into(),
        SlotState::Sent(p) => format!("out with peer {p}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_counts_its_slots_out_through_sends_returns_and_a_consumer_gone() {
        const T: Option<Duration> = Some(Duration::from_secs(10));
        let addr = format!("@devshare-unit-out-{}", std::process::id());
        let ch = LocalChannel::listen(&addr).expect("listen");
        let c = std::thread::scope(|s| {
            let c = s.spawn(|| super::super::consumer::LocalConnection::connect(&addr, T));
            ch.wait_peers(1, T).expect("peers");
            c.join().expect("join").expect("connect")
        });
        let peer = ch.peer_ids().expect("ids")[0];
        let pool = ch.pool(Arc::new(Exporter::channel_host_alloc(4 * 64).expect("alloc")), 64, 4).expect("pool");
        let out = || pool.shared.lock().expect("lock").pools[&pool.id].out;
        let serve_until = |want: u32| {
            let end = Instant::now() + Duration::from_secs(10);
            while out() != want && Instant::now() < end {
                ch.service(Some(Duration::from_millis(10))).expect("service");
            }
            out()
        };
        for _ in 0..3 {
            let (s, _) = pool.acquire(T).expect("acquire");
            pool.send(s, peer, &TensorDesc { shape: &[64], ..Default::default() }).expect("send");
        }
        let (kept, _) = pool.acquire(T).expect("acquire");
        assert_eq!(out(), 3, "three sent, one acquired");
        c.recv(T).expect("recv").release();
        c.recv(T).expect("recv").release();
        assert_eq!(serve_until(1), 1, "two came back");
        pool.release(kept).expect("release");
        let held = c.recv(T).expect("recv");
        drop(c); // the consumer goes with its item: the producer takes the slot back
        assert_eq!(serve_until(0), 0, "the last came back with its consumer gone");
        assert_eq!(pool.info().expect("info").2, 4);
        held.release();
    }

    /// A raw consumer that announces `tgid` in its handshake.
    fn announce(addr: &str, tgid: i32) -> OwnedFd {
        announce_with(addr, tgid, 0)
    }

    /// A raw consumer that announces `tgid` and the `features` it reads.
    fn announce_with(addr: &str, tgid: i32, features: u16) -> OwnedFd {
        let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
            .expect("socket");
        let name = addr.strip_prefix('@').expect("abstract");
        rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).expect("name"))
            .expect("connect");
        let hello = Message::Hello { magic: wire::MAGIC, version: wire::VERSION, features, tgid }.encode();
        assert!(wire::try_send(fd.as_fd(), &hello, &[]).expect("send"));
        fd
    }

    /// The messages waiting on a raw consumer's socket after the WELCOME: (type, shares in it,
    /// descriptors that came with it), reading until nothing arrives for 200 ms.
    fn drain(ch: &LocalChannel, fd: &OwnedFd) -> Vec<(u32, usize, usize)> {
        let (mut buf, mut fds, mut out) = (Vec::new(), Vec::new(), Vec::new());
        while {
            let _ = ch.service(Some(Duration::ZERO)); // what waits in the peer's queue goes out
            true
        } && wire::wait_ready(fd.as_fd(), rustix::event::PollFlags::IN, Some(Duration::from_millis(200)))
            .expect("poll")
        {
            match wire::recv(fd.as_fd(), &mut buf, &mut fds).expect("recv") {
                wire::Received::Message(n) => {
                    let m = Message::decode(&buf[..n]).expect("decode");
                    let (ty, shares) = match m {
                        Message::Share { .. } => (wire::SHARE, 1),
                        Message::Shares { entries, .. } => (wire::SHARES, entries.len()),
                        Message::Welcome { .. } => continue,
                        other => panic!("unexpected {other:?}"),
                    };
                    out.push((ty, shares, fds.len()));
                }
                _ => break,
            }
        }
        out
    }

    #[test]
    fn a_batch_goes_in_few_messages_to_consumers_that_read_them_and_one_by_one_to_older_ones() {
        let addr = format!("@devshare-unit-batch-{}", std::process::id());
        let ch = LocalChannel::listen(&addr).expect("listen");
        let own = std::process::id() as i32;
        let new = announce_with(&addr, own, wire::FEATURE_SHARES);
        let old = announce(&addr, own);
        ch.wait_peers(2, Some(Duration::from_secs(10))).expect("two peers");
        let ids = ch.peer_ids().expect("ids");
        let memfd = Exporter::channel_host_alloc(1 << 16).expect("memfd");
        let named = Exporter::host_alloc(1 << 16).expect("shm");
        let shape = [16i64];
        let items: Vec<(&Exporter, TensorDesc<'_>)> = (0..300)
            .map(|i| {
                let e = if i % 3 == 0 { &memfd } else { &named };
                (
                    e,
                    TensorDesc {
                        shape: &shape,
                        storage_offset: 64 * i as u64,
                        storage_size: Some(64),
                        ..Default::default()
                    },
                )
            })
            .collect();
        ch.send_batch(ids[0], &items).expect("batch to a 1.4 consumer");
        ch.send_batch(ids[1], &items).expect("batch to an older consumer");
        let got = drain(&ch, &new);
        assert!(got.iter().all(|&(ty, _, _)| ty == wire::SHARES), "{got:?}");
        assert_eq!(got.iter().map(|&(_, n, _)| n).sum::<usize>(), 300);
        assert!(got.len() <= 3, "300 shares of about 700 bytes in {} messages of 128 KiB", got.len());
        assert_eq!(got.iter().map(|&(_, _, f)| f).sum::<usize>(), 100, "one memfd per memfd share");
        let got = drain(&ch, &old);
        assert_eq!(got.len(), 300);
        assert!(got.iter().all(|&(ty, n, _)| ty == wire::SHARE && n == 1));
        assert_eq!(memfd.outstanding().unwrap() + named.outstanding().unwrap(), 600);
        let bad = [(&named, TensorDesc { shape: &shape, storage_offset: 1 << 20, ..Default::default() })];
        let before = named.outstanding().unwrap();
        assert!(ch.send_batch(ids[0], &[items[1].clone(), bad[0].clone()]).is_err());
        assert_eq!(named.outstanding().unwrap(), before, "a refused description sends nothing");
        ch.close();
    }

    #[test]
    fn an_announced_pid_that_is_not_the_kernels_is_whitelisted_only_when_trusted() {
        let addr = format!("@devshare-unit-tgid-{}", std::process::id());
        let ch = LocalChannel::listen(&addr).expect("listen");
        let own = std::process::id() as i32;
        let _honest = announce(&addr, own);
        let _other = announce(&addr, own + 3_000_000); // a container's host pid, or a lie
        ch.wait_peers(2, Some(Duration::from_secs(10))).expect("two peers");
        let ids = ch.peer_ids().expect("ids");
        let pids = |ch: &LocalChannel| -> Vec<(i32, i32)> {
            let core = ch.shared.lock().expect("lock");
            ids.iter().map(|&id| core.peer(id).map(|p| (p.info.tgid, core.whitelist_pid(p))).expect("peer")).collect()
        };
        assert_eq!(pids(&ch), vec![(own, own), (own + 3_000_000, own)], "the kernel's pid, not the announced one");
        ch.trust_announced_pids(true).expect("trust");
        assert_eq!(pids(&ch), vec![(own, own), (own + 3_000_000, own + 3_000_000)]);
    }
}
