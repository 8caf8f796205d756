//! Pools across machines: the same channel, pool and item API when the consumer is on another
//! host (`tcp://HOST:PORT` addresses).
//!
//! - **One connection** per consumer, devshare's own TCP connection, carries everything: the
//!   handshake (a challenge-response over a shared key file, [`super::auth`]), each
//!   pool's registration (`ATTACH` from the producer, `POOL` back when the consumer holds its
//!   copy), every item and every return (`RETURN`). A dead peer is the connection's end, as on a
//!   Unix channel.
//! - **Items on the stream path** (the default, [`DataPath::Stream`]): the producer writes a
//!   `DATA` header (pool, slot, offset, length), the item's bytes and its `ITEM` message, in one
//!   write for small items, queued with the connection's messages ([`Framed::try_queue_item`]),
//!   and straight from its slot for large ones, outside the channel's lock so that a consumer
//!   slow to read holds up no other ([`Framed::begin_raw`]); the consumer checks the header
//!   against its copy of the pool and reads the bytes straight into its slot
//!   ([`Framed::read_raw`]). One copy (the
//!   wire's), no round trip beyond the item and its return. The consumer's slots are its own
//!   memory, allocated once per pool, so every slot keeps its address.
//! - **Items over UCX** ([`DataPath::Ucx`], where both ends set `DEVSHARE_REMOTE_DATA=ucx`):
//!   the producer `put`s the bytes into the consumer's registered copy of the pool ([`super::ucx`]),
//!   flushes for remote completion, then sends `ITEM`. For RDMA networks, whose NICs check
//!   remote keys.
//! - **CUDA pools** cross through host memory at both ends: the producer copies the item to a
//!   host staging buffer (one slot, allocated with the pool) before it goes, and the consumer
//!   copies it from its host copy of the pool into its own `cuMemAlloc` copy (fixed addresses
//!   too) before handing the item out.
//! - **Trust.** No `SO_PEERCRED` across hosts: both ends prove knowledge of a key file only
//!   their user can read (HMAC-SHA256 over fresh nonces of both sides and the handshake's fields:
//!   the producer's proof covers the consumer's whole hello, the consumer's covers its hello and
//!   what follows its proof; the key never crosses the wire), the producer proving first.
//!   Before its proof a peer gets nothing: no peer-table entry, no endpoint, no pool, and a
//!   refusal that names nothing of the producer; connections waiting for their handshake are
//!   limited per source address ([`crate::channel::admission`]). Not protected: the connection is not
//!   encrypted and its messages after the handshake are not authenticated one by one, so an
//!   on-path attacker can read or change items (within the consumer's slots, whose bounds every
//!   header is checked against): use remote channels on a network you trust or in a tunnel.

use crate::channel::wire::{self, In, Out};
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Instant;

/// Consumer -> producer, first: `magic u32, version u16, data u16, nonce [32]`, then its UCX
/// version (UTF-8; empty unless `data` asks for [`DataPath::Ucx`]).
pub(crate) const R_HELLO: u32 = 20;
/// Producer -> consumer: `nonce [32], proof [32]`; the proof covers the whole hello.
pub(crate) const R_CHALLENGE: u32 = 21;
/// Consumer -> producer: `proof [32]`, then its UCX worker address (empty on the stream path);
/// the proof covers the hello and the address.
pub(crate) const R_PROOF: u32 = 22;
/// Consumer -> producer, answering `ATTACH`: `pool u32, 0 u32, base u64, length u64`, then the
/// packed remote key of its slot memory (empty on the stream path: the answer only says the
/// consumer holds its copy of the pool).
pub(crate) const R_POOL: u32 = 23;
/// Producer -> consumer, on the stream path: `pool u32, slot u32, offset u64, length u64`, then
/// (outside the frame) `length` bytes of the item, which the consumer reads straight into its
/// slot at `offset`; the item's `ITEM` message follows.
pub(crate) const R_DATA: u32 = 24;
/// First bytes of a remote handshake ("DSRC").
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"DSRC");
/// Protocol version of remote channels (2: the stream path, proofs bound to the handshake).
pub(crate) const VERSION: u16 = 2;
/// Bytes a peer may leave unread (waiting in our buffer) before it is disconnected.
pub(crate) const MAX_BACKLOG: usize = 4 << 20;
/// Room in a connection's queue that items leave free for messages (`ATTACH`, `POOL_CLOSED`,
/// ...): a message that finds no room ends the connection, an item waits.
pub(crate) const CONTROL_ROOM: usize = 256 << 10;
/// Items up to this size are queued with their messages and written in one system call; larger
/// ones are written straight from the slot.
pub(crate) const INLINE_PAYLOAD: usize = 256 << 10;
/// Bytes of a large item a producer hands to the socket at a time (and a consumer copies to a
/// device at a time as they arrive): large enough that a copy per chunk costs little, small
/// enough that copying one overlaps with the network carrying the one before.
pub(crate) const CHUNK: usize = 1 << 20;
/// Bytes a connection reads at a time (more for a larger message).
const READ_CHUNK: usize = 64 << 10;

