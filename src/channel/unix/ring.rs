//! The shared-memory fast path of pool items: one ring of items (producer -> consumer) and one of
//! returns (consumer -> producer) per connected peer, in a sealed memfd the producer creates and
//! passes with a `RING` message, and two eventfds that wake a side only while it sleeps.
//!
//! The socket keeps everything else — the handshake, credentials, descriptors, shares, the
//! pools' `ATTACH` and `POOL_CLOSED`, pin offers and `RETIRE`, death detection — so the crash and
//! trust guarantees do not depend on the ring. What travels in it is exactly what the socket's
//! `ITEM`, `LEASE` (a lease of a pinned export), `RETURN` and `RELEASE` carry — a release as two
//! return words, [`LEASE_WORD`] and the lease, and only to a producer that reads them — and
//! each side checks it the same way:
//!
//! - Each side keeps the index it advances (the producer's item tail and return head, the
//!   consumer's item head and return tail) in its own memory and only publishes it; an index it
//!   reads from the other side is refused unless it lies within one ring's capacity of its own
//!   (a peer that breaks that rule has broken the ring: the producer disconnects it, the
//!   consumer stops receiving with `UNTRUSTED`).
//! - A record is copied out of shared memory before it is read and then decoded and checked
//!   like a socket message (an item's slot and bytes against the attached pool; a return
//!   against the producer's own record of which peer holds which slot), so a peer writing into
//!   the ring while it is read only ever produces a refused record, never an out-of-bounds
//!   access or a slot freed twice.
//! - Order. Every item record carries the number of socket messages the producer had sent the
//!   peer before it; the consumer takes a record only once it has received that many, and
//!   takes the records that precede a socket message before the message. Items, shares,
//!   attachments and pool closes therefore arrive in the order they were sent, whichever way
//!   each went (a full ring sends the item over the socket instead).
//! - Wake-ups. Each direction has a `pending` word and an eventfd (registered edge-triggered in
//!   the receiver's epoll set, never read: every write is an edge). The sender publishes its
//!   index, then sets `pending`; only when it was clear does it write the eventfd (one system
//!   call). The receiver clears `pending`, looks at the ring once more, and only then sleeps —
//!   so a side that is awake or spinning costs its peer no system call, and no record is left
//!   without a wake-up.
//! - A wake-up never blocks. Both sides hold each eventfd's one open file description, so
//!   either could clear its `O_NONBLOCK` and fill its counter, and a write of 1 would then
//!   block its writer (holding the channel's lock, or in a release) until the other side read
//!   it. The producer creates both eventfds with a count of 1 and every wake-up writes 0: a
//!   write of 0 never blocks, whatever the flags and the count, and while the count is above 0
//!   (nothing here ever reads it) it is an edge in the epoll sets like any other write. A peer
//!   that reads an eventfd down to 0 only loses the wake-ups meant for itself (the producer's
//!   for returns, the consumer's for items). Consumers from 1.16 on announce this ring
//!   ([`wire::FEATURE_RING_PRIMED`]) instead of the old one, so a producer before 1.16, whose
//!   eventfds start at 0, sends them none (their items take the socket).
//! - Put-off returns. A producer that waits with a timer (it looks at its rings again within
//!   5 ms) publishes the CPU it armed on. A consumer running on that CPU with more items
//!   waiting in the ring puts the return's wake-up off until it sleeps or finds nothing
//!   ([`ConsumerRing::pay_owed`]): woken at once, the producer would only take this CPU from
//!   the consumer for one return at a time. Between two CPUs every return wakes at once.
//! - Handing the CPU over. Each side publishes the CPU it runs on (`P_HERE` when the producer
//!   arms or yields and with every 16th item, `C_HERE` when the consumer wakes or yields and
//!   with every 16th return; a store only when the CPU changed). A side about to sleep (a
//!   producer's acquire that found no free slot or its wait for a lease's return, a
//!   consumer's receive that found no item) whose peer is awake on this same CPU first yields
//!   the CPU to it (`sched_yield`), once per wait, then looks again, and only then arms and
//!   sleeps. Awake: a consumer whose `pending` word is set (it clears the word only to sleep);
//!   a producer that says so in `P_AWAKE` (it says "asleep" just before it sleeps in a wait,
//!   "awake" once out of it, the last of its threads to start or end a wait speaking for it:
//!   its `pending` word cannot tell, as a wait arms the rings on its way out for
//!   `Channel.service`'s callers; a producer before 1.18 writes no such word, and its
//!   `pending` word is taken instead). On one CPU the peer is then ready to run, and does so
//!   without a wake-up: the producer sends a
//!   batch of items to a consumer that never slept (no eventfd write), the consumer returns
//!   the slots to a producer that never slept, and each handoff is one yield instead of an
//!   eventfd write, a wake-up and an `epoll_wait`. The words only decide whether a side yields
//!   once before it sleeps, so a peer that writes them falsely costs the other side at most one
//!   `sched_yield` per wait and never a missed wake-up (the arm, the look and the sleep are
//!   unchanged), but that yield may give the CPU to another thread ready to run there for the
//!   rest of its time slice: a wait with less than [`YIELD_LEFT`] to go does not yield, and a
//!   yield that took long pauses the side's yields (`spin.rs`, `YieldGuard`). A
//!   side's word is only as fresh as its last item, return, wait or yield: one that moved to
//!   another CPU since, while still awake, may be yielded to once per wait in vain. The price: what the
//!   peer sends while this side is between its yield and its next look is not announced by a
//!   wake-up (this side never slept), so it is taken when the scheduler runs this side again,
//!   at the latest when the peer blocks or its time slice ends, where a wake-up might have
//!   preempted the peer at once.
//!
//! Any pool's items travel here (host or device: a record holds an `ITEM` with its 64-byte
//! event handle); what the consumer then maps or waits for is decided as for a socket `ITEM`.

