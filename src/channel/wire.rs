//! The channel's messages and the socket calls that carry them.
//!
//! A channel is a `SOCK_SEQPACKET` Unix socket: every message arrives whole or not at all, so
//! there is no framing to get wrong. Each message starts with a little-endian `u32` type; the
//! rest depends on the type (see the constants). Descriptors (memfds) travel as `SCM_RIGHTS`
//! next to the message that needs them and nowhere else; a message that comes with descriptors
//! it should not have, or without the ones it needs, is refused and its descriptors closed.

use crate::error::{Error, Result};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

/// First bytes of the handshake messages ("DSCH").
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"DSCH");
/// Protocol version spoken by this library (a peer with another version is refused by name).
pub(crate) const VERSION: u16 = 1;
/// Largest message either side sends or accepts (an encoded handle with a long segment table
/// fits; the default socket buffers hold it).
pub(crate) const MAX_MESSAGE: usize = 128 * 1024;
/// Most descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub(crate) const MAX_FDS: usize = crate::export::MAX_PASSED_FDS;
/// How long a send waits for room in the peer's socket buffer before it gives up.
pub(crate) const SEND_PATIENCE: Duration = Duration::from_secs(10);

/// Consumer -> producer: `magic u32, version u16, 0 u16, tgid i32`.
pub(crate) const HELLO: u32 = 1;
/// Producer -> consumer: `magic u32, version u16, 0 u16, peer id u64, producer pid i32, 0 u32`.
pub(crate) const WELCOME: u32 = 2;
/// Producer -> consumer, then the producer closes: a UTF-8 reason.
pub(crate) const REFUSED: u32 = 3;
/// Producer -> consumer: `0 u32, lease u64`, then a handle's byte encoding; the memfd of a
/// channel handle as `SCM_RIGHTS`.
pub(crate) const SHARE: u32 = 4;
/// Consumer -> producer: `0 u32, lease u64`.
pub(crate) const RELEASE: u32 = 5;
/// Producer -> consumer: `pool u32, slot_size u64, count u32, 0 u32`, then the byte encoding of
/// the handle of the pool's whole allocation (its memfd as `SCM_RIGHTS`).
pub(crate) const ATTACH: u32 = 6;
/// Producer -> consumer: `pool u32, slot u32, ndim u32, dtype (code u8, bits u8, lanes u16),
/// flags u32, storage_offset u64 (in the slot), storage_size u64, tensor_offset i64,
/// shape i64 x ndim, strides i64 x ndim`, then with flag [`ITEM_EVENT`] the 64-byte IPC event
/// handle to wait on before use.
pub(crate) const ITEM: u32 = 7;
/// [`ITEM`] flag: an interprocess event handle follows.
pub(crate) const ITEM_EVENT: u32 = 1;
/// Consumer -> producer: `pool u32, slot u32, 0 u32`.
pub(crate) const RETURN: u32 = 8;
/// Producer -> consumer: `pool u32`: the pool is closed; detach once its items are released.
pub(crate) const POOL_CLOSED: u32 = 9;
/// Consumer -> producer: `pool u32`: this consumer no longer maps the pool.
pub(crate) const DETACH: u32 = 10;

pub(crate) fn os(call: &str, e: Errno) -> Error {
    Error::Os { call: call.into(), errno: e.raw_os_error(), message: std::io::Error::from(e).to_string() }
}

/// A message being written.
#[derive(Default)]
pub(crate) struct Out(pub Vec<u8>);

impl Out {
    pub(crate) fn new(ty: u32) -> Out {
        let mut o = Out(Vec::with_capacity(64));
        o.u32(ty);
        o
    }
    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn i32(&mut self, v: i32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn i64(&mut self, v: i64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
}

/// A message being read: every read is bounds-checked, a short message is a protocol error.
pub(crate) struct In<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> In<'a> {
    pub(crate) fn new(b: &'a [u8]) -> In<'a> {
        In { b, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            Error::Untrusted(format!("a channel message of {} bytes is shorter than its type requires", self.b.len()))
        })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub(crate) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub(crate) fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(crate) fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let s = &self.b[self.pos..];
        self.pos = self.b.len();
        s
    }
    /// The message must end here.
    pub(crate) fn end(&self) -> Result<()> {
        if self.pos != self.b.len() {
            return Err(Error::Untrusted(format!(
                "a channel message has {} bytes more than its type holds",
                self.b.len() - self.pos
            )));
        }
        Ok(())
    }
}

/// Wait until `fd` is ready for `flags`, at most `timeout` (`None`: forever). `Ok(false)` on
/// timeout. Interrupted waits resume.
pub(crate) fn wait_ready(fd: BorrowedFd<'_>, flags: PollFlags, timeout: Option<Duration>) -> Result<bool> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let ts = left.map(|l| Timespec { tv_sec: l.as_secs() as i64, tv_nsec: i64::from(l.subsec_nanos()) });
        let mut fds = [PollFd::from_borrowed_fd(fd, flags)];
        match poll(&mut fds, ts.as_ref()) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(os("poll", e)),
        }
    }
}

