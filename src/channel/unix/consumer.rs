//! The consumer end of a channel: the connection, what arrives on it, and the leases that go back.

use super::opened::OpenEvents;
use super::ring::{ConsumerRing, ItemRecord};
use crate::channel::item::{narrow, open, usable, AttachToken, LeaseToken, SpareTokens, Teller};
use crate::channel::wire::{self, Message, Received};
use crate::error::{Error, Result};
use crate::handle::encode::decode_full;
use crate::import::{Import, Lease};
use rustc_hash::FxHashMap;
use rustix::event::{epoll, PollFd, PollFlags};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The socket and what the leases need to go back.
pub(crate) struct ConnShared {
    fd: OwnedFd,
    generation: crate::fork::Stamp,
    /// Set by [`Connection::close`]: nothing is sent any more.
    closed: std::sync::atomic::AtomicBool,
    /// Set when the backlog reached [`RELEASE_BACKLOG`]: this consumer ended the connection.
    abandoned: AtomicBool,
    /// Messages (releases, returns, detaches) the producer's socket had no room for: sent, in
    /// order, before any later one and by every receive, never dropped while connected.
    backlog: Mutex<std::collections::VecDeque<Vec<u8>>>,
    /// Whether `backlog` held messages when its lock was last let go: a receive looks here
    /// before taking the lock (most find it empty).
    backlogged: AtomicBool,
    /// The shared-memory ring pool items and returns travel in, once the producer sent one.
    ring: std::sync::OnceLock<ConsumerRing>,
    /// Whether the producer reads `RELEASES` (it said so in its `WELCOME`).
    releases: bool,
    /// Whether the producer reads `PINNED` (it said so in its `WELCOME`).
    pins: bool,
}

impl ConnShared {
    fn speaks(&self) -> bool {
        self.generation.is_current() && !self.closed.load(Ordering::Acquire)
    }

    /// Send what waits in the backlog while the socket takes it; whether some still waits.
    fn flush(&self) -> bool {
        // A message another thread queues after this look is its own to send (`tell` flushes
        // first), as it was when this receive took the lock just before it.
        if !self.backlogged.load(Ordering::Acquire) || !self.speaks() {
            return false;
        }
        let mut q = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        self.flush_locked(&mut q);
        self.backlogged.store(!q.is_empty(), Ordering::Release);
        !q.is_empty()
    }

    fn flush_locked(&self, q: &mut std::collections::VecDeque<Vec<u8>>) {
        while let Some(front) = q.front() {
            match wire::try_send(self.fd.as_fd(), front, &[]) {
                Ok(true) => {
                    q.pop_front();
                }
                Ok(false) => return,
                Err(_) => {
                    q.clear(); // the producer is gone: the hang-up returned everything
                    return;
                }
            }
        }
    }
}

/// Messages (releases, returns, detaches) a consumer keeps for a producer that is not reading
/// its socket: one more ends the connection (see [`ConnShared::queue`]).
pub(crate) const RELEASE_BACKLOG: usize = 65536;

impl Teller for ConnShared {
    /// Never waits on the producer: what its socket has no room for now (it is not serving the
    /// channel at the moment) waits in the backlog, in order, and goes out with the next message,
    /// the next receive, or when the connection's descriptor is polled and received on. A
    /// backlog of [`RELEASE_BACKLOG`] messages ends the connection instead, so a producer that
    /// never reads cannot make the consumer's memory grow without bound, nor make anything
    /// wait for it.
    fn tell(&self, msg: Message<'_>) {
        if !self.speaks() {
            return;
        }
        let bytes = msg.encode();
        let mut q = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        self.queue(&mut q, bytes);
        self.backlogged.store(!q.is_empty(), Ordering::Release);
    }

    /// One `RELEASES` message per [`wire::MAX_RELEASES`] leases when the producer reads them,
    /// else a `RELEASE` each; queued like any message when the socket has no room.
    fn tell_releases(&self, leases: &[u64]) {
        if !self.releases || leases.len() == 1 {
            return leases.iter().for_each(|&lease| self.tell(Message::Release { lease }));
        }
        if !self.speaks() {
            return;
        }
        let mut q = self.backlog.lock().unwrap_or_else(|p| p.into_inner());
        for chunk in leases.chunks(wire::MAX_RELEASES) {
            self.queue(&mut q, Message::Releases { leases: chunk.to_vec() }.encode());
        }
        self.backlogged.store(!q.is_empty(), Ordering::Release);
    }

    /// Through the ring when the producer reads releases there (`PRODUCER_PINS`) and it has
    /// room, else a `RELEASE`.
    fn give_back_lease(&self, lease: u64) {
        if !self.speaks() {
            return;
        }
        if self.pins && self.ring.get().is_some_and(|r| r.push_release(lease)) {
            return;
        }
        self.tell(Message::Release { lease });
    }

    /// Through the ring when there is one with room, else a `RETURN`.
    fn give_back_slot(&self, pool: u32, slot: u32) {
        if !self.speaks() {
            return;
        }
        if self.ring.get().is_some_and(|r| r.push_return(pool, slot)) {
            return;
        }
        self.tell(Message::Return { pool, slot });
    }
}

impl ConnShared {
    /// [`Teller::tell`]'s work under the backlog's lock: send `bytes` after what waits, or
    /// queue it.
    fn queue(&self, q: &mut std::collections::VecDeque<Vec<u8>>, bytes: Vec<u8>) {
        self.flush_locked(q);
        if q.is_empty() {
            match wire::try_send(self.fd.as_fd(), &bytes, &[]) {
                Ok(false) => {} // no room now: it waits below
                _ => return,    // sent, or the producer is gone
            }
        } else if q.len() >= RELEASE_BACKLOG {
            // The bound. A producer this far behind does not serve its channel: it hangs, or
            // it floods this consumer with messages whose answers it never reads (attachments
            // that replace each other, refused shares). Waiting for room here would hold this
            // lock, and so every other thread's release and receive, and from a receive (which
            // gives back what it refuses) that receive's own time limit: the connection ends
            // instead, as if the producer had closed it. It takes back every lease and slot of
            // this consumer (what is held stays mapped, as after a close, and may be written
            // again); the next receive takes nothing more and says CLOSED (`pump`).
            self.abandoned.store(true, Ordering::Release);
            let _ = rustix::net::shutdown(&self.fd, rustix::net::Shutdown::Both);
            q.clear();
            return;
        }
        q.push_back(bytes);
    }
}

