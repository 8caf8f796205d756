//! The producer end of a remote channel (`tcp://HOST:PORT`): the listening TCP socket, its
//! authenticated peers, and pools whose items go into each consumer's own slots (on the
//! connection, or as UCX puts).
//! See [`super::protocol`] for the protocol and what is and is not protected.

use super::auth::{self, Key, Role};
use super::protocol::{self, DataPath, Framed, PoolMemory, Remote};
use super::ucx::{self, Endpoint, RemoteKey};
use crate::channel::admission::Admission;
use crate::channel::item::{pool_fits, slot_desc};
use crate::channel::limits::{
    DEVSHARE_CHANNEL_ERROR_BUDGET, DEVSHARE_CHANNEL_HANDSHAKE_MS, DEVSHARE_CHANNEL_MAX_PEERS, DEVSHARE_POOL_MAX_SLOTS,
};
use crate::channel::peers::{self, serve_wait, PeerInfo, PeerSet};
use crate::channel::wire::{self, ItemLayout, Message};
use crate::error::{Error, Result};
use crate::export::{Exporter, TensorDesc};
use rustc_hash::FxHashMap;
use rustix::event::epoll;
use std::mem::MaybeUninit;
use std::net::TcpListener;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Most messages taken from one peer per service pass.
const PEER_BATCH: usize = 64;
/// Epoll data of the listening socket (peers are their ids, from 1).
const LISTENER: u64 = 0;
/// How long [`RemotePool::send`] waits for the consumer's pool registration or a free slot of
/// it (backpressure) before it gives up.
const SEND_WAIT: Duration = Duration::from_secs(10);

/// A consumer's copy of one pool: its registered slots and which of them it holds.
struct PeerPool {
    /// The consumer's slot memory (None until its `POOL` answer arrived). Borrows the peer's
    /// endpoint: declared (dropped) before it.
    rkey: Option<RemoteKey<'static>>,
    /// Whether the consumer answered `ATTACH` (holds its copy; on UCX, registered it).
    registered: bool,
    base: u64,
    free: Vec<u32>,
    held: Vec<bool>,
}

enum Handshake {
    /// Waiting for the consumer's hello.
    Hello,
    /// Challenge sent: waiting for its proof (which covers the hello, kept here as it came).
    Proof {
        theirs: [u8; auth::NONCE],
        mine: [u8; auth::NONCE],
        hello: Vec<u8>,
    },
    Ready,
}

struct Peer {
    /// Dropped first: the remote keys borrow the endpoint.
    pools: FxHashMap<u32, PeerPool>,
    /// Boxed: its address is what the keys borrow. Dropped before the channel's worker.
    ep: Option<Box<Endpoint<'static>>>,
    id: u64,
    /// Where the connection came from: its pending handshake counts against this address.
    source: std::net::IpAddr,
    framed: Framed,
    state: Handshake,
    /// How its items travel (chosen by the consumer, allowed by this producer).
    data: DataPath,
    accepted: Instant,
    doomed: Option<String>,
    protocol_errors: u64,
    /// Whether the socket is registered for writability (messages wait for room).
    writable: bool,
}

struct PoolState {
    exporter: Arc<Exporter>,
    /// What the consumers allocate their copies of (the exporter's kind of memory).
    memory: PoolMemory,
    /// CUDA pools: the host buffer an item is copied to before the put (one slot).
    /// Unpins `staging` when dropped (declared first: it goes before the buffer does).
    _pinned: Option<Box<dyn Send>>,
    staging: Vec<u8>,
    /// CUDA pools: the chunk buffers of large items written outside the channel's lock (one
    /// per such write at a time, made when none is spare, kept for the next).
    bounce: Vec<Bounce>,
    slot_size: u64,
    count: u32,
    acquired: Vec<bool>,
    free: Vec<u32>,
}

/// One [`protocol::CHUNK`] of host memory, pinned where the driver allows, that a large item
/// of a CUDA pool crosses through a chunk at a time.
struct Bounce {
    /// Unpins `buf` when dropped (declared first: it goes before the buffer does).
    _pinned: Option<Box<dyn Send>>,
    buf: Vec<u8>,
}

impl Bounce {
    fn new(device: i32, backend: &dyn crate::backend::Backend) -> Bounce {
        let mut buf = vec![0u8; protocol::CHUNK];
        // SAFETY: the buffer lives in this struct, unmoved (never resized), until after the
        // guard, declared before it, unpinned it.
        let pinned = unsafe { backend.pin_host(device, buf.as_mut_ptr(), buf.len()) };
        Bounce { _pinned: pinned, buf }
    }
}

struct Core {
    /// Dropped before the worker (their endpoints use it).
    peers: PeerSet<Peer>,
    pools: FxHashMap<u32, PoolState>,
    listener: TcpListener,
    key: Key,
    /// The UCX worker and version, when this producer allows UCX ([`protocol::DATA_VAR`]).
    /// Boxed: the endpoints borrow it. Declared after `peers`.
    ucx: Option<(Box<ucx::Worker>, String)>,
    next_peer: u64,
    next_pool: u32,
    closed: bool,
}

// SAFETY: the UCX worker is made `UCS_THREAD_MODE_SERIALIZED` (any thread, one at a time) and
// it, its endpoints and remote keys are only touched under the channel's mutex, which holds
// this struct; everything else in it is `Send`.
unsafe impl Send for Core {}

pub(crate) struct Shared {
    core: Mutex<Core>,
    epoll: OwnedFd,
    generation: crate::fork::Stamp,
}

