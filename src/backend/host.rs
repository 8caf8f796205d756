//! The host backend: POSIX shared memory in PyTorch's `file_system` layout.
//!
//! An object is `64 + size` bytes: a 64-byte header whose first 4 bytes are an atomic `int32`
//! count of live mappings, then the data. Exporter and importers each count once while they
//! map it.
//!
//! Who unlinks the name: **whoever brings the count to 0** — PyTorch's protocol, kept exactly,
//! because a PyTorch process that brings the count to 0 after someone else removed the name
//! aborts ("could not unlink the shared memory file"). So the exporter unlinks on close when no
//! importer maps the object any more, otherwise the last importer does when it releases;
//! mappings stay valid meanwhile. A consumer that dies without releasing keeps its count, and the
//! object then stays until someone unlinks it: an exporter that knows no PyTorch process maps the
//! buffer can close with `DEVSHARE_CLOSE_UNLINK` to remove the names at once.
//!
//! What a handle may make a consumer open: a name of the data family (devshare's
//! `/devshare_<pid>_<hex>` or PyTorch's `/torch_<pid>_...`), owned by the consumer's user, mode
//! 0600, at least 64 bytes + the handle's `alloc_size` — checked on the opened descriptor before
//! it is mapped or counted (`shm::open_trusted`). New allocations are refused when `/dev/shm`
//! cannot hold them (`shm::ensure_capacity`).

use super::{Backend, Exported, ImportRequest, Mapping, Probe};
use crate::error::{Error, Result};
use crate::fork::Stamp;
use crate::handle::{DevshareHandle, Validated, DEVSHARE_BACKEND_HOST};
use crate::shm::{self, Map};
use std::sync::atomic::Ordering;

/// Bytes before the data in a host shm object (PyTorch's header).
pub(crate) const HEADER_SIZE: u64 = 64;

pub(crate) struct Host;
pub(crate) static HOST: Host = Host;

/// One live mapping of a host object (the exporter's or an importer's). Counts itself in the
/// header while alive; the drop that brings the count to 0 unlinks the name.
struct Counted {
    name: Vec<u8>,
    /// The whole object (header + data), with the requested protection.
    data: Map,
    /// A writable view of the header when `data` is read-only.
    header: Option<Map>,
    data_len: u64,
    /// The fork generation it counted itself in: a forked child's copy counts nothing.
    generation: Stamp,
    /// The object mapped: the last holder unlinks the name only while it still stands for it.
    id: shm::ObjectId,
}

impl Counted {
    fn count(&self) -> &std::sync::atomic::AtomicI32 {
        self.header.as_ref().unwrap_or(&self.data).atomic_i32(0)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // In a forked child this mapping is a copy of the parent's, whose count it is.
        if !self.generation.is_current() {
            return;
        }
        if self.count().fetch_sub(1, Ordering::SeqCst) == 1 {
            shm::unlink_if_same(&self.name, self.id);
        }
    }
}

fn data_ptr(c: &Counted) -> *mut u8 {
    // SAFETY: the map is HEADER_SIZE + data_len bytes long.
    unsafe { c.data.ptr().add(HEADER_SIZE as usize) }
}