struct AttachedPool {
    /// The whole allocation's import, which every item of the pool holds.
    base: Arc<Import>,
    slot_size: u64,
    count: u32,
    token: Arc<AttachToken>,
    spares: SpareTokens,
}

/// Most socket messages one look at the connection handles ([`LocalConnection::pump`]) before
/// the receive checks its time limit again.
const PUMP_MESSAGES: usize = 64;

/// Most registered exports one connection keeps mapped between leases (`KEPT_SHARES`,
/// `PIN_SHARES`): the consumer's map of them is keyed by the producer's export numbers, so it is
/// bounded; a share of an export beyond it is an ordinary share (mapped until released).
const MAX_KEPT_EXPORTS: usize = 65536;

/// Note the exports a `KEPT_SHARES` or `PIN_SHARES` message names (0: a share of no registered
/// export), at most [`MAX_KEPT_EXPORTS`].
fn announce((announced, full): (&mut rustc_hash::FxHashSet<u64>, &mut bool), exports: impl Iterator<Item = u64>) {
    for export in exports.filter(|&e| e != 0) {
        if announced.len() < MAX_KEPT_EXPORTS || announced.contains(&export) {
            announced.insert(export);
        } else {
            *full = true;
        }
    }
}

/// A registered export's window this connection keeps mapped (`PIN_SHARES`), until the producer
/// retires it (`RETIRE`) or the connection ends; its leases (`LEASE`) are views of it. Counted
/// in the process's bounds on kept mappings while it lives ([`crate::import::pin`]).
struct Pinned {
    /// Dropped first (fields drop in order): the allocation stops counting as pinned before
    /// its mapping may turn idle (and count as idle).
    _counted: crate::import::PinnedWindow,
    base: Arc<Import>,
}

impl Pinned {
    /// `base` pinned, or `None` when the process's bounds have no room for its allocation.
    fn new(base: Import) -> Option<Pinned> {
        let counted = crate::import::pin(&base)?;
        Some(Pinned { _counted: counted, base: Arc::new(base) })
    }
}

