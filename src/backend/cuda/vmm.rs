//! Segmented (VMM) memory of the cuda backend: PyTorch's expandable segments ('e' handles,
//! version 2) and a C producer's `cuMemCreate` + `cuMemMap` buffers, shared as POSIX fds (taken
//! by consumers with `pidfd_getfd`) or fabric handles. See the backend's module documentation
//! for the calls and their order.
//!
//! A consumer knows an fd-table page by the handle's word only: (producer pid, fd number), in
//! its page cache here and (with the whole table) in the import registry. That is sound while
//! the producer keeps the fds open, which it does while references are outstanding (closing
//! waits for them). A channel connection may keep pages mapped past that (a registered
//! export's, between leases), so its pages are cached for it alone (`ImportRequest::scope`):
//! its producer tells it of a close (`RETIRE`) before any later share on it, but nothing orders
//! that news before another connection's or a plain import's handle of new memory under the
//! same numbers. A producer that FORCE-closes a segmented export with references outstanding
//! closes the fds, and a later export of other memory may get the same fd numbers: a consumer
//! that still holds an import of the old table then gets the old mapping (the old memory) for
//! the new handle. FORCE-closing a segmented CUDA export with outstanding references is
//! therefore unsafe (documented at `devshare_exporter_close`).
//!
//! Both page caches belong to one process generation ([`PerGeneration`]): a forked child starts
//! with empty ones (a hit there would return the parent's handles), and a fork while another
//! thread holds one during a driver call does not leave the child a lock that is never let go.

use super::api::{CudaApi, DevPtr, MemAccess, MemHandle, FABRIC_HANDLE_LEN};
use super::{api, uuid};
use crate::backend::per_generation::PerGeneration;
use crate::backend::runtime::{self, Runtime, Stream};
use crate::backend::{ExportOptions, Exported, ImportRequest, IpcEvent, Mapping, SegmentedMemory};
use crate::error::{Error, Result};
use crate::handle::segments::{SegmentTable, DEVSHARE_SEGMENTS_CUDA_FABRIC, DEVSHARE_SEGMENTS_CUDA_FD};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};

// ---------------------------------------------------------------------------------------------
// Segmented (VMM) export

/// What consumers open one physical allocation by.
enum Shareable {
    /// A POSIX fd of this process (`cuMemExportToShareableHandle`), open until the page is
    /// dropped; consumers take it with `pidfd_getfd`.
    Fd(OwnedFd),
    /// A `CUmemFabricHandle`.
    Fabric([u8; FABRIC_HANDLE_LEN]),
}

/// One physical allocation exported by this process, shared by every segmented exporter of it:
/// the driver is asked once per handle and kind (as PyTorch caches a segment's shareable
/// handle), so two exports of overlapping pages carry the same fd numbers and a consumer imports
/// each page once (per scope: `ImportRequest::scope`).
struct ExportedPage {
    shareable: Shareable,
}

/// Key: (fabric, physical handle). The caller keeps each handle alive while it is exported. Held
/// across the export call; a forked child starts with an empty cache (see [`PerGeneration`]).
static EXPORTED_PAGES: PerGeneration<HashMap<(bool, MemHandle), Weak<ExportedPage>>> = PerGeneration::new();

impl Drop for ExportedPage {
    /// The fd closes with the page (consumers that took it keep their own); the cache forgets it.
    fn drop(&mut self) {
        runtime::prune(&mut EXPORTED_PAGES.lock());
    }
}

/// The page of `handle`, exported now or shared with a live exporter of it.
fn exported_page(api: &CudaApi, handle: MemHandle, fabric: bool) -> Result<Arc<ExportedPage>> {
    let mut cache = EXPORTED_PAGES.lock();
    if let Some(page) = cache.get(&(fabric, handle)).and_then(Weak::upgrade) {
        return Ok(page);
    }
    let shareable = if fabric {
        Shareable::Fabric(api.mem_export_fabric(handle)?)
    } else {
        Shareable::Fd(api.mem_export_fd(handle)?)
    };
    let page = Arc::new(ExportedPage { shareable });
    runtime::prune(&mut cache);
    cache.insert((fabric, handle), Arc::downgrade(&page));
    Ok(page)
}

/// A C producer's segmented allocation, exported: its pages (fds kept open) and the table that
/// goes into its handles.
pub(super) struct CudaSegmentsExport {
    base: DevPtr,
    segment_size: u64,
    device: c_int,
    uuid: [u8; 16],
    kind: u16,
    table: Vec<u8>,
    /// Kept for the life of the export: each holds its fd open.
    pages: Vec<Arc<ExportedPage>>,
}