impl Exported for Counted {
    fn ptr(&self) -> *mut u8 {
        data_ptr(self)
    }
    fn size(&self) -> u64 {
        self.data_len
    }
    fn key(&self) -> &[u8] {
        &self.name
    }
    fn device_index(&self) -> i32 {
        0
    }
    fn survives_exporter_close(&self) -> bool {
        true
    }
    fn unlink(&self) {
        // A forked child's copy of the parent's export removes nothing of the parent's.
        if self.generation.is_current() {
            shm::unlink_if_same(&self.name, self.id);
        }
    }
    fn add_inflight(&self) -> Result<()> {
        self.count().fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl Mapping for Counted {
    fn base(&self) -> *mut u8 {
        data_ptr(self)
    }
    fn size(&self) -> u64 {
        self.data_len
    }
    fn take_over_inflight(&self) {
        // Our own mapping holds one count, so this never reaches 0.
        self.count().fetch_sub(1, Ordering::SeqCst);
    }
}

/// Allocate `size` bytes of shareable host memory (zero-filled) under a fresh unguessable name,
/// mode 0600. The returned export counts as one mapping. Refused (`DEVSHARE_STATUS_OS`, errno
/// `ENOSPC`, nothing created) when `/dev/shm` has less room than the object needs.
pub(crate) fn alloc(size: u64) -> Result<Box<dyn Exported>> {
    let generation = Stamp::now();
    let total = size
        .checked_add(HEADER_SIZE)
        .filter(|&t| t <= i64::MAX as u64 && usize::try_from(t).is_ok())
        .ok_or_else(|| Error::InvalidArgument(format!("size {size} is too large")))?;
    let name = shm::random_name(shm::DATA_PREFIX)?;
    let fd = shm::create(&name, total)?;
    let data =
        match shm::id_of(&fd, &name).and_then(|id| Ok((id, Map::new(&fd, total as usize, true, "host allocation")?))) {
            Ok(m) => m,
            Err(e) => {
                shm::unlink(&name);
                return Err(e);
            }
        };
    let (id, data) = data;
    data.atomic_i32(0).store(1, Ordering::SeqCst);
    Ok(Box::new(Counted { name, data, header: None, data_len: size, generation, id }))
}

impl Backend for Host {
    fn id(&self) -> u16 {
        DEVSHARE_BACKEND_HOST
    }

    fn probe(&self) -> Probe {
        match std::fs::metadata("/dev/shm") {
            Ok(m) if m.is_dir() => {
                Probe { usable: true, detail: "POSIX shared memory in /dev/shm (PyTorch file_system layout)".into() }
            }
            _ => Probe { usable: false, detail: "/dev/shm is missing: POSIX shared memory is unavailable".into() },
        }
    }

    fn export(&self, _: i32, _: *mut u8, _: u64, _: &super::ExportOptions) -> Result<Box<dyn Exported>> {
        Err(Error::Unsupported(
            "the host backend cannot share arbitrary process memory; allocate shareable memory \
             with devshare_host_alloc"
                .into(),
        ))
    }

    fn import(&self, h: &DevshareHandle, _: &Validated, req: &ImportRequest) -> Result<Box<dyn Mapping>> {
        if let Some(d) = req.device.filter(|&d| d != 0) {
            return Err(Error::InvalidArgument(format!("host memory has no device {d} (use -1 or 0)")));
        }
        Ok(Box::new(open_counted(h.key_bytes(), h.alloc_size, req.read_only, "the handle's alloc_size")?))
    }
}

/// Map an existing host object of at least `min_data` data bytes and count ourselves in its
/// header. `what` names where `min_data` came from, for the mismatch message. The name family,
/// owner, mode and size are checked on the opened descriptor before anything is mapped.
fn open_counted(name: &[u8], min_data: u64, read_only: bool, what: &str) -> Result<Counted> {
    let generation = Stamp::now();
    let shown = String::from_utf8_lossy(name);
    let shm::Opened { fd, size, id } = shm::open_trusted(name, shm::Kind::Data, true)?;
    let data_len = size.saturating_sub(HEADER_SIZE);
    if size < HEADER_SIZE || data_len < min_data {
        return Err(Error::Mismatch(format!(
            "host object {shown} holds {data_len} data bytes but {what} is {min_data}"
        )));
    }
    let len = usize::try_from(size).map_err(|_| Error::Mismatch(format!("host object {shown} is too large to map")))?;
    let data = Map::new(&fd, len, !read_only, "host object")?;
    let header = if read_only { Some(Map::new(&fd, HEADER_SIZE as usize, true, "host header")?) } else { None };
    // Count ourselves in. A count that was already 0 means the last holder is unlinking it:
    // back out (our maps are simply unmapped; the unlink belongs to that holder).
    let count = header.as_ref().unwrap_or(&data).atomic_i32(0);
    let before = count.fetch_add(1, Ordering::SeqCst);
    if before <= 0 {
        count.fetch_sub(1, Ordering::SeqCst);
        return Err(Error::NotFound(format!(
            "host object {shown} is being released by its last holder (header count was {before})"
        )));
    }
    Ok(Counted { name: name.to_vec(), data, header, data_len, generation, id })
}

/// Export an existing host object in PyTorch's `file_system` layout (one that PyTorch's
/// `_share_filename_cpu_` or another devshare process created) without copying: map it and count
/// in its header like any other holder. The object passes the importer's checks (name family,
/// owner, mode, size): handles naming anything else would be refused by every consumer.
pub(crate) fn adopt(name: &[u8], size: u64) -> Result<Box<dyn Exported>> {
    if !crate::handle::is_shm_name(name) {
        return Err(Error::InvalidArgument(format!(
            "{:?} is not a shm name ('/' then [A-Za-z0-9_.-])",
            String::from_utf8_lossy(name)
        )));
    }
    if name.len() > crate::handle::DEVSHARE_KEY_CAPACITY {
        return Err(Error::InvalidArgument(format!(
            "shm name of {} bytes does not fit a handle key ({} bytes)",
            name.len(),
            crate::handle::DEVSHARE_KEY_CAPACITY
        )));
    }
    let mut c = open_counted(name, size, false, "the requested size")?;
    c.data_len = size;
    Ok(Box::new(c))
}