/// TCP keepalive on every connection, both ends: a peer whose host vanished (power, a cable, a
/// network partition: no FIN, no RST) while the connection was quiet is found within about 50 s,
/// its connection then failing like a closed one, instead of staying in the peer table (a
/// producer) or leaving a receive without a time limit waiting for ever (a consumer). Probes
/// after 30 s of silence, every 5 s, 4 unanswered end it. (With data unacknowledged the kernel
/// sends no probes: its retransmission limit decides.)
pub(crate) const KEEPALIVE: (std::time::Duration, std::time::Duration, u32) =
    (std::time::Duration::from_secs(30), std::time::Duration::from_secs(5), 4);
/// The environment variable that selects UCX for a remote channel's items (`ucx`), on both ends.
pub(crate) const DATA_VAR: &str = "DEVSHARE_REMOTE_DATA";

/// How a remote channel's item bytes travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataPath {
    /// On the authenticated connection itself, read straight into the consumer's slot (the
    /// default): nothing but the channel's own port is open, and only a peer that proved the
    /// key can make either process read or write anything.
    Stream,
    /// UCX puts into the consumer's registered slots (one-sided RDMA where the NIC checks
    /// remote keys). Both ends opt in with `DEVSHARE_REMOTE_DATA=ucx`: UCX's TCP transport
    /// listens on every interface and does not check remote keys.
    Ucx,
}

impl DataPath {
    pub(crate) fn code(self) -> u16 {
        match self {
            DataPath::Stream => 0,
            DataPath::Ucx => 1,
        }
    }

    pub(crate) fn from_code(c: u16) -> Option<DataPath> {
        match c {
            0 => Some(DataPath::Stream),
            1 => Some(DataPath::Ucx),
            _ => None,
        }
    }

    /// The number `peer_info` and the C API report: 1 the stream, 2 UCX (0 is a Unix channel).
    pub(crate) fn reported(self) -> u32 {
        u32::from(self.code()) + 1
    }

    /// What this process asked for with [`DATA_VAR`]: `ucx`, `stream` or unset (the stream).
    pub(crate) fn from_env() -> Result<DataPath> {
        match std::env::var(DATA_VAR).as_deref() {
            Err(_) | Ok("") | Ok("stream") => Ok(DataPath::Stream),
            Ok("ucx") => Ok(DataPath::Ucx),
            Ok(other) => Err(Error::InvalidArgument(format!("{DATA_VAR}={other:?}: use \"stream\" or \"ucx\""))),
        }
    }
}