/// The producer end of a remote channel.
pub(crate) struct RemoteChannel {
    shared: Arc<Shared>,
}

impl RemoteChannel {
    /// Listen on `tcp://HOST:PORT` (only there), with the key of [`auth::key_path`].
    pub(crate) fn listen(address: &str) -> Result<RemoteChannel> {
        let addrs = protocol::socket_addrs(address)?;
        let key = Key::load(&auth::key_path()?)?;
        // UCX only where asked for: otherwise nothing but the channel's own port listens.
        let ucx = match DataPath::from_env()? {
            DataPath::Stream => None,
            DataPath::Ucx => {
                let context = ucx::Context::new(protocol::UCX_SETTINGS)?;
                Some((Box::new(ucx::Worker::new(&context)?), ucx::version()?))
            }
        };
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => Error::Busy(format!("channel address {address:?} is in use")),
            _ => Error::Os {
                call: format!("bind to {address:?}"),
                errno: e.raw_os_error().unwrap_or(0),
                message: e.to_string(),
            },
        })?;
        listener.set_nonblocking(true).map_err(|e| Error::Os {
            call: "fcntl(O_NONBLOCK)".into(),
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        })?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| wire::os("epoll_create", e))?;
        epoll::add(&ep, &listener, epoll::EventData::new_u64(LISTENER), epoll::EventFlags::IN)
            .map_err(|e| wire::os("epoll_ctl", e))?;
        let core = Core {
            peers: PeerSet::default(),
            pools: FxHashMap::default(),
            listener,
            key,
            ucx,
            next_peer: 1,
            next_pool: 1,
            closed: false,
        };
        Ok(RemoteChannel {
            shared: Arc::new(Shared { core: Mutex::new(core), epoll: ep, generation: crate::fork::Stamp::now() }),
        })
    }

    /// The TCP address it listens on (with the port the system chose for port 0).
    pub(crate) fn local_addr(&self) -> Result<std::net::SocketAddr> {
        let core = self.shared.lock()?;
        core.listener.local_addr().map_err(|e| Error::Os {
            call: "getsockname".into(),
            errno: e.raw_os_error().unwrap_or(0),
            message: e.to_string(),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.shared.epoll.as_fd()
    }

    pub(crate) fn service(&self, timeout: Option<Duration>) -> Result<()> {
        self.shared.service(timeout)
    }

    pub(crate) fn wait_peers(&self, n: usize, timeout: Option<Duration>) -> Result<()> {
        peers::wait_peers(n, timeout, || Ok(self.shared.lock()?.peers.ready_count()), |t| self.shared.service(t))
    }

    pub(crate) fn peer_ids(&self) -> Result<Vec<u64>> {
        Ok(self.shared.lock()?.peers.ready_ids())
    }

    pub(crate) fn peer_info(&self, id: u64) -> Result<PeerInfo> {
        let core = self.shared.lock()?;
        let p = core.peers.get(id)?;
        let held: usize = p.pools.values().map(|pp| pp.held.iter().filter(|&&h| h).count()).sum();
        Ok(PeerInfo {
            id,
            leases: p.pools.len() as u64,
            slots: held as u64,
            protocol_errors: p.protocol_errors,
            transport: p.data.reported(),
            ..Default::default()
        })
    }

    pub(crate) fn disconnect(&self, peer: u64) -> Result<()> {
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.lock()?;
        let idx = core.peers.index(peer)?;
        let _ = core.peers[idx].framed.flush();
        core.drop_peer(idx, epfd);
        Ok(())
    }

    pub(crate) fn close(&self) {
        self.shared.close();
    }

    /// A pool of `count` slots of `slot_size` bytes at the start of `exp`'s range: host memory,
    /// or CUDA device memory, whose items cross through host memory at both ends (any UCX; ACL
    /// memory is refused by name).
    pub(crate) fn pool(&self, exp: Arc<Exporter>, slot_size: u64, count: u32) -> Result<RemotePool> {
        let memory = match exp.backend() {
            crate::handle::DEVSHARE_BACKEND_HOST => PoolMemory::Host,
            crate::handle::DEVSHARE_BACKEND_CUDA => {
                if exp.ptr().is_null() {
                    return Err(Error::Unsupported(
                        "an adopted (PyTorch) export has no address in this process that UCX could \
                         read: make the pool over memory this process exported (devshare_export, \
                         devshare_export_segments)"
                            .into(),
                    ));
                }
                PoolMemory::Cuda { device: exp.device() }
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "a remote channel's pools are host or CUDA memory; this export is {} memory \
                     (Ascend devices across hosts are planned on a Mooncake-based backend)",
                    crate::handle::backend_name(other)
                )))
            }
        };
        if slot_size == 0 || count == 0 || count > DEVSHARE_POOL_MAX_SLOTS {
            return Err(Error::InvalidArgument(format!(
                "a pool of {count} slots of {slot_size} bytes (1..={DEVSHARE_POOL_MAX_SLOTS} slots of at least 1 byte)"
            )));
        }
        pool_fits(&exp, slot_size, count)?;
        let n = count as usize;
        // CUDA pools: one slot of host memory, pinned where the driver allows, that items are
        // copied to on their way out (chunk by chunk for large ones).
        let (mut staging, mut pinned) = (Vec::new(), None);
        if let PoolMemory::Cuda { device } = memory {
            staging = vec![0u8; slot_size as usize];
            let backend = crate::backend::get(exp.backend())?;
            // SAFETY: the buffer lives in the pool state, unmoved (never resized), until after
            // the guard, declared before it there, unpinned it.
            pinned = unsafe { backend.pin_host(device, staging.as_mut_ptr(), staging.len()) };
        }
        let mut core = self.shared.lock()?;
        let id = core.next_pool;
        core.next_pool = core.next_pool.checked_add(1).ok_or_else(|| Error::Busy("pool ids are exhausted".into()))?;
        core.pools.insert(
            id,
            PoolState {
                exporter: exp,
                memory,
                _pinned: pinned,
                staging,
                bounce: Vec::new(),
                slot_size,
                count,
                acquired: vec![false; n],
                free: (0..count).rev().collect(),
            },
        );
        Ok(RemotePool { shared: self.shared.clone(), id })
    }
}

