//! The consumer end of a remote channel (`tcp://HOST:PORT`): the authenticated connection, its
//! copies of the pools (its own memory, allocated once per pool, so every slot keeps its
//! address; registered with UCX on the UCX path), and the items that arrive there. See
//! [`super::protocol`].

use super::auth::{self, Key, Role};
use super::protocol::{self, DataPath, Framed, PoolMemory, Remote};
use super::ucx::{self, Arm, MemRegion};
use crate::channel::item::{narrow, open, usable, AttachToken, SpareTokens, Teller};
use crate::channel::wire::{self, Message};
use crate::error::{Error, Result};
use crate::handle::DevshareHandle;
use crate::import::Import;
use rustc_hash::FxHashMap;
use rustix::event::epoll;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What the tokens of received items need: the sending half of the connection.
struct Shared {
    writer: Mutex<Framed>,
    closed: AtomicBool,
    generation: crate::fork::Stamp,
}

impl Teller for Shared {
    /// What the socket has no room for waits, and goes out with the next receive.
    fn tell(&self, msg: Message<'_>) {
        if !self.generation.is_current() || self.closed.load(Ordering::Acquire) {
            return;
        }
        let _ = self.writer.lock().unwrap_or_else(|p| p.into_inner()).send(&msg.encode());
    }
}

/// This consumer's copy of a pool: its memory, registered with UCX once.
struct Attached {
    /// Unregistered before the memory goes (declared first); UCX path only.
    _region: Option<MemRegion>,
    /// Unpins `base` (CUDA pools) before it goes (declared before it).
    _pinned: Option<Box<dyn Send>>,
    /// The host memory items arrive in (the producer's puts, or the bytes read).
    base: Arc<Import>,
    /// A CUDA pool's slots: this consumer's own device memory, where each item is copied from
    /// `base` before it is handed out.
    device: Option<Arc<Import>>,
    slot_size: u64,
    count: u32,
    token: Arc<AttachToken>,
    spares: SpareTokens,
}

/// This consumer's UCX worker, on the UCX path.
struct Ucx {
    worker: Box<ucx::Worker>,
    context: ucx::Context,
}

/// An item's bytes arriving on the stream path: where the rest goes.
struct Incoming {
    pool: u32,
    /// Offset of the item's first byte in the pool's host memory.
    start: usize,
    /// Offset of the next byte in the pool's host memory.
    at: usize,
    left: usize,
    /// CUDA pools: bytes from `start` already copied to the device.
    copied: usize,
}

/// Most pools one remote connection holds (each is this consumer's own memory, and its
/// bookkeeping a few bytes per slot): a pool is a pipeline's depth, and producers make a few.
const MAX_POOLS: usize = crate::channel::limits::DEVSHARE_CHANNEL_MAX_POOLS;

/// Most messages one look takes before a receive checks its time limit again (a producer that
/// keeps sending messages that are not items must not keep a receive past it).
const MESSAGES_PER_LOOK: usize = 1024;

struct State {
    /// The last look stopped at [`MESSAGES_PER_LOOK`]: more may be waiting.
    more: bool,
    reader: Framed,
    /// Dropped before the worker.
    pools: FxHashMap<u32, Attached>,
    /// The item whose bytes are being read (stream path).
    incoming: Option<Incoming>,
    /// The bytes of the last item that arrived whole and are on the device already (CUDA
    /// pools, stream path): pool, offset, length.
    on_device: Option<(u32, usize, usize)>,
    ucx: Option<Ucx>,
    eof: bool,
}

/// The consumer end of a remote channel.
pub(crate) struct RemoteConnection {
    shared: Arc<Shared>,
    state: Mutex<State>,
    /// The socket (data 0) and the UCX worker's event fd (data 1): what receives sleep on and
    /// a caller's event loop polls.
    epoll: OwnedFd,
    /// The socket, to wait for room in it while messages wait (a descriptor of its own: the
    /// writer's lock is not held while waiting).
    sock: OwnedFd,
    peer_id: u64,
    producer_pid: i32,
    data: DataPath,
}

fn os(call: &str, e: std::io::Error) -> Error {
    Error::Os { call: call.into(), errno: e.raw_os_error().unwrap_or(0), message: e.to_string() }
}