/// A handshake or registration message of a remote channel (the rest are [`wire::Message`]s).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Remote<'a> {
    Hello { magic: u32, version: u16, data: u16, nonce: [u8; 32], ucx: &'a [u8] },
    Challenge { nonce: [u8; 32], proof: [u8; 32] },
    Proof { proof: [u8; 32], worker: &'a [u8] },
    Pool { pool: u32, base: u64, len: u64, rkey: &'a [u8] },
    Data { pool: u32, slot: u32, offset: u64, len: u64 },
}

impl<'a> Remote<'a> {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut m;
        match self {
            Remote::Hello { magic, version, data, nonce, ucx } => {
                m = Out::new(R_HELLO);
                m.u32(*magic).u16(*version).u16(*data).bytes(nonce).bytes(ucx);
            }
            Remote::Challenge { nonce, proof } => {
                m = Out::new(R_CHALLENGE);
                m.bytes(nonce).bytes(proof);
            }
            Remote::Proof { proof, worker } => {
                m = Out::new(R_PROOF);
                m.bytes(proof).bytes(worker);
            }
            Remote::Pool { pool, base, len, rkey } => {
                m = Out::new(R_POOL);
                m.u32(*pool).u32(0).u64(*base).u64(*len).bytes(rkey);
            }
            Remote::Data { pool, slot, offset, len } => {
                m = Out::new(R_DATA);
                m.u32(*pool).u32(*slot).u64(*offset).u64(*len);
            }
        }
        m.0
    }

    /// A remote message, or `None` when the type is not one of them (a [`wire::Message`]).
    pub(crate) fn decode(b: &'a [u8]) -> Result<Option<Remote<'a>>> {
        let mut r = In::new(b);
        let msg = match r.u32()? {
            R_HELLO => {
                let (magic, version, data) = (r.u32()?, r.u16()?, r.u16()?);
                Remote::Hello { magic, version, data, nonce: r.array()?, ucx: r.rest() }
            }
            R_CHALLENGE => Remote::Challenge { nonce: r.array()?, proof: r.array()? },
            R_PROOF => Remote::Proof { proof: r.array()?, worker: r.rest() },
            R_POOL => {
                let pool = r.u32()?;
                let _ = r.u32()?;
                Remote::Pool { pool, base: r.u64()?, len: r.u64()?, rkey: r.rest() }
            }
            R_DATA => Remote::Data { pool: r.u32()?, slot: r.u32()?, offset: r.u64()?, len: r.u64()? },
            _ => return Ok(None),
        };
        r.end()?;
        Ok(Some(msg))
    }
}

/// What the consumer's proof covers: its whole hello (as sent, type included) and the worker
/// address it sends after the proof.
pub(crate) fn consumer_bound(hello: &[u8], worker: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + hello.len() + worker.len());
    b.extend((hello.len() as u64).to_le_bytes());
    b.extend(hello);
    b.extend(worker);
    b
}

/// Whether `address` names a remote channel (`tcp://HOST:PORT`).
pub(crate) fn is_remote(address: &str) -> bool {
    address.starts_with("tcp://")
}

/// The socket addresses of `tcp://HOST:PORT` (HOST a name, an IPv4 address or `[IPv6]`).
pub(crate) fn socket_addrs(address: &str) -> Result<Vec<SocketAddr>> {
    let rest = address
        .strip_prefix("tcp://")
        .ok_or_else(|| Error::InvalidArgument(format!("{address:?} is not a tcp://HOST:PORT address")))?;
    let bad = || Error::InvalidArgument(format!("{address:?} is not a tcp://HOST:PORT address (a port is needed)"));
    let (_, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let addrs: Vec<SocketAddr> = rest
        .to_socket_addrs()
        .map_err(|e| Error::NotFound(format!("the host of {address:?} does not resolve: {e}")))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::NotFound(format!("the host of {address:?} resolves to no address")));
    }
    Ok(addrs)
}

fn io(what: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::ConnectionAborted
        | std::io::ErrorKind::UnexpectedEof => Error::Closed(format!("the other end of the channel is gone ({what})")),
        _ => Error::Os { call: what.into(), errno: e.raw_os_error().unwrap_or(0), message: e.to_string() },
    }
}

/// A non-blocking TCP connection carrying length-prefixed messages (`u32` little-endian length,
/// at most [`wire::MAX_MESSAGE`] bytes each): what arrived is parsed as it comes; what the
/// socket had no room for waits (at most [`MAX_BACKLOG`] bytes).
pub(crate) struct Framed {
    pub(crate) stream: TcpStream,
    /// What was read: `rbuf[taken..filled]` is not handed out yet.
    rbuf: Vec<u8>,
    taken: usize,
    filled: usize,
    /// Whether the last read found the socket emptied (a short read, or nothing): reading again
    /// before a poll says it is readable ([`Self::readable`]) would only cost a system call.
    drained: bool,
    wbuf: VecDeque<u8>,
    /// A large item is being written through a second handle ([`Self::begin_raw`]): nothing
    /// else may go to the socket until it ends (never again, once its write failed).
    raw: bool,
    /// The turns of senders waiting for room for their items, first first ([`Self::take_turn`]).
    waiting: VecDeque<u64>,
    /// The last turn handed out.
    turns: u64,
    eof: bool,
}

