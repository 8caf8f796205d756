//! PyTorch's ref-counter object, created by devshare on the exporter side and
//! decremented by devshare on the consumer side.
//!
//! Layout (`RefcountedMapAllocator`): a 64-byte header whose first 4 bytes are an atomic `int32`
//! count of live mappings, then 10000 `int64` slots; slot k is at byte `64 + 8k`; 80064 bytes in
//! all. Each handle an exporter hands out takes a fresh slot set to 1; its consumer decrements it
//! exactly once.
//!
//! devshare's own ref-counters (`/devshare_rc_<pid>_<hex>`) keep the same layout and size, and
//! use two places PyTorch never reads (a PyTorch consumer touches only the header count and the
//! slot its tuple names):
//!
//! - header bytes 8..16 hold [`MAGIC`], so a consumer knows the object keeps the record below;
//! - the last [`RECORD_WORDS`] slots are the **in-flight record**: bit k says that the share at
//!   slot k was sent with an in-flight reference (`DEVSHARE_HANDLE_FLAG_INFLIGHT`) that no consumer
//!   has taken over yet. So only the first [`SHARE_SLOTS`] slots are handed out.
//!
//! A consumer refuses a handle whose in-flight flag differs from the record, and takes an
//! in-flight reference over by clearing its bit atomically (a second take-over finds it clear).
//! Every recorded in-flight share also holds one count in this object's header, like the data
//! object's: the record stays readable after the exporter closes, until every in-flight share
//! was taken over; whoever brings the count to 0 unlinks, as always.

use crate::error::{Error, Result};
use crate::fork::Stamp;
use crate::handle::DEVSHARE_REF_SLOTS;
use crate::shm::{self, Kind, Map};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes before slot 0 (the header with the mapping count).
pub(crate) const HEADER_SIZE: usize = 64;
/// Size of a ref-counter object: header plus 10000 slots = 80064 bytes.
pub(crate) const OBJECT_SIZE: usize = HEADER_SIZE + 8 * DEVSHARE_REF_SLOTS as usize;
/// Slots a devshare ref-counter hands out; the slots after them hold the in-flight record.
pub(crate) const SHARE_SLOTS: u64 = 9846;
/// 64-bit words of the in-flight record (one bit per share slot).
pub(crate) const RECORD_WORDS: usize = SHARE_SLOTS.div_ceil(64) as usize;
/// Byte offset of the in-flight record.
const RECORD_OFFSET: usize = HEADER_SIZE + 8 * SHARE_SLOTS as usize;
static_assertions::const_assert!(RECORD_OFFSET + 8 * RECORD_WORDS <= OBJECT_SIZE);
/// Where a devshare ref-counter's header holds [`MAGIC`] (PyTorch uses bytes 0..4 only).
const MAGIC_OFFSET: usize = 8;
/// "devshare ref-counter with an in-flight record, version 1".
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"dvshRC1\0");

fn slot_offset(slot: u64) -> usize {
    HEADER_SIZE + 8 * slot as usize
}

fn shown(name: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(name)
}

/// The record word and bit of a share slot (`slot < SHARE_SLOTS`).
fn record_bit(map: &Map, slot: u64) -> (&AtomicU64, u64) {
    debug_assert!(slot < SHARE_SLOTS);
    (map.atomic_u64(RECORD_OFFSET + 8 * (slot / 64) as usize), 1u64 << (slot % 64))
}

/// An exporter's ref-counter object: created here, header count 1 for our own mapping (plus one
/// per in-flight share not yet taken over).
pub(crate) struct RefCounter {
    name: Vec<u8>,
    map: Map,
    next_slot: u64,
    /// The fork generation at creation: dropped in a forked child, it gives nothing back.
    generation: Stamp,
    /// The object created: its name is unlinked only while it still stands for it.
    id: shm::ObjectId,
}