/// The window `offer` names, opened from the allocation of the share just received for its
/// export (`kept`, the share's handle `h` and segment table): a 1-D byte view of the window
/// (checked by the import against the allocation), pinned when the process's bounds have room
/// (`None`: declined). An export pinned already, or a window the allocation does not hold, is
/// refused.
fn pin_window(
    kept: &crate::import::KeptKey,
    h: &crate::handle::DevshareHandle,
    table: Option<&[u8]>,
    offer: &wire::Offer,
    pinned_already: bool,
) -> Result<Option<Pinned>> {
    if pinned_already {
        return Err(Error::Untrusted("an export was offered for pinning twice".into()));
    }
    let size = i64::try_from(offer.window_size)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::Untrusted(format!("a pinned window of {} bytes", offer.window_size)))?;
    let mut w = *h;
    w.ndim = 1;
    w.dtype = crate::dtype::DevshareDType::new(crate::dtype::code::UINT, 8, 1);
    w.shape = [0; crate::handle::DEVSHARE_MAX_NDIM];
    w.strides = [0; crate::handle::DEVSHARE_MAX_NDIM];
    (w.shape[0], w.strides[0]) = (size, 1);
    (w.storage_offset, w.storage_size, w.tensor_offset) = (offer.window_offset, offer.window_size, 0);
    w.flags &= !crate::handle::DEVSHARE_HANDLE_FLAG_EVENT;
    w.event_handle = [0; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE];
    match crate::import::import_kept(kept, &w, table) {
        Ok(base) => Ok(Pinned::new(base)),
        Err(Error::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

struct State {
    buf: Vec<u8>,
    fds: Vec<OwnedFd>,
    pools: FxHashMap<u32, AttachedPool>,
    eof: bool,
    /// Imports received but not handed out yet (a several-share message's, the ring records
    /// that preceded a socket message), in order.
    ready: std::collections::VecDeque<Box<Import>>,
    /// Socket messages received since the handshake (ring records wait for theirs).
    seen: u64,
    /// The ring's head (this consumer's own copy; the ring's is only published).
    head: u64,
    /// The epoll set was waited on (its edge-triggered wake-ups taken) since this consumer last
    /// woke itself: leaving an item waiting then needs a wake-up of its own.
    harvested: bool,
    /// The producer broke the ring (an impossible index or record): it is not read again.
    broken: bool,
    /// The registered exports whose allocations this connection keeps mapped between leases
    /// (`KEPT_SHARES`), until the producer retires them (`RETIRE`) or the connection ends.
    kept: FxHashMap<u64, crate::import::KeptKey>,
    /// The registered exports' windows pinned here (`PIN_SHARES`), by export.
    pinned: FxHashMap<u64, Pinned>,
    /// The exports the producer sent kept shares of (`KEPT_SHARES`, `PIN_SHARES`), kept or not
    /// (a share refused here was still sent): the only ones it may retire. At most
    /// [`MAX_KEPT_EXPORTS`]; past that, or once a message was refused unread (it may have named
    /// some), `announced_full`: a retirement of another is let be.
    announced: rustc_hash::FxHashSet<u64>,
    announced_full: bool,
    /// The events `LEASE`s were last waited on for (one entry per event, the most recent
    /// [`WAITED_EVENTS`]), each with the stream (as a number) it was waited on: a later lease of
    /// the same send that says it carries the same record needs no second wait there.
    waited: Vec<([u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE], usize)>,
    /// Names (`NAMES`) of leases whose shares have not arrived yet, at most [`MAX_PENDING_NAMES`].
    names: FxHashMap<u64, std::ffi::CString>,
    /// The ring record being looked at, copied out of the ring (here, not moved on the way).
    rec: Box<ItemRecord>,
    /// The last ring item decoded (the next one described alike is not decoded again).
    memo: Box<wire::ItemMemo>,
    /// The events of items and leases kept open between waits, where the producer keeps them
    /// alive (`PRODUCER_KEEPS_EVENTS`).
    events: Option<OpenEvents>,
}

impl State {
    /// Wait for the producer's event of an item or a lease: on the copy this connection keeps
    /// open where the producer keeps its events alive, else opened for this wait alone.
    fn wait_for_producer(
        &mut self,
        h: &crate::handle::DevshareHandle,
        req: &crate::backend::ImportRequest,
    ) -> Result<()> {
        match self.events.as_mut() {
            Some(events) => events.wait_for_producer(h, req),
            None => crate::import::wait_for_producer(h, req),
        }
    }
}

/// Most lease names a consumer holds for shares still to come: two messages' worth; a producer
/// that sends more names than shares breaks the protocol.
const MAX_PENDING_NAMES: usize = 2 * wire::MAX_SHARES;

/// Events a connection remembers having waited on for its `LEASE`s: as many streams as one send
/// is likely to use. A lease whose event was forgotten is waited on again, which is only slower.
const WAITED_EVENTS: usize = 8;

/// The consumer end of a channel.
pub struct LocalConnection {
    shared: Arc<ConnShared>,
    /// What a caller's event loop polls, and receives sleep on: the socket (level-triggered) and
    /// the ring's wake-up eventfd (edge-triggered, once there is a ring).
    epoll: OwnedFd,
    state: Mutex<State>,
    peer_id: u64,
    producer_pid: i32,
    /// This connection among the process's (what the allocations it keeps mapped are kept for).
    owner: u64,
    /// How long [`Connection::recv`] polls before it sleeps (ns; 0: not).
    spin_ns: std::sync::atomic::AtomicU64,
    /// How this connection's adaptive spins went (spin.rs).
    backoff: super::spin::Backoff,
    /// How its yields to a producer on the same CPU went (spin.rs).
    yields: super::spin::YieldGuard,
    /// The stream received device items are read on (`CUstream` / `aclrtStream`; 0: none, an
    /// item's event is waited for on the host).
    stream: std::sync::atomic::AtomicUsize,
    /// Whether the caller took the descriptor ([`Self::fd`]): then an event loop may sleep on it
    /// between receives, and every receive leaves the ring armed (see `leave`).
    polled: AtomicBool,
}

impl LocalConnection {
    /// Connect to the channel at `address` and shake hands (waiting at most `timeout` for the
    /// producer to accept).
    pub fn connect(address: &str, timeout: Option<Duration>) -> Result<LocalConnection> {
        let addr = wire::address(address)?;
        let deadline = timeout.map(|t| Instant::now() + t);
        // Asked before connecting (it may load the ACL runtime): the handshake goes out right
        // after the connection, well within the producer's handshake deadline.
        let tgid = crate::backend::pid_for_peers();
        let fd = super::seqpacket_socket()?;
        loop {
            match rustix::net::connect(&fd, &addr) {
                Ok(()) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => {
                    // The producer's backlog is full: it is not serving; try again shortly.
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(Error::Timeout(format!("the channel at {address:?} accepted no connection")));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e @ (rustix::io::Errno::NOENT | rustix::io::Errno::CONNREFUSED)) => {
                    return Err(Error::NotFound(format!(
                        "no channel listens at {address:?} ({})",
                        std::io::Error::from(e)
                    )))
                }
                Err(e) => return Err(wire::os(&format!("connect to {address:?}"), e)),
            }
        }
        // The producer must be this user (or root, who could read our memory anyway).
        let cred = rustix::net::sockopt::socket_peercred(&fd).map_err(|e| wire::os("getsockopt(SO_PEERCRED)", e))?;
        let euid = rustix::process::geteuid().as_raw();
        if cred.uid.as_raw() != euid && cred.uid.as_raw() != 0 {
            return Err(Error::Untrusted(format!(
                "the channel at {address:?} is served by uid {}, not this process's uid {euid} (or root)",
                cred.uid.as_raw()
            )));
        }
        // The ring of 1.16 (eventfds that start at 1, woken with writes of 0), not the old one:
        // a wake-up of ours never blocks, whatever the producer does to the eventfds.
        let features = wire::FEATURE_SHARES
            | wire::FEATURE_RING_PRIMED
            | wire::FEATURE_KEEP
            | wire::FEATURE_NAMES
            | wire::FEATURE_PIN
            | wire::FEATURE_LEASES;
        let hello = Message::Hello { magic: wire::MAGIC, version: wire::VERSION, features, tgid };
        match wire::send(fd.as_fd(), &hello.encode(), &[]) {
            // A producer that refused us at once has closed already: its reason is queued.
            Ok(()) | Err(Error::Closed(_)) => {}
            Err(e) => return Err(e),
        }
        let mut buf = Vec::new();
        let mut fds = Vec::new();
        loop {
            match wire::recv(fd.as_fd(), &mut buf, &mut fds)? {
                Received::Message(n) => {
                    // A refusal's reason is reported before anything else of the message is
                    // judged (a WELCOME of another length is refused by its length).
                    let decoded = Message::decode(&buf[..n]);
                    if let Ok(Message::Refused { reason }) = decoded {
                        return Err(Error::Untrusted(format!(
                            "the channel at {address:?} refused this process: {}",
                            wire::peer_text(reason)
                        )));
                    }
                    match decoded? {
                        Message::Welcome { magic, version, features, peer_id, producer_pid } => {
                            if magic != wire::MAGIC || version != wire::VERSION {
                                return Err(Error::UnsupportedVersion(format!(
                                    "the channel at {address:?} speaks protocol version {version}, this library {}",
                                    wire::VERSION
                                )));
                            }
                            let ep =
                                epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| wire::os("epoll_create", e))?;
                            epoll::add(&ep, &fd, epoll::EventData::new_u64(0), epoll::EventFlags::IN)
                                .map_err(|e| wire::os("epoll_ctl", e))?;
                            return Ok(LocalConnection {
                                epoll: ep,
                                shared: Arc::new(ConnShared {
                                    fd,
                                    generation: crate::fork::Stamp::now(),
                                    closed: Default::default(),
                                    abandoned: Default::default(),
                                    backlog: Default::default(),
                                    backlogged: AtomicBool::new(false),
                                    ring: Default::default(),
                                    releases: features & wire::PRODUCER_RELEASES != 0,
                                    pins: features & wire::PRODUCER_PINS != 0,
                                }),
                                state: Mutex::new(State {
                                    buf,
                                    fds,
                                    pools: FxHashMap::default(),
                                    eof: false,
                                    ready: Default::default(),
                                    seen: 0,
                                    head: 0,
                                    harvested: false,
                                    broken: false,
                                    kept: FxHashMap::default(),
                                    pinned: FxHashMap::default(),
                                    announced: Default::default(),
                                    announced_full: false,
                                    waited: Vec::new(),
                                    names: FxHashMap::default(),
                                    rec: Box::new(ItemRecord::new()),
                                    memo: Default::default(),
                                    events: (features & wire::PRODUCER_KEEPS_EVENTS != 0).then(OpenEvents::new),
                                }),
                                peer_id,
                                producer_pid,
                                owner: {
                                    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                                    NEXT.fetch_add(1, Ordering::Relaxed)
                                },
                                spin_ns: Default::default(),
                                backoff: Default::default(),
                                yields: Default::default(),
                                stream: Default::default(),
                                polled: AtomicBool::new(false),
                            });
                        }
                        other => {
                            return Err(Error::Untrusted(format!(
                                "the channel at {address:?} answered the handshake with {other:?}"
                            )))
                        }
                    }
                }
                Received::Refused(_, what) => {
                    return Err(Error::Untrusted(format!(
                        "the channel at {address:?} answered the handshake with {what}"
                    )))
                }
                Received::Closed => {
                    return Err(Error::Closed(format!("the channel at {address:?} closed the connection")))
                }
                Received::Empty => {
                    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                    if left.is_some_and(|l| l.is_zero()) || !wire::wait_ready(fd.as_fd(), PollFlags::IN, left)? {
                        return Err(Error::Timeout(format!(
                            "the channel at {address:?} did not complete the handshake (is its producer serving it?)"
                        )));
                    }
                }
            }
        }
    }

    /// The descriptor a caller's event loop polls for reading (an epoll set of the socket and
    /// the ring's wake-up): readable when an item or the close arrives, and while an item that
    /// a receive left waiting is there.
    pub fn fd(&self) -> BorrowedFd<'_> {
        if !self.polled.swap(true, Ordering::SeqCst) {
            // From now on receives leave the ring armed (see `leave`); the receives before may
            // have left it unarmed, so arm it here and wake the descriptor once (at most a
            // spurious wake-up), for items that already wait.
            if let Some(r) = self.shared.ring.get() {
                r.be_prompt();
                r.arm();
                r.wake_self();
            }
        }
        self.epoll.as_fd()
    }

    /// This consumer's id at the producer.
    pub fn peer_id(&self) -> u64 {
        self.peer_id
    }

    /// The producer's pid (as it reported it).
    pub fn producer_pid(&self) -> i32 {
        self.producer_pid
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        usable(&self.shared.generation, &self.shared.closed)?;
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Let [`Self::recv`] poll for up to `spin` before it sleeps (for a consumer that owns a
    /// core: an item is taken within a microsecond or so instead of after a wake-up); zero (the
    /// default) adds no spin of its own (the adaptive one, `spin.rs`, still applies). At most
    /// [`super::MAX_SPIN`].
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        self.spin_ns.store(super::spin_ns(spin)?, Ordering::Relaxed);
        Ok(())
    }

    /// Read received device items on `stream` (`CUstream` / `aclrtStream` of the device they
    /// arrive on): an item's interprocess event is then waited for by that stream, on the
    /// device, instead of by `recv` on the host. Null (the default): `recv` waits.
    pub fn set_stream(&self, stream: *mut std::ffi::c_void) {
        self.stream.store(stream as usize, Ordering::Relaxed);
    }

    fn stream(&self) -> *mut std::ffi::c_void {
        self.stream.load(Ordering::Relaxed) as *mut std::ffi::c_void
    }

    /// The next item: a leased reference or a pool slot, as an import whose release gives it back.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Import> {
        self.recv_boxed(timeout).map(|imp| *imp)
    }

    /// [`Self::recv`], the import boxed as it was made (what the C API hands out, without
    /// moving it on the way).
    pub(crate) fn recv_boxed(&self, timeout: Option<Duration>) -> Result<Box<Import>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let spin = self.spin_ns.load(Ordering::Relaxed);
        let mut spin_until = (spin > 0).then(|| Instant::now() + Duration::from_nanos(spin));
        // Whether this receive considered the adaptive spin (once), and is in it now.
        let (mut adapted, mut adaptive) = (false, false);
        let mut spins = 0u32;
        // Whether the socket may have a message. With a ring, items need no socket read: the
        // socket is read when the epoll set says so (or a ring record waits for its messages).
        let mut socket = self.shared.ring.get().is_none();
        let mut looked = false;
        let mut spinning = spin_until.is_some();
        let mut yielded = false;
        'recv: loop {
            // Releases the producer's socket had no room for go first; while some still wait,
            // the wait below also wakes when there is room.
            let backlog = self.shared.flush();
            let mut hand_over = false;
            let left = 'look: {
                let mut st = self.state()?;
                // Spinning (opt-in): look again without sleeping until the spin (or the
                // timeout) is over; the ring on every turn, the socket on every 64th.
                // (The clock is read every 16th turn: a read costs more than a look at the ring.)
                if spin_until.is_some() && spins % 16 == 0 {
                    let now = Instant::now();
                    spinning = spin_until.is_some_and(|u| now < u) && deadline.map_or(true, |d| now < d);
                    if adaptive && !spinning {
                        adaptive = false;
                        self.backoff.tried(false);
                    }
                }
                socket |= spinning && spins % 64 == 0;
                spins = spins.wrapping_add(1);
                let took = self.pump(&mut st, socket);
                socket = self.shared.ring.get().is_none();
                if let Some(imp) = took? {
                    if adaptive {
                        self.backoff.tried(true);
                    }
                    self.leave(&mut st);
                    return Ok(imp);
                }
                if st.eof {
                    // Nothing stays mapped for a producer that is gone but what is held.
                    st.pinned.clear();
                    if !st.kept.is_empty() {
                        st.kept.clear();
                        crate::import::retire_all(self.owner);
                    }
                    if self.shared.abandoned.load(Ordering::Acquire) {
                        return Err(Error::Closed(format!(
                            "the producer did not read this connection ({RELEASE_BACKLOG} messages waited for it): \
                             it was ended"
                        )));
                    }
                    return Err(Error::Closed("the producer closed the channel or exited".into()));
                }
                if spinning {
                    if adaptive && spins % super::spin::YIELD_EVERY == 0 {
                        hand_over = true; // let another thread ready here run (spin.rs)
                        break 'look None;
                    }
                    std::hint::spin_loop();
                    continue 'recv;
                }
                // About to sleep or to report that nothing came: the returns whose wake-up was
                // put off wake the producer now; the producer's next item wakes the epoll set,
                // and one that came meanwhile is taken now.
                if let Some(r) = self.shared.ring.get() {
                    r.pay_owed();
                    // A producer awake on this CPU gets it before this consumer sleeps: it
                    // sends while this consumer is still awake (no wake-up to pay either way).
                    // Once per receive, only one with time to spare, and after the
                    // connection's lock is let go (below).
                    if !yielded && deadline.map_or(true, |d| d > Instant::now() + super::ring::YIELD_LEFT) {
                        yielded = true;
                        if self.yields.may_yield() && r.producer_awake_on(true) {
                            hand_over = true;
                            break 'look None;
                        }
                    }
                    // A producer awake on another CPU may send before a wake-up would even
                    // reach this one: poll for a while first (spin.rs; once per receive, not
                    // where the caller's own spin was on).
                    if !adapted && spin_until.is_none() {
                        adapted = true;
                        let budget = super::spin::budget();
                        let now = Instant::now();
                        if !budget.is_zero()
                            && deadline.map_or(true, |d| now < d)
                            && r.producer_awake_on(false)
                            && self.backoff.may_try()
                        {
                            spin_until = Some(now + budget);
                            (spinning, adaptive, spins) = (true, true, 1);
                            continue 'recv;
                        }
                    }
                    r.arm();
                    if self.takeable(&st, r)? {
                        continue 'recv;
                    }
                }
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                if left.is_some_and(|l| l.is_zero()) && (looked || self.shared.ring.get().is_none()) {
                    return Err(Error::Timeout("nothing arrived on the channel".into()));
                }
                st.harvested = true;
                left
            };
            if hand_over {
                let began = Instant::now();
                super::ring::yield_cpu();
                if !adaptive {
                    self.yields.yielded(began);
                }
                continue;
            }
            // Out of time: one look (without waiting) at what the socket has.
            looked = left.is_some_and(|l| l.is_zero());
            match self.sleep(backlog, left)? {
                None => return Err(Error::Timeout("nothing arrived on the channel".into())),
                Some(s) => {
                    socket = s;
                    if let Some(r) = self.shared.ring.get() {
                        r.here();
                    }
                }
            }
        }
    }

    /// Wait until the epoll set (or, with a backlog, room in the socket) is ready, at most
    /// `left`: `None` when the time ran out, else whether the socket may have a message.
    fn sleep(&self, backlog: bool, left: Option<Duration>) -> Result<Option<bool>> {
        let ts =
            left.map(|d| rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) });
        if backlog {
            let mut fds = [PollFd::new(&self.epoll, PollFlags::IN), PollFd::new(&self.shared.fd, PollFlags::OUT)];
            return match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(0) => Ok(None),
                Ok(_) | Err(rustix::io::Errno::INTR) => Ok(Some(true)),
                Err(e) => Err(wire::os("poll", e)),
            };
        }
        let mut events = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 4];
        match epoll::wait(&self.epoll, &mut events, ts.as_ref()) {
            Ok(([], _)) => Ok(None),
            // Data 0 is the socket, 1 the ring's wake-up.
            Ok((evs, _)) => Ok(Some(evs.iter().any(|e| e.data.u64() == 0))),
            Err(rustix::io::Errno::INTR) => Ok(Some(true)),
            Err(e) => Err(wire::os("epoll_wait", e)),
        }
    }

    /// Whether an item can be taken without waiting: one received and not handed out, or a
    /// ring record whose socket messages arrived.
    fn takeable(&self, st: &State, r: &ConsumerRing) -> Result<bool> {
        if !st.ready.is_empty() {
            return Ok(true);
        }
        // A broken ring is "takeable": the next look reports it.
        Ok(r.peek(st.head).map_or(true, |rec| rec.is_some_and(|rec| rec.socket_messages <= st.seen)))
    }

    /// Leaving a receive with an item: when another waits and the epoll set may not show it
    /// (its wake-up was taken by this receive's wait), wake it, so that a caller's event loop
    /// that takes one item per readable event still sees the next.
    fn leave(&self, st: &mut State) {
        let Some(r) = self.shared.ring.get() else { return };
        if self.polled.load(Ordering::SeqCst) {
            // An event loop may sleep on the descriptor before the next receive, which then
            // arms nothing: arm now, so that the producer's next item wakes the descriptor
            // (even when this receive's own wait took the last wake-up), and wake it for what
            // already waits. Consumers that only receive skip this (a receive looks before it
            // sleeps), which saves the producer a system call per item.
            r.arm();
            if !st.ready.is_empty() || r.waiting(st.head).unwrap_or(false) {
                r.wake_self();
            }
            st.harvested = false;
        } else if st.harvested && (!st.ready.is_empty() || r.waiting(st.head).unwrap_or(false)) {
            r.wake_self();
            st.harvested = false;
        }
    }

    /// Take the next item that arrived, without waiting: one already received, a ring record
    /// whose preceding socket messages have arrived, or what the next socket messages carry
    /// (looked at only with `socket`, or when a ring record waits for them). A socket message
    /// is handled after the ring records that precede it.
    ///
    /// At most [`PUMP_MESSAGES`] socket messages per call: a producer that keeps the socket full
    /// of messages that are no item (names, retirements, attachments) cannot keep a receive
    /// from its time limit, which the caller checks between calls (the socket stays readable).
    fn pump(&self, st: &mut State, socket: bool) -> Result<Option<Box<Import>>> {
        if self.shared.abandoned.load(Ordering::Acquire) && !st.eof {
            // This consumer ended the connection (its backlog's bound): nothing more is taken,
            // from the socket or the ring (the producer has taken back every slot and lease).
            (st.eof, st.broken) = (true, true);
        }
        for _ in 0..PUMP_MESSAGES {
            // Looked up on every turn: a RING message taken below starts the ring. A broken
            // ring is not read again.
            let ring = self.shared.ring.get().filter(|_| !st.broken);
            if let Some(imp) = st.ready.pop_front() {
                return Ok(Some(imp));
            }
            let mut behind = false;
            if let Some(r) = ring {
                if self.peek(st, r)? {
                    if st.rec.socket_messages <= st.seen {
                        st.head = r.advance(st.head);
                        return self.ring_item(st).map(Some);
                    }
                    behind = true; // it waits for socket messages sent before it
                }
            }
            if !(socket || behind) || st.eof {
                return Ok(None);
            }
            let State { buf, fds, .. } = &mut *st;
            // (What came, a refused message's too, is closed in this receive, under this
            // connection's lock: recv_with made sure no socket among it lingers.)
            let (n, refused) = match wire::recv_with(self.shared.fd.as_fd(), buf, fds, false) {
                Ok(Received::Empty) => return Ok(None),
                Ok(Received::Closed) => {
                    st.eof = true;
                    return Ok(None);
                }
                Ok(Received::Message(n)) => (n, None),
                Ok(Received::Refused(n, what)) => (n, Some(what)),
                Err(e @ Error::Untrusted(_)) => {
                    // A message refused whole (too long, or more descriptors than fit): one
                    // socket message all the same (the ring records sent after it wait for it),
                    // and what it named cannot be known: a retirement of an export it may have
                    // announced is let be from now on.
                    st.seen += 1;
                    st.announced_full = true;
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            st.seen += 1;
            // The ring records sent before this message are handled before it; the first
            // refusal among them (or of the message) is this call's error, what was taken
            // meanwhile waits in `ready`.
            let mut first_error = None;
            if let Some(r) = ring {
                // At most one ring's worth: an honest producer wrote no more before the message
                // (a full ring sends over the socket); one that keeps writing records it
                // claims came first only gets them taken after the message.
                for _ in 0..r.capacity() {
                    match self.peek(st, r) {
                        Ok(true) if st.rec.socket_messages < st.seen => {
                            st.head = r.advance(st.head);
                            match self.ring_item(st) {
                                Ok(imp) => st.ready.push_back(imp),
                                Err(e) => {
                                    first_error.get_or_insert(e);
                                }
                            }
                        }
                        Ok(_) => break,
                        Err(e) => {
                            first_error.get_or_insert(e);
                            break;
                        }
                    }
                }
            }
            let handled = if let Some(what) = refused {
                st.fds.clear();
                Err(Error::Untrusted(format!("a channel message came with {what} (no message carries one)")))
            } else {
                self.message(st, n)
            };
            match handled {
                Ok(Some(imp)) => st.ready.push_back(imp),
                Ok(None) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
            if let Some(e) = first_error {
                return Err(e);
            }
        }
        Ok(st.ready.pop_front())
    }

    /// The ring's next record, copied into `st.rec` (whether one waits); a ring the producer
    /// broke ends the connection.
    fn peek(&self, st: &mut State, r: &ConsumerRing) -> Result<bool> {
        r.copy(st.head, &mut st.rec).inspect_err(|_| {
            st.eof = true;
            st.broken = true;
        })
    }

    /// The pool item in `st.rec`, which came through the ring, checked as one from the socket.
    fn ring_item(&self, st: &mut State) -> Result<Box<Import>> {
        let mut layout = wire::ItemLayout::empty();
        let (pool, slot, event) = match Message::decode_item_memo(st.rec.item(), &mut layout, &mut st.memo) {
            Some(item) => item?,
            None => match Message::decode(st.rec.item())? {
                Message::Item { pool, slot, layout: l, event } => {
                    layout = l;
                    (pool, slot, event)
                }
                Message::Lease { export, lease, layout, event, again } => {
                    return self.lease(st, export, lease, &layout, event, again);
                }
                other => return Err(Error::Untrusted(format!("a ring record holds {other:?}, not a pool item"))),
            },
        };
        self.item(st, pool, slot, &layout, event)
    }

    /// Handle one received message; an item comes back as an import.
    fn message(&self, st: &mut State, n: usize) -> Result<Option<Box<Import>>> {
        let fds = std::mem::take(&mut st.fds);
        match Message::decode(&st.buf[..n])? {
            Message::Share { lease, handle } => {
                // The token exists from here on: a refused share (a handle form this library
                // does not understand included) is given back at once.
                let token: Arc<dyn Lease> = Arc::new(LeaseToken::new(self.shared.clone(), lease));
                st.names.clear(); // (names come only with SHARES)
                let d = decode_full(handle)?;
                let imp = open(&d.handle, d.table.as_deref(), fds, Some(token), self.stream(), Some(self.owner))?;
                Ok(Some(Box::new(imp)))
            }
            Message::Shares { first_lease, entries } => {
                let entries: Vec<_> = entries.into_iter().map(|(n, h)| (n, 0, wire::Offer::NONE, h)).collect();
                self.shares((&mut st.ready, &mut st.kept, &mut st.names, &mut st.pinned), first_lease, &entries, fds)
            }
            Message::KeptShares { first_lease, entries } => {
                announce((&mut st.announced, &mut st.announced_full), entries.iter().map(|e| e.1));
                let entries: Vec<_> = entries.into_iter().map(|(n, e, h)| (n, e, wire::Offer::NONE, h)).collect();
                self.shares((&mut st.ready, &mut st.kept, &mut st.names, &mut st.pinned), first_lease, &entries, fds)
            }
            Message::PinShares { first_lease, entries } => {
                announce((&mut st.announced, &mut st.announced_full), entries.iter().map(|e| e.1));
                self.shares((&mut st.ready, &mut st.kept, &mut st.names, &mut st.pinned), first_lease, &entries, fds)
            }
            Message::Names { first_lease, names } => {
                if !fds.is_empty() {
                    return Err(Error::Untrusted("names came with descriptors".into()));
                }
                if st.names.len() + names.len() > MAX_PENDING_NAMES {
                    st.names.clear();
                    return Err(Error::Untrusted(format!(
                        "more than {MAX_PENDING_NAMES} lease names before their shares"
                    )));
                }
                for (i, name) in names.into_iter().enumerate() {
                    if !name.is_empty() {
                        // check_name refused NUL bytes.
                        let name = std::ffi::CString::new(name).map_err(|e| Error::Untrusted(e.to_string()))?;
                        st.names.insert(first_lease + i as u64, name);
                    }
                }
                Ok(None)
            }
            Message::Retire { export } => {
                // A pinned window is unmapped once no lease of it is held. An export sent here
                // but not kept (or already let go) is nothing to do; one never sent is the
                // producer's lie, refused (nothing else changes).
                let announced = st.announced.remove(&export);
                st.pinned.remove(&export);
                if let Some(k) = st.kept.remove(&export) {
                    crate::import::retire(self.owner, &k);
                }
                if !announced && !st.announced_full {
                    return Err(Error::Untrusted(format!(
                        "the producer retired export {export}, which it never sent this connection as a kept share"
                    )));
                }
                Ok(None)
            }
            Message::Lease { export, lease, layout, event, again } => {
                if !fds.is_empty() {
                    return Err(Error::Untrusted("a lease of a pinned export came with descriptors".into()));
                }
                self.lease(st, export, lease, &layout, event, again).map(Some)
            }
            Message::Leases { leases } => {
                if !fds.is_empty() {
                    return Err(Error::Untrusted("leases of pinned exports came with descriptors".into()));
                }
                // Each as a LEASE of its own: a refused one is given back, the others still
                // arrive, and the first refusal is this call's error. (A message refused whole,
                // for its descriptors or a record that does not decode, gives nothing back, as
                // a LEASE with descriptors does not: only its sender's own count suffers.)
                let mut first_error = None;
                for l in leases {
                    match self.lease(st, l.export, l.lease, &l.layout, l.event, l.again) {
                        Ok(imp) => st.ready.push_back(imp),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                first_error.map_or(Ok(None), Err)
            }
            Message::Attach { pool, slot_size, count, handle } => {
                let d = decode_full(handle)?;
                let token = AttachToken::new(self.shared.clone(), pool);
                let whole = slot_size.checked_mul(u64::from(count));
                if count > crate::channel::limits::DEVSHARE_POOL_MAX_SLOTS {
                    // (The slots' bookkeeping is sized by the count: 2^32 of them in a sparse
                    // allocation would cost this process 32 GiB, or abort it.)
                    return Err(Error::Untrusted(format!(
                        "pool {pool}: {count} slots (at most {} are possible)",
                        crate::channel::limits::DEVSHARE_POOL_MAX_SLOTS
                    )));
                }
                if slot_size == 0 || count == 0 || whole.map_or(true, |w| w > d.handle.storage_size) {
                    return Err(Error::Untrusted(format!(
                        "pool {pool}: {count} slots of {slot_size} bytes do not fit its {}-byte allocation",
                        d.handle.storage_size
                    )));
                }
                // A pool more than the bound (one already attached is replaced): each costs a
                // mapping and bookkeeping per slot, and a producer that attached 65,000 used
                // up this process's mappings (every mmap failed after). The connection ends.
                let most = crate::channel::limits::DEVSHARE_CHANNEL_MAX_POOLS;
                if st.pools.len() >= most && !st.pools.contains_key(&pool) {
                    st.events = None; // (closed before the hang-up, as in `close`)
                    let _ = rustix::net::shutdown(&self.shared.fd, rustix::net::Shutdown::Both);
                    (st.eof, st.broken) = (true, true); // (what else it sent is not read)
                    return Err(Error::Untrusted(format!(
                        "pool {pool}: the producer attached {most} pools already (the most one connection holds); \
                         the connection ends"
                    )));
                }
                let base = open(&d.handle, d.table.as_deref(), fds, None, std::ptr::null_mut(), Some(self.owner))?;
                let spares = SpareTokens::new(count);
                st.pools.insert(pool, AttachedPool { base: Arc::new(base), slot_size, count, token, spares });
                Ok(None)
            }
            Message::Item { pool, slot, layout, event } => {
                if !fds.is_empty() {
                    return Err(Error::Untrusted("a pool item came with descriptors".into()));
                }
                self.item(st, pool, slot, &layout, event).map(Some)
            }
            Message::Ring { capacity, record } => {
                if self.shared.ring.get().is_some() {
                    return Err(Error::Untrusted("a second ring on one connection".into()));
                }
                let r = ConsumerRing::open(capacity, record, fds)?;
                if self.polled.load(Ordering::SeqCst) {
                    r.be_prompt(); // an event loop polls the descriptor (see `fd`)
                }
                let flags = epoll::EventFlags::IN | epoll::EventFlags::ET;
                epoll::add(&self.epoll, r.wake_fd(), epoll::EventData::new_u64(1), flags)
                    .map_err(|e| wire::os("epoll_ctl", e))?;
                let _ = self.shared.ring.set(r);
                Ok(None)
            }
            Message::PoolClosed { pool } => {
                st.pools.remove(&pool);
                Ok(None)
            }
            other => Err(Error::Untrusted(format!("{other:?} is not a message a producer sends"))),
        }
    }

    /// A pool item (from the socket or the ring): the slot and its bytes checked against the
    /// attached pool, then the pool's mapping narrowed to it.
    /// A several-share message's leases (each with its registered export, 0: none), opened in
    /// order: every share is opened (or its lease given back at once, when refused) and waits for
    /// the next receives; the first refusal is this call's error.
    /// A registered export's share is kept mapped (`kept`), and an offer of its window pinned
    /// (`PIN_SHARES`): opened from the share's own allocation, answered with one `PINNED`.
    #[allow(clippy::type_complexity)]
    fn shares(
        &self,
        (ready, kept, names, pinned): (
            &mut std::collections::VecDeque<Box<Import>>,
            &mut FxHashMap<u64, crate::import::KeptKey>,
            &mut FxHashMap<u64, std::ffi::CString>,
            &mut FxHashMap<u64, Pinned>,
        ),
        first_lease: u64,
        entries: &[(u32, u64, wire::Offer, &[u8])],
        fds: Vec<OwnedFd>,
    ) -> Result<Option<Box<Import>>> {
        let total: usize = entries.iter().map(|(n, ..)| *n as usize).sum();
        if total != fds.len() {
            return Err(Error::Untrusted(format!(
                "a message of {} shares naming {total} descriptors came with {}",
                entries.len(),
                fds.len()
            )));
        }
        let mut fds = fds.into_iter();
        let mut first_error = None;
        let stream = self.stream();
        // The events this message's opens waited on: a producer records one event per stream
        // of a batch, so shares carrying the same event handle in one message carry the same
        // record, and one wait on this connection's stream covers them all. (A producer that
        // lies here only loses its own ordering.)
        let mut waited: Vec<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]> = Vec::new();
        let mut taken = Vec::new(); // offers pinned: (export, pin)
        for (i, (nfds, export, offer, handle)) in entries.iter().enumerate() {
            let mine: Vec<OwnedFd> = fds.by_ref().take(*nfds as usize).collect();
            let lease = first_lease + i as u64;
            let mut token = LeaseToken::new(self.shared.clone(), lease);
            if !names.is_empty() {
                token.name = names.remove(&lease);
            }
            let token: Arc<dyn Lease> = Arc::new(token);
            let event_flag = crate::handle::DEVSHARE_HANDLE_FLAG_EVENT;
            let mut event = None;
            let mut decoded = None;
            let opened = decode_full(handle).and_then(|mut d| {
                if d.handle.flags & event_flag != 0 {
                    if waited.contains(&d.handle.event_handle) {
                        // Waited on already: the share goes on as one without an event.
                        d.handle.flags &= !event_flag;
                        d.handle.event_handle = [0; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE];
                    } else {
                        event = Some(d.handle.event_handle);
                    }
                }
                let imp = open(&d.handle, d.table.as_deref(), mine, Some(token), stream, Some(self.owner))?;
                decoded = Some(d);
                Ok(imp)
            });
            match opened {
                Ok(imp) => {
                    waited.extend(event);
                    // (Past MAX_KEPT_EXPORTS exports, a new one's shares are not kept: this map
                    // is keyed by numbers the producer chooses.)
                    if *export != 0 && (kept.len() < MAX_KEPT_EXPORTS || kept.contains_key(export)) {
                        let k = imp.keep_for(self.owner);
                        // An export now of another allocation: the one it was of is retired, and
                        // its pinned window with it (the later leases of the export are of this
                        // allocation; an offer with this share pins it).
                        if let Some(old) = kept.insert(*export, k.clone()).filter(|old| *old != k) {
                            pinned.remove(export);
                            crate::import::retire(self.owner, &old);
                        }
                        if offer.pin != 0 {
                            let d = decoded.as_ref().expect("decoded with the share");
                            match pin_window(&k, &d.handle, d.table.as_deref(), offer, pinned.contains_key(export)) {
                                Ok(Some(p)) => {
                                    pinned.insert(*export, p);
                                    taken.push((*export, offer.pin));
                                }
                                // Declined (past the bounds): nothing is said.
                                Ok(None) => {}
                                Err(e) => {
                                    first_error.get_or_insert(e);
                                }
                            }
                        }
                    }
                    ready.push_back(Box::new(imp));
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if self.shared.pins && !taken.is_empty() {
            self.shared.tell(Message::Pinned { entries: taken });
        }
        // Names of leases before these are of shares that never came: none is kept.
        if !names.is_empty() {
            let end = first_lease + entries.len() as u64;
            names.retain(|&lease, _| lease >= end);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// A lease of a pinned export (from the socket or the ring): its token made first (a
    /// refused lease goes back at once), its bytes checked against the pinned window, then a
    /// view of the window; the producer's event waited for first, unless an earlier lease of
    /// the same send waited on it on this stream.
    fn lease(
        &self,
        st: &mut State,
        export: u64,
        lease: u64,
        l: &wire::ItemLayout,
        event: Option<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]>,
        again: bool,
    ) -> Result<Box<Import>> {
        let mut token = LeaseToken::new(self.shared.clone(), lease);
        if !st.names.is_empty() {
            token.name = st.names.remove(&lease);
        }
        let token: Arc<dyn Lease> = Arc::new(token);
        let stream = self.stream();
        // What this lease's event was waited on before is forgotten unless this lease waits on
        // it now, or says it carries the record waited on (a refused lease waited on nothing).
        let earlier = event.and_then(|e| st.waited.iter().position(|w| crate::handle::same(&w.0, &e)));
        let covered = again && earlier.is_some_and(|i| st.waited[i].1 == stream as usize);
        if let Some(i) = earlier.filter(|_| !covered) {
            st.waited.remove(i);
        }
        let Some(p) = st.pinned.get(&export) else {
            token.give_back();
            return Err(Error::Untrusted(format!("a lease of export {export}, which this consumer never pinned")));
        };
        let base = &p.base;
        let window = base.handle().storage_size;
        if l.storage_offset.checked_add(l.storage_size).map_or(true, |e| e > window) {
            token.give_back();
            return Err(Error::Untrusted(format!(
                "a lease of export {export}: bytes {}..+{} are outside its {window}-byte window",
                l.storage_offset, l.storage_size
            )));
        }
        let layout = wire::ItemLayout { storage_offset: base.handle().storage_offset + l.storage_offset, ..*l };
        let imp = Import::derive(base, &layout, event.filter(|_| !covered), token, None)?;
        if let (Some(e), false) = (event, covered) {
            let req = crate::backend::ImportRequest { device: Some(base.device()), stream, ..Default::default() };
            st.wait_for_producer(imp.handle(), &req)?;
            if st.waited.len() == WAITED_EVENTS {
                st.waited.remove(0);
            }
            st.waited.push((e, stream as usize));
        }
        Ok(imp)
    }

    fn item(
        &self,
        st: &mut State,
        pool: u32,
        slot: u32,
        l: &wire::ItemLayout,
        event: Option<[u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE]>,
    ) -> Result<Box<Import>> {
        let p = st
            .pools
            .get_mut(&pool)
            .ok_or_else(|| Error::Untrusted(format!("an item of pool {pool}, which this consumer never attached")))?;
        let imp = narrow(
            &p.base,
            p.slot_size,
            p.count,
            pool,
            slot,
            l,
            event,
            (&|| self.shared.clone() as Arc<dyn Teller>, &p.token, &mut p.spares),
        )?;
        if event.is_some() {
            // The producer's work on the slot may still be running: its event is waited for
            // before the item is used (on the connection's stream, or blocking this thread).
            let req = crate::backend::ImportRequest {
                device: Some(p.base.device()),
                stream: self.stream(),
                ..Default::default()
            };
            st.wait_for_producer(imp.handle(), &req)?;
        }
        Ok(imp)
    }

    /// Close the connection: the producer takes back every lease and slot of it at once (imports
    /// stay mapped until released; releasing them then sends nothing).
    pub fn close(&self) {
        if !self.shared.generation.is_current() {
            return;
        }
        if !self.shared.closed.swap(true, Ordering::AcqRel) {
            // Wake a receive blocked in another thread (it holds the state) without telling the
            // producer yet; unmap the pools no item holds; only then hang up, so that a producer
            // that frees its memory once this consumer is gone never frees it under a mapping.
            let _ = rustix::net::shutdown(&self.shared.fd, rustix::net::Shutdown::Read);
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.pools.clear();
            st.pinned.clear();
            st.ready.clear();
            // The producer's events this connection kept open, closed before the hang-up too:
            // the producer destroys its own once this consumer is gone.
            st.events = None;
            if !st.kept.is_empty() {
                st.kept.clear();
                crate::import::retire_all(self.owner);
            }
            drop(st);
            let _ = rustix::net::shutdown(&self.shared.fd, rustix::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
impl LocalConnection {
    /// The ring this connection reads, once the producer sent one (tests write into it as a
    /// hostile consumer would).
    pub(crate) fn ring(&self) -> Option<&ConsumerRing> {
        self.shared.ring.get()
    }
}

impl Drop for LocalConnection {
    fn drop(&mut self) {
        self.close();
    }
}