/// Send one message with `fds` beside it without waiting: `Ok(false)` when the peer's socket
/// buffer has no room (nothing was sent); a peer that is gone is [`Error::Closed`].
pub(crate) fn try_send(sock: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool> {
    debug_assert!(msg.len() <= MAX_MESSAGE && fds.len() <= MAX_FDS);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    loop {
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(Error::Internal("descriptors do not fit the control buffer".into()));
        }
        let iov = [IoSlice::new(msg)];
        match sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
            Ok(_) => return Ok(true),
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return Ok(false),
            Err(Errno::PIPE | Errno::CONNRESET | Errno::NOTCONN) => {
                return Err(Error::Closed("the other end of the channel is gone".into()))
            }
            Err(e) => return Err(os("sendmsg on a channel", e)),
        }
    }
}

/// Send one message with `fds` beside it. Waits (at most [`SEND_PATIENCE`]) while the peer's
/// buffer is full; a peer that is gone is [`Error::Closed`]. Only the consumer sends this way
/// (it holds no lock another thread needs meanwhile); the producer queues instead.
pub(crate) fn send(sock: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    let deadline = Instant::now() + SEND_PATIENCE;
    loop {
        if try_send(sock, msg, fds)? {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !wait_ready(sock, PollFlags::OUT, Some(left))? {
            return Err(Error::Timeout(format!(
                "the peer has not read its channel messages for {} s",
                SEND_PATIENCE.as_secs()
            )));
        }
    }
}

/// What a non-blocking receive found.
pub(crate) enum Received {
    /// A message of this many bytes (in the buffer), with these descriptors.
    Message(usize),
    /// Nothing queued now.
    Empty,
    /// The other end is gone (orderly close or reset).
    Closed,
}

/// Receive one message without blocking into `buf` (resized to [`MAX_MESSAGE`]); its
/// descriptors go to `fds` (cleared first). A message cut short by the buffer is refused.
pub(crate) fn recv(sock: BorrowedFd<'_>, buf: &mut Vec<u8>, fds: &mut Vec<OwnedFd>) -> Result<Received> {
    recv_with(sock, buf, fds, false)
}

/// [`recv`], or with `block` (on a blocking socket) waiting in the kernel until a message or the
/// close arrives — one system call instead of a poll and a receive.
pub(crate) fn recv_with(
    sock: BorrowedFd<'_>,
    buf: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
    block: bool,
) -> Result<Received> {
    let flags = if block { RecvFlags::CMSG_CLOEXEC } else { RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC };
    fds.clear();
    buf.resize(MAX_MESSAGE, 0);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut reset = false;
    loop {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(buf)];
        let r = recvmsg(sock, &mut iov, &mut control, flags);
        let msg = match r {
            Ok(m) => m,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => return Ok(Received::Empty),
            // A peer that closed with our messages unread reports ECONNRESET once, before the
            // messages it queued for us: read those (its last words, e.g. why it refused us).
            Err(Errno::CONNRESET) if !reset => {
                reset = true;
                continue;
            }
            Err(Errno::CONNRESET | Errno::NOTCONN) => return Ok(Received::Closed),
            Err(e) => return Err(os("recvmsg on a channel", e)),
        };
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        if msg.bytes == 0 && !msg.flags.contains(ReturnFlags::CTRUNC) {
            return Ok(Received::Closed);
        }
        if msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) {
            fds.clear();
            return Err(Error::Untrusted(format!(
                "a channel message longer than {MAX_MESSAGE} bytes or with more than {MAX_FDS} descriptors was refused"
            )));
        }
        return Ok(Received::Message(msg.bytes));
    }
}

/// The socket address for `address`: `@name` is a Linux abstract name, anything else a path.
pub(crate) fn address(address: &str) -> Result<rustix::net::SocketAddrUnix> {
    if address.is_empty() || address == "@" {
        return Err(Error::InvalidArgument("the channel address is empty".into()));
    }
    let r = match address.strip_prefix('@') {
        Some(name) => rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()),
        None => rustix::net::SocketAddrUnix::new(address),
    };
    r.map_err(|_| {
        Error::InvalidArgument(format!(
            "channel address {address:?} does not fit a Unix socket address (at most 107 bytes, no NUL)"
        ))
    })
}