impl Drop for RemoteChannel {
    fn drop(&mut self) {
        self.shared.close();
    }
}

impl Peer {
    fn ready(&self) -> bool {
        matches!(self.state, Handshake::Ready) && self.doomed.is_none()
    }

    /// Refuse the peer: tell it why (what the socket takes now), then drop it.
    fn refuse(&mut self, why: String) {
        let _ = self.framed.send(&Message::Refused { reason: why.as_bytes() }.encode());
        self.doomed = Some(why);
    }
}

impl peers::Peer for Peer {
    type Source = std::net::IpAddr;
    fn group(source: std::net::IpAddr) -> std::net::IpAddr {
        network_of(source)
    }
    fn id(&self) -> u64 {
        self.id
    }
    fn ready(&self) -> bool {
        Peer::ready(self)
    }
    fn waiting(&self) -> Option<(std::net::IpAddr, Instant)> {
        (!matches!(self.state, Handshake::Ready) && self.doomed.is_none()).then_some((self.source, self.accepted))
    }
}

impl Core {
    /// Send a message to peer `idx` (what its socket has no room for waits, bounded).
    fn post(&mut self, idx: usize, msg: &[u8], epfd: BorrowedFd<'_>) -> Result<()> {
        let p = &mut self.peers[idx];
        if let Err(e) = p.framed.send(msg) {
            p.doomed.get_or_insert_with(|| format!("peer {}: {e}", p.id));
            return Err(e);
        }
        p.watch(epfd);
        Ok(())
    }

    fn accept_all(&mut self, epfd: BorrowedFd<'_>) {
        loop {
            let (stream, from) = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            let source = from.ip().to_canonical();
            let Ok(mut framed) = Framed::new(stream) else { continue };
            let refuse = if self.peers.ready_count() >= DEVSHARE_CHANNEL_MAX_PEERS {
                Some(format!("the channel already serves {DEVSHARE_CHANNEL_MAX_PEERS} peers"))
            } else {
                // Limits per address: connections from one host that never prove the key cannot
                // keep another host's consumer out.
                match self.peers.admit(source) {
                    Admission::Admit => None,
                    Admission::Evict(victim) => {
                        self.peers[victim].refuse("its place was given to a connection from another address".into());
                        self.drop_peer(victim, epfd);
                        None
                    }
                    Admission::Refuse(why) => Some(why),
                }
            };
            if let Some(why) = refuse {
                let _ = framed.send(&Message::Refused { reason: why.as_bytes() }.encode());
                continue;
            }
            let id = self.next_peer;
            self.next_peer += 1;
            if epoll::add(epfd, &framed.stream, epoll::EventData::new_u64(id), epoll::EventFlags::IN).is_err() {
                continue;
            }
            self.peers.push(Peer {
                pools: FxHashMap::default(),
                ep: None,
                id,
                source,
                framed,
                state: Handshake::Hello,
                data: DataPath::Stream,
                accepted: Instant::now(),
                doomed: None,
                protocol_errors: 0,
                writable: false,
            });
        }
    }

    /// Take up to [`PEER_BATCH`] messages of peer `idx`.
    fn drain_peer(&mut self, idx: usize) {
        for _ in 0..PEER_BATCH {
            let p = &mut self.peers[idx];
            if p.doomed.is_some() {
                return;
            }
            if p.protocol_errors > DEVSHARE_CHANNEL_ERROR_BUDGET {
                p.doomed =
                    Some(format!("peer {} sent more than {DEVSHARE_CHANNEL_ERROR_BUDGET} refused messages", p.id));
                return;
            }
            let msg = match p.framed.next() {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => {
                    p.doomed = Some(format!("peer {}: {e}", p.id));
                    return;
                }
            };
            if let Err(e) = self.message(idx, &msg) {
                let p = &mut self.peers[idx];
                if p.ready() {
                    p.protocol_errors += 1;
                } else {
                    // A handshake that fails ends the connection, with the reason.
                    p.refuse(e.to_string());
                }
            }
        }
    }