impl RefCounter {
    pub(crate) fn create() -> Result<RefCounter> {
        let generation = Stamp::now();
        let name = shm::random_name(shm::RC_PREFIX)?;
        let fd = shm::create(&name, OBJECT_SIZE as u64)?;
        let made = shm::id_of(&fd, &name).and_then(|id| Ok((id, Map::new(&fd, OBJECT_SIZE, true, "ref-counter")?)));
        let (id, map) = match made {
            Ok(m) => m,
            Err(e) => {
                shm::unlink(&name);
                return Err(e);
            }
        };
        map.atomic_i64(MAGIC_OFFSET).store(MAGIC as i64, Ordering::SeqCst);
        map.atomic_i32(0).store(1, Ordering::SeqCst);
        Ok(RefCounter { name, map, next_slot: 0, generation, id })
    }

    pub(crate) fn name(&self) -> &[u8] {
        &self.name
    }

    /// Whether a slot is left.
    pub(crate) fn has_free_slot(&self) -> bool {
        self.next_slot < SHARE_SLOTS
    }

    /// Take a fresh slot and set it to 1, or `None` when all are used. With `inflight`, record
    /// that the share carries an in-flight reference (and count it in the header).
    pub(crate) fn take_slot(&mut self, inflight: bool) -> Option<u64> {
        if self.next_slot >= SHARE_SLOTS {
            return None;
        }
        let slot = self.next_slot;
        self.next_slot += 1;
        if inflight {
            let (word, bit) = record_bit(&self.map, slot);
            word.fetch_or(bit, Ordering::SeqCst);
            self.map.atomic_i32(0).fetch_add(1, Ordering::SeqCst);
        }
        self.map.atomic_i64(slot_offset(slot)).store(1, Ordering::SeqCst);
        Some(slot)
    }

    /// References handed out and not yet returned. A slot of devshare's holds 1 (held) or 0
    /// (returned) and nothing else; any other value means something else wrote to the object,
    /// and is reported (naming the slot) instead of being summed.
    pub(crate) fn outstanding(&self) -> Result<u64> {
        let mut n = 0u64;
        for s in 0..self.next_slot {
            match self.map.atomic_i64(slot_offset(s)).load(Ordering::SeqCst) {
                0 => {}
                1 => n += 1,
                v => {
                    return Err(Error::Untrusted(format!(
                        "slot {s} of ref-counter {} holds {v}: devshare's slots are only ever 1 \
                         (held) or 0 (returned), so something else wrote to it and its \
                         references cannot be counted",
                        shown(&self.name)
                    )))
                }
            }
        }
        Ok(n)
    }

    pub(crate) fn slot_value(&self, slot: u64) -> i64 {
        self.map.atomic_i64(slot_offset(slot)).load(Ordering::SeqCst)
    }
}

impl RefCounter {
    /// Remove the name now (`DEVSHARE_CLOSE_UNLINK`); consumers that release later find no
    /// object and have nothing to report.
    pub(crate) fn unlink(&self) {
        // A forked child's copy of the parent's ref-counter removes nothing of the parent's.
        if self.generation.is_current() {
            shm::unlink_if_same(&self.name, self.id);
        }
    }
}

impl Drop for RefCounter {
    /// PyTorch's protocol: leave the mapping count; whoever brings it to 0 unlinks (a consumer
    /// in the middle of its release may be the last). In a forked child the count is the
    /// parent's: leave it alone.
    fn drop(&mut self) {
        if !self.generation.is_current() {
            return;
        }
        if self.map.atomic_i32(0).fetch_sub(1, Ordering::SeqCst) == 1 {
            shm::unlink_if_same(&self.name, self.id);
        }
    }
}

/// A consumer's mapping of someone else's ref-counter, kept while imports in this process hold
/// references in it, so that checking and returning each reference costs no system call.
///
/// Holding the mapping is not counted in the header: the count protocol is followed around each
/// decrement exactly as PyTorch's consumer does it (count +1, slot -1, count -1, unlink at 0), so
/// the producer sees the same sequence; only the open and map are shared between decrements.
/// Names are unique per object, so a kept mapping never stands for a different object.
pub(crate) struct Watched {
    name: Vec<u8>,
    map: Map,
    /// A devshare ref-counter (name and magic): slots beyond [`SHARE_SLOTS`] are its in-flight
    /// record, and its slots are only ever 0 or 1.
    devshare: bool,
    /// The object mapped: its name is unlinked only while it still stands for it.
    id: shm::ObjectId,
}