impl Framed {
    pub(crate) fn new(stream: TcpStream) -> Result<Framed> {
        stream.set_nonblocking(true).map_err(|e| io("fcntl(O_NONBLOCK)", e))?;
        stream.set_nodelay(true).map_err(|e| io("setsockopt(TCP_NODELAY)", e))?;
        {
            use rustix::net::sockopt;
            let os = |what: &'static str| move |e| wire::os(what, e);
            sockopt::set_socket_keepalive(&stream, true).map_err(os("setsockopt(SO_KEEPALIVE)"))?;
            sockopt::set_tcp_keepidle(&stream, KEEPALIVE.0).map_err(os("setsockopt(TCP_KEEPIDLE)"))?;
            sockopt::set_tcp_keepintvl(&stream, KEEPALIVE.1).map_err(os("setsockopt(TCP_KEEPINTVL)"))?;
            sockopt::set_tcp_keepcnt(&stream, KEEPALIVE.2).map_err(os("setsockopt(TCP_KEEPCNT)"))?;
        }
        Ok(Framed {
            stream,
            rbuf: vec![0; READ_CHUNK],
            taken: 0,
            filled: 0,
            drained: false,
            wbuf: VecDeque::new(),
            raw: false,
            waiting: VecDeque::new(),
            turns: 0,
            eof: false,
        })
    }

