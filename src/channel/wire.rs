//! The channel's messages and the socket calls that carry them.
//!
//! A channel is a `SOCK_SEQPACKET` Unix socket: every message arrives whole or not at all, so
//! there is no framing to get wrong. Each message starts with a little-endian `u32` type; the
//! rest depends on the type (see the constants). Descriptors (memfds) travel as `SCM_RIGHTS`
//! next to the message that needs them and nowhere else; a message that comes with descriptors
//! it should not have, or without the ones it needs, is refused and its descriptors closed.

use crate::dtype::DevshareDType;
use crate::error::{Error, Result};
use crate::handle::{DEVSHARE_EVENT_HANDLE_SIZE, DEVSHARE_MAX_NDIM};
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

/// Consumer -> producer: `magic u32, version u16, features u16, tgid i32`. `features`: the
/// `FEATURE_*` bits the consumer reads (0 from consumers before 1.4; producers before 1.4 ignore
/// the field).
pub(crate) const HELLO: u32 = 1;
/// [`HELLO`] feature: the consumer reads [`SHARES`] messages.
pub(crate) const FEATURE_SHARES: u16 = 1;
/// Producer -> consumer: `magic u32, version u16, features u16, peer id u64, producer pid i32,
/// 0 u32`. `features`: the `PRODUCER_*` bits of what the producer reads (0 from producers before
/// 1.12; consumers before 1.12 ignore the field).
pub(crate) const WELCOME: u32 = 2;
/// [`WELCOME`] feature: the producer reads [`RELEASES`].
pub(crate) const PRODUCER_RELEASES: u16 = 1;
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
/// Producer -> consumer (to consumers that announced [`FEATURE_SHARES`]): several leased
/// references in one message, leases `first lease .. first lease + count`: `count u32,
/// first lease u64`, then per share `len u32, fds u32` and a handle's byte encoding of `len`
/// bytes; the descriptors of every share, in order (`fds` each), as `SCM_RIGHTS`.
pub(crate) const SHARES: u32 = 11;
/// Most shares one [`SHARES`] message carries.
pub(crate) const MAX_SHARES: usize = 4096;
/// [`HELLO`] feature: the consumer reads pool items from a shared-memory ring ([`RING`]), and
/// wakes the producer with writes of 1 (consumers before 1.16).
pub(crate) const FEATURE_RING: u16 = 2;
/// [`HELLO`] feature (1.16): [`FEATURE_RING`] with eventfds the producer created with a count
/// of 1, which both sides wake with writes of 0 (a write that never blocks: see `ring`).
/// Consumers announce this instead of [`FEATURE_RING`], so producers before 1.16 (their
/// eventfds start at 0) send them no ring.
pub(crate) const FEATURE_RING_PRIMED: u16 = 64;
/// Producer -> consumer (to consumers that announced [`FEATURE_RING`] or [`FEATURE_RING_PRIMED`]), before the first item
/// that travels in it: `capacity u32, record size u32`; the ring's sealed memfd, the eventfd
/// that wakes the consumer and the one that wakes the producer as `SCM_RIGHTS` (see `ring`).
pub(crate) const RING: u32 = 12;
/// [`HELLO`] feature: the consumer reads [`KEPT_SHARES`] and [`RETIRE`]: it may keep the
/// allocations of registered exports mapped between their leases.
pub(crate) const FEATURE_KEEP: u16 = 4;
/// Producer -> consumer (to consumers that announced [`FEATURE_KEEP`]): [`SHARES`] whose entries
/// also name the registered export they lease (`count u32, first lease u64`, then per share
/// `len u32, fds u32, export u64` and the handle's encoding; export 0: not registered). The
/// consumer may keep a registered export's allocation mapped once its leases are released, until
/// [`RETIRE`] names the export.
pub(crate) const KEPT_SHARES: u32 = 13;
/// Producer -> consumer: `export u64`: the export is no longer registered; unmap its allocation
/// once no lease of it is held.
pub(crate) const RETIRE: u32 = 14;
/// [`HELLO`] feature: the consumer reads [`NAMES`].
pub(crate) const FEATURE_NAMES: u16 = 8;
/// Producer -> consumer (to consumers that announced [`FEATURE_NAMES`]), right before the shares
/// of leases `first lease .. first lease + count`: their names, `count u32, first lease u64`,
/// then per lease `len u16` and `len` bytes of UTF-8 without NUL (len 0: no name), each at most
/// [`DEVSHARE_MAX_NAME_LEN`](crate::channel::limits::DEVSHARE_MAX_NAME_LEN) bytes.
pub(crate) const NAMES: u32 = 15;
/// Consumer -> producer (to producers that announced [`PRODUCER_RELEASES`]): several leases
/// given back in one message, `count u32, 0 u32`, then `count` leases `u64`.
pub(crate) const RELEASES: u32 = 16;
/// Most leases one [`RELEASES`] message gives back (64 KiB of them).
pub(crate) const MAX_RELEASES: usize = 8192;
/// [`HELLO`] feature: the consumer reads [`PIN_SHARES`] and [`LEASE`] (and answers with
/// [`PINNED`] where the producer reads it).
pub(crate) const FEATURE_PIN: u16 = 16;
/// [`WELCOME`] feature: the producer reads [`PINNED`], and leases given back through the ring.
pub(crate) const PRODUCER_PINS: u16 = 2;
/// [`WELCOME`] feature (1.19): every interprocess event an [`ITEM`] or a [`LEASE`] carries to
/// this consumer stays alive, under its handle bytes, until the connection ends; the consumer
/// may open it once and wait on it again for each record (producers before 1.19 destroy an
/// event once the leases of its send came back, and another may then get its bytes).
pub(crate) const PRODUCER_KEEPS_EVENTS: u16 = 4;
/// Producer -> consumer (to consumers that announced [`FEATURE_PIN`], from producers that
/// announced [`PRODUCER_PINS`]): [`KEPT_SHARES`] whose entries may also offer the export's
/// whole window to be kept mapped for its later leases (once per registration): `count u32,
/// first lease u64`, then per share `len u32, fds u32, export u64, pin u64, window offset u64,
/// window size u64` and the handle's encoding (pin 0: no offer; the window in the allocation's
/// bytes). The consumer opens the window from the allocation the share came with, never anew,
/// and answers [`PINNED`] for the offers it keeps; past its bounds it says nothing, and that
/// export's leases keep coming as shares.
pub(crate) const PIN_SHARES: u32 = 17;
/// Consumer -> producer: `count u32, 0 u32`, then per export `export u64, pin u64`: the windows
/// of those offers are mapped here until [`RETIRE`] names the export or the connection ends;
/// their leases may come as [`LEASE`].
pub(crate) const PINNED: u32 = 18;
/// Producer -> consumer: a lease of a pinned export (in the ring, or over the socket when the
/// ring is full): `export u64, lease u64`, then an [`ITEM`]'s fields from `ndim` on, with
/// `storage_offset` relative to the export's window; flags [`ITEM_EVENT`] and
/// [`LEASE_EVENT_AGAIN`].
pub(crate) const LEASE: u32 = 19;
/// [`HELLO`] feature: the consumer reads [`LEASES`].
pub(crate) const FEATURE_LEASES: u16 = 32;
/// Producer -> consumer (to consumers that announced [`FEATURE_LEASES`]): the [`LEASE`]s of one
/// send that found the ring full, in one message instead of one each (a send of thousands of
/// registered tensors would otherwise fill the socket and the send queue with them): `count
/// u32, 0 u32`, then per lease `len u32` and that [`LEASE`]'s encoding, its type included.
pub(crate) const LEASES: u32 = 20;
/// [`LEASE`] flag (with [`ITEM_EVENT`]): an earlier lease of the same send carried this event
/// record; a consumer that waited on it for that lease, on the same stream, need not again.
pub(crate) const LEASE_EVENT_AGAIN: u32 = 2;