impl RemoteConnection {
    /// Connect to the remote channel at `tcp://HOST:PORT`, prove the key and check the
    /// producer's proof and UCX version (waiting at most `timeout`, 10 s when `None`, for the
    /// connection and the handshake).
    pub(crate) fn connect(address: &str, timeout: Option<Duration>) -> Result<RemoteConnection> {
        let addrs = protocol::socket_addrs(address)?;
        let key = Key::load(&auth::key_path()?)?;
        let data = DataPath::from_env()?;
        // UCX only where asked for: on the stream path nothing else listens or is registered.
        let ucx = match data {
            DataPath::Stream => None,
            DataPath::Ucx => {
                let context = ucx::Context::new(protocol::UCX_SETTINGS)?;
                let worker = Box::new(ucx::Worker::new(&context)?);
                Some((context, worker, ucx::version()?))
            }
        };
        let limit = timeout.unwrap_or(Duration::from_secs(10)).max(Duration::from_millis(1));
        let deadline = Instant::now() + limit;
        let mut last = None;
        let mut stream = None;
        for a in &addrs {
            match TcpStream::connect_timeout(
                a,
                deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
            ) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = stream.ok_or_else(|| match last {
            Some(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Error::NotFound(format!("no channel listens at {address:?} ({e})"))
            }
            Some(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                Error::Timeout(format!("the channel at {address:?} accepted no connection"))
            }
            Some(e) => os(&format!("connect to {address:?}"), e),
            None => Error::NotFound(format!("{address:?} resolves to no address")),
        })?;
        let writer_stream = stream.try_clone().map_err(|e| os("dup of a socket", e))?;
        let mut reader = Framed::new(stream)?;
        let mut writer = Framed::new(writer_stream)?;
        let mine = auth::nonce()?;
        let version = ucx.as_ref().map_or("", |(_, _, v)| v.as_str());
        let hello = Remote::Hello {
            magic: protocol::MAGIC,
            version: protocol::VERSION,
            data: data.code(),
            nonce: mine,
            ucx: version.as_bytes(),
        }
        .encode();
        writer.send(&hello)?;
        writer.flush_until(deadline)?;
        let refused = |m: &[u8]| -> Option<Error> {
            match Message::decode(m) {
                Ok(Message::Refused { reason }) => Some(Error::Untrusted(format!(
                    "the channel at {address:?} refused this process (remote channel protocol version {}): {}",
                    protocol::VERSION,
                    wire::peer_text(reason)
                ))),
                _ => None,
            }
        };
        let m = reader.next_until(deadline)?;
        if let Some(e) = refused(&m) {
            return Err(e);
        }
        let Some(Remote::Challenge { nonce: theirs, proof }) = Remote::decode(&m)? else {
            return Err(Error::Untrusted(format!(
                "the channel at {address:?} answered the handshake with something else"
            )));
        };
        // The producer's proof covers this hello as the producer received it.
        if !key.verify(Role::Producer, &mine, &theirs, &hello, &proof) {
            return Err(Error::Untrusted(format!(
                "the channel at {address:?} did not prove that it has the channel's key (or the handshake \
                 was changed on the way)"
            )));
        }
        let worker_address = match &ucx {
            Some((_, w, _)) => w.address()?,
            None => Vec::new(),
        };
        let proof = key.prove(Role::Consumer, &theirs, &mine, &protocol::consumer_bound(&hello, &worker_address));
        writer.send(&Remote::Proof { proof, worker: &worker_address }.encode())?;
        writer.flush_until(deadline)?;
        let m = reader.next_until(deadline)?;
        if let Some(e) = refused(&m) {
            return Err(e);
        }
        let Message::Welcome { version: v, peer_id, producer_pid, .. } = Message::decode(&m)? else {
            return Err(Error::Untrusted(format!("the channel at {address:?} answered the proof with something else")));
        };
        if v != protocol::VERSION {
            return Err(Error::UnsupportedVersion(format!("remote channel protocol version {v}")));
        }
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| wire::os("epoll_create", e))?;
        epoll::add(&ep, &reader.stream, epoll::EventData::new_u64(0), epoll::EventFlags::IN)
            .map_err(|e| wire::os("epoll_ctl", e))?;
        let ucx = match ucx {
            Some((context, worker, _)) => {
                epoll::add(&ep, worker.efd(), epoll::EventData::new_u64(1), epoll::EventFlags::IN)
                    .map_err(|e| wire::os("epoll_ctl", e))?;
                Some(Ucx { worker, context })
            }
            None => None,
        };
        let sock = rustix::io::fcntl_dupfd_cloexec(&reader.stream, 0).map_err(|e| wire::os("dup of a socket", e))?;
        Ok(RemoteConnection {
            sock,
            shared: Arc::new(Shared {
                writer: Mutex::new(writer),
                closed: AtomicBool::new(false),
                generation: crate::fork::Stamp::now(),
            }),
            state: Mutex::new(State {
                more: false,
                reader,
                pools: FxHashMap::default(),
                incoming: None,
                on_device: None,
                ucx,
                eof: false,
            }),
            epoll: ep,
            peer_id,
            producer_pid,
            data,
        })
    }