    /// The next whole message, reading what the socket has; `None` when none is complete yet
    /// (without a read when the last one emptied the socket: call [`Self::readable`] once a
    /// poll says more came). `Closed` once the peer hung up (after the messages it sent).
    pub(crate) fn next(&mut self) -> Result<Option<Vec<u8>>> {
        loop {
            let avail = &self.rbuf[self.taken..self.filled];
            let mut need = 4;
            if avail.len() >= 4 {
                let len = u32::from_le_bytes(avail[..4].try_into().expect("4 bytes")) as usize;
                if len > wire::MAX_MESSAGE {
                    return Err(Error::Untrusted(format!(
                        "a remote channel message of {len} bytes (at most {})",
                        wire::MAX_MESSAGE
                    )));
                }
                if avail.len() >= 4 + len {
                    let msg = avail[4..4 + len].to_vec();
                    self.taken += 4 + len;
                    return Ok(Some(msg));
                }
                need = 4 + len;
            }
            if self.eof {
                return Err(Error::Closed("the other end of the channel hung up".into()));
            }
            // Room for the rest of this message, without clearing the buffer on every read:
            // what is unread moves to the front, and the buffer grows only for a message larger
            // than it (at most one of MAX_MESSAGE bytes).
            if self.taken > 0 {
                self.rbuf.copy_within(self.taken..self.filled, 0);
                self.filled -= self.taken;
                self.taken = 0;
            }
            if need > self.rbuf.len() {
                self.rbuf.resize(need, 0);
            }
            if self.drained {
                return Ok(None);
            }
            let space = self.rbuf.len() - self.filled;
            match self.stream.read(&mut self.rbuf[self.filled..]) {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    self.filled += n;
                    self.drained = n < space;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.drained = true;
                    return Ok(None);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io("recv on a remote channel", e)),
            }
        }
    }

    /// Queue one message and send what the socket takes now. `Closed` when the peer is gone or
    /// has left more than [`MAX_BACKLOG`] bytes unread.
    pub(crate) fn send(&mut self, msg: &[u8]) -> Result<()> {
        if self.wbuf.len() + 4 + msg.len() > MAX_BACKLOG {
            return Err(Error::Closed(format!(
                "the peer does not read its messages ({} bytes wait; at most {MAX_BACKLOG})",
                self.wbuf.len()
            )));
        }
        self.wbuf.extend((msg.len() as u32).to_le_bytes());
        self.wbuf.extend(msg);
        self.flush()
    }

    /// Whether the sender holding `turn` (none: a sender that has not waited yet) may send an
    /// item now as far as order goes: nobody waits, or it is the first of those who do.
    fn my_turn(&self, turn: Option<u64>) -> bool {
        self.waiting.front().map_or(true, |&first| turn == Some(first))
    }

    /// A sender whose item found no room takes its turn (once; kept while it waits): items then
    /// go in the order their senders started waiting, so a large item waits for the queue to
    /// empty without small ones slipping in ahead of it for ever, nor large ones.
    fn take_turn(&mut self, turn: &mut Option<u64>) {
        if turn.is_none() {
            self.turns += 1;
            self.waiting.push_back(self.turns);
            *turn = Some(self.turns);
        }
    }

    /// A waiting sender gives its turn up (it sent its item, or it stopped waiting for room).
    pub(crate) fn leave_turn(&mut self, turn: &mut Option<u64>) {
        if let Some(t) = turn.take() {
            self.waiting.retain(|&w| w != t);
        }
    }

    /// Whether an item of `len` bytes (with its two messages, `messages` bytes together) may be
    /// queued now by the sender holding `turn` ([`Self::try_queue_item`]): its turn, no large
    /// item being written, and the queue keeps [`CONTROL_ROOM`] free for messages after it.
    /// When not, the sender takes its turn (it waits).
    pub(crate) fn item_fits(&mut self, len: usize, messages: usize, turn: &mut Option<u64>) -> bool {
        let fits =
            self.my_turn(*turn) && !self.raw && self.wbuf.len() + 8 + messages + len + CONTROL_ROOM <= MAX_BACKLOG;
        if !fits {
            self.take_turn(turn);
        }
        fits
    }

    /// Queue `head`, the raw `payload` and `tail` (messages framed, the payload not) after what
    /// waits already, and send what the socket takes now: an item up to [`INLINE_PAYLOAD`]
    /// bytes waits with the messages (one system call when the socket has room). `false`, with
    /// nothing queued, unless [`Self::item_fits`]: the caller waits (in turn) for the socket to
    /// drain (items never fill the queue to where a message would not fit and end
    /// the connection). Once queued the item is the peer's: a closing channel still sends what
    /// waits.
    pub(crate) fn try_queue_item(
        &mut self,
        head: &[u8],
        payload: &[u8],
        tail: &[u8],
        turn: &mut Option<u64>,
    ) -> Result<bool> {
        if !self.item_fits(payload.len(), head.len() + tail.len(), turn) {
            return Ok(false);
        }
        self.leave_turn(turn);
        self.queue(head);
        self.wbuf.extend(payload);
        self.queue(tail);
        self.flush()?;
        Ok(true)
    }

    /// Begin writing a large item straight from where it lies, outside the channel's lock, so
    /// that a peer slow to read it holds up nobody else: on the sender's turn (see
    /// [`Self::try_queue_item`]) once nothing waits in the queue (flush it first), a second
    /// handle on the socket to write the item's bytes with ([`write_all_stalling`]); `None`
    /// while something waits, another item is being written or goes first (the caller waits,
    /// in turn). Until [`Self::end_raw`] what is queued for this peer stays queued
    /// (after the item's bytes).
    pub(crate) fn begin_raw(&mut self, turn: &mut Option<u64>) -> Result<Option<TcpStream>> {
        if self.raw || self.pending() || !self.my_turn(*turn) {
            self.take_turn(turn);
            return Ok(None);
        }
        let writer = self.stream.try_clone().map_err(|e| io("dup of a remote channel's socket", e))?;
        self.leave_turn(turn);
        self.raw = true;
        Ok(Some(writer))
    }

    /// The large item of [`Self::begin_raw`] was written: what waits goes now. When its write
    /// failed (`written` false) part of it may have gone, and the stream can carry nothing
    /// more: what waits is dropped and nothing is written again (the connection is ending).
    pub(crate) fn end_raw(&mut self, written: bool) -> Result<()> {
        if !written {
            self.wbuf.clear();
            return Ok(());
        }
        self.raw = false;
        self.flush()
    }

    /// Queue one framed message (sent by the next flush).
    fn queue(&mut self, msg: &[u8]) {
        self.wbuf.extend((msg.len() as u32).to_le_bytes());
        self.wbuf.extend(msg);
    }

    /// Move the next bytes of the stream (after the last message handed out) into `dst`: what
    /// was read already first, then straight from the socket until it has no more. The number
    /// of bytes moved (less than `dst.len()` when the rest has not arrived yet); `Closed` once
    /// the peer hung up before `dst` was filled.
    pub(crate) fn read_raw(&mut self, dst: &mut [u8]) -> Result<usize> {
        let buffered = (self.filled - self.taken).min(dst.len());
        dst[..buffered].copy_from_slice(&self.rbuf[self.taken..self.taken + buffered]);
        self.taken += buffered;
        let mut done = buffered;
        while done < dst.len() && !self.drained {
            if self.eof {
                return Err(Error::Closed("the other end of the channel hung up in the middle of an item".into()));
            }
            let want = dst.len() - done;
            match self.stream.read(&mut dst[done..]) {
                Ok(0) => self.eof = true,
                Ok(n) => {
                    done += n;
                    self.drained = n < want;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.drained = true;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io("recv on a remote channel", e)),
            }
        }
        Ok(done)
    }

    /// Send what waits while the socket takes it (nothing while a large item is being written:
    /// its bytes go first).
    pub(crate) fn flush(&mut self) -> Result<()> {
        while !self.wbuf.is_empty() && !self.raw {
            let (a, _) = self.wbuf.as_slices();
            match self.stream.write(a) {
                Ok(0) => return Err(Error::Closed("the other end of the channel is gone".into())),
                Ok(n) => {
                    self.wbuf.drain(..n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io("send on a remote channel", e)),
            }
        }
        Ok(())
    }

    /// Whether messages wait for room in the socket.
    pub(crate) fn pending(&self) -> bool {
        !self.wbuf.is_empty()
    }

    /// Whether a poll should say when the socket has room: messages wait, and no large item is
    /// being written (whose writer waits for room itself).
    pub(crate) fn wants_room(&self) -> bool {
        self.pending() && !self.raw
    }

    /// Send everything that waits, waiting for room at most until `deadline`. `Busy` while a
    /// large item is being written ([`Self::begin_raw`]).
    pub(crate) fn flush_until(&mut self, deadline: Instant) -> Result<()> {
        if self.raw {
            return Err(Error::Busy("a large item is being written on this connection".into()));
        }
        loop {
            self.flush()?;
            if !self.pending() {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout("the other end of the channel does not read".into()));
            }
            use std::os::fd::AsFd;
            wire::wait_ready(self.stream.as_fd(), rustix::event::PollFlags::OUT, Some(left))?;
        }
    }

    /// Wait for the next whole message at most until `deadline` (handshakes).
    pub(crate) fn next_until(&mut self, deadline: Instant) -> Result<Vec<u8>> {
        use std::os::fd::AsFd;
        loop {
            if let Some(m) = self.next()? {
                return Ok(m);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !wire::wait_ready(self.stream.as_fd(), rustix::event::PollFlags::IN, Some(left))? {
                return Err(Error::Timeout("the other end of the channel did not answer the handshake".into()));
            }
            self.readable();
        }
    }

    /// Read and drop what the peer sent and nobody will take any more (a closing channel).
    pub(crate) fn discard_input(&mut self) {
        let mut sink = [0u8; 4096];
        while let Ok(n) = self.stream.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    }

    /// A poll said the socket is readable (or may be): the next read goes to it again.
    pub(crate) fn readable(&mut self) {
        self.drained = false;
    }
}