use crate::channel::wire;
use crate::error::{Error, Result};
use crate::shm::Map;
use rustix::event::{eventfd, EventfdFlags};
use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, FileType, MemfdFlags, SealFlags};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Records per ring (items, and returns likewise). A full item ring sends over the socket; a
/// full return ring likewise; nothing waits for room.
pub(crate) const CAPACITY: u32 = 1024;
/// Bytes per item record: `socket messages before it u64, length u32, 0 u32`, then the bytes of
/// an `ITEM` message (at most `RECORD - 16`).
pub(crate) const RECORD: u32 = 256;
/// The largest `ITEM` message a record holds.
pub(crate) const MAX_ITEM: usize = RECORD as usize - 16;
/// "DSRING01": the first word of a ring's memory.
const MAGIC: u64 = u64::from_le_bytes(*b"DSRING01");
const HEADER: usize = 4096;
// Header words, one cache line each (who writes them in brackets).
const ITEM_TAIL: usize = 64; // [producer]
const ITEM_HEAD: usize = 128; // [consumer]
const C_PENDING: usize = 192; // [both] the consumer has a wake-up coming (or is awake)
const RET_TAIL: usize = 256; // [consumer]
const RET_HEAD: usize = 320; // [producer]
const P_PENDING: usize = 384; // [both]
const P_CPU: usize = 448; // [producer] the CPU it armed the ring on, plus one, when it may wait for a return (0: wake it at once)
const P_HERE: usize = 512; // [producer] the CPU it last sent, armed or yielded on, plus one (see "Handing the CPU over")
const C_HERE: usize = 576; // [consumer] likewise
const P_AWAKE: usize = 640; // [producer] AWAKE or ASLEEP (in its wait): as its last thread to start or end a wait said; 0 from a producer before 1.18

/// A side refreshes its CPU word with every this many items sent or slots returned (and
/// whenever it arms, wakes or yields): often enough to follow a side the scheduler moved,
/// rarely enough to cost nothing per item where `sched_getcpu` is a system call.
const REFRESH_EVERY: u64 = 16;

/// A wait with less time left than this does not yield the CPU (a yield may cost the rest of
/// another thread's time slice).
pub(crate) const YIELD_LEFT: std::time::Duration = std::time::Duration::from_millis(5);

/// `P_AWAKE`: the producer runs (it is not asleep in one of its waits), or it sleeps in one. A
/// producer's wait leaves its rings armed on the way out (`Channel.service`'s callers are woken
/// for the next return), so `P_PENDING` alone cannot say whether it is awake. The word is the
/// last that any of its threads wrote: with several threads serving one channel it speaks for
/// the last to start or end a wait, and a producer idle in its own event loop (outside the
/// library's waits) reads as awake. It only decides whether the consumer yields or polls once
/// per wait (bounded as for any peer, spin.rs); the arm, the look and the sleep do not read it.
const AWAKE: u64 = 1;
const ASLEEP: u64 = 2;

/// The bit of a consumer's own return tail that says a thread is writing a return (the tail
/// counts returns: it never reaches 2^63).
const RET_BUSY: u64 = 1 << 63;

/// The size of a ring's memory for `capacity` records each way.
fn ring_size(capacity: u32) -> usize {
    HEADER + capacity as usize * (RECORD as usize + 8)
}

fn os(call: &str, e: rustix::io::Errno) -> Error {
    wire::os(call, e)
}

/// The CPU this thread runs on, plus one (0: unknown).
fn cpu_plus_one() -> u64 {
    // SAFETY: sched_getcpu takes nothing and only returns a number (or -1).
    let cpu = unsafe { libc::sched_getcpu() };
    u64::try_from(cpu).map_or(0, |c| c + 1)
}

/// Wake the side whose epoll set holds the eventfd: a write of 0, which never blocks (see the
/// module's "A wake-up never blocks") and is an edge while the count is above 0, as the
/// producer created it. A bad descriptor only loses a wake-up of a peer that broke it itself.
fn wake(fd: BorrowedFd<'_>) {
    let _ = rustix::io::write(fd, &0u64.to_ne_bytes());
}

/// Set the other side's `pending` word and wake it when it was clear (it armed before
/// sleeping). A word already set is only read: a side that is awake costs no locked write. (The
/// index published before this with `SeqCst` and the sleeper's `SeqCst` clear-then-look make the
/// plain read as safe as the swap: a clear that this read missed comes after the index in the
/// one order of `SeqCst` operations, so the sleeper's look after it sees the record.)
fn wake_unless_pending(pending: &AtomicU64, fd: BorrowedFd<'_>) {
    if pending.load(Ordering::SeqCst) == 0 && pending.swap(1, Ordering::SeqCst) == 0 {
        wake(fd);
    }
}

/// Say in `here` which CPU this thread runs on (a store only when it changed: the word is
/// read by the other side on every wait).
fn publish_cpu(here: &AtomicU64) {
    let cpu = cpu_plus_one();
    if here.load(Ordering::Relaxed) != cpu {
        here.store(cpu, Ordering::Relaxed);
    }
}

/// Whether the other side of a ring is `awake` and said it runs on
/// this thread's CPU (`same`) or on another (its `here` word); if so, this side's CPU is
/// published in `mine` first, and the caller yields ([`yield_cpu`]: the same CPU, "Handing the
/// CPU over") or may poll before it sleeps (another CPU, `spin.rs`).
fn awake_on(same: bool, awake: impl FnOnce() -> bool, here: &AtomicU64, mine: &AtomicU64) -> bool {
    let cpu = cpu_plus_one();
    if cpu == 0 || !awake() {
        return false;
    }
    let theirs = here.load(Ordering::Relaxed);
    if theirs == 0 || (theirs == cpu) != same {
        return false;
    }
    mine.store(cpu, Ordering::Relaxed);
    true
}

/// Give the CPU to another thread that is ready to run on it (a no-op when none is).
pub(crate) fn yield_cpu() {
    // SAFETY: sched_yield takes nothing and only returns a status.
    unsafe { libc::sched_yield() };
}

struct Shared {
    map: Map,
    capacity: u32,
    /// `capacity - 1` when `capacity` is a power of two (every ring this library makes): an
    /// index's place is then a mask, not a division (tens of cycles, four per item); 0 else.
    mask: u64,
}

impl Shared {
    fn new(map: Map, capacity: u32) -> Shared {
        let mask = if capacity.is_power_of_two() { u64::from(capacity) - 1 } else { 0 };
        Shared { map, capacity, mask }
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        self.map.atomic_u64(offset)
    }