    /// How this connection's items travel.
    pub(crate) fn data_path(&self) -> DataPath {
        self.data
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }

    pub(crate) fn peer_id(&self) -> u64 {
        self.peer_id
    }

    pub(crate) fn producer_pid(&self) -> i32 {
        self.producer_pid
    }

    fn state(&self) -> Result<MutexGuard<'_, State>> {
        usable(&self.shared.generation, &self.shared.closed)?;
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The next item. While it waits it progresses this consumer's UCX worker: the producer's
    /// puts into this consumer's slots complete only then over software transports (TCP).
    pub(crate) fn recv(&self, timeout: Option<Duration>) -> Result<Import> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut woke = false;
        // Once the time is up: one more look at what arrived, then `Timeout` (a producer that
        // keeps sending messages that are not items must not keep a receive past its limit).
        let mut last_look = false;
        let mut more;
        loop {
            let backlog = {
                let mut w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
                let _ = w.flush();
                w.pending()
            };
            {
                let mut st = self.state()?;
                if std::mem::take(&mut woke) {
                    st.reader.readable();
                }
                // The control connection first: once it says the producer is gone, this worker
                // is never progressed again. Every item's bytes were in place before its ITEM
                // was sent (the producer flushed), and UCX 1.13 aborts the process from inside
                // progress when it cannot acknowledge a put to a producer that died mid-transfer.
                if let Some(imp) = self.take_messages(&mut st)? {
                    return Ok(imp);
                }
                more = st.more;
                if let (false, Some(u)) = (st.eof, &st.ucx) {
                    while u.worker.progress() > 0 {}
                    if let Some(imp) = self.take_messages(&mut st)? {
                        return Ok(imp);
                    }
                    more = st.more;
                }
                if st.eof {
                    return Err(Error::Closed("the producer closed the channel or exited".into()));
                }
                // (A time limit that has run out still polls once, with no wait: the last read
                // may have left the socket without looking again.)
                if let Some(u) = &st.ucx {
                    if u.worker.arm()? == Arm::Busy {
                        continue;
                    }
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                if last_look {
                    return Err(Error::Timeout("nothing arrived on the channel".into()));
                }
                last_look = true;
            }
            if more {
                continue; // (what was read already is looked at before any wait)
            }
            // Wake for messages, for UCX (the producer's puts), and for room to send releases.
            let ts = left
                .map(|d| rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) });
            let out = if backlog { rustix::event::PollFlags::OUT } else { rustix::event::PollFlags::empty() };
            let mut both = [
                rustix::event::PollFd::new(&self.epoll, rustix::event::PollFlags::IN),
                rustix::event::PollFd::new(&self.sock, out),
            ];
            // The stream path has only the socket to wait on.
            let mut one = [rustix::event::PollFd::new(&self.sock, out | rustix::event::PollFlags::IN)];
            let fds: &mut [rustix::event::PollFd<'_>] =
                if self.data == DataPath::Stream { &mut one } else { &mut both };
            match rustix::event::poll(fds, ts.as_ref()) {
                Ok(0) => return Err(Error::Timeout("nothing arrived on the channel".into())),
                Ok(_) | Err(rustix::io::Errno::INTR) => woke = true,
                Err(e) => return Err(wire::os("poll", e)),
            }
        }
    }

    /// Handle the control messages that arrived, until one is an item; notes the producer's
    /// hang-up in `st.eof`.
    fn take_messages(&self, st: &mut State) -> Result<Option<Import>> {
        st.more = false;
        if st.eof {
            return Ok(None);
        }
        for _ in 0..MESSAGES_PER_LOOK {
            if !self.take_bytes(st)? {
                return Ok(None);
            }
            let m = match st.reader.next() {
                Ok(Some(m)) => m,
                Ok(None) => return Ok(None),
                Err(Error::Closed(_)) => {
                    st.eof = true;
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            if let Some(imp) = self.message(st, &m)? {
                return Ok(Some(imp));
            }
        }
        // More may be waiting (read already, where polling the socket does not see it): the
        // caller looks again before it sleeps, after checking its time limit.
        st.more = true;
        Ok(None)
    }

    /// Read the bytes of the item that is arriving (stream path) straight into its slot; true
    /// once none are missing.
    fn take_bytes(&self, st: &mut State) -> Result<bool> {
        let Some(inc) = &mut st.incoming else { return Ok(true) };
        let Some(p) = st.pools.get(&inc.pool) else {
            return Err(Error::Internal("an arriving item's pool went".into()));
        };
        // SAFETY: `at..at + left` lies in the pool's host memory (checked against its slots
        // when the item's header came), which `p.base` keeps mapped; nothing else writes there
        // meanwhile (the producer sends a slot's bytes only while this consumer does not hold
        // it, and the consumer hands out no item of a slot before its bytes arrived).
        let dst = unsafe { std::slice::from_raw_parts_mut(p.base.view().data.add(inc.at), inc.left) };
        let n = match st.reader.read_raw(dst) {
            Ok(n) => n,
            Err(Error::Closed(_)) => {
                st.eof = true;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        inc.at += n;
        inc.left -= n;
        if let Some(device) = &p.device {
            // CUDA pools: what arrived goes on to the device a chunk at a time while the rest
            // is still on its way, and the last part once all is there.
            let arrived = inc.at - inc.start;
            while arrived - inc.copied >= protocol::CHUNK || (inc.left == 0 && arrived > inc.copied) {
                let len = (arrived - inc.copied).min(protocol::CHUNK);
                let off = inc.start + inc.copied;
                let backend = crate::backend::get(device.handle().backend)?;
                // SAFETY: `off..off + len` arrived in the host copy of the pool and lies in the
                // item's slot (checked with its header); the device copy has the same size.
                unsafe {
                    backend.copy(device.device(), false, device.view().data.add(off), p.base.view().data.add(off), len)
                }?;
                inc.copied += len;
            }
        }
        if inc.left > 0 {
            return Ok(false);
        }
        if p.device.is_some() {
            st.on_device = Some((inc.pool, inc.start, inc.copied));
        }
        st.incoming = None;
        Ok(true)
    }

    fn message(&self, st: &mut State, b: &[u8]) -> Result<Option<Import>> {
        if let Some(r) = Remote::decode(b)? {
            let Remote::Data { pool, slot, offset, len } = r else {
                return Err(Error::Untrusted(format!("{r:?} after the handshake")));
            };
            if st.ucx.is_some() {
                return Err(Error::Untrusted("an item's bytes on the connection of a UCX consumer".into()));
            }
            let p = st.pools.get(&pool).ok_or_else(|| {
                Error::Untrusted(format!("the bytes of an item of pool {pool}, which this consumer never attached"))
            })?;
            if slot >= p.count || offset.checked_add(len).map_or(true, |e| e > p.slot_size) {
                return Err(Error::Untrusted(format!(
                    "pool {pool} item bytes: slot {slot}, bytes {offset}..+{len} is outside the {} slots of {} bytes",
                    p.count, p.slot_size
                )));
            }
            let at = (u64::from(slot) * p.slot_size + offset) as usize;
            st.incoming = Some(Incoming { pool, start: at, at, left: len as usize, copied: 0 });
            st.on_device = None;
            return Ok(None);
        }
        match Message::decode(b)? {
            Message::Attach { pool, slot_size, count, handle } => {
                if st.pools.contains_key(&pool) {
                    return Err(Error::Untrusted(format!("pool {pool} attached twice")));
                }
                let memory_kind = PoolMemory::decode(handle)?;
                let whole = slot_size
                    .checked_mul(u64::from(count))
                    .filter(|&w| {
                        slot_size > 0
                            && count > 0
                            && count <= crate::channel::limits::DEVSHARE_POOL_MAX_SLOTS
                            && w <= isize::MAX as u64
                    })
                    .ok_or_else(|| Error::Untrusted(format!("pool {pool}: {count} slots of {slot_size} bytes")))?;
                // Every pool this connection holds is this consumer's own memory: at most
                // MAX_POOLS of them, and all of them together must fit where one must.
                let held: u64 = st.pools.values().map(|p| p.slot_size * u64::from(p.count)).sum();
                if st.pools.len() >= MAX_POOLS {
                    self.hang_up();
                    return Err(Error::Untrusted(format!(
                        "pool {pool}: the producer attached {MAX_POOLS} pools already (the most one connection holds)"
                    )));
                }
                crate::shm::ensure_capacity(held.saturating_add(whole)).inspect_err(|_| self.hang_up())?;
                let token = AttachToken::new(self.shared.clone(), pool);
                let memory = |m| match m {
                    PoolMemory::Host => Ok(None),
                    PoolMemory::Cuda { device } => own_device_memory(device, whole).map(Some),
                };
                // A pool this consumer cannot hold ends the connection: the producer then sees
                // the hang-up (its send fails at once) instead of waiting for a registration.
                let (base, device) =
                    own_memory(whole).and_then(|b| Ok((b, memory(memory_kind)?))).inspect_err(|_| self.hang_up())?;
                let ptr = base.view().data;
                let (region, reply) = match &st.ucx {
                    Some(u) => {
                        // SAFETY: the memory is this consumer's own allocation of `whole` bytes,
                        // held by `base` for as long as the region (declared before it in
                        // Attached) lives; the producer's puts land there only between items, as
                        // the control channel says.
                        let region = unsafe { MemRegion::map(&u.context, ptr, whole as usize) }?;
                        let rkey = region.pack_rkey()?;
                        let reply = Remote::Pool { pool, base: ptr as u64, len: whole, rkey: &rkey }.encode();
                        (Some(region), reply)
                    }
                    // The stream path registers nothing: the answer says the copy is there.
                    None => (None, Remote::Pool { pool, base: 0, len: whole, rkey: &[] }.encode()),
                };
                // CUDA pools: the host copy is pinned where the driver allows, so that each item's
                // copy to the device runs at the device's speed.
                let pinned = match (&device, memory_kind) {
                    (Some(d), PoolMemory::Cuda { device: ordinal }) => {
                        let backend = crate::backend::get(d.handle().backend)?;
                        // SAFETY: `base` stays mapped until after the guard, declared before
                        // it in Attached, unpinned it.
                        unsafe { backend.pin_host(ordinal, ptr, whole as usize) }
                    }
                    _ => None,
                };
                let (base, device, spares) = (Arc::new(base), device.map(Arc::new), SpareTokens::new(count));
                let attached =
                    Attached { _region: region, _pinned: pinned, base, device, slot_size, count, token, spares };
                st.pools.insert(pool, attached);
                self.shared.writer.lock().unwrap_or_else(|p| p.into_inner()).send(&reply)?;
                Ok(None)
            }
            Message::Item { pool, slot, layout, event } => {
                if st.incoming.is_some() {
                    return Err(Error::Internal("an item before its bytes arrived".into()));
                }
                let State { pools, on_device, .. } = st;
                let p = pools.get_mut(&pool).ok_or_else(|| {
                    Error::Untrusted(format!("an item of pool {pool}, which this consumer never attached"))
                })?;
                if event.is_some() {
                    return Err(Error::Untrusted("a remote item with an event".into()));
                }
                let teller = || self.shared.clone() as Arc<dyn Teller>;
                let conn = (&teller as &dyn Fn() -> Arc<dyn Teller>, &p.token, &mut p.spares);
                let Some(device) = &p.device else {
                    return narrow(&p.base, p.slot_size, p.count, pool, slot, &layout, None, conn)
                        .map(|imp| Some(*imp));
                };
                // Checks the item's bytes against the pool (and gives the slot back if the copy
                // below fails: the import is dropped).
                let imp = narrow(device, p.slot_size, p.count, pool, slot, &layout, None, conn)?;
                let at = u64::from(slot) * p.slot_size + layout.storage_offset;
                // On the stream path the bytes went to the device as they arrived.
                if let Some((on_pool, start, len)) = on_device.take() {
                    if on_pool == pool && start as u64 == at && len as u64 >= layout.storage_size {
                        return Ok(Some(*imp));
                    }
                }
                let backend = crate::backend::get(device.handle().backend)?;
                // SAFETY: `at..+storage_size` lies in the host copy of the pool (narrow checked
                // the item against the same slots), which the producer finished putting before
                // it sent the item; the device side is the item's storage in this consumer's
                // own device memory.
                unsafe {
                    let src = p.base.view().data.add(at as usize);
                    backend.copy(device.device(), false, imp.view().storage, src, layout.storage_size as usize)
                }?;
                Ok(Some(*imp))
            }
            Message::PoolClosed { pool } => {
                st.pools.remove(&pool);
                Ok(None)
            }
            other => Err(Error::Untrusted(format!("{other:?} is not a message a producer sends"))),
        }
    }

    /// Shut the connection down in both directions (the next receive reports `CLOSED`).
    fn hang_up(&self) {
        let w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = w.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Close: the producer takes back every slot of this connection at once; imports stay
    /// mapped until released.
    pub(crate) fn close(&self) {
        if !self.shared.generation.is_current() {
            return;
        }
        if !self.shared.closed.swap(true, Ordering::AcqRel) {
            let w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
            let _ = w.stream.shutdown(std::net::Shutdown::Read);
            drop(w);
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.pools.clear();
            drop(st);
            let w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
            let _ = w.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for RemoteConnection {
    fn drop(&mut self) {
        self.close();
    }
}

/// `len` bytes of this process's own memory (a sealed memfd) as an import: what a remote
/// pool's slots are, in the consumer.
fn own_memory(len: u64) -> Result<Import> {
    use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
    crate::shm::ensure_capacity(len)?;
    let fd = memfd_create("devshare-remote-pool", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| wire::os("memfd_create", e))?;
    ftruncate(&fd, len).map_err(|e| wire::os("ftruncate of a memfd", e))?;
    fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(|e| wire::os("fcntl(F_ADD_SEALS)", e))?;
    let mut h = DevshareHandle {
        backend: crate::handle::DEVSHARE_BACKEND_HOST,
        flags: crate::handle::DEVSHARE_HANDLE_FLAG_CHANNEL,
        alloc_size: len,
        storage_size: len,
        ndim: 1,
        dtype: crate::dtype::DevshareDType::new(crate::dtype::code::UINT, 8, 1),
        producer_pid: crate::fork::pid(),
        ..Default::default()
    };
    h.shape[0] = len as i64;
    h.strides[0] = 1;
    open(&h, None, vec![fd], None, std::ptr::null_mut(), None)
}

/// `len` bytes of this process's own CUDA device memory on `device` (`cuMemAlloc`), as an
/// import: a remote CUDA pool's slots, in the consumer.
fn own_device_memory(device: i32, len: u64) -> Result<Import> {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mapping = crate::backend::get(crate::handle::DEVSHARE_BACKEND_CUDA)?.alloc_private(device, len)?;
    // The registry's key for this allocation: unique in the process, never an IPC handle (the
    // handle's key says what it is, and the driver refuses to open it elsewhere).
    let mut key = [0u8; 64];
    let text = format!("devshare remote pool {} {}", crate::fork::pid(), NEXT.fetch_add(1, Ordering::Relaxed));
    key[..text.len()].copy_from_slice(text.as_bytes());
    let mut h = DevshareHandle {
        backend: crate::handle::DEVSHARE_BACKEND_CUDA,
        device_index: device,
        alloc_size: len,
        storage_size: len,
        ndim: 1,
        dtype: crate::dtype::DevshareDType::new(crate::dtype::code::UINT, 8, 1),
        producer_pid: crate::fork::pid(),
        key_len: 64,
        ..Default::default()
    };
    h.key[..64].copy_from_slice(&key);
    h.shape[0] = len as i64;
    h.strides[0] = 1;
    let mut mapping = Some(mapping);
    let mut opener = || mapping.take().ok_or_else(|| Error::Internal("a private allocation mapped twice".into()));
    let req = crate::backend::ImportRequest { device: Some(device), ..Default::default() };
    let attached = crate::import::Attached { key: &key, open: &mut opener };
    crate::import::import_attached(&h, None, req, Some(attached), None, None)
}