/// Bytes sent on `stream` that the peer's kernel has not acknowledged yet (`SIOCOUTQ`); 0 when
/// that cannot be asked.
/// `msg` with its length before it, as [`Framed`] frames messages.
pub(crate) fn framed(msg: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + msg.len());
    v.extend((msg.len() as u32).to_le_bytes());
    v.extend(msg);
    v
}

/// Write `bytes` to a non-blocking `stream`, waiting for room; `Timeout` once the stream took
/// nothing for `patience` (a peer that reads, however slowly, is waited for), or once `limit` (a
/// whole transfer's time limit, see [`transfer_limit`]) has passed.
pub(crate) fn write_all_stalling(
    stream: &TcpStream,
    bytes: &[u8],
    patience: std::time::Duration,
    limit: Option<Instant>,
) -> Result<()> {
    let mut done = 0;
    let mut stalled_since: Option<Instant> = None;
    let past_limit = || {
        Error::Timeout(format!(
            "the other end of the channel read too slowly: the transfer's time limit passed \
             ({} s, and 1 s per {} bytes: {MIN_RATE_VAR})",
            patience.as_secs(),
            min_rate()
        ))
    };
    while done < bytes.len() {
        match (&mut &*stream).write(&bytes[done..]) {
            Ok(0) => return Err(Error::Closed("the other end of the channel is gone".into())),
            Ok(n) => {
                done += n;
                stalled_since = None;
                // (A peer that reads a little at a time makes every write succeed.)
                if limit.is_some_and(|l| done < bytes.len() && Instant::now() >= l) {
                    return Err(past_limit());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                let since = *stalled_since.get_or_insert(now);
                let left = patience.saturating_sub(now.duration_since(since));
                if left.is_zero() {
                    return Err(Error::Timeout(format!(
                        "the other end of the channel read nothing for {} s",
                        patience.as_secs()
                    )));
                }
                let until_limit = limit.map(|l| l.saturating_duration_since(now));
                if until_limit.is_some_and(|u| u.is_zero()) {
                    return Err(past_limit());
                }
                use std::os::fd::AsFd;
                let wait = until_limit.map_or(left, |u| u.min(left));
                wire::wait_ready(stream.as_fd(), rustix::event::PollFlags::OUT, Some(wait))?;
            }
            Err(e) => return Err(io("send on a remote channel", e)),
        }
    }
    Ok(())
}

/// The variable that sets the slowest rate, in bytes per second, at which a producer waits for
/// a consumer to read a large item (default 1 MiB/s; 0: no limit but the stall's).
pub(crate) const MIN_RATE_VAR: &str = "DEVSHARE_REMOTE_MIN_RATE";

/// The rate [`MIN_RATE_VAR`] sets (read once per process).
pub(crate) fn min_rate() -> u64 {
    static RATE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *RATE.get_or_init(|| std::env::var(MIN_RATE_VAR).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(1 << 20))
}

/// When a transfer of `bytes` begun now must have ended: `patience` plus one second per
/// [`min_rate`] bytes, so a consumer that reads a little at a time cannot hold a send (and its
/// thread) for longer than a slow but honest one would. `None` when the rate is 0.
pub(crate) fn transfer_limit(bytes: u64, patience: std::time::Duration) -> Option<Instant> {
    limit_at(Instant::now(), bytes, patience, min_rate())
}

/// [`transfer_limit`] from `now` at `rate`.
fn limit_at(now: Instant, bytes: u64, patience: std::time::Duration, rate: u64) -> Option<Instant> {
    if rate == 0 {
        return None;
    }
    // (A limit past what a clock can say is no limit.)
    let more = std::time::Duration::try_from_secs_f64(bytes as f64 / rate as f64).ok()?;
    now.checked_add(patience)?.checked_add(more)
}

pub(crate) fn unacknowledged(stream: &TcpStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int to the pointer; the descriptor is open.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if rc == 0 {
        n.max(0) as usize
    } else {
        0
    }
}

/// What a remote pool's slots are, as the handle field of its `ATTACH` message tells the
/// consumer (which allocates its own copy of that kind): empty for host memory, or `b"cuda"`
/// then the device ordinal (`u32`, little-endian) for CUDA device memory. A 1.5 consumer
/// refuses anything but empty, so a CUDA pool never reaches one as host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolMemory {
    Host,
    Cuda { device: i32 },
}