impl Exported for CudaSegmentsExport {
    fn ptr(&self) -> *mut u8 {
        self.base as *mut u8
    }
    fn size(&self) -> u64 {
        self.segment_size * (self.pages.len() as u64)
    }
    fn key(&self) -> &[u8] {
        &[]
    }
    fn device_index(&self) -> i32 {
        self.device
    }
    fn device_uuid(&self) -> [u8; 16] {
        self.uuid
    }
    /// Consumers cannot import once the fds are closed: closing waits for their references.
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn segments(&self) -> Option<(u64, u16, &[u8])> {
        Some((self.segment_size, self.kind, &self.table))
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        runtime::prepare_share(api()?, self.device, Stream(stream), event)
    }
    fn segment_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let mut seen = std::collections::HashSet::new();
        self.pages
            .iter()
            .filter_map(|p| match &p.shareable {
                Shareable::Fd(fd) if seen.insert(fd.as_raw_fd()) => Some(fd.as_fd()),
                _ => None,
            })
            .collect()
    }
}

/// The device's VMM granularity, and an error naming it when `segment_size` is no multiple.
fn check_granularity(api: &CudaApi, device: c_int, segment_size: u64) -> Result<()> {
    let granularity = api.mem_get_allocation_granularity(device)?;
    if granularity == 0 || segment_size % granularity != 0 {
        return Err(Error::Unsupported(format!(
            "segment_size {segment_size} is not a multiple of CUDA device {device}'s VMM granularity \
             {granularity} (cuMemGetAllocationGranularity): its segments cannot be mapped here"
        )));
    }
    Ok(())
}

pub(super) fn export_segments(
    api: &Runtime<CudaApi>,
    device: c_int,
    mem: &SegmentedMemory<'_>,
    opts: &ExportOptions,
) -> Result<CudaSegmentsExport> {
    let _g = api.bind(device)?;
    check_granularity(api, device, mem.segment_size)?;
    let base = mem.base as DevPtr;
    // Each handle must be what is mapped at its segment's address: a wrong order or a gap would
    // give consumers other bytes than the producer's.
    for (i, &physical) in mem.physical.iter().enumerate() {
        let addr = base + i as u64 * mem.segment_size;
        let mapped = api.mem_retain_allocation_handle(addr).map_err(|e| {
            Error::InvalidArgument(format!(
                "segment {i} at {addr:#x} is not VMM memory mapped in this process (cuMemCreate + cuMemMap): {e}"
            ))
        })?;
        api.mem_release(mapped)?;
        if mapped != physical {
            return Err(Error::InvalidArgument(format!(
                "segment {i} at {addr:#x} is mapped from physical handle {mapped:#x}, not physical[{i}] = \
                 {physical:#x}: list the handles in address order, one per segment_size bytes"
            )));
        }
    }
    let mut pages = Vec::with_capacity(mem.physical.len());
    let (kind, mut table) = if opts.fabric {
        (DEVSHARE_SEGMENTS_CUDA_FABRIC, Vec::with_capacity(mem.physical.len() * FABRIC_HANDLE_LEN))
    } else {
        (DEVSHARE_SEGMENTS_CUDA_FD, Vec::with_capacity(mem.physical.len() * 4))
    };
    for &physical in mem.physical {
        let page = exported_page(api, physical, opts.fabric)?;
        match &page.shareable {
            Shareable::Fd(fd) => table.extend_from_slice(&fd.as_raw_fd().to_le_bytes()),
            Shareable::Fabric(f) => table.extend_from_slice(f),
        }
        pages.push(page);
    }
    Ok(CudaSegmentsExport {
        base,
        segment_size: mem.segment_size,
        device,
        uuid: uuid(api, device)?,
        kind,
        table,
        pages,
    })
}

// ---------------------------------------------------------------------------------------------
// Segmented (VMM) import

/// What identifies one segment's physical memory for a consumer: the producer's fd number
/// (valid while the producer keeps the segment exported, which it does while references to it
/// are outstanding), or the fabric handle.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum PageKey {
    /// (`scope`: whom the page is cached for, `ImportRequest::scope`.)
    Fd {
        pid: i32,
        fd: i32,
        scope: u64,
    },
    Fabric([u8; FABRIC_HANDLE_LEN]),
}

/// One imported physical allocation (one `cuMemImportFromShareableHandle` reference), shared by
/// every mapping in this process that maps it; released when the last one drops.
struct ImportedPage {
    handle: MemHandle,
    /// The device whose context released it (any context of the process would do).
    device: c_int,
}

/// Held across the `pidfd_getfd` and import calls; a forked child starts with an empty cache (a
/// hit there would return the parent's handles; see [`PerGeneration`]).
static IMPORTED_PAGES: PerGeneration<HashMap<PageKey, Weak<ImportedPage>>> = PerGeneration::new();

impl Drop for ImportedPage {
    /// Never takes the cache's lock (pages may drop while it is held); dead entries are pruned
    /// by the next insert and by the mapping that dropped them.
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                let _ = api.mem_release(self.handle);
            }
        }
    }
}

/// The page `key` names, imported now by `import` or shared with a live mapping of it.
fn imported_page(key: PageKey, device: c_int, import: impl FnOnce() -> Result<MemHandle>) -> Result<Arc<ImportedPage>> {
    let mut cache = IMPORTED_PAGES.lock();
    if let Some(page) = cache.get(&key).and_then(Weak::upgrade) {
        return Ok(page);
    }
    let page = Arc::new(ImportedPage { handle: import()?, device });
    runtime::prune(&mut cache);
    cache.insert(key, Arc::downgrade(&page));
    Ok(page)
}

