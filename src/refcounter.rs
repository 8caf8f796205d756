//! PyTorch's ref-counter object, created by devshare on the exporter side and
//! decremented by devshare on the consumer side.
//!
//! Layout (`RefcountedMapAllocator`): a 64-byte header whose first 4 bytes are an atomic `int32`
//! count of live mappings, then 10000 `int64` slots; slot k is at byte `64 + 8k`. Each handle an
//! exporter hands out takes a fresh slot set to 1; its consumer decrements it exactly once.

use crate::error::{Error, Result};
use crate::handle::DEVSHARE_REF_SLOTS;
use crate::shm::{self, Map};
use std::sync::atomic::Ordering;

/// Bytes before slot 0 (the header with the mapping count).
pub(crate) const HEADER_SIZE: usize = 64;
/// Size of a ref-counter object: header plus 10000 slots = 80064 bytes.
pub(crate) const OBJECT_SIZE: usize = HEADER_SIZE + 8 * DEVSHARE_REF_SLOTS as usize;

fn slot_offset(slot: u64) -> usize {
    HEADER_SIZE + 8 * slot as usize
}

/// An exporter's ref-counter object: created here, header count 1 for our own mapping.
pub(crate) struct RefCounter {
    name: Vec<u8>,
    map: Map,
    next_slot: u64,
}

impl RefCounter {
    pub(crate) fn create() -> Result<RefCounter> {
        let name = shm::random_name("devshare_rc")?;
        let fd = shm::create(&name, OBJECT_SIZE as u64)?;
        let map = match Map::new(&fd, OBJECT_SIZE, true, "ref-counter") {
            Ok(m) => m,
            Err(e) => {
                shm::unlink(&name);
                return Err(e);
            }
        };
        map.atomic_i32(0).store(1, Ordering::SeqCst);
        Ok(RefCounter { name, map, next_slot: 0 })
    }

    pub(crate) fn name(&self) -> &[u8] {
        &self.name
    }

    /// Whether a slot is left.
    pub(crate) fn has_free_slot(&self) -> bool {
        self.next_slot < DEVSHARE_REF_SLOTS
    }

    /// Take a fresh slot and set it to 1, or `None` when all 10000 are used.
    pub(crate) fn take_slot(&mut self) -> Option<u64> {
        if self.next_slot >= DEVSHARE_REF_SLOTS {
            return None;
        }
        let slot = self.next_slot;
        self.next_slot += 1;
        self.map.atomic_i64(slot_offset(slot)).store(1, Ordering::SeqCst);
        Some(slot)
    }

    /// Sum of the positive slot values: references handed out and not yet returned.
    pub(crate) fn outstanding(&self) -> u64 {
        (0..self.next_slot)
            .map(|s| self.map.atomic_i64(slot_offset(s)).load(Ordering::SeqCst).max(0) as u64)
            .sum()
    }

    pub(crate) fn slot_value(&self, slot: u64) -> i64 {
        self.map.atomic_i64(slot_offset(slot)).load(Ordering::SeqCst)
    }
}

impl RefCounter {
    /// Remove the name now (`DEVSHARE_CLOSE_UNLINK`); consumers that release later find no
    /// object and have nothing to report.
    pub(crate) fn unlink(&self) {
        shm::unlink(&self.name);
    }
}

impl Drop for RefCounter {
    /// PyTorch's protocol: leave the mapping count; whoever brings it to 0 unlinks (a consumer
    /// in the middle of its release may be the last).
    fn drop(&mut self) {
        if self.map.atomic_i32(0).fetch_sub(1, Ordering::SeqCst) == 1 {
            shm::unlink(&self.name);
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
    len: usize,
}

impl Watched {
    /// `Ok(None)` when the object is gone (the producer stopped tracking).
    pub(crate) fn open(name: &[u8]) -> Result<Option<Watched>> {
        let fd = match shm::open(name) {
            Ok(fd) => fd,
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let size = shm::size_of(&fd, name)?;
        let len = usize::try_from(size.min(OBJECT_SIZE as u64)).expect("at most OBJECT_SIZE");
        if len < HEADER_SIZE + 8 {
            return Err(Error::Mismatch(format!(
                "ref-counter {} is {size} bytes, too small for any slot",
                String::from_utf8_lossy(name)
            )));
        }
        let map = Map::new(&fd, len, true, "ref-counter")?;
        Ok(Some(Watched { name: name.to_vec(), map, len }))
    }

    fn slot(&self, slot: u64) -> Result<&std::sync::atomic::AtomicI64> {
        if slot_offset(slot) + 8 > self.len {
            return Err(Error::Mismatch(format!(
                "ref-counter {} is {} bytes, too small for slot {slot}",
                String::from_utf8_lossy(&self.name),
                self.len
            )));
        }
        Ok(self.map.atomic_i64(slot_offset(slot)))
    }

    /// Before use: the reference must still be outstanding.
    pub(crate) fn check(&self, slot: u64) -> Result<()> {
        let v = self.slot(slot)?.load(Ordering::SeqCst);
        if v <= 0 {
            return Err(Error::AlreadyReleased(format!(
                "slot {slot} of ref-counter {} is {v}: this handle's reference was already returned",
                String::from_utf8_lossy(&self.name)
            )));
        }
        Ok(())
    }

    /// Return one reference in PyTorch's order (count +1, slot -1 but not below 0, count -1,
    /// unlink when the count reached 0).
    pub(crate) fn release(&self, slot: u64) {
        let Ok(s) = self.slot(slot) else { return };
        let count = self.map.atomic_i32(0);
        count.fetch_add(1, Ordering::SeqCst);
        let _ = s.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| (v > 0).then(|| v - 1));
        if count.fetch_sub(1, Ordering::SeqCst) == 1 {
            shm::unlink(&self.name);
        }
    }
}

/// Consumer side, before use: the handle's reference must still be outstanding. `Ok(false)` when
/// the ref-counter is gone (the producer stopped tracking), `Ok(true)` when the slot is > 0.
///
/// A plain read through the descriptor (no mapping, no header count change): an aligned 8-byte
/// `pread` of shared memory sees a whole value, and this check only refuses handles whose
/// reference was already returned, which nothing can undo.
pub(crate) fn check_outstanding(name: &[u8], slot: u64) -> Result<bool> {
    let fd = match shm::open_read(name) {
        Ok(fd) => fd,
        Err(Error::NotFound(_)) => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut buf = [0u8; 8];
    let at = slot_offset(slot);
    // SAFETY: valid fd, buf has 8 writable bytes.
    let n = unsafe { libc::pread(std::os::fd::AsRawFd::as_raw_fd(&fd), buf.as_mut_ptr().cast(), 8, at as libc::off_t) };
    if n != 8 {
        return Err(Error::Mismatch(format!(
            "ref-counter {} is too small for slot {slot}",
            String::from_utf8_lossy(name)
        )));
    }
    let v = i64::from_ne_bytes(buf);
    if v <= 0 {
        return Err(Error::AlreadyReleased(format!(
            "slot {slot} of ref-counter {} is {v}: this handle's reference was already returned",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(true)
}