    /// Handle one message of peer `idx`.
    fn message(&mut self, idx: usize, b: &[u8]) -> Result<()> {
        // Before the proof: a refusal says nothing about this producer (no versions, no
        // reasons beyond the handshake's form), and nothing is made for the peer.
        let not_ours = || Error::Untrusted("the handshake is not one this devshare remote channel speaks".into());
        let state = match &self.peers[idx].state {
            Handshake::Hello => None,
            Handshake::Proof { theirs, mine, hello } => Some((*theirs, *mine, hello.clone())),
            Handshake::Ready => return self.ready_message(idx, b),
        };
        match state {
            None => {
                let Ok(Some(Remote::Hello { magic, version, data, nonce: theirs, .. })) = Remote::decode(b) else {
                    return Err(not_ours());
                };
                if magic != protocol::MAGIC || version != protocol::VERSION || DataPath::from_code(data).is_none() {
                    return Err(not_ours());
                }
                let mine = auth::nonce()?;
                // The proof covers the whole hello: a relay that changed any field of it is
                // caught by the consumer.
                let proof = self.key.prove(Role::Producer, &theirs, &mine, b);
                let m = Remote::Challenge { nonce: mine, proof }.encode();
                let p = &mut self.peers[idx];
                p.framed.send(&m)?;
                p.state = Handshake::Proof { theirs, mine, hello: b.to_vec() };
                Ok(())
            }
            Some((theirs, mine, hello)) => {
                let Ok(Some(Remote::Proof { proof, worker })) = Remote::decode(b) else {
                    return Err(not_ours());
                };
                if !self.key.verify(Role::Consumer, &mine, &theirs, &protocol::consumer_bound(&hello, worker), &proof) {
                    return Err(Error::Untrusted("the consumer did not prove that it has the channel's key".into()));
                }
                // Proved: from here on the peer may learn why it is refused.
                let Some(Remote::Hello { data, ucx, .. }) = Remote::decode(&hello)? else {
                    return Err(Error::Internal("a hello that decoded before does not".into()));
                };
                let data = DataPath::from_code(data).ok_or_else(not_ours)?;
                let ep = match data {
                    DataPath::Stream => {
                        if !worker.is_empty() {
                            return Err(Error::Untrusted("a UCX worker address on the stream path".into()));
                        }
                        None
                    }
                    DataPath::Ucx => Some(self.endpoint(ucx, worker)?),
                };
                let welcome = Message::Welcome {
                    magic: wire::MAGIC,
                    version: protocol::VERSION,
                    features: 0, // a remote consumer gives leases back one message each
                    peer_id: self.peers[idx].id,
                    producer_pid: crate::fork::pid(),
                }
                .encode();
                let p = &mut self.peers[idx];
                p.ep = ep;
                p.data = data;
                p.framed.send(&welcome)?;
                p.state = Handshake::Ready;
                Ok(())
            }
        }
    }