/// Check the size of an opened ref-counter: exactly PyTorch's.
fn check_size(name: &[u8], size: u64) -> Result<()> {
    if size != OBJECT_SIZE as u64 {
        return Err(Error::Untrusted(format!(
            "ref-counter {} is {size} bytes; PyTorch's layout (and devshare's) is exactly \
             {OBJECT_SIZE} bytes",
            shown(name)
        )));
    }
    Ok(())
}

impl Watched {
    /// `Ok(None)` when the object is gone (the producer stopped tracking). The name family,
    /// owner, mode and size are checked before anything is mapped ([`shm::open_trusted`]).
    pub(crate) fn open(name: &[u8]) -> Result<Option<Watched>> {
        let shm::Opened { fd, size, id } = match shm::open_trusted(name, Kind::RefCounter, true) {
            Ok(x) => x,
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        check_size(name, size)?;
        let map = Map::new(&fd, OBJECT_SIZE, true, "ref-counter")?;
        let devshare = shm::is_devshare_name(name, shm::RC_PREFIX);
        if devshare && map.atomic_i64(MAGIC_OFFSET).load(Ordering::SeqCst) != MAGIC as i64 {
            return Err(Error::Untrusted(format!(
                "ref-counter {} has a devshare name but not devshare's header (no in-flight record)",
                shown(name)
            )));
        }
        Ok(Some(Watched { name: name.to_vec(), map, devshare, id }))
    }

    fn slot(&self, slot: u64) -> Result<&std::sync::atomic::AtomicI64> {
        if slot >= DEVSHARE_REF_SLOTS || (self.devshare && slot >= SHARE_SLOTS) {
            return Err(Error::Untrusted(format!(
                "slot {slot} of ref-counter {} is not a slot its producer hands out (devshare uses \
                 slots 0..{SHARE_SLOTS}; the rest is its in-flight record)",
                shown(&self.name)
            )));
        }
        Ok(self.map.atomic_i64(slot_offset(slot)))
    }

    /// Before use: the reference must still be outstanding (and, in a devshare ref-counter, 1).
    pub(crate) fn check(&self, slot: u64) -> Result<()> {
        let v = self.slot(slot)?.load(Ordering::SeqCst);
        if v <= 0 {
            return Err(Error::AlreadyReleased(format!(
                "slot {slot} of ref-counter {} is {v}: this handle's reference was already returned",
                shown(&self.name)
            )));
        }
        if self.devshare && v != 1 {
            return Err(Error::Untrusted(format!(
                "slot {slot} of ref-counter {} holds {v}: devshare's slots are only ever 1 or 0, so \
                 something else wrote to it",
                shown(&self.name)
            )));
        }
        Ok(())
    }

    /// Check a handle's in-flight flag against the producer's record: `Ok` when they agree.
    /// A PyTorch ref-counter keeps no record, and devshare handles with the flag always name a
    /// devshare ref-counter: such a handle is refused.
    pub(crate) fn check_inflight(&self, slot: u64, inflight: bool) -> Result<()> {
        self.slot(slot)?;
        if !self.devshare {
            if inflight {
                return Err(Error::Untrusted(format!(
                    "the handle says it carries an in-flight reference, but its ref-counter {} is \
                     not devshare's and keeps no record of one",
                    shown(&self.name)
                )));
            }
            return Ok(());
        }
        let (word, bit) = record_bit(&self.map, slot);
        let recorded = word.load(Ordering::SeqCst) & bit != 0;
        if recorded != inflight {
            return Err(Error::Untrusted(format!(
                "the handle says its share at slot {slot} of ref-counter {} was sent {}, but its \
                 producer recorded {}; the handle was altered (or its in-flight reference was \
                 already taken over)",
                shown(&self.name),
                if inflight { "with an in-flight reference" } else { "without an in-flight reference" },
                if recorded {
                    "an in-flight reference not yet taken over"
                } else {
                    "no in-flight reference to take over"
                },
            )));
        }
        Ok(())
    }

    /// Take the in-flight reference of `slot` over: clear its record bit atomically. `Untrusted`
    /// when it is not set (never sent in flight, or another consumer took it over first).
    pub(crate) fn claim_inflight(&self, slot: u64) -> Result<()> {
        self.check_inflight(slot, true)?;
        let (word, bit) = record_bit(&self.map, slot);
        if word.fetch_and(!bit, Ordering::SeqCst) & bit == 0 {
            return Err(Error::Untrusted(format!(
                "the in-flight reference of slot {slot} of ref-counter {} was taken over by another \
                 consumer: the handle was sent twice",
                shown(&self.name)
            )));
        }
        Ok(())
    }

    /// Undo [`Self::claim_inflight`] (the import failed after it).
    pub(crate) fn unclaim_inflight(&self, slot: u64) {
        let (word, bit) = record_bit(&self.map, slot);
        word.fetch_or(bit, Ordering::SeqCst);
    }

    /// After a successful take-over: give back the count the in-flight share held in this
    /// object's header (unlinking it when that was the last, as any holder would).
    pub(crate) fn drop_inflight_count(&self) {
        if self.map.atomic_i32(0).fetch_sub(1, Ordering::SeqCst) == 1 {
            shm::unlink_if_same(&self.name, self.id);
        }
    }

    /// Return one reference in PyTorch's order (count +1, slot -1 but not below 0, count -1,
    /// unlink when the count reached 0).
    pub(crate) fn release(&self, slot: u64) {
        let Ok(s) = self.slot(slot) else { return };
        let count = self.map.atomic_i32(0);
        count.fetch_add(1, Ordering::SeqCst);
        let _ = s.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| (v > 0).then(|| v - 1));
        if count.fetch_sub(1, Ordering::SeqCst) == 1 {
            shm::unlink_if_same(&self.name, self.id);
        }
    }
}