impl PoolMemory {
    pub(crate) fn encode(self) -> Vec<u8> {
        match self {
            PoolMemory::Host => Vec::new(),
            PoolMemory::Cuda { device } => {
                let mut b = b"cuda".to_vec();
                b.extend_from_slice(&(device as u32).to_le_bytes());
                b
            }
        }
    }

    pub(crate) fn decode(b: &[u8]) -> Result<PoolMemory> {
        match b {
            [] => Ok(PoolMemory::Host),
            [b'c', b'u', b'd', b'a', d @ ..] if d.len() == 4 => {
                let device = u32::from_le_bytes(d.try_into().expect("4 bytes"));
                i32::try_from(device)
                    .map(|device| PoolMemory::Cuda { device })
                    .map_err(|_| Error::Untrusted(format!("a CUDA pool on device {device}")))
            }
            _ => Err(Error::Untrusted(format!("a pool whose memory is described by {} unknown bytes", b.len()))),
        }
    }
}

/// The UCX settings of a remote channel's context (none: UCX's own defaults and `UCX_*`
/// environment variables decide the transports).
pub(crate) const UCX_SETTINGS: &[(&str, &str)] = &[];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_connection_probes_a_silent_peer_with_tcp_keepalive() {
        use rustix::net::sockopt;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (inn, _) = l.accept().unwrap();
        for f in [Framed::new(out).unwrap(), Framed::new(inn).unwrap()] {
            let s = &f.stream;
            assert!(sockopt::socket_keepalive(s).unwrap());
            assert_eq!(sockopt::tcp_keepidle(s).unwrap(), KEEPALIVE.0);
            assert_eq!(sockopt::tcp_keepintvl(s).unwrap(), KEEPALIVE.1);
            assert_eq!(sockopt::tcp_keepcnt(s).unwrap(), KEEPALIVE.2);
        }
    }

    #[test]
    fn a_transfer_limit_is_the_patience_and_a_second_per_rate_bytes_and_never_panics() {
        let now = Instant::now();
        let ten = std::time::Duration::from_secs(10);
        assert_eq!(limit_at(now, 32 << 20, ten, 4 << 20), Some(now + std::time::Duration::from_secs(18)));
        assert_eq!(limit_at(now, 32 << 20, ten, 0), None, "rate 0: no limit but the stall");
        // The largest sizes at the smallest rate: past what the clock can say, no limit.
        assert_eq!(limit_at(now, u64::MAX, ten, 1), None);
        assert!(limit_at(now, u64::MAX, ten, u64::MAX).is_some());
    }

    /// A connection whose peer reads nothing: items queue until they would eat into the room
    /// kept for messages, and stop there (the send waits); a message still fits after them (it
    /// would end the connection if it did not). Then a large item's turn: only once the queue is
    /// empty, and while it is written nothing else goes to the socket.
    #[test]
    fn queued_items_leave_room_for_messages_and_a_large_item_waits_for_an_empty_queue() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_peer, _) = l.accept().unwrap(); // never read
        let mut f = Framed::new(out).unwrap();
        let payload = vec![7u8; 64 << 10];
        let mut queued = 0;
        while f.try_queue_item(b"head", &payload, b"tail", &mut None).unwrap() {
            queued += 1;
            assert!(queued < 10_000, "items stop queueing");
        }
        assert!(f.pending(), "what the socket did not take waits");
        assert!(f.wbuf.len() + CONTROL_ROOM <= MAX_BACKLOG, "items left the messages' room");
        // The largest message kinds after them: every one fits.
        for _ in 0..4 {
            f.send(&[1u8; 32 << 10]).unwrap();
        }
        assert!(f.begin_raw(&mut None).unwrap().is_none(), "a large item waits while the queue holds anything");
        let mut g = Framed::new(TcpStream::connect(l.local_addr().unwrap()).unwrap()).unwrap();
        let writer = g.begin_raw(&mut None).unwrap().expect("an empty queue: the large item may go");
        g.send(b"after the item").unwrap();
        assert!(g.pending() && !g.wants_room(), "a message waits for the item's end, unwatched");
        assert!(!g.try_queue_item(b"h", b"p", b"t", &mut None).unwrap(), "no item queues during a large one");
        assert!(matches!(g.flush_until(Instant::now()), Err(Error::Busy(_))));
        drop(writer);
        g.end_raw(true).unwrap();
        assert!(!g.pending(), "once it ended, what waited went");
    }

    #[test]
    fn remote_messages_round_trip_and_others_are_left_to_the_channel_wire() {
        let all = [
            Remote::Hello { magic: MAGIC, version: VERSION, data: 1, nonce: [1; 32], ucx: b"1.13.1" },
            Remote::Hello { magic: MAGIC, version: VERSION, data: 0, nonce: [1; 32], ucx: b"" },
            Remote::Challenge { nonce: [2; 32], proof: [3; 32] },
            Remote::Data { pool: 2, slot: 7, offset: 12, len: 64 << 20 },
            Remote::Proof { proof: [4; 32], worker: b"worker address" },
            Remote::Pool { pool: 3, base: 1 << 40, len: 4096, rkey: b"rkey" },
        ];
        for m in all {
            assert_eq!(Remote::decode(&m.encode()).unwrap(), Some(m));
        }
        assert_eq!(Remote::decode(&wire::Message::Return { pool: 1, slot: 2 }.encode()).unwrap(), None);
        assert!(Remote::decode(&R_CHALLENGE.to_le_bytes()).is_err(), "a short challenge");
    }

    #[test]
    fn pool_memory_round_trips_and_unknown_kinds_are_refused() {
        for m in [PoolMemory::Host, PoolMemory::Cuda { device: 0 }, PoolMemory::Cuda { device: 7 }] {
            assert_eq!(PoolMemory::decode(&m.encode()).unwrap(), m);
        }
        let mut big = b"cuda".to_vec();
        big.extend_from_slice(&u32::MAX.to_le_bytes());
        for bad in [&b"cuda"[..], b"cuda\0\0\0", b"acl\0\0\0\0\0", &big[..], b"cuda\0\0\0\0\0"] {
            assert!(PoolMemory::decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tcp_addresses_need_a_host_and_a_port() {
        assert_eq!(socket_addrs("tcp://127.0.0.1:7000").unwrap()[0], "127.0.0.1:7000".parse().unwrap());
        assert_eq!(socket_addrs("tcp://[::1]:7000").unwrap()[0], "[::1]:7000".parse().unwrap());
        for bad in ["tcp://127.0.0.1", "tcp://127.0.0.1:x", "tcp://:99999", "udp://1.2.3.4:5"] {
            assert!(socket_addrs(bad).is_err(), "{bad}");
        }
        assert!(is_remote("tcp://h:1") && !is_remote("@name") && !is_remote("/tmp/x"));
    }
}