    /// Handle one message of peer `idx`, which proved the key.
    fn ready_message(&mut self, idx: usize, b: &[u8]) -> Result<()> {
        if let Some(r) = Remote::decode(b)? {
            let Remote::Pool { pool, base, len, rkey } = r else {
                return Err(Error::Untrusted(format!("{r:?} after the handshake")));
            };
            let Some(ps) = self.pools.get(&pool) else { return Ok(()) }; // closed meanwhile
            let whole = ps.slot_size * u64::from(ps.count);
            let p = &mut self.peers[idx];
            let pp =
                p.pools.get_mut(&pool).filter(|pp| !pp.registered).ok_or_else(|| {
                    Error::Untrusted(format!("a registration of pool {pool}, which was not asked for"))
                })?;
            if len != whole {
                return Err(Error::Untrusted(format!("pool {pool} registered with {len} bytes, not {whole}")));
            }
            match p.ep.as_deref() {
                None if !rkey.is_empty() => {
                    return Err(Error::Untrusted(format!("pool {pool} registered with a UCX key on the stream path")))
                }
                None => {}
                Some(ep) => {
                    // SAFETY: the endpoint is boxed and outlives its pools' keys (Peer drops
                    // `pools` first); the key comes whole from the authenticated consumer.
                    let ep: &'static Endpoint<'static> = unsafe { &*(ep as *const Endpoint<'static>) };
                    // SAFETY: as above.
                    pp.rkey = Some(unsafe { ep.unpack_rkey(rkey, base, len as usize) }?);
                    pp.base = base;
                }
            }
            pp.registered = true;
            pp.free = (0..ps.count).rev().collect();
            pp.held = vec![false; ps.count as usize];
            return Ok(());
        }
        match Message::decode(b)? {
            Message::Return { pool, slot } => {
                let p = &mut self.peers[idx];
                let Some(pp) = p.pools.get_mut(&pool) else { return Ok(()) };
                match pp.held.get_mut(slot as usize) {
                    Some(h) if *h => {
                        *h = false;
                        pp.free.push(slot);
                        Ok(())
                    }
                    _ => Err(Error::Untrusted(format!("slot {slot} of pool {pool} is not held by peer {}", p.id))),
                }
            }
            Message::Detach { pool } => {
                self.peers[idx].pools.remove(&pool);
                Ok(())
            }
            other => Err(Error::Untrusted(format!("{other:?} is not a message a consumer sends"))),
        }
    }

    /// An endpoint toward an authenticated consumer that asked for UCX: refused unless this
    /// producer allows UCX too, and unless both have the same UCX version.
    fn endpoint(&self, ucx: &[u8], worker: &[u8]) -> Result<Box<Endpoint<'static>>> {
        let Some((w, version)) = &self.ucx else {
            return Err(Error::Unsupported(format!(
                "this channel moves items on its own connection only; UCX is used where both ends set {}=ucx",
                protocol::DATA_VAR
            )));
        };
        if ucx != version.as_bytes() {
            return Err(Error::UnsupportedVersion(format!(
                "the consumer has UCX {}, this producer UCX {version}: both ends need the same UCX version",
                String::from_utf8_lossy(ucx)
            )));
        }
        if worker.is_empty() || worker.len() > 64 * 1024 {
            return Err(Error::Untrusted(format!("a UCX worker address of {} bytes", worker.len())));
        }
        // SAFETY: the worker outlives every endpoint (peers are dropped before it, see Core).
        let w: &'static ucx::Worker = unsafe { &*(&**w as *const ucx::Worker) };
        // SAFETY: as above; the address comes from a consumer that proved the key, and the
        // proof covers it (a relay could not have changed it).
        Ok(Box::new(unsafe { Endpoint::connect(w, worker) }?))
    }

    fn drop_peer(&mut self, idx: usize, epfd: BorrowedFd<'_>) {
        let peer = self.peers.remove(idx);
        let _ = epoll::delete(epfd, &peer.framed.stream);
        let _ = peer.framed.stream.shutdown(std::net::Shutdown::Both);
        // Its keys, then its endpoint (forced when it failed), go with it.
        drop(peer);
    }

    /// Drop the peers that are marked, past their handshake deadline or their error budget.
    fn sweep(&mut self, epfd: BorrowedFd<'_>) {
        let handshake = Duration::from_millis(DEVSHARE_CHANNEL_HANDSHAKE_MS);
        let mut i = 0;
        while i < self.peers.len() {
            let p = &self.peers[i];
            let late = !matches!(p.state, Handshake::Ready) && p.accepted.elapsed() >= handshake;
            if p.doomed.is_some() || late || p.protocol_errors > DEVSHARE_CHANNEL_ERROR_BUDGET {
                self.drop_peer(i, epfd);
            } else {
                i += 1;
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let handshake = Duration::from_millis(DEVSHARE_CHANNEL_HANDSHAKE_MS);
        self.peers.iter().filter(|p| !matches!(p.state, Handshake::Ready)).map(|p| p.accepted + handshake).min()
    }
}

impl Peer {
    /// Watch the socket for room while messages wait, and stop once they went.
    fn watch(&mut self, epfd: BorrowedFd<'_>) {
        let want = self.framed.wants_room();
        if want != self.writable {
            let flags = if want { epoll::EventFlags::IN | epoll::EventFlags::OUT } else { epoll::EventFlags::IN };
            if epoll::modify(epfd, &self.framed.stream, epoll::EventData::new_u64(self.id), flags).is_ok() {
                self.writable = want;
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, Core>> {
        self.generation.check("channel")?;
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if core.closed {
            return Err(Error::Closed("the channel is closed".into()));
        }
        Ok(core)
    }

    fn service(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = self.lock()?.next_deadline();
        let mut events = [MaybeUninit::<epoll::Event>::uninit(); 32];
        let ts = serve_wait(timeout, deadline);
        let mut ready = [0u64; 32];
        let n = loop {
            match epoll::wait(&self.epoll, &mut events, ts.as_ref()) {
                Ok((evs, _)) => {
                    for (r, e) in ready.iter_mut().zip(evs.iter()) {
                        *r = e.data.u64();
                    }
                    break evs.len();
                }
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(wire::os("epoll_wait", e)),
            }
        };
        let epfd = self.epoll.as_fd();
        let mut core = self.lock()?;
        if let Some((w, _)) = &core.ucx {
            while w.progress() > 0 {}
        }
        for &id in &ready[..n] {
            if id == LISTENER {
                core.sweep(epfd);
                core.accept_all(epfd);
            } else if let Some(i) = core.peers.iter().position(|p| p.id == id) {
                let p = &mut core.peers[i];
                p.framed.readable();
                if let Err(e) = p.framed.flush() {
                    p.doomed.get_or_insert_with(|| format!("peer {id}: {e}"));
                }
                p.watch(epfd);
                core.drain_peer(i);
            }
        }
        core.sweep(epfd);
        Ok(())
    }

    fn close(&self) {
        if !self.generation.is_current() {
            return;
        }
        let mut core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if core.closed {
            return;
        }
        core.closed = true;
        // What was sent is the peers' to read. A TCP socket closed with bytes of the peer
        // unread resets the connection, and a reset drops what the kernel had not yet sent: so
        // each ready peer gets its queue and the end of the stream, and the close waits (at most
        // CLOSE_LINGER) until every peer's kernel acknowledged every byte, reading away what
        // the peers send meanwhile (their returns).
        let deadline = Instant::now() + CLOSE_LINGER;
        for p in core.peers.iter_mut().filter(|p| p.ready()) {
            if p.framed.flush_until(deadline).is_ok() {
                let _ = p.framed.stream.shutdown(std::net::Shutdown::Write);
            }
        }
        loop {
            let mut unacknowledged = false;
            for p in core.peers.iter_mut().filter(|p| p.ready()) {
                p.framed.discard_input();
                unacknowledged |= protocol::unacknowledged(&p.framed.stream) > 0;
            }
            if !unacknowledged || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        while !core.peers.is_empty() {
            let _ = core.peers[0].framed.flush();
            core.drop_peer(0, self.epoll.as_fd());
        }
        core.pools.clear();
    }
}

/// How long closing a remote channel waits for its peers' kernels to take what was sent.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// A pool of a remote channel: the producer's slots, put into each consumer's own slots.
pub(crate) struct RemotePool {
    shared: Arc<Shared>,
    id: u32,
}

impl RemotePool {
    fn with<T>(&self, f: impl FnOnce(&mut Core, &mut PoolState) -> Result<T>) -> Result<T> {
        let mut core = self.shared.lock()?;
        let mut p = core.pools.remove(&self.id).ok_or_else(|| Error::Closed("the pool is closed".into()))?;
        let r = f(&mut core, &mut p);
        core.pools.insert(self.id, p);
        core.sweep(self.shared.epoll.as_fd());
        r
    }

    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    pub(crate) fn info(&self) -> Result<(u64, u32, u32)> {
        self.with(|_, p| Ok((p.slot_size, p.count, p.free.len() as u32)))
    }

    /// A free slot of the producer's pool (they come back as soon as an item's put completed;
    /// the consumers' slots are the backpressure, in [`Self::send`]).
    pub(crate) fn acquire(&self, timeout: Option<Duration>) -> Result<(u32, *mut u8)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut last_look = false;
        loop {
            let got = self.with(|_, p| {
                Ok(p.free.pop().map(|s| {
                    p.acquired[s as usize] = true;
                    // SAFETY: s < count and count x slot_size fits the export (checked at creation).
                    (s, unsafe { p.exporter.ptr().add((u64::from(s) * p.slot_size) as usize) })
                }))
            })?;
            if let Some(g) = got {
                return Ok(g);
            }
            if last_look {
                return Err(Error::Timeout("every slot of the pool is acquired".into()));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            last_look = left.is_some_and(|l| l.is_zero());
            let wait = left.map_or(Duration::from_millis(5), |l| l.min(Duration::from_millis(5)));
            self.shared.service(Some(wait))?;
        }
    }

    pub(crate) fn release(&self, slot: u32) -> Result<()> {
        self.with(|_, p| match p.acquired.get(slot as usize) {
            Some(true) => {
                p.acquired[slot as usize] = false;
                p.free.push(slot);
                Ok(())
            }
            Some(false) => Err(Error::InvalidArgument(format!("slot {slot} is not acquired"))),
            None => Err(Error::InvalidArgument(format!("slot {slot} is beyond the {} slots", p.count))),
        })
    }

    /// Send the tensor `desc` describes in an acquired slot into a free slot of `peer`'s copy
    /// of the pool: on the stream path its bytes and its `ITEM` message go on the connection
    /// (an item up to [`protocol::INLINE_PAYLOAD`] bytes queued with the connection's messages,
    /// a larger one written straight from the slot without holding the channel's lock, so that
    /// a consumer slow to read it holds up no send to another), on UCX a put, a flush, then
    /// `ITEM`. The producer's slot is free again once its bytes left it. The first item to a
    /// peer asks it to make its copy (`ATTACH`) and waits for the answer; while every slot of
    /// the peer's copy is held, or its connection has no room for the item, waits (serving the
    /// channel; items waiting for room go in turn), at most 10 s (`Timeout`; the slot stays
    /// acquired). A large item, once begun, is written as long as the peer reads, within 10 s and
    /// 1 s per [`protocol::min_rate`] bytes: one cut off in its middle (the peer read nothing for
    /// 10 s, read too slowly on the whole, or went) ends the connection (`Closed`).
    pub(crate) fn send(&self, slot: u32, peer: u64, desc: &TensorDesc<'_>) -> Result<()> {
        // This send's turn among those waiting for room in the peer's connection (taken when it
        // first finds none, given up once it sends or stops waiting: on every way out, a panic
        // included, or the peer's later items would wait behind it for ever).
        let mut turn = Turn { pool: self, peer, turn: None };
        self.send_in_turn(slot, peer, desc, &mut turn.turn)
    }

    /// [`Self::send`], holding `turn` while it waits for room.
    fn send_in_turn(&self, slot: u32, peer: u64, desc: &TensorDesc<'_>, turn: &mut Option<u64>) -> Result<()> {
        let deadline = Instant::now() + SEND_WAIT;
        let epfd = self.shared.epoll.as_fd();
        loop {
            let step = self.with(|core, p| {
                match p.acquired.get(slot as usize) {
                    Some(true) => {}
                    Some(false) => {
                        return Err(Error::InvalidArgument(format!(
                            "slot {slot} is not acquired: only an acquired slot can be sent"
                        )))
                    }
                    None => return Err(Error::InvalidArgument(format!("slot {slot} is beyond the {} slots", p.count))),
                }
                let (rel_size, mut abs) = slot_desc(desc, slot, p.slot_size)?;
                let idx = core.peers.index(peer)?;
                // Describes and validates the tensor, and for device memory synchronises the
                // stream that wrote it (an event could not cross hosts; the bytes must be the
                // finished ones anyway).
                abs.event = false;
                let (h, _) = p.exporter.share_leased(&abs)?;
                if !core.peers[idx].pools.contains_key(&self.id) {
                    crate::channel::limits::room_for_a_pool(peer, core.peers[idx].pools.len())?;
                    let memory = p.memory.encode();
                    let m = Message::Attach { pool: self.id, slot_size: p.slot_size, count: p.count, handle: &memory }
                        .encode();
                    core.post(idx, &m, epfd)?;
                    let pp = PeerPool { rkey: None, registered: false, base: 0, free: Vec::new(), held: Vec::new() };
                    core.peers[idx].pools.insert(self.id, pp);
                }
                let peer_ref = &mut core.peers[idx];
                let pp = peer_ref.pools.get_mut(&self.id).expect("attached above");
                let Some(cslot) = pp.free.last().copied().filter(|_| pp.registered) else {
                    // The registration or a free slot of the peer: no turn held meanwhile (the
                    // items after this one may be of another pool).
                    peer_ref.framed.leave_turn(turn);
                    return Ok(Step::Wait);
                };
                // SAFETY: the bytes lie in the export (checked above); the export lives in the
                // pool state while this call runs.
                let src = unsafe { p.exporter.ptr().add(abs.storage_offset as usize) } as *const u8;
                let len = rel_size as usize;
                let layout = ItemLayout::of(&h, desc.storage_offset, rel_size);
                let item = Message::Item { pool: self.id, slot: cslot, layout, event: None }.encode();
                let head = Remote::Data { pool: self.id, slot: cslot, offset: desc.storage_offset, len: rel_size };
                let cuda = match p.memory {
                    PoolMemory::Cuda { device } => Some((device, crate::backend::get(p.exporter.backend())?)),
                    PoolMemory::Host => None,
                };
                let moved = match (peer_ref.ep.as_deref(), pp.rkey.as_ref()) {
                    (Some(ep), Some(rkey)) => {
                        let mut from = src;
                        if let Some((device, backend)) = cuda {
                            // SAFETY: `staging` is one slot, and the item lies in one slot.
                            unsafe { backend.copy(device, true, p.staging.as_mut_ptr(), src, len) }?;
                            from = p.staging.as_ptr();
                        }
                        let remote = pp.base + u64::from(cslot) * p.slot_size + desc.storage_offset;
                        // SAFETY: as above; the put and flush complete (or fail) before this
                        // returns.
                        unsafe { ep.put(from, len, remote, rkey) }
                            .and_then(|()| ep.flush())
                            .and_then(|()| peer_ref.framed.send(&item))
                    }
                    (None, None) if len <= protocol::INLINE_PAYLOAD => {
                        // Small: copied into the connection's queue, after what waits there.
                        let head = head.encode();
                        if !peer_ref.framed.item_fits(len, head.len() + item.len(), turn) {
                            return Ok(Step::Wait); // no room yet, or others first
                        }
                        let mut from = src;
                        if let Some((device, backend)) = cuda {
                            // SAFETY: `staging` is one slot, and the item lies in one slot.
                            unsafe { backend.copy(device, true, p.staging.as_mut_ptr(), src, len) }?;
                            from = p.staging.as_ptr();
                        }
                        // SAFETY: `from` holds the item's `len` bytes (the export's, or the
                        // staging copy), unchanged while this call runs.
                        let bytes = unsafe { std::slice::from_raw_parts(from, len) };
                        match peer_ref.framed.try_queue_item(&head, bytes, &item, turn) {
                            Ok(false) => return Ok(Step::Wait),
                            r => r.map(drop),
                        }
                    }
                    (None, None) => {
                        // Large: written outside the channel's lock, straight from the slot
                        // (device memory through a chunk buffer of its own, a chunk at a time).
                        if let Err(e) = peer_ref.framed.flush() {
                            peer_ref.doomed.get_or_insert_with(|| format!("peer {peer}: {e}"));
                            return Err(Error::Closed(format!("the transfer to peer {peer} failed: {e}")));
                        }
                        // (A failed dup, out of descriptors, is this process's trouble, not the peer's.)
                        let Some(writer) = peer_ref.framed.begin_raw(turn)? else {
                            return Ok(Step::Wait); // the connection is busy, or others first
                        };
                        pp.free.pop();
                        pp.held[cslot as usize] = true;
                        peer_ref.watch(epfd);
                        p.acquired[slot as usize] = false; // on its way: neither acquired nor free
                        let bounce = cuda
                            .map(|(device, backend)| p.bounce.pop().unwrap_or_else(|| Bounce::new(device, backend)));
                        return Ok(Step::Write(Transfer {
                            peer_id: peer_ref.id,
                            slot,
                            writer,
                            head: protocol::framed(&head.encode()),
                            tail: protocol::framed(&item),
                            _exporter: p.exporter.clone(),
                            src,
                            len,
                            cuda,
                            bounce,
                        }));
                    }
                    _ => Err(Error::Internal("a pool registered without its data path".into())),
                };
                if let Err(e) = moved {
                    // Part of an item may have gone: the connection cannot carry another.
                    peer_ref.doomed = Some(format!("peer {peer}: {e}"));
                    return Err(Error::Closed(format!("the transfer to peer {peer} failed: {e}")));
                }
                pp.free.pop();
                pp.held[cslot as usize] = true;
                peer_ref.watch(epfd);
                p.acquired[slot as usize] = false;
                p.free.push(slot);
                Ok(Step::Sent)
            })?;
            match step {
                Step::Sent => return Ok(()),
                Step::Write(t) => return self.write_outside_lock(t, peer),
                Step::Wait => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(format!(
                    "peer {peer} did not register its copy of the pool, holds every slot of it, or \
                     did not read its connection, for {} s",
                    SEND_WAIT.as_secs()
                )));
            }
            self.shared.service(Some(left.min(Duration::from_millis(5))))?;
        }
    }

    /// Write a large item's header, bytes and `ITEM` to its peer without the channel's lock
    /// (waiting as long as the peer reads: 10 s without taking a byte cut it off, and so does
    /// reading slower than [`protocol::min_rate`] on the whole, see
    /// [`protocol::transfer_limit`]), then settle
    /// the slot under it: free once every byte left, acquired again (and the connection ended,
    /// `Closed`) when the write failed.
    fn write_outside_lock(&self, mut t: Transfer, peer: u64) -> Result<()> {
        let total = (t.head.len() + t.len + t.tail.len()) as u64;
        let limit = protocol::transfer_limit(total, SEND_WAIT);
        let written = (|| {
            protocol::write_all_stalling(&t.writer, &t.head, SEND_WAIT, limit)?;
            match (t.cuda, t.bounce.as_mut()) {
                (Some((device, backend)), Some(bounce)) => {
                    let bounce = bounce.buf.as_mut_ptr();
                    let mut at = 0;
                    while at < t.len {
                        let n = protocol::CHUNK.min(t.len - at);
                        // SAFETY: `at..at + n` lies in the item, which lies in one slot of the
                        // export `t` holds (checked), and the chunk buffer (CHUNK bytes) is this
                        // transfer's alone; each chunk is written before the next is copied.
                        let chunk = unsafe {
                            backend.copy(device, true, bounce, t.src.add(at), n)?;
                            std::slice::from_raw_parts(bounce, n)
                        };
                        protocol::write_all_stalling(&t.writer, chunk, SEND_WAIT, limit)?;
                        at += n;
                    }
                }
                (Some(_), None) => return Err(Error::Internal("a CUDA item without its chunk buffer".into())),
                (None, _) => {
                    // SAFETY: the item's `len` bytes lie in the export `t` holds, in a slot that
                    // is neither acquired nor free while it is on its way.
                    let bytes = unsafe { std::slice::from_raw_parts(t.src, t.len) };
                    for chunk in bytes.chunks(protocol::CHUNK) {
                        protocol::write_all_stalling(&t.writer, chunk, SEND_WAIT, limit)?;
                    }
                }
            }
            protocol::write_all_stalling(&t.writer, &t.tail, SEND_WAIT, limit)
        })();
        let epfd = self.shared.epoll.as_fd();
        let mut core = self.shared.core.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = core.peers.iter().position(|p| p.id == t.peer_id) {
            let p = &mut core.peers[i];
            if let Err(e) = &written {
                // Part of the item may have gone: the connection cannot carry another.
                p.doomed.get_or_insert_with(|| format!("peer {peer}: {e}"));
            }
            if let Err(e) = p.framed.end_raw(written.is_ok()) {
                p.doomed.get_or_insert_with(|| format!("peer {peer}: {e}"));
            }
            p.watch(epfd);
        }
        if let Some(p) = core.pools.get_mut(&self.id) {
            if let Some(b) = t.bounce.take() {
                p.bounce.push(b);
            }
            if written.is_ok() {
                p.free.push(t.slot);
            } else {
                p.acquired[t.slot as usize] = true; // a failed send leaves the slot acquired
            }
        }
        if !core.closed {
            core.sweep(epfd);
        }
        drop(core);
        // The item was cut off (the connection is ending): never a `Timeout`, which says the
        // send may be tried again.
        written.map_err(|e| Error::Closed(format!("the transfer to peer {peer} was cut off: {e}")))
    }
}

/// A send's turn in its peer's connection, given up when dropped ([`RemotePool::send`]).
struct Turn<'a> {
    pool: &'a RemotePool,
    peer: u64,
    turn: Option<u64>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.turn.is_none() {
            return;
        }
        // (Unwinding from under the channel's lock left it poisoned: taken all the same.)
        let mut core = self.pool.shared.core.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = core.peers.iter_mut().find(|p| p.id == self.peer) {
            p.framed.leave_turn(&mut self.turn);
        }
    }
}

/// What a send does next.
enum Step {
    Sent,
    /// Wait (serving the channel) and try again: the peer's registration, a free slot of it,
    /// or room in its connection.
    Wait,
    /// Write a large item without the channel's lock.
    Write(Transfer),
}

/// A large item on its way to a peer, written without the channel's lock.
struct Transfer {
    peer_id: u64,
    slot: u32,
    /// A second handle on the peer's socket (valid even if the peer is dropped meanwhile).
    writer: std::net::TcpStream,
    head: Vec<u8>,
    tail: Vec<u8>,
    /// Keeps the slot's memory mapped until the write ends.
    _exporter: Arc<Exporter>,
    src: *const u8,
    len: usize,
    cuda: Option<(i32, &'static dyn crate::backend::Backend)>,
    /// CUDA pools: the chunk buffer the item crosses through (given back to the pool after).
    bounce: Option<Bounce>,
}

impl Drop for RemotePool {
    fn drop(&mut self) {
        let Ok(mut core) = self.shared.lock() else { return };
        if core.pools.remove(&self.id).is_none() {
            return;
        }
        let m = Message::PoolClosed { pool: self.id }.encode();
        let epfd = self.shared.epoll.as_fd();
        for i in 0..core.peers.len() {
            if core.peers[i].pools.remove(&self.id).is_some() {
                let _ = core.post(i, &m, epfd);
            }
        }
        core.sweep(epfd);
    }
}

/// The group a connection from `ip` also counts against in the limits of connections waiting for
/// their handshake: an IPv4 address itself, an IPv6 address's /64 (one host is given a whole /64
/// and may connect from any address in it).
fn network_of(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip.to_canonical() {
        std::net::IpAddr::V6(v6) => {
            let mut o = v6.octets();
            o[8..].fill(0);
            std::net::IpAddr::V6(o.into())
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_ipv6_host_counts_as_its_slash_64_and_an_ipv4_address_as_itself() {
        let a: std::net::IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: std::net::IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
        let c: std::net::IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(super::network_of(a), super::network_of(b), "one /64");
        assert_ne!(super::network_of(a), super::network_of(c), "another /64");
        let (x, y): (std::net::IpAddr, std::net::IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert_ne!(super::network_of(x), super::network_of(y), "IPv4 hosts apart");
        let mapped: std::net::IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(super::network_of(mapped), x, "an IPv4-mapped address is its IPv4 address");
    }
}