/// A pool item's tensor, as it travels in an [`ITEM`] message: a handle's layout fields, with
/// `storage_offset` relative to the item's slot (the consumer adds the slot's place in the pool).
pub(crate) type ItemLayout = crate::handle::Layout;

/// Every message of the protocol, typed: both ends build and read messages only through
/// [`Message::encode`] and [`Message::decode`]. Byte fields borrow from the received buffer.
// An item is the message sent per handoff: kept inline (no allocation per item); messages are
// built and read at once, never stored in bulk.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Message<'a> {
    /// Consumer -> producer, first: its protocol, what it reads, and the pid it announces (its
    /// bare tgid).
    Hello { magic: u32, version: u16, features: u16, tgid: i32 },
    /// Producer -> consumer: accepted, as peer `peer_id`; what the producer reads.
    Welcome { magic: u32, version: u16, features: u16, peer_id: u64, producer_pid: i32 },
    /// Producer -> consumer, then the producer closes: why (UTF-8).
    Refused { reason: &'a [u8] },
    /// Producer -> consumer: a leased reference (a handle's byte encoding).
    Share { lease: u64, handle: &'a [u8] },
    /// Consumer -> producer: a lease given back.
    Release { lease: u64 },
    /// Consumer -> producer: leases given back (1..=[`MAX_RELEASES`] of them).
    Releases { leases: Vec<u64> },
    /// Producer -> consumer: a pool's whole allocation (a handle's byte encoding).
    Attach { pool: u32, slot_size: u64, count: u32, handle: &'a [u8] },
    /// Producer -> consumer: a slot of an attached pool, and the event to wait on first.
    Item { pool: u32, slot: u32, layout: ItemLayout, event: Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]> },
    /// Consumer -> producer: a slot given back.
    Return { pool: u32, slot: u32 },
    /// Producer -> consumer: the pool is closed.
    PoolClosed { pool: u32 },
    /// Consumer -> producer: this consumer no longer maps the pool.
    Detach { pool: u32 },
    /// Producer -> consumer: leased references `first_lease..`, each (its descriptor count, a
    /// handle's byte encoding).
    Shares { first_lease: u64, entries: Vec<(u32, &'a [u8])> },
    /// Producer -> consumer: pool items and returns travel in the ring whose descriptors come
    /// with this message.
    Ring { capacity: u32, record: u32 },
    /// Producer -> consumer: [`Message::Shares`] with each share's registered export (0: none).
    KeptShares { first_lease: u64, entries: Vec<(u32, u64, &'a [u8])> },
    /// Producer -> consumer: the export is no longer registered.
    Retire { export: u64 },
    /// Producer -> consumer: the names of leases `first_lease..` (empty: no name), checked UTF-8
    /// without NUL, each at most `DEVSHARE_MAX_NAME_LEN` bytes.
    Names { first_lease: u64, names: Vec<&'a str> },
    /// Producer -> consumer: [`Message::KeptShares`] whose entries may offer their export's
    /// window to be kept mapped: each (descriptor count, export, [`Offer`], handle encoding).
    PinShares { first_lease: u64, entries: Vec<(u32, u64, Offer, &'a [u8])> },
    /// Consumer -> producer: the offers taken, each (export, the offer's number).
    Pinned { entries: Vec<(u64, u64)> },
    /// Producer -> consumer: lease `lease` of pinned export `export` (`layout` within its
    /// window), the event to wait on first and whether an earlier lease of its send carried it.
    Lease { export: u64, lease: u64, layout: ItemLayout, event: Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>, again: bool },
    /// Producer -> consumer: several [`Message::Lease`]s, in order.
    Leases { leases: Vec<LeaseRecord> },
}

/// One lease of a [`Message::Leases`]: a [`Message::Lease`]'s fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeaseRecord {
    pub export: u64,
    pub lease: u64,
    pub layout: ItemLayout,
    pub event: Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>,
    pub again: bool,
}

/// A [`LEASES`] message being filled: [`Self::push`] appends a [`LEASE`]'s encoding while the
/// message stays within [`MAX_MESSAGE`] and [`MAX_SHARES`] leases.
pub(crate) struct LeasesOut {
    buf: Vec<u8>,
    count: u32,
}

impl LeasesOut {
    pub(crate) fn new() -> Self {
        let mut buf = Vec::with_capacity(4096);
        buf.extend_from_slice(&LEASES.to_le_bytes());
        buf.extend_from_slice(&[0; 8]);
        LeasesOut { buf, count: 0 }
    }

    /// Append `lease` (a [`LEASE`]'s encoding); false (nothing appended) when the message is
    /// full.
    pub(crate) fn push(&mut self, lease: &[u8]) -> bool {
        if self.count as usize == MAX_SHARES || self.buf.len() + 4 + lease.len() > MAX_MESSAGE {
            return false;
        }
        self.buf.extend_from_slice(&(lease.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(lease);
        self.count += 1;
        true
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The message's bytes.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.buf[4..8].copy_from_slice(&self.count.to_le_bytes());
        self.buf
    }
}

impl Message<'_> {
    /// The message's bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        self.encode_into(Vec::with_capacity(64))
    }

    /// [`Self::encode`] into `buf` (cleared first; its memory reused): what a pool item is sent
    /// with, so that a send allocates nothing.
    pub(crate) fn encode_into(&self, mut buf: Vec<u8>) -> Vec<u8> {
        buf.clear();
        let mut m = Out(buf);
        match self {
            Message::Hello { magic, version, features, tgid } => {
                m.u32(HELLO);
                m.u32(*magic).u16(*version).u16(*features).i32(*tgid);
            }
            Message::Welcome { magic, version, features, peer_id, producer_pid } => {
                m.u32(WELCOME);
                m.u32(*magic).u16(*version).u16(*features).u64(*peer_id).i32(*producer_pid).u32(0);
            }
            Message::Refused { reason } => {
                m.u32(REFUSED);
                m.bytes(reason);
            }
            Message::Share { lease, handle } => {
                m.u32(SHARE);
                m.u32(0).u64(*lease).bytes(handle);
            }
            Message::Release { lease } => {
                m.u32(RELEASE);
                m.u32(0).u64(*lease);
            }
            Message::Releases { leases } => {
                m.u32(RELEASES);
                m.u32(leases.len() as u32).u32(0);
                for lease in leases {
                    m.u64(*lease);
                }
            }
            Message::Attach { pool, slot_size, count, handle } => {
                m.u32(ATTACH);
                m.u32(*pool).u64(*slot_size).u32(*count).u32(0).bytes(handle);
            }
            Message::Item { pool, slot, layout, event } => item_bytes(&mut m, *pool, *slot, layout, event.as_ref()),
            Message::Lease { export, lease, layout, event, again } => {
                lease_bytes(&mut m, *export, *lease, layout, event.as_ref(), *again)
            }
            Message::Leases { leases } => {
                m.u32(LEASES);
                m.u32(leases.len() as u32).u32(0);
                for l in leases {
                    let mut one = Out(Vec::new());
                    lease_bytes(&mut one, l.export, l.lease, &l.layout, l.event.as_ref(), l.again);
                    m.u32(one.0.len() as u32).bytes(&one.0);
                }
            }
            Message::PinShares { first_lease, entries } => {
                m.u32(PIN_SHARES);
                m.u32(entries.len() as u32).u64(*first_lease);
                for (fds, export, o, handle) in entries {
                    m.u32(handle.len() as u32).u32(*fds).u64(*export);
                    m.u64(o.pin).u64(o.window_offset).u64(o.window_size).bytes(handle);
                }
            }
            Message::Pinned { entries } => {
                m.u32(PINNED);
                m.u32(entries.len() as u32).u32(0);
                for (export, pin) in entries {
                    m.u64(*export).u64(*pin);
                }
            }
            Message::Return { pool, slot } => {
                m.u32(RETURN);
                m.u32(*pool).u32(*slot).u32(0);
            }
            Message::PoolClosed { pool } => {
                m.u32(POOL_CLOSED);
                m.u32(*pool);
            }
            Message::Detach { pool } => {
                m.u32(DETACH);
                m.u32(*pool);
            }
            Message::Shares { first_lease, entries } => {
                m.u32(SHARES);
                m.u32(entries.len() as u32).u64(*first_lease);
                for (fds, handle) in entries {
                    m.u32(handle.len() as u32).u32(*fds).bytes(handle);
                }
            }
            Message::Ring { capacity, record } => {
                m.u32(RING);
                m.u32(*capacity).u32(*record);
            }
            Message::KeptShares { first_lease, entries } => {
                m.u32(KEPT_SHARES);
                m.u32(entries.len() as u32).u64(*first_lease);
                for (fds, export, handle) in entries {
                    m.u32(handle.len() as u32).u32(*fds).u64(*export).bytes(handle);
                }
            }
            Message::Retire { export } => {
                m.u32(RETIRE);
                m.u64(*export);
            }
            Message::Names { first_lease, names } => {
                m = Out::new(NAMES);
                m.u32(names.len() as u32).u64(*first_lease);
                for name in names {
                    m.u16(name.len() as u16).bytes(name.as_bytes());
                }
            }
        }
        m.0
    }
}

impl<'a> Message<'a> {
    /// Read a message: every length and field checked (a short or long message, an unknown
    /// type, more dimensions than a handle holds, unknown item flags are refused by name).
    pub(crate) fn decode(b: &'a [u8]) -> Result<Message<'a>> {
        let mut r = In::new(b);
        let t = r.u32()?;
        let msg = match t {
            HELLO => {
                let (magic, version, features) = (r.u32()?, r.u16()?, r.u16()?);
                Message::Hello { magic, version, features, tgid: r.i32()? }
            }
            WELCOME => {
                let (magic, version, features) = (r.u32()?, r.u16()?, r.u16()?);
                let (peer_id, producer_pid) = (r.u64()?, r.i32()?);
                let _ = r.u32()?;
                Message::Welcome { magic, version, features, peer_id, producer_pid }
            }
            REFUSED => Message::Refused { reason: r.rest() },
            SHARE => {
                let _ = r.u32()?;
                Message::Share { lease: r.u64()?, handle: r.rest() }
            }
            RELEASE => {
                let _ = r.u32()?;
                Message::Release { lease: r.u64()? }
            }
            RELEASES => {
                let count = r.count(MAX_RELEASES, "a message releasing", "leases")?;
                let _ = r.u32()?;
                let leases = (0..count).map(|_| r.u64()).collect::<Result<Vec<u64>>>()?;
                Message::Releases { leases }
            }
            ATTACH => {
                let (pool, slot_size, count) = (r.u32()?, r.u64()?, r.u32()?);
                let _ = r.u32()?;
                Message::Attach { pool, slot_size, count, handle: r.rest() }
            }
            ITEM => {
                let mut layout = ItemLayout::empty();
                let (pool, slot, event) = item_body(&mut r, &mut layout)?;
                Message::Item { pool, slot, layout, event }
            }
            LEASE => {
                let LeaseRecord { export, lease, layout, event, again } = lease_body(&mut r)?;
                Message::Lease { export, lease, layout, event, again }
            }
            LEASES => {
                let count = r.count(MAX_SHARES, "a message of", "leases")?;
                let _ = r.u32()?;
                // (Reserved for as many records as the bytes left can hold, not for the count.)
                let mut leases = Vec::with_capacity(count.min(r.left() / LEASE_RECORD_MIN));
                for _ in 0..count {
                    // Each record is a LEASE, read here: its type first, then its body. Never a
                    // message decoded again, which would let records nest (LEASES in LEASES ...)
                    // as deep as the bytes allow, and each level costs stack.
                    let len = r.u32()? as usize;
                    let mut rec = In::new(r.bytes(len)?);
                    match rec.u32()? {
                        LEASE => leases.push(lease_body(&mut rec)?),
                        t => {
                            return Err(Error::Untrusted(format!(
                                "a message of leases holds a record of type {t}, not a lease"
                            )))
                        }
                    }
                    rec.end()?;
                }
                Message::Leases { leases }
            }
            PINNED => {
                let count = r.count(MAX_SHARES, "a message of", "pins")?;
                let _ = r.u32()?;
                let entries = (0..count).map(|_| Ok((r.u64()?, r.u64()?))).collect::<Result<Vec<_>>>()?;
                Message::Pinned { entries }
            }
            RETURN => {
                let (pool, slot) = (r.u32()?, r.u32()?);
                let _ = r.u32()?;
                Message::Return { pool, slot }
            }
            POOL_CLOSED => Message::PoolClosed { pool: r.u32()? },
            DETACH => Message::Detach { pool: r.u32()? },
            SHARES | KEPT_SHARES | PIN_SHARES => {
                let count = r.count(MAX_SHARES, "a message of", "shares")?;
                let first_lease = r.u64()?;
                if first_lease.checked_add(count as u64).is_none() {
                    return Err(Error::Untrusted("share lease numbers overflow".into()));
                }
                let kept = t == KEPT_SHARES || t == PIN_SHARES;
                let mut entries = Vec::with_capacity(count.min(r.left() / 8)); // (8: len and fds)
                for _ in 0..count {
                    let (len, fds) = (r.u32()? as usize, r.u32()?);
                    if fds as usize > MAX_FDS {
                        return Err(Error::Untrusted(format!("a share with {fds} descriptors")));
                    }
                    let export = if kept { r.u64()? } else { 0 };
                    let offer = if t == PIN_SHARES {
                        Offer { pin: r.u64()?, window_offset: r.u64()?, window_size: r.u64()? }
                    } else {
                        Offer::NONE
                    };
                    entries.push((fds, export, offer, r.bytes(len)?));
                }
                if t == PIN_SHARES {
                    Message::PinShares { first_lease, entries }
                } else if kept {
                    Message::KeptShares {
                        first_lease,
                        entries: entries.into_iter().map(|(f, e, _, h)| (f, e, h)).collect(),
                    }
                } else {
                    Message::Shares { first_lease, entries: entries.into_iter().map(|(f, _, _, h)| (f, h)).collect() }
                }
            }
            RETIRE => Message::Retire { export: r.u64()? },
            NAMES => {
                let count = r.count(MAX_SHARES, "names of", "leases")?;
                let first_lease = r.u64()?;
                if first_lease.checked_add(count as u64).is_none() {
                    return Err(Error::Untrusted("named lease numbers overflow".into()));
                }
                let mut names = Vec::with_capacity(count.min(r.left() / 2)); // (2: a length)
                for _ in 0..count {
                    let len = r.u16()? as usize;
                    names.push(check_name(r.bytes(len)?).map_err(Error::Untrusted)?);
                }
                Message::Names { first_lease, names }
            }
            RING => Message::Ring { capacity: r.u32()?, record: r.u32()? },
            t => return Err(Error::Untrusted(format!("channel message type {t} is unknown"))),
        };
        r.end()?;
        Ok(msg)
    }

    /// [`Self::decode`] of an `ITEM`, without making the message (a ring record's path), its
    /// layout written into `layout`: `None` when `b` is another type of message (or too short
    /// for one), else what `decode` makes of it, field by field.
    pub(crate) fn decode_item(b: &[u8], layout: &mut ItemLayout) -> Option<Result<Item>> {
        let mut r = In::new(b);
        if r.u32().ok()? != ITEM {
            return None;
        }
        Some(item_body(&mut r, layout).and_then(|item| r.end().map(|()| item)))
    }

    /// [`Self::decode_item`], remembering in `memo` what the last `ITEM` decoded to: one whose
    /// bytes after its pool and slot are those of the last one (a pipeline describes every item
    /// alike) takes its layout and event from `memo` instead of being decoded again (decoding
    /// the same bytes again would give the same).
    pub(crate) fn decode_item_memo(b: &[u8], layout: &mut ItemLayout, memo: &mut ItemMemo) -> Option<Result<Item>> {
        if let (Some((l, event)), Some(head), Some(body)) = (&memo.decoded, b.get(..12), b.get(12..)) {
            if head[..4] == ITEM.to_le_bytes() && body == memo.body.as_slice() {
                *layout = *l;
                return Some(Ok((u32::from_le_bytes(at(head, 4)), u32::from_le_bytes(at(head, 8)), *event)));
            }
        }
        let decoded = Self::decode_item(b, layout)?;
        memo.decoded = None;
        if let (Ok(item), Some(body)) = (&decoded, b.get(12..)) {
            memo.body.clear();
            memo.body.extend_from_slice(body);
            memo.decoded = Some((*layout, item.2));
        }
        Some(decoded)
    }

    /// An `ITEM`'s bytes, appended to `buf` (cleared first): what [`Self::encode_into`] makes of
    /// a `Message::Item`, from a layout it does not copy.
    pub(crate) fn encode_item_into(
        pool: u32,
        slot: u32,
        layout: &ItemLayout,
        event: Option<&[u8; DEVSHARE_EVENT_HANDLE_SIZE]>,
        mut buf: Vec<u8>,
    ) -> Vec<u8> {
        buf.clear();
        let mut m = Out(buf);
        item_bytes(&mut m, pool, slot, layout, event);
        m.0
    }
}

/// The longest `ITEM`: 48 bytes of fields, shape and strides, an event handle.
const ITEM_MAX: usize = 48 + 16 * DEVSHARE_MAX_NDIM + DEVSHARE_EVENT_HANDLE_SIZE;

/// An `ITEM`, laid out in one buffer and appended at once (the per-item message).
fn item_bytes(m: &mut Out, pool: u32, slot: u32, l: &ItemLayout, event: Option<&[u8; DEVSHARE_EVENT_HANDLE_SIZE]>) {
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&ITEM.to_le_bytes());
    head[4..8].copy_from_slice(&pool.to_le_bytes());
    head[8..].copy_from_slice(&slot.to_le_bytes());
    let flags = if event.is_some() { ITEM_EVENT } else { 0 };
    layout_bytes(m, &head, l, flags, event);
}

/// The smallest record of a [`LEASES`] message: its length, then a [`LEASE`] (type, export and
/// lease, then a 0-d layout: ndim, dtype and flags, offsets and size).
const LEASE_RECORD_MIN: usize = 4 + 4 + 16 + 12 + 24;

/// The body of a [`LEASE`] (after its type): export, lease, layout, event.
fn lease_body(r: &mut In<'_>) -> Result<LeaseRecord> {
    let (export, lease) = (r.u64()?, r.u64()?);
    let mut layout = ItemLayout::empty();
    let (flags, event) = layout_body(r, &mut layout, ITEM_EVENT | LEASE_EVENT_AGAIN)?;
    if flags & LEASE_EVENT_AGAIN != 0 && event.is_none() {
        return Err(Error::Untrusted("a lease says its event came before but carries none".into()));
    }
    Ok(LeaseRecord { export, lease, layout, event, again: flags & LEASE_EVENT_AGAIN != 0 })
}

/// A `LEASE`: its head, then an `ITEM`'s fields from `ndim` on.
fn lease_bytes(
    m: &mut Out,
    export: u64,
    lease: u64,
    l: &ItemLayout,
    event: Option<&[u8; DEVSHARE_EVENT_HANDLE_SIZE]>,
    again: bool,
) {
    let mut head = [0u8; 20];
    head[..4].copy_from_slice(&LEASE.to_le_bytes());
    head[4..12].copy_from_slice(&export.to_le_bytes());
    head[12..].copy_from_slice(&lease.to_le_bytes());
    let flags = match event {
        Some(_) if again => ITEM_EVENT | LEASE_EVENT_AGAIN,
        Some(_) => ITEM_EVENT,
        None => 0,
    };
    layout_bytes(m, &head, l, flags, event);
}

/// `head` (at most 20 bytes; a fixed size, copied inline), then a layout's fields, `flags` and
/// the event when there is one.
#[inline]
fn layout_bytes<const N: usize>(
    m: &mut Out,
    head: &[u8; N],
    l: &ItemLayout,
    flags: u32,
    event: Option<&[u8; DEVSHARE_EVENT_HANDLE_SIZE]>,
) {
    let mut b = [0u8; ITEM_MAX + 8];
    let n = (l.ndim as usize).min(DEVSHARE_MAX_NDIM);
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        b[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    put(&head[..]);
    put(&l.ndim.to_le_bytes());
    put(&[l.dtype.code, l.dtype.bits]);
    put(&l.dtype.lanes.to_le_bytes());
    put(&flags.to_le_bytes());
    put(&l.storage_offset.to_le_bytes());
    put(&l.storage_size.to_le_bytes());
    put(&l.tensor_offset.to_le_bytes());
    for d in &l.shape[..n] {
        put(&d.to_le_bytes());
    }
    for d in &l.strides[..n] {
        put(&d.to_le_bytes());
    }
    if let Some(e) = event {
        put(e);
    }
    m.bytes(&b[..at]);
}

/// What a [`PIN_SHARES`] entry offers: its export's window (bytes of the allocation) to keep
/// mapped, under the offer's number (`pin` 0: no offer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub pin: u64,
    pub window_offset: u64,
    pub window_size: u64,
}

impl Offer {
    pub(crate) const NONE: Offer = Offer { pin: 0, window_offset: 0, window_size: 0 };
}

/// A pool item's fields but its layout: pool, slot, the producer's event.
pub(crate) type Item = (u32, u32, Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>);

/// The last `ITEM` a consumer decoded ([`Message::decode_item_memo`]): its bytes after pool and
/// slot, and their layout and event.
#[derive(Default)]
pub(crate) struct ItemMemo {
    body: Vec<u8>,
    decoded: Option<(ItemLayout, Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>)>,
}

/// An `ITEM`'s fields after its type, the layout written into `out`. Read in three runs of
/// fixed-size fields, each taken whole (a message too short for a run is refused as it is for
/// the run's first short field: the same error, after the same checks).
#[inline]
fn item_body(r: &mut In<'_>, out: &mut ItemLayout) -> Result<Item> {
    // pool u32, slot u32
    let f: [u8; 8] = r.array()?;
    let (pool, slot) = (u32::from_le_bytes(at(&f, 0)), u32::from_le_bytes(at(&f, 4)));
    let (_, event) = layout_body(r, out, ITEM_EVENT)?;
    Ok((pool, slot, event))
}

fn at<const N: usize>(b: &[u8], i: usize) -> [u8; N] {
    b[i..i + N].try_into().expect("N bytes")
}

/// An `ITEM`'s (or a `LEASE`'s) fields from `ndim` on, the layout written into `out`: its flags
/// (only those of `allowed`) and event.
#[inline]
fn layout_body(
    r: &mut In<'_>,
    out: &mut ItemLayout,
    allowed: u32,
) -> Result<(u32, Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>)> {
    // ndim u32, code u8, bits u8, lanes u16, flags u32
    let f: [u8; 12] = r.array()?;
    let ndim = u32::from_le_bytes(at(&f, 0));
    let (code, bits, lanes) = (f[4], f[5], u16::from_le_bytes(at(&f, 6)));
    let flags = u32::from_le_bytes(at(&f, 8));
    if flags & !allowed != 0 {
        return Err(Error::UnsupportedVersion(format!("pool item flags {flags:#x}")));
    }
    // storage_offset u64, storage_size u64, tensor_offset i64
    let f: [u8; 24] = r.array()?;
    let (storage_offset, storage_size) = (u64::from_le_bytes(at(&f, 0)), u64::from_le_bytes(at(&f, 8)));
    let tensor_offset = i64::from_le_bytes(at(&f, 16));
    if ndim as usize > DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!("a pool item has {ndim} dimensions")));
    }
    let n = ndim as usize;
    let (shape, strides) = (r.bytes(8 * n)?, r.bytes(8 * n)?);
    let event = if flags & ITEM_EVENT != 0 { Some(r.array::<DEVSHARE_EVENT_HANDLE_SIZE>()?) } else { None };
    out.shape = [0; DEVSHARE_MAX_NDIM];
    out.strides = [0; DEVSHARE_MAX_NDIM];
    for (s, b) in out.shape.iter_mut().zip(shape.chunks_exact(8)) {
        *s = i64::from_le_bytes(b.try_into().expect("8 bytes"));
    }
    for (s, b) in out.strides.iter_mut().zip(strides.chunks_exact(8)) {
        *s = i64::from_le_bytes(b.try_into().expect("8 bytes"));
    }
    out.dtype = DevshareDType::new(code, bits, lanes);
    (out.ndim, out.storage_offset, out.storage_size, out.tensor_offset) =
        (ndim, storage_offset, storage_size, tensor_offset);
    Ok((flags, event))
}

/// A peer's words (a refusal's reason) as they may go into an error message: UTF-8 with what is
/// not replaced, control characters (a terminal's escapes, line breaks) and the invisible ones
/// that reorder or hide text (bidirectional overrides, zero-width characters) shown as U+FFFD,
/// at most 512 characters (a peer without the key may send anything here).
pub(crate) fn peer_text(b: &[u8]) -> String {
    let hidden =
        |c: char| matches!(c, '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2069}' | '\u{FEFF}');
    String::from_utf8_lossy(b)
        .chars()
        .take(512)
        .map(|c| if c.is_control() || hidden(c) { '\u{FFFD}' } else { c })
        .collect()
}

/// `b` as a lease's name: UTF-8 without NUL, at most `DEVSHARE_MAX_NAME_LEN` bytes; otherwise
/// why not.
pub(crate) fn check_name(b: &[u8]) -> std::result::Result<&str, String> {
    use crate::channel::limits::DEVSHARE_MAX_NAME_LEN;
    if b.len() > DEVSHARE_MAX_NAME_LEN {
        return Err(format!("a name of {} bytes (at most {DEVSHARE_MAX_NAME_LEN})", b.len()));
    }
    if b.contains(&0) {
        return Err("a name with a NUL byte".into());
    }
    std::str::from_utf8(b).map_err(|e| format!("a name that is not UTF-8 ({e})"))
}

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
    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            Error::Untrusted(format!("a channel message of {} bytes is shorter than its type requires", self.b.len()))
        })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    #[inline]
    pub(crate) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    #[inline]
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    #[inline]
    pub(crate) fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    #[inline]
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    #[inline]
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        self.take(n)
    }
    /// A record count (`u32`) of 1..=`max`, else `Untrusted`: "{before} {count} {noun} (1..=max
    /// are possible)".
    pub(crate) fn count(&mut self, max: usize, before: &str, noun: &str) -> Result<usize> {
        let count = self.u32()? as usize;
        if count == 0 || count > max {
            return Err(Error::Untrusted(format!("{before} {count} {noun} (1..={max} are possible)")));
        }
        Ok(count)
    }
    /// Bytes not read yet.
    pub(crate) fn left(&self) -> usize {
        self.b.len() - self.pos
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
    /// A message of this many bytes that came with a descriptor no honest message carries
    /// (`fds::take_unwanted` took them out; the kind of the first): to be refused (its other
    /// descriptors are in `fds`).
    Refused(usize, &'static str),
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
        // What no honest message carries (a socket, a file that is not shared memory) is taken
        // out and closed on a thread of its own: its close, even its `fstat`, may wait for as
        // long as the sender chose (`fds`).
        let unwanted = crate::fds::take_unwanted(fds);
        if msg.bytes == 0 && !msg.flags.contains(ReturnFlags::CTRUNC) {
            return Ok(Received::Closed);
        }
        if msg.flags.intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC) {
            // The descriptors that came stay in `fds` for the caller to close (a producer does
            // after its lock: closing one can block).
            return Err(Error::Untrusted(format!(
                "a channel message longer than {MAX_MESSAGE} bytes or with more than {MAX_FDS} descriptors was refused"
            )));
        }
        return Ok(match unwanted {
            Some(what) => Received::Refused(msg.bytes, what),
            None => Received::Message(msg.bytes),
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_item_described_as_the_last_one_decodes_from_the_memo_to_what_decoding_gives() {
        let mut shape = [0i64; DEVSHARE_MAX_NDIM];
        shape[0] = 1024;
        let layout = ItemLayout {
            dtype: DevshareDType::new(2, 32, 1),
            ndim: 1,
            shape,
            strides: [0; DEVSHARE_MAX_NDIM],
            storage_offset: 0,
            storage_size: 4096,
            tensor_offset: 0,
        };
        let event = [7u8; DEVSHARE_EVENT_HANDLE_SIZE];
        let mut memo = ItemMemo::default();
        let check = |bytes: &[u8], memo: &mut ItemMemo| {
            let (mut plain, mut memoed) = (ItemLayout::empty(), ItemLayout::empty());
            let want = Message::decode_item(bytes, &mut plain).map(|r| r.map_err(|e| e.status()));
            let got = Message::decode_item_memo(bytes, &mut memoed, memo).map(|r| r.map_err(|e| e.status()));
            assert_eq!(got, want);
            if matches!(want, Some(Ok(_))) {
                assert_eq!(memoed, plain);
            }
        };
        for (pool, slot, ev) in [(1, 0, None), (1, 1, None), (2, 7, None), (2, 7, Some(&event)), (1, 0, None)] {
            let bytes = Message::encode_item_into(pool, slot, &layout, ev, Vec::new());
            check(&bytes, &mut memo); // decoded (a new body) or from the memo (the same one)
            check(&bytes, &mut memo);
            // Other bytes after pool and slot, or too few, or another message: decoded afresh.
            let mut other = bytes.clone();
            other[12] = 9; // ndim 9
            check(&other, &mut memo);
            check(&bytes[..bytes.len() - 1], &mut memo);
            check(&bytes[..8], &mut memo);
            check(&Message::Release { lease: 3 }.encode(), &mut memo);
        }
        // A hit takes pool and slot from its own record, and only an ITEM's record hits.
        let first = Message::encode_item_into(1, 0, &layout, None, Vec::new());
        let second = Message::encode_item_into(3, 5, &layout, None, Vec::new());
        let mut l = ItemLayout::empty();
        assert!(matches!(Message::decode_item_memo(&first, &mut l, &mut memo), Some(Ok((1, 0, None)))));
        assert!(matches!(Message::decode_item_memo(&second, &mut l, &mut memo), Some(Ok((3, 5, None)))));
        let mut not_an_item = second.clone();
        not_an_item[0] ^= 1;
        assert!(Message::decode_item_memo(&not_an_item, &mut l, &mut memo).is_none(), "another type's record");
    }

    fn every_message() -> Vec<Message<'static>> {
        let mut shape = [0i64; DEVSHARE_MAX_NDIM];
        let mut strides = [0i64; DEVSHARE_MAX_NDIM];
        shape[..3].copy_from_slice(&[2, 3, 4]);
        strides[..3].copy_from_slice(&[12, 4, 1]);
        let layout = ItemLayout {
            dtype: DevshareDType::new(2, 32, 1),
            ndim: 3,
            shape,
            strides,
            storage_offset: 64,
            storage_size: 96,
            tensor_offset: 1,
        };
        vec![
            Message::Hello { magic: MAGIC, version: VERSION, features: FEATURE_SHARES, tgid: 4242 },
            Message::Welcome {
                magic: MAGIC,
                version: VERSION,
                features: PRODUCER_RELEASES,
                peer_id: 7,
                producer_pid: 99,
            },
            Message::Refused { reason: b"no" },
            Message::Share { lease: 1 << 40, handle: b"DSH1...." },
            Message::Release { lease: 3 },
            Message::Attach { pool: 2, slot_size: 4096, count: 8, handle: b"handle" },
            Message::Item { pool: 2, slot: 5, layout, event: None },
            Message::Item { pool: 2, slot: 5, layout: ItemLayout { ndim: 0, ..layout }, event: Some([7; 64]) },
            Message::Return { pool: 2, slot: 5 },
            Message::PoolClosed { pool: 2 },
            Message::Detach { pool: 2 },
            Message::Shares { first_lease: 9, entries: vec![(0, &b"DSH1...."[..]), (2, &b"DSH1..+"[..])] },
            Message::Ring { capacity: 1024, record: 256 },
            Message::KeptShares { first_lease: 9, entries: vec![(0, 3, &b"DSH1...."[..]), (2, 0, &b"DSH1..+"[..])] },
            Message::Retire { export: 3 },
            Message::Names { first_lease: 9, names: vec!["model.layers.0.weight", "", "ü"] },
            Message::Releases { leases: vec![3, 9, u64::MAX] },
            Message::PinShares {
                first_lease: 9,
                entries: vec![
                    (1, 3, Offer { pin: 11, window_offset: 64, window_size: 4096 }, &b"DSH1...."[..]),
                    (0, 4, Offer::NONE, &b"DSH1..+"[..]),
                ],
            },
            Message::Pinned { entries: vec![(3, 11), (4, 12)] },
            Message::Lease { export: 3, lease: 1 << 33, layout, event: None, again: false },
            Message::Lease { export: 3, lease: 12, layout, event: Some([5; 64]), again: false },
            Message::Lease {
                export: 3,
                lease: 13,
                layout: ItemLayout { ndim: 0, ..layout },
                event: Some([5; 64]),
                again: true,
            },
            Message::Leases {
                leases: vec![
                    LeaseRecord { export: 3, lease: 14, layout, event: None, again: false },
                    LeaseRecord { export: 4, lease: 15, layout, event: Some([5; 64]), again: true },
                ],
            },
        ]
    }

    #[test]
    fn every_message_round_trips_through_its_bytes() {
        for m in every_message() {
            let b = m.encode();
            let back = Message::decode(&b).unwrap();
            // ndim 0 items carry no dimensions: compare what travels.
            if let (Message::Item { layout: a, .. }, Message::Item { layout: z, .. })
            | (Message::Lease { layout: a, .. }, Message::Lease { layout: z, .. }) = (&m, &back)
            {
                assert_eq!(a.ndim, z.ndim);
                assert_eq!(&a.shape[..a.ndim as usize], &z.shape[..z.ndim as usize]);
            } else {
                assert_eq!(back, m);
            }
        }
    }

    #[test]
    fn short_long_and_unknown_messages_are_refused() {
        for m in every_message() {
            let b = m.encode();
            // Refused, Share and Attach end in bytes of any length; the others have one length.
            if !matches!(m, Message::Refused { .. } | Message::Share { .. } | Message::Attach { .. }) {
                let mut long = b.clone();
                long.push(0);
                assert!(Message::decode(&long).is_err(), "{m:?} with a byte more");
                assert!(Message::decode(&b[..b.len() - 1]).is_err(), "{m:?} cut short");
            }
            assert!(Message::decode(&b[..3]).is_err(), "{m:?}: 3 bytes");
        }
        assert!(Message::decode(&[1, 2]).is_err());
        assert!(Message::decode(&99u32.to_le_bytes()).is_err());
        let mut item = every_message()[6].encode();
        item[12] = 9; // ndim 9
        assert_eq!(Message::decode(&item).unwrap_err().status(), crate::Status::BadNdim);
    }

    #[test]
    fn a_lease_that_says_its_event_came_before_but_carries_none_is_refused() {
        let layout = ItemLayout {
            ndim: 1,
            shape: [4, 0, 0, 0, 0, 0, 0, 0],
            strides: [1, 0, 0, 0, 0, 0, 0, 0],
            ..ItemLayout::empty()
        };
        let mut b = Message::Lease { export: 3, lease: 9, layout, event: None, again: false }.encode();
        // flags sit after type, export, lease, ndim and dtype (4 + 8 + 8 + 4 + 4 bytes)
        b[28..32].copy_from_slice(&LEASE_EVENT_AGAIN.to_le_bytes());
        assert_eq!(Message::decode(&b).unwrap_err().status(), crate::Status::Untrusted);
        b[28..32].copy_from_slice(&8u32.to_le_bytes());
        assert_eq!(Message::decode(&b).unwrap_err().status(), crate::Status::UnsupportedVersion, "an unknown flag");
    }

    #[test]
    fn an_item_decodes_alone_as_it_decodes_as_a_message() {
        for m in every_message() {
            let b = m.encode();
            let mut long = b.clone();
            long.push(0);
            let mut bad_ndim = b.clone();
            if b.len() > 12 {
                bad_ndim[12] = 9;
            }
            for bytes in [&b[..], &b[..b.len() - 1], &long[..], &b[..3], &bad_ndim[..]] {
                let full = Message::decode(bytes);
                let mut layout = ItemLayout::empty();
                layout.shape = [9; DEVSHARE_MAX_NDIM]; // whatever it held before
                match (Message::decode_item(bytes, &mut layout), full) {
                    (None, Ok(Message::Item { .. })) => panic!("{m:?}: an item not taken alone"),
                    (None, _) => assert!(!matches!(m, Message::Item { .. }) || bytes.len() < 4),
                    (Some(Ok((pool, slot, event))), Ok(full)) => {
                        assert_eq!(full, Message::Item { pool, slot, layout, event })
                    }
                    (Some(Err(a)), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                    (alone, full) => panic!("{m:?}: alone {alone:?}, as a message {full:?}"),
                }
            }
        }
    }

    /// A `LEASES` whose one record is a `LEASES` whose one record is ... as deep as a whole
    /// message allows (16 bytes a level: about 8,000 levels), around one good `LEASE`.
    fn nested_leases() -> Vec<u8> {
        let layout = ItemLayout { ndim: 1, shape: [4, 0, 0, 0, 0, 0, 0, 0], ..ItemLayout::empty() };
        let mut m = Message::Lease { export: 3, lease: 1, layout, event: None, again: false }.encode();
        while m.len() + 16 <= MAX_MESSAGE {
            m = le(&[&LEASES.to_le_bytes(), &1u32.to_le_bytes(), &[0; 4], &(m.len() as u32).to_le_bytes(), &m]);
        }
        m
    }

    #[test]
    fn leases_nested_in_leases_are_refused_at_the_first_level_without_recursion() {
        let m = nested_leases();
        assert!(m.len() > MAX_MESSAGE - 16, "{} bytes", m.len());
        // On a small stack: a decode that recursed into each record (as 1.15.0 did) overflows
        // it and aborts the process, whichever side read the message.
        let e = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || Message::decode(&m).map(|_| ()))
            .unwrap()
            .join()
            .unwrap()
            .unwrap_err();
        assert_eq!(e.status(), crate::Status::Untrusted);
        assert!(e.to_string().contains("a record of type 20, not a lease"), "{e}");
        // A record that is a lease with bytes after it: refused too.
        let layout = ItemLayout { ndim: 1, shape: [4, 0, 0, 0, 0, 0, 0, 0], ..ItemLayout::empty() };
        let mut lease = Message::Lease { export: 3, lease: 1, layout, event: None, again: false }.encode();
        lease.extend_from_slice(&[0; 8]);
        let m = le(&[&LEASES.to_le_bytes(), &1u32.to_le_bytes(), &[0; 4], &(lease.len() as u32).to_le_bytes(), &lease]);
        assert!(Message::decode(&m).unwrap_err().to_string().contains("8 bytes more"));
    }

    #[test]
    fn a_leases_message_is_filled_to_its_bounds_and_lies_about_its_leases_are_refused() {
        let layout = ItemLayout {
            ndim: 1,
            shape: [4, 0, 0, 0, 0, 0, 0, 0],
            strides: [1, 0, 0, 0, 0, 0, 0, 0],
            ..ItemLayout::empty()
        };
        let lease = |n: u64| Message::Lease { export: 3, lease: n, layout, event: None, again: false }.encode();
        // Filled lease by lease: what it holds is what Message::Leases encodes, and it stops at
        // MAX_MESSAGE bytes.
        let mut out = LeasesOut::new();
        assert!(out.is_empty());
        let mut n = 0;
        while out.push(&lease(n)) {
            n += 1;
        }
        assert!(n > 1000 && n < MAX_SHARES as u64, "{n} leases of {} bytes", lease(0).len());
        let b = out.finish();
        assert!(b.len() <= MAX_MESSAGE);
        let Message::Leases { leases } = Message::decode(&b).unwrap() else { panic!("not LEASES") };
        assert_eq!(leases.len() as u64, n);
        assert!(leases.iter().enumerate().all(|(i, l)| l.lease == i as u64 && l.export == 3));
        // Lies: no lease, more leases than it holds, a length past its end, and a record that
        // is not a lease (an ITEM).
        let ok =
            Message::Leases { leases: vec![LeaseRecord { export: 3, lease: 1, layout, event: None, again: false }] }
                .encode();
        assert!(Message::decode(&ok).is_ok());
        let mut zero = ok.clone();
        zero[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(Message::decode(&zero).unwrap_err().status(), crate::Status::Untrusted, "0 leases");
        let mut more = ok.clone();
        more[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert!(Message::decode(&more).is_err(), "a count above the leases");
        let mut long = ok.clone();
        long[12..16].copy_from_slice(&1000u32.to_le_bytes());
        assert!(Message::decode(&long).is_err(), "a length beyond the message");
        let item = Message::Item { pool: 1, slot: 0, layout, event: None }.encode();
        let mut not_lease = le(&[&LEASES.to_le_bytes(), &1u32.to_le_bytes(), &[0; 4]]);
        not_lease.extend_from_slice(&(item.len() as u32).to_le_bytes());
        not_lease.extend_from_slice(&item);
        let e = Message::decode(&not_lease).unwrap_err();
        assert_eq!(e.status(), crate::Status::Untrusted);
        assert!(e.to_string().contains("not a lease"), "{e}");
    }

    fn le(parts: &[&[u8]]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn shares_messages_that_lie_about_their_counts_are_refused() {
        let ok = Message::Shares { first_lease: 1, entries: vec![(1, &b"abc"[..])] }.encode();
        assert!(Message::decode(&ok).is_ok());
        let mut zero = ok.clone();
        zero[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(Message::decode(&zero).is_err(), "0 shares");
        let mut more = ok.clone();
        more[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert!(Message::decode(&more).is_err(), "a count above the entries");
        let mut long = ok.clone();
        long[16..20].copy_from_slice(&4u32.to_le_bytes());
        assert!(Message::decode(&long).is_err(), "a length beyond the message");
        let mut fds = ok.clone();
        fds[20..24].copy_from_slice(&1000u32.to_le_bytes());
        assert!(Message::decode(&fds).is_err(), "more descriptors than a message carries");
        let mut wrap = ok;
        wrap[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Message::decode(&wrap).is_err(), "lease numbers that overflow");
    }

    #[test]
    fn names_that_are_too_long_not_utf8_hold_a_nul_or_lie_about_their_count_are_refused() {
        let names = |first_lease: u64, raw: &[&[u8]]| {
            let mut m = Out::new(NAMES);
            m.u32(raw.len() as u32).u64(first_lease);
            for n in raw {
                m.u16(n.len() as u16).bytes(n);
            }
            m.0
        };
        assert!(Message::decode(&names(1, &[b"a", b""])).is_ok());
        let longest = vec![b'x'; crate::channel::limits::DEVSHARE_MAX_NAME_LEN];
        assert!(Message::decode(&names(1, &[&longest])).is_ok());
        let too_long = vec![b'x'; crate::channel::limits::DEVSHARE_MAX_NAME_LEN + 1];
        for (what, bad) in [
            ("too long", names(1, &[&too_long])),
            ("not UTF-8", names(1, &[b"\xff\xfe"])),
            ("a NUL", names(1, &[b"a\0b"])),
            ("no names", names(1, &[])),
            ("lease numbers that overflow", names(u64::MAX, &[b"a"])),
        ] {
            let e = Message::decode(&bad).unwrap_err();
            assert_eq!(e.status(), crate::Status::Untrusted, "{what}: {e}");
        }
        let mut more = names(1, &[b"a"]);
        more[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert!(Message::decode(&more).is_err(), "a count above the names");
    }

    #[test]
    fn the_bytes_are_the_documented_layout() {
        // HELLO: type 1, magic, version, 0, tgid.
        let h = Message::Hello { magic: MAGIC, version: 1, features: 0, tgid: 5 }.encode();
        assert_eq!(h, [&1u32.to_le_bytes()[..], b"DSCH", &1u16.to_le_bytes(), &[0, 0], &5i32.to_le_bytes()].concat());
        // RETURN: type 8, pool, slot, 0.
        let r = Message::Return { pool: 3, slot: 4 }.encode();
        assert_eq!(r, [8u32, 3, 4, 0].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>());
    }

    #[test]
    fn a_peers_words_lose_their_control_characters_and_stop_at_512_characters() {
        assert_eq!(peer_text(b"no room\x1b[2J\nnext"), "no room\u{FFFD}[2J\u{FFFD}next");
        assert_eq!(peer_text(&[b'x'; 5000]).len(), 512);
        assert_eq!(peer_text(b"caf\xc3\xa9 \xff"), "caf\u{e9} \u{FFFD}");
        assert_eq!(peer_text("a\u{202E}b\u{200B}c".as_bytes()), "a\u{FFFD}b\u{FFFD}c", "bidi and zero-width");
    }
}