    /// The place of `index` in the ring: `index % capacity`.
    fn place(&self, index: u64) -> usize {
        (if self.mask != 0 { index & self.mask } else { index % u64::from(self.capacity) }) as usize
    }

    fn record(&self, index: u64) -> *mut u8 {
        let i = self.place(index);
        // SAFETY: i < capacity and the map holds capacity records after the header.
        unsafe { self.map.ptr().add(HEADER + i * RECORD as usize) }
    }

    fn ret(&self, index: u64) -> &AtomicU64 {
        let i = self.place(index);
        self.word(HEADER + self.capacity as usize * RECORD as usize + i * 8)
    }

    /// Whether `theirs`, an index the other side published, is within one ring of `ours` in the
    /// direction it must be (`ahead`: theirs is ahead of ours, as a tail is of a head).
    fn plausible(&self, ours: u64, theirs: u64, ahead: bool) -> bool {
        let d = if ahead { theirs.wrapping_sub(ours) } else { ours.wrapping_sub(theirs) };
        d <= u64::from(self.capacity)
    }
}

/// The producer's side of one peer's ring.
pub(crate) struct ProducerRing {
    shared: Shared,
    memfd: OwnedFd,
    /// Written by the producer to wake the consumer.
    c_efd: OwnedFd,
    /// Written by the consumer to wake the producer; in the channel's epoll set.
    p_efd: OwnedFd,
    tail: u64,
    ret_head: u64,
}

impl ProducerRing {
    pub(crate) fn create() -> Result<ProducerRing> {
        let size = ring_size(CAPACITY);
        let memfd = memfd_create("devshare-ring", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| os("memfd_create", e))?;
        ftruncate(&memfd, size as u64).map_err(|e| os("ftruncate of a ring memfd", e))?;
        fcntl_add_seals(&memfd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| os("fcntl(F_ADD_SEALS)", e))?;
        let map = Map::new(&memfd, size, true, "a channel ring")?;
        let shared = Shared::new(map, CAPACITY);
        shared.word(0).store(MAGIC, Ordering::Relaxed);
        shared.word(P_AWAKE).store(AWAKE, Ordering::Relaxed);
        // A count of 1 from the start: every wake-up is a write of 0 (see `wake`).
        let flags = EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK;
        let c_efd = eventfd(1, flags).map_err(|e| os("eventfd", e))?;
        let p_efd = eventfd(1, flags).map_err(|e| os("eventfd", e))?;
        Ok(ProducerRing { shared, memfd, c_efd, p_efd, tail: 0, ret_head: 0 })
    }

    /// The descriptors the `RING` message carries: the memory, the consumer's and the
    /// producer's eventfd.
    pub(crate) fn fds(&self) -> [BorrowedFd<'_>; 3] {
        [self.memfd.as_fd(), self.c_efd.as_fd(), self.p_efd.as_fd()]
    }

    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.p_efd.as_fd()
    }

    /// Put an `ITEM` message in the ring, after `socket_messages` socket messages to the peer.
    /// `Ok(false)`: the ring is full (send it over the socket); `Err`: the consumer published
    /// an impossible head.
    pub(crate) fn push_item(&mut self, socket_messages: u64, item: &[u8]) -> Result<bool> {
        debug_assert!(item.len() <= MAX_ITEM);
        let s = &self.shared;
        let head = s.word(ITEM_HEAD).load(Ordering::Acquire);
        if !s.plausible(self.tail, head, false) {
            return Err(Error::Untrusted(format!(
                "the consumer's ring head {head} is not within {} records behind the tail {}",
                s.capacity, self.tail
            )));
        }
        if self.tail.wrapping_sub(head) == u64::from(s.capacity) {
            return Ok(false);
        }
        let rec = s.record(self.tail).cast::<u64>();
        // SAFETY: the record holds RECORD bytes (2 + MAX_ITEM / 8 words); 8-aligned (the map is
        // page-aligned).
        let put = |i: usize, w: u64| unsafe { std::ptr::write_volatile(rec.add(i), w) };
        put(0, socket_messages);
        put(1, item.len() as u64);
        // Whole words, then the last partial one zero-padded (no call to copy a chunk).
        let words = item.chunks_exact(8);
        let rest = words.remainder();
        let mut i = 2;
        for w in words {
            put(i, u64::from_le_bytes(w.try_into().expect("8 bytes")));
            i += 1;
        }
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            put(i, u64::from_le_bytes(w));
        }
        self.tail = self.tail.wrapping_add(1);
        s.word(ITEM_TAIL).store(self.tail, Ordering::SeqCst);
        if self.tail % REFRESH_EVERY == 0 {
            publish_cpu(s.word(P_HERE));
        }
        wake_unless_pending(s.word(C_PENDING), self.c_efd.as_fd());
        Ok(true)
    }

    /// About to sleep (or to report the channel idle): the next return wakes the producer;
    /// `patient`: the producer looks at the ring again within 5 ms by itself, so a consumer
    /// on this CPU may put that wake-up off (see the module's "put-off returns").
    pub(crate) fn arm(&self, patient: bool) {
        let here = cpu_plus_one();
        self.shared.word(P_HERE).store(here, Ordering::Relaxed);
        self.shared.word(P_CPU).store(if patient { here } else { 0 }, Ordering::Relaxed);
        self.shared.word(P_PENDING).store(0, Ordering::SeqCst);
    }

    /// Say whether the producer is about to sleep in its wait (`true`) or has left it, for the
    /// consumer's choice to poll for the next item or to yield to the producer
    /// ([`ConsumerRing::producer_awake_on`]). A store only when it changed.
    pub(crate) fn asleep(&self, yes: bool) {
        let w = self.shared.word(P_AWAKE);
        let v = if yes { ASLEEP } else { AWAKE };
        if w.load(Ordering::Relaxed) != v {
            w.store(v, Ordering::SeqCst);
        }
    }

    /// About to wait for a return: whether the consumer is awake on this CPU (`same`: the
    /// producer yields it the CPU first, [`yield_cpu`], without the channel's lock; see the
    /// module's "Handing the CPU over") or on another (the producer may poll for its return
    /// before it sleeps, `spin.rs`).
    pub(crate) fn consumer_awake_on(&self, same: bool) -> bool {
        let s = &self.shared;
        // A consumer arms its ring only when it is about to sleep: `pending` says it.
        awake_on(same, || s.word(C_PENDING).load(Ordering::SeqCst) != 0, s.word(C_HERE), s.word(P_HERE))
    }

    /// Take up to one ring's worth of returns, each given to `f` in order.
    /// `Err`: the consumer published an impossible tail.
    pub(crate) fn take_returns(&mut self, mut f: impl FnMut(Returned)) -> Result<usize> {
        let s = &self.shared;
        let tail = s.word(RET_TAIL).load(Ordering::SeqCst);
        if !s.plausible(self.ret_head, tail, true) {
            return Err(Error::Untrusted(format!(
                "the consumer's return tail {tail} is not within {} records ahead of the head {}",
                s.capacity, self.ret_head
            )));
        }
        let n = tail.wrapping_sub(self.ret_head) as usize;
        let mut i = 0;
        while i < n {
            let w = s.ret(self.ret_head).load(Ordering::Relaxed);
            self.ret_head = self.ret_head.wrapping_add(1);
            i += 1;
            if w != LEASE_WORD {
                f(Returned::Slot(w as u32, (w >> 32) as u32));
            } else if i < n {
                let lease = s.ret(self.ret_head).load(Ordering::Relaxed);
                self.ret_head = self.ret_head.wrapping_add(1);
                i += 1;
                f(Returned::Lease(lease));
            } else {
                // A consumer publishes a release's two words at once: this one broke the rule.
                f(Returned::Torn);
            }
        }
        if n > 0 {
            s.word(RET_HEAD).store(self.ret_head, Ordering::Release);
        }
        Ok(n)
    }
}