/// Who in this process holds references taken over from ref-counters: the import registry
/// implements it, so that an adoption (in the exporter, which does not name the import layer)
/// can refuse a reference an import holds, whose release returns it.
pub(crate) trait Holders: Send + Sync {
    /// Whether slot `slot` of ref-counter `name` is held here.
    fn holds(&self, name: &[u8], slot: u64) -> bool;
}

static HOLDERS: std::sync::OnceLock<&'static dyn Holders> = std::sync::OnceLock::new();

/// Register the holders of references in this process (once; later calls change nothing).
pub(crate) fn register_holders(h: &'static dyn Holders) {
    let _ = HOLDERS.set(h);
}

/// Whether slot `slot` of ref-counter `name` is held by an import in this process.
pub(crate) fn held_here(name: &[u8], slot: u64) -> bool {
    HOLDERS.get().is_some_and(|h| h.holds(name, slot))
}

/// Consumer side, before use: the handle's reference must still be outstanding. `Ok(false)` when
/// the ref-counter is gone (the producer stopped tracking), `Ok(true)` when the slot is > 0.
///
/// A plain read through the descriptor (no mapping, no header count change): an aligned 8-byte
/// `pread` of shared memory sees a whole value, and this check only refuses handles whose
/// reference was already returned, which nothing can undo. The object passes the same checks
/// as any other before it is read.
pub(crate) fn check_outstanding(name: &[u8], slot: u64) -> Result<bool> {
    let shm::Opened { fd, size, .. } = match shm::open_trusted(name, Kind::RefCounter, false) {
        Ok(x) => x,
        Err(Error::NotFound(_)) => return Ok(false),
        Err(e) => return Err(e),
    };
    check_size(name, size)?;
    let mut buf = [0u8; 8];
    let at = slot_offset(slot);
    // SAFETY: valid fd, buf has 8 writable bytes.
    let n = unsafe { libc::pread(std::os::fd::AsRawFd::as_raw_fd(&fd), buf.as_mut_ptr().cast(), 8, at as libc::off_t) };
    if n != 8 {
        return Err(Error::Mismatch(format!("ref-counter {} is too small for slot {slot}", shown(name))));
    }
    let v = i64::from_ne_bytes(buf);
    if v <= 0 {
        return Err(Error::AlreadyReleased(format!(
            "slot {slot} of ref-counter {} is {v}: this handle's reference was already returned",
            shown(name)
        )));
    }
    Ok(true)
}