/// Every segment's physical memory, in address order (nothing is mapped yet). On an error the
/// pages imported so far are released and every stolen fd is closed.
fn import_pages(
    api: &CudaApi,
    device: c_int,
    t: &SegmentTable<'_>,
    passed: Option<&crate::backend::PassedFds>,
    scope: u64,
) -> Result<Vec<Arc<ImportedPage>>> {
    let mut pages = Vec::with_capacity(t.seg.count as usize);
    match t.seg.kind {
        DEVSHARE_SEGMENTS_CUDA_FD => {
            let pid = t.producer_pid;
            let mut producer: Option<crate::backend::pidfd::Process> = None;
            for fd in t.fds() {
                pages.push(imported_page(PageKey::Fd { pid, fd, scope }, device, || {
                    // Passed next to the handle (over a channel): no pidfd_getfd needed.
                    if let Some(passed) = passed.and_then(|p| p.take(pid, fd)) {
                        return api.mem_import_fd(passed.as_fd());
                    }
                    let process = match &mut producer {
                        Some(p) => p,
                        none => none.insert(crate::backend::pidfd::Process::open(pid)?),
                    };
                    let stolen = process.take_fd(fd)?;
                    // The driver keeps its own reference: the stolen fd closes right here,
                    // whatever the import did.
                    api.mem_import_fd(stolen.as_fd())
                })?);
            }
        }
        DEVSHARE_SEGMENTS_CUDA_FABRIC => {
            for fabric in t.fabric_handles() {
                pages.push(imported_page(PageKey::Fabric(fabric), device, || api.mem_import_fabric(&fabric))?);
            }
        }
        kind => return Err(Error::Internal(format!("segment table kind {kind} reached the cuda backend"))),
    }
    Ok(pages)
}

/// A segmented allocation mapped into this process: one reservation of exactly
/// `count x segment_size`, segment i mapped at `va + i x segment_size`.
pub(super) struct CudaSegmentsMapping {
    va: DevPtr,
    /// `count x segment_size`: the reservation's size.
    size: u64,
    segment_size: u64,
    device: c_int,
    /// Segments mapped so far (all of them once built): an import that fails part way unmaps
    /// these.
    mapped: usize,
    /// Whether the address space is reserved yet.
    reserved: bool,
    /// Every segment's page once built (the reservation comes first, then the pages).
    pages: Vec<Arc<ImportedPage>>,
}

impl Mapping for CudaSegmentsMapping {
    fn base(&self) -> *mut u8 {
        self.va as *mut u8
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn device(&self) -> Option<i32> {
        Some(self.device)
    }
}

impl Drop for CudaSegmentsMapping {
    /// After this process's work: unmap each segment, release the pages no other mapping uses,
    /// give the address space back.
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                let _ = api.ctx_synchronize();
                for i in 0..self.mapped {
                    let _ = api.mem_unmap(self.va + i as u64 * self.segment_size, self.segment_size);
                }
                self.pages.clear();
                if self.reserved {
                    let _ = api.mem_address_free(self.va, self.size);
                }
            }
        }
        self.pages.clear();
        runtime::prune(&mut IMPORTED_PAGES.lock());
    }
}

pub(super) fn import_segmented(
    api: &Runtime<CudaApi>,
    device: c_int,
    t: &SegmentTable<'_>,
    req: &ImportRequest,
    passed: Option<&crate::backend::PassedFds>,
) -> Result<CudaSegmentsMapping> {
    let _g = api.bind(device)?;
    check_granularity(api, device, t.seg.segment_size)?;
    let size = t
        .seg
        .segment_size
        .checked_mul(u64::from(t.seg.count))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| Error::bad_size("ext", "count x segment_size does not fit this process's address space"))?;
    // Owned from here on: an error below undoes what was done (unmap, release, free).
    let mut m = CudaSegmentsMapping {
        va: 0,
        size,
        segment_size: t.seg.segment_size,
        device,
        mapped: 0,
        reserved: false,
        pages: Vec::new(),
    };
    // The address range first: a size the driver cannot reserve fails before any fd is taken
    // from the producer or any page is imported.
    m.va = api.mem_address_reserve(size)?;
    m.reserved = true;
    m.pages = import_pages(api, device, t, passed, req.scope)?;
    if m.pages.len() != t.seg.count as usize {
        return Err(Error::Internal(format!("{} pages imported for {} segments", m.pages.len(), t.seg.count)));
    }
    for i in 0..m.pages.len() {
        api.mem_map(m.va + i as u64 * m.segment_size, m.segment_size, m.pages[i].handle)?;
        m.mapped += 1;
    }
    let access = if req.read_only { MemAccess::Read } else { MemAccess::ReadWrite };
    api.mem_set_access(m.va, m.size, device, access)?;
    Ok(m)
}