/// What a consumer gave back through the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Returned {
    /// A pool's slot: `(pool, slot)`.
    Slot(u32, u32),
    /// A lease (what a `RELEASE` gives back).
    Lease(u64),
    /// A lease's first word as the last published one: not a return.
    Torn,
}

/// The return word that says the next word is a lease given back (no pool has id 0). Only to
/// producers that read them (`wire::PRODUCER_PINS`).
const LEASE_WORD: u64 = 0;

/// A record copied out of the ring: the socket messages that precede it, and an `ITEM`.
pub(crate) struct ItemRecord {
    pub socket_messages: u64,
    len: usize,
    bytes: [u8; MAX_ITEM],
}

impl ItemRecord {
    /// An empty record, to copy records into ([`ConsumerRing::copy`]).
    pub(crate) fn new() -> ItemRecord {
        ItemRecord { socket_messages: 0, len: 0, bytes: [0; MAX_ITEM] }
    }

    pub(crate) fn item(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The consumer's side of the ring.
pub(crate) struct ConsumerRing {
    shared: Shared,
    c_efd: OwnedFd,
    p_efd: OwnedFd,
    /// This consumer's return tail, and [`RET_BUSY`] while a thread writes a return (returns
    /// may be written from any thread; one at a time, the others go over the socket).
    ret_tail: AtomicU64,
    /// A return whose wake-up was put off ([`Self::push_return`]), until [`Self::pay_owed`].
    owed: AtomicBool,
    /// Returns wake the producer at once: an event loop polls this consumer's descriptor and
    /// may never sleep in a receive, where a put-off wake-up is paid.
    prompt: AtomicBool,
}

impl ConsumerRing {
    /// Map a ring a producer sent (`capacity` and `record` from its `RING` message): a sealed
    /// memfd of exactly the size they give, and two eventfds.
    pub(crate) fn open(capacity: u32, record: u32, fds: Vec<OwnedFd>) -> Result<ConsumerRing> {
        if record != RECORD || capacity == 0 || capacity > 65536 {
            return Err(Error::Untrusted(format!(
                "a ring of {capacity} records of {record} bytes (this library reads 1..=65536 records of {RECORD})"
            )));
        }
        let [memfd, c_efd, p_efd]: [OwnedFd; 3] = fds.try_into().map_err(|f: Vec<OwnedFd>| {
            Error::Untrusted(format!("a ring came with {} descriptors instead of 3", f.len()))
        })?;
        let size = ring_size(capacity);
        let refused = || {
            Err(Error::Untrusted(format!(
                "a ring's memory is not a tmpfs memfd of {size} bytes sealed against shrinking and growing"
            )))
        };
        // The seals first: only shared memory has them, and its `fstat` never leaves this kernel.
        let seals = fcntl_get_seals(&memfd).unwrap_or(SealFlags::empty());
        // (A hugetlbfs memfd has seals too: the receive's screen, `fds::kind`, refused it.)
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return refused();
        }
        let st = fstat(&memfd).map_err(|e| os("fstat of a ring memfd", e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile
            || u64::try_from(st.st_size).ok() != Some(size as u64)
        {
            return refused();
        }
        for fd in [&c_efd, &p_efd] {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            if link.as_ref().is_ok_and(|l| l.as_os_str() != "anon_inode:[eventfd]") {
                return Err(Error::Untrusted(format!("a ring's wake-up descriptor is {link:?}, not an eventfd")));
            }
            let fl = rustix::fs::fcntl_getfl(fd).map_err(|e| os("fcntl(F_GETFL)", e))?;
            rustix::fs::fcntl_setfl(fd, fl | rustix::fs::OFlags::NONBLOCK).map_err(|e| os("fcntl(F_SETFL)", e))?;
        }
        let map = Map::new(&memfd, size, true, "a channel ring")?;
        let shared = Shared::new(map, capacity);
        if shared.word(0).load(Ordering::Relaxed) != MAGIC {
            return Err(Error::Untrusted("a ring's memory does not start with its magic".into()));
        }
        Ok(ConsumerRing {
            shared,
            c_efd,
            p_efd,
            ret_tail: AtomicU64::new(0),
            owed: AtomicBool::new(false),
            prompt: AtomicBool::new(false),
        })
    }

    /// The eventfd that wakes this consumer (edge-triggered in its epoll set).
    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.c_efd.as_fd()
    }

    /// Records the ring holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.shared.capacity
    }

    /// Wake this consumer's own epoll set (an item is waiting that no wake-up announced).
    pub(crate) fn wake_self(&self) {
        wake(self.c_efd.as_fd());
    }

    /// About to wait for an item: whether the producer is awake on this CPU (`same`: the
    /// consumer yields it the CPU first, [`yield_cpu`], without the connection's lock; see the
    /// module's "Handing the CPU over") or on another (the consumer may poll for the item
    /// before it sleeps, `spin.rs`).
    pub(crate) fn producer_awake_on(&self, same: bool) -> bool {
        let s = &self.shared;
        let awake = || match s.word(P_AWAKE).load(Ordering::SeqCst) {
            AWAKE => true,
            ASLEEP => false,
            // A producer before 1.18: its `pending` word is the best guess.
            _ => s.word(P_PENDING).load(Ordering::SeqCst) != 0,
        };
        awake_on(same, awake, s.word(P_HERE), s.word(C_HERE))
    }

    /// Woken (or about to look without sleeping): say which CPU this consumer runs on, so
    /// that a producer on the same one may hand it the CPU.
    pub(crate) fn here(&self) {
        publish_cpu(self.shared.word(C_HERE));
    }

    /// About to sleep: the producer's next item wakes this consumer.
    pub(crate) fn arm(&self) {
        self.shared.word(C_PENDING).store(0, Ordering::SeqCst);
    }

    /// Whether a record is waiting after `head`. `Err`: the producer published an impossible
    /// tail.
    pub(crate) fn waiting(&self, head: u64) -> Result<bool> {
        let tail = self.shared.word(ITEM_TAIL).load(Ordering::SeqCst);
        if !self.shared.plausible(head, tail, true) {
            return Err(Error::Untrusted(format!(
                "the producer's ring tail {tail} is not within {} records ahead of the head {head}",
                self.shared.capacity
            )));
        }
        Ok(tail != head)
    }

    /// The record at `head`, copied, when one is waiting; not taken until [`Self::advance`].
    pub(crate) fn peek(&self, head: u64) -> Result<Option<ItemRecord>> {
        let mut rec = ItemRecord::new();
        Ok(self.copy(head, &mut rec)?.then_some(rec))
    }

    /// [`Self::peek`] into `rec` (the receive path's own record, not moved on the way): whether
    /// a record was waiting (and is now in `rec`).
    pub(crate) fn copy(&self, head: u64, rec: &mut ItemRecord) -> Result<bool> {
        if !self.waiting(head)? {
            return Ok(false);
        }
        let at = self.shared.record(head).cast::<u64>();
        // SAFETY: the record holds RECORD bytes, 8-aligned.
        let word = |i: usize| unsafe { std::ptr::read_volatile(at.add(i)) };
        let (socket_messages, len) = (word(0), word(1));
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= MAX_ITEM)
            .ok_or_else(|| Error::Untrusted(format!("a ring record of {len} bytes (at most {MAX_ITEM})")))?;
        // Each word read once, whole words only (MAX_ITEM is a multiple of 8).
        for (i, chunk) in rec.bytes[..len.div_ceil(8) * 8].chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&word(2 + i).to_le_bytes());
        }
        rec.socket_messages = socket_messages;
        rec.len = len;
        Ok(true)
    }

    /// Take the record at `head` (the new head is `head + 1`).
    pub(crate) fn advance(&self, head: u64) -> u64 {
        let h = head.wrapping_add(1);
        self.shared.word(ITEM_HEAD).store(h, Ordering::Release);
        h
    }

    /// Return a slot through the ring; false when the ring has no room (or the producer
    /// published an impossible head), or another thread is writing a return at this moment:
    /// send it over the socket instead (returns are taken in any order; nothing waits).
    pub(crate) fn push_return(&self, pool: u32, slot: u32) -> bool {
        debug_assert!(pool != 0, "pools are numbered from 1");
        self.push_words(&[u64::from(pool) | (u64::from(slot) << 32)])
    }

    /// Give lease `lease` back through the ring (two words: [`LEASE_WORD`], the lease), as
    /// [`Self::push_return`] gives a slot back. Only to a producer that reads them.
    pub(crate) fn push_release(&self, lease: u64) -> bool {
        self.push_words(&[LEASE_WORD, lease])
    }

    /// Publish `words` (one return) at once, or none of them.
    fn push_words(&self, words: &[u64]) -> bool {
        let s = &self.shared;
        // The tail, claimed with one locked instruction; given back with a plain store.
        let tail = self.ret_tail.load(Ordering::Relaxed);
        if tail & RET_BUSY != 0
            || self.ret_tail.compare_exchange(tail, tail | RET_BUSY, Ordering::Acquire, Ordering::Relaxed).is_err()
        {
            return false;
        }
        let head = s.word(RET_HEAD).load(Ordering::Acquire);
        let n = words.len() as u64;
        if !s.plausible(tail, head, false) || tail.wrapping_sub(head) + n > u64::from(s.capacity) {
            self.ret_tail.store(tail, Ordering::Release);
            return false;
        }
        for (i, &w) in words.iter().enumerate() {
            s.ret(tail.wrapping_add(i as u64)).store(w, Ordering::Relaxed);
        }
        let tail = tail.wrapping_add(n) & !RET_BUSY;
        s.word(RET_TAIL).store(tail, Ordering::SeqCst);
        self.ret_tail.store(tail, Ordering::Release);
        if tail % REFRESH_EVERY == 0 {
            publish_cpu(s.word(C_HERE));
        }
        // A producer asleep on this CPU (it said so, and that it looks again by itself), while
        // more items wait for this consumer: its wake-up would only take the CPU from this
        // consumer for one return; put it off until this consumer sleeps or finds nothing.
        // (`pending` first: the CPU read after it is the one the producer armed with, or a
        // later one, never an earlier arm's.)
        if !self.prompt.load(Ordering::Relaxed)
            && s.word(P_PENDING).load(Ordering::SeqCst) == 0
            && {
                let cpu = s.word(P_CPU).load(Ordering::Relaxed);
                cpu != 0 && cpu == cpu_plus_one()
            }
            && s.word(ITEM_TAIL).load(Ordering::SeqCst) != s.word(ITEM_HEAD).load(Ordering::SeqCst)
        {
            self.owed.store(true, Ordering::SeqCst);
            return true;
        }
        self.wake_producer();
        true
    }

    /// Wake the producer unless a wake-up is already pending.
    fn wake_producer(&self) {
        wake_unless_pending(self.shared.word(P_PENDING), self.p_efd.as_fd());
    }

    /// Wake the producer for the returns whose wake-up was put off (before this consumer
    /// sleeps, or reports that nothing came).
    pub(crate) fn pay_owed(&self) {
        if self.owed.load(Ordering::Relaxed) && self.owed.swap(false, Ordering::SeqCst) {
            self.wake_producer();
        }
    }

    /// From now on every return wakes the producer at once (an event loop polls the
    /// consumer's descriptor); what was put off is paid now.
    pub(crate) fn be_prompt(&self) {
        self.prompt.store(true, Ordering::SeqCst);
        self.pay_owed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot_of(r: Returned) -> (u32, u32) {
        match r {
            Returned::Slot(pool, slot) => (pool, slot),
            other => panic!("{other:?} is not a slot"),
        }
    }

    #[test]
    fn an_index_s_place_is_its_remainder_for_any_capacity_a_producer_may_send() {
        // A power of two (what this library makes) takes a mask, any other a division: the
        // same places either way.
        for capacity in [1u32, 2, 1000, 1024, 65536, 65535] {
            let size = ring_size(capacity);
            let memfd = memfd_create("devshare-ring-test", MemfdFlags::CLOEXEC).expect("memfd");
            ftruncate(&memfd, size as u64).expect("ftruncate");
            let s = Shared::new(Map::new(&memfd, size, true, "a test ring").expect("map"), capacity);
            for index in [0u64, 1, 999, 1000, 1023, 1024, 65535, 65536, u64::MAX - 1, u64::MAX] {
                assert_eq!(s.place(index), (index % u64::from(capacity)) as usize, "{index} in {capacity}");
            }
        }
    }

    fn pair() -> (ProducerRing, ConsumerRing) {
        let p = ProducerRing::create().expect("create");
        let fds = p.fds().iter().map(|f| rustix::io::fcntl_dupfd_cloexec(f, 0).expect("dup")).collect();
        let c = ConsumerRing::open(CAPACITY, RECORD, fds).expect("open");
        (p, c)
    }

    /// An edge-triggered epoll set watching one eventfd, as the rings' receivers watch theirs.
    struct Watch(OwnedFd);

    impl Watch {
        /// Watch `fd`; the readiness it has when added (its count of 1) is taken at once.
        fn new(fd: &OwnedFd) -> Watch {
            use rustix::event::epoll;
            let ep = epoll::create(epoll::CreateFlags::CLOEXEC).expect("epoll_create");
            epoll::add(&ep, fd, epoll::EventData::new_u64(0), epoll::EventFlags::IN | epoll::EventFlags::ET)
                .expect("epoll_ctl");
            let w = Watch(ep);
            assert!(w.woken(), "a fresh ring's eventfd is readable (its count is 1)");
            w
        }

        /// Whether the eventfd was written since the last look (an edge).
        fn woken(&self) -> bool {
            use rustix::event::epoll;
            let mut events = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 4];
            let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
            !epoll::wait(&self.0, &mut events, Some(&zero)).expect("epoll_wait").0.is_empty()
        }
    }

    /// Keep this thread on the CPU it runs on: the CPU, plus one.
    fn stay_here() -> u64 {
        let cpu = cpu_plus_one().checked_sub(1).expect("sched_getcpu") as usize;
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity (this
        // thread) get a valid set of the size passed.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
        }
        cpu as u64 + 1
    }

    #[test]
    fn a_side_yields_only_to_a_peer_awake_on_its_cpu_and_polls_only_for_one_awake_on_another() {
        let here = stay_here();
        let (mut p, c) = pair();
        // An item wakes the consumer (its pending word set), which has not said where it
        // runs: the producer does not yield.
        assert!(p.push_item(0, &[1]).expect("push"));
        assert!(!p.consumer_awake_on(true));
        // Awake on this CPU (it woke here): the producer yields, saying where it runs.
        c.here();
        assert!(p.consumer_awake_on(true), "awake on this CPU");
        assert_eq!(p.shared.word(P_HERE).load(Ordering::SeqCst), here);
        // Asleep (armed): no.
        c.arm();
        assert!(!p.consumer_awake_on(true), "a consumer that sleeps is woken, not yielded to");
        // Awake on another CPU: no.
        p.shared.word(C_PENDING).store(1, Ordering::SeqCst);
        p.shared.word(C_HERE).store(here + 1, Ordering::SeqCst);
        assert!(!p.consumer_awake_on(true), "on another CPU");
        // The consumer's side likewise: a producer awake here (its last arm or yield said so)
        // gets the CPU; one asleep in its wait does not, armed or not.
        p.arm(false);
        p.asleep(true);
        assert!(!c.producer_awake_on(true), "a producer that sleeps");
        p.shared.word(P_PENDING).store(1, Ordering::SeqCst);
        assert!(!c.producer_awake_on(true), "a producer that sleeps, its wake-up on the way");
        // Out of its wait it is awake, though its wait armed the ring on the way out.
        p.asleep(false);
        p.arm(false);
        assert!(c.producer_awake_on(true), "a producer awake on this CPU, its ring armed");
        // A producer before 1.18 (no such word): its pending word says it.
        p.shared.word(P_AWAKE).store(0, Ordering::SeqCst);
        assert!(!c.producer_awake_on(true), "an older producer, armed");
        p.shared.word(P_PENDING).store(1, Ordering::SeqCst);
        assert!(c.producer_awake_on(true), "an older producer, its pending word set");
        p.asleep(false);
        assert_eq!(p.shared.word(C_HERE).load(Ordering::SeqCst), here, "the consumer said where it runs");
        p.shared.word(P_HERE).store(here + 1, Ordering::SeqCst);
        assert!(!c.producer_awake_on(true), "on another CPU");
        // ... where the consumer may poll for it instead, and the producer for the consumer.
        assert!(c.producer_awake_on(false), "awake on another CPU");
        c.here();
        assert!(!p.consumer_awake_on(false), "the consumer said it runs here");
        p.shared.word(C_HERE).store(here + 1, Ordering::SeqCst);
        assert!(p.consumer_awake_on(false), "the consumer awake on another CPU");
        p.shared.word(C_PENDING).store(0, Ordering::SeqCst);
        assert!(!p.consumer_awake_on(false), "a consumer that sleeps is woken, not polled for");
        // A side's word follows it: the producer's items (every 16th) and the consumer's
        // returns (likewise) say where it runs now.
        p.shared.word(P_HERE).store(here + 1, Ordering::SeqCst);
        for i in 0..REFRESH_EVERY {
            assert!(p.push_item(0, &[i as u8]).expect("push"));
        }
        assert_eq!(p.shared.word(P_HERE).load(Ordering::SeqCst), here, "refreshed by the sends");
        for i in 0..REFRESH_EVERY as u32 {
            assert!(c.push_return(1, i));
        }
        assert_eq!(p.shared.word(C_HERE).load(Ordering::SeqCst), here, "refreshed by the returns");
    }

    #[test]
    fn a_return_wakes_the_producer_at_once_unless_it_sleeps_on_this_cpu_and_items_wait() {
        // Stay on one CPU: the producer's CPU is compared with this thread's.
        let cpu = (stay_here() - 1) as usize;
        let (mut p, c) = pair();
        let pw = Watch::new(&p.p_efd);
        let mut head = 0;
        for i in 0..3u8 {
            assert!(p.push_item(0, &[i]).expect("push"));
        }
        // One item taken, two wait. A producer that armed without patience (it waits without
        // a timer): at once.
        head = c.advance(head);
        p.arm(false);
        assert!(c.push_return(1, 0));
        assert!(pw.woken(), "a producer that waits without a timer is woken by every return");
        // Patient, on this CPU, items waiting: put off until the consumer pays.
        p.arm(true);
        assert!(c.push_return(1, 1));
        assert!(!pw.woken(), "put off while the consumer has items to take");
        c.pay_owed();
        assert!(pw.woken(), "paid before the consumer sleeps");
        c.pay_owed();
        assert!(!pw.woken(), "paid once");
        // Patient, but on another CPU: at once.
        p.arm(true);
        p.shared.word(P_CPU).store(cpu as u64 + 2, Ordering::Relaxed);
        assert!(c.push_return(1, 2));
        assert!(pw.woken(), "a producer on another CPU is woken at once");
        // Patient, this CPU, but nothing waits for the consumer: at once.
        head = c.advance(c.advance(head));
        assert!(c.peek(head).expect("peek").is_none());
        p.arm(true);
        assert!(c.push_return(1, 3));
        assert!(pw.woken(), "with nothing left to take, a return wakes at once");
        // A consumer whose descriptor an event loop polls: at once, and what it owed is paid.
        assert!(p.push_item(0, b"x").expect("push"));
        p.arm(true);
        assert!(c.push_return(1, 4));
        assert!(!pw.woken());
        c.be_prompt();
        assert!(pw.woken(), "what was put off is paid when the consumer turns prompt");
        p.arm(true);
        assert!(c.push_return(1, 5));
        assert!(pw.woken(), "a prompt consumer wakes at once");
        let mut got = Vec::new();
        p.take_returns(|r| got.push(slot_of(r))).expect("take");
        assert_eq!(got, (0..6).map(|s| (1, s)).collect::<Vec<_>>(), "every return arrived, in order");
    }

    #[test]
    fn items_and_returns_go_round_in_order_and_a_full_ring_says_so() {
        let (mut p, c) = pair();
        let mut head = 0;
        for round in 0..3u64 {
            for i in 0..u64::from(CAPACITY) {
                let msg = (round * 10_000 + i).to_le_bytes();
                assert!(p.push_item(i, &msg[..(i % 8 + 1) as usize]).expect("push"));
            }
            assert!(!p.push_item(0, b"x").expect("full"), "a full ring refuses the record, it does not wait");
            for i in 0..u64::from(CAPACITY) {
                let r = c.peek(head).expect("peek").expect("a record");
                assert_eq!(r.socket_messages, i);
                let want = (round * 10_000 + i).to_le_bytes();
                assert_eq!(r.item(), &want[..(i % 8 + 1) as usize]);
                head = c.advance(head);
            }
            assert!(c.peek(head).expect("peek").is_none());
            for s in 0..CAPACITY {
                assert!(c.push_return(7, s));
            }
            assert!(!c.push_return(7, 0), "a full return ring says so");
            let mut got = Vec::new();
            assert_eq!(p.take_returns(|r| got.push(slot_of(r))).expect("take"), CAPACITY as usize);
            assert_eq!(got, (0..CAPACITY).map(|s| (7, s)).collect::<Vec<_>>());
        }
    }

    #[test]
    fn lease_releases_travel_as_two_words_between_slot_returns_and_need_room_for_both() {
        let (mut p, c) = pair();
        assert!(c.push_return(7, 1));
        assert!(c.push_release(1 << 40));
        assert!(c.push_return(7, 2));
        assert!(c.push_release(u64::MAX));
        let mut got = Vec::new();
        assert_eq!(p.take_returns(|r| got.push(r)).expect("take"), 6);
        let want = [Returned::Slot(7, 1), Returned::Lease(1 << 40), Returned::Slot(7, 2), Returned::Lease(u64::MAX)];
        assert_eq!(got, want);
        // One word of room left: a release (two words) does not fit, and leaves the ring as it was.
        for s in 0..CAPACITY - 1 {
            assert!(c.push_return(7, s));
        }
        assert!(!c.push_release(9), "a release needs two words of room");
        assert!(c.push_return(7, 0), "the last word is still free");
        got.clear();
        p.take_returns(|r| got.push(r)).expect("take");
        assert_eq!(got.len(), CAPACITY as usize);
        assert!(got.iter().all(|r| matches!(r, Returned::Slot(7, _))));
    }

    #[test]
    fn a_lease_word_published_without_its_lease_is_torn_not_read_past_the_tail() {
        let (mut p, c) = pair();
        // A hostile consumer publishes the lease word alone (one word), then nothing else.
        c.shared.ret(0).store(LEASE_WORD, Ordering::Relaxed);
        c.shared.ret(1).store(42, Ordering::Relaxed); // beyond the tail: never read
        c.shared.word(RET_TAIL).store(1, Ordering::SeqCst);
        let mut got = Vec::new();
        assert_eq!(p.take_returns(|r| got.push(r)).expect("take"), 1);
        assert_eq!(got, [Returned::Torn]);
    }

    #[test]
    fn a_return_while_another_thread_writes_one_goes_over_the_socket_and_leaves_the_ring_alone() {
        let (mut p, c) = pair();
        assert!(c.push_return(1, 0));
        // Another thread is writing a return (it holds the tail): this one is refused at once.
        c.ret_tail.fetch_or(RET_BUSY, Ordering::SeqCst);
        assert!(!c.push_return(1, 1), "the socket carries it");
        assert_eq!(c.shared.word(RET_TAIL).load(Ordering::SeqCst), 1, "nothing written");
        c.ret_tail.fetch_and(!RET_BUSY, Ordering::SeqCst);
        assert!(c.push_return(1, 2));
        // A full ring gives the tail back as it found it.
        for s in 3..=CAPACITY {
            assert!(c.push_return(1, s));
        }
        assert!(!c.push_return(1, 0), "full");
        assert_eq!(c.ret_tail.load(Ordering::SeqCst), u64::from(CAPACITY), "not left busy");
        let mut got = Vec::new();
        p.take_returns(|r| got.push(slot_of(r))).expect("take");
        let want: Vec<_> = std::iter::once(0).chain(2..=CAPACITY).map(|s| (1, s)).collect();
        assert_eq!(got, want, "every return written, in order");
        assert!(c.push_return(1, 9), "room again");
    }

    #[test]
    fn threads_returning_at_once_lose_no_return_and_write_none_twice() {
        let (mut p, c) = pair();
        let (mut ring, mut socket) = (Vec::new(), 0usize);
        std::thread::scope(|s| {
            let threads: Vec<_> = (0..4u32)
                .map(|t| {
                    let c = &c;
                    s.spawn(move || {
                        let mut refused = 0;
                        for i in 0..200u32 {
                            // (Pools are numbered from 1: pool 0, slot 0 is a release's word.)
                            if !c.push_return(t + 1, i) {
                                refused += 1;
                            }
                        }
                        refused
                    })
                })
                .collect();
            // Taken while they write (the ring holds fewer than they return).
            while !threads.iter().all(|t| t.is_finished()) {
                p.take_returns(|r| ring.push(slot_of(r))).expect("take");
            }
            socket = threads.into_iter().map(|t| t.join().expect("join")).sum();
        });
        p.take_returns(|r| ring.push(slot_of(r))).expect("take");
        assert_eq!(ring.len() + socket, 800, "each return went one way");
        let mut seen = ring.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), ring.len(), "no return written twice");
        for t in 1..=4 {
            let mine: Vec<u32> = ring.iter().filter(|r| r.0 == t).map(|r| r.1).collect();
            assert!(mine.windows(2).all(|w| w[0] < w[1]), "one thread's returns in its order");
        }
    }

    #[test]
    fn an_index_the_other_side_cannot_have_published_breaks_the_ring_by_name() {
        let (mut p, c) = pair();
        // The consumer claims returns it never wrote; the producer claims items past a ring.
        c.shared.word(RET_TAIL).store(u64::from(CAPACITY) + 1, Ordering::SeqCst);
        let e = p.take_returns(|_| panic!("no record is read")).expect_err("refused");
        assert!(e.to_string().contains("return tail"), "{e}");
        p.shared.word(ITEM_TAIL).store(u64::MAX, Ordering::SeqCst);
        assert!(c.peek(0).is_err());
        c.shared.word(ITEM_HEAD).store(5, Ordering::SeqCst); // ahead of the producer's tail 0
        assert!(p.push_item(0, b"x").is_err());
        // A record of impossible length is refused, not read past its end.
        let (mut p, c) = pair();
        assert!(p.push_item(0, b"ok").expect("push"));
        // SAFETY: the record is in the map.
        unsafe { std::ptr::write_volatile(p.shared.record(0).cast::<u64>().add(1), 1 << 40) };
        assert!(c.peek(0).is_err());
    }

    #[test]
    fn a_ring_that_is_not_a_sealed_memfd_of_the_right_size_is_refused() {
        let p = ProducerRing::create().expect("create");
        let dup = |f: BorrowedFd<'_>| rustix::io::fcntl_dupfd_cloexec(f, 0).expect("dup");
        let [m, a, b] = p.fds();
        assert!(ConsumerRing::open(CAPACITY * 2, RECORD, vec![dup(m), dup(a), dup(b)]).is_err(), "size");
        assert!(ConsumerRing::open(CAPACITY, RECORD, vec![dup(m), dup(a)]).is_err(), "descriptors");
        assert!(ConsumerRing::open(CAPACITY, RECORD, vec![dup(a), dup(a), dup(b)]).is_err(), "not a memfd");
        assert!(ConsumerRing::open(CAPACITY, RECORD, vec![dup(m), dup(m), dup(b)]).is_err(), "not an eventfd");
    }

    #[test]
    fn a_wake_up_through_an_eventfd_the_peer_made_blocking_and_filled_returns_at_once_and_wakes() {
        // The other side shares each eventfd's open file description: it can clear O_NONBLOCK
        // and fill the counter, after which a write of 1 blocks until someone reads it.
        let (mut p, c) = pair();
        let cw = Watch::new(&p.c_efd);
        let pw = Watch::new(&p.p_efd);
        for fd in [&p.c_efd, &p.p_efd] {
            let fl = rustix::fs::fcntl_getfl(fd).expect("F_GETFL");
            rustix::fs::fcntl_setfl(fd, fl - rustix::fs::OFlags::NONBLOCK).expect("F_SETFL");
            rustix::io::write(fd, &(u64::MAX - 2).to_ne_bytes()).expect("fill the counter");
        }
        assert!(cw.woken() && pw.woken(), "(the filling writes were edges)");
        // Both are full now: the next write of 1 to either would block. The producer's push
        // wakes the consumer, the consumer's return wakes the producer: each returns, and each
        // is an edge.
        assert!(p.push_item(0, &[1]).expect("push"));
        assert!(cw.woken(), "the item woke the consumer");
        let head = c.advance(0);
        assert_eq!(head, 1);
        p.arm(false);
        assert!(c.push_return(1, 0));
        assert!(pw.woken(), "the return woke the producer");
        c.wake_self();
        assert!(cw.woken(), "the consumer's own wake-up");
    }
}
