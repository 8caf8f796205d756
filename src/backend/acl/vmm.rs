//! Segmented (VMM) memory on ACL: what torch_npu's expandable segments share ('e' handles), and
//! what a C producer builds with `aclrtMallocPhysical` + `aclrtMapMem`.
//!
//! - **Export** (a C producer's physical handles): each physical handle is exported once per
//!   process with `aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_NONE, flags, &s)`
//!   (CANN fails a second export of the same handle; flags 1 = no pid validation, else 0 and
//!   `allow_pid` whitelists the importer on every shareable handle with
//!   `aclrtMemSetPidToShareableHandle`). The process-wide cache maps physical handle ->
//!   shareable handle and counts the live exporters listing it. CANN has no "unexport": a
//!   shareable handle lives as long as its physical handle, which the producer owns and frees
//!   (devshare never frees it). So an entry stays after its last exporter closed ("retired"),
//!   because the same physical memory may be exported again. But a handle value can also be
//!   reused by a later `aclrtMallocPhysical` once the producer freed the old one, and devshare
//!   cannot see the free: exporting a retired handle therefore tries the export again — a fresh
//!   handle exports and replaces the entry; CANN's refusal of a second export
//!   (`ACL_ERROR_INVALID_PARAM`) means the old physical handle is still live (exported before),
//!   and its cached shareable handle is used. Any other error is returned.
//! - **Import**: the target device is bound; every shareable handle is imported with
//!   `aclrtMemImportFromShareableHandle` once per process and refcounted (`PAGES`: shareable
//!   handle -> imported physical handle, users), because CANN allows one live import per
//!   shareable handle per process and torch_npu no longer dedups: two storages whose page lists
//!   overlap import each shared page once. Then exactly `count x segment_size` of address space
//!   is reserved (`aclrtReserveMemAddress(&va, size, 0, NULL, 0)`) and segment i is mapped at
//!   `va + i x segment_size` (`aclrtMapMem`, offset 0, flags 0; no `aclrtMemSetAccess`, as
//!   torch_npu). A failure part-way undoes everything done so far.
//! - **Teardown**, in torch_npu's order: synchronise the device, `aclrtUnmapMem` per segment,
//!   `aclrtReleaseMemAddress`, then per shareable handle one user fewer and `aclrtFreePhysical`
//!   of the imported handle when none is left.
//! - **Cross-device**: `aclrtMemImportFromShareableHandle` has no peer-access flag, so both
//!   `PeerAccess::ByImportFlag` (the default) and `Explicit` call `aclrtDeviceEnablePeerAccess`
//!   (once per device pair and process) before importing on a device other than the handle's;
//!   `None` enables nothing. Whether CANN needs that call for a cross-device 'e' import (or
//!   refuses without it) is unverified: only the stand-in runtime has been run.
//! - Importing a shareable handle in the process that exported it is refused before ACL is
//!   called (CANN does not support it).
//! - The address range is reserved before any shareable handle is imported: a size the runtime
//!   cannot reserve fails before up to `DEVSHARE_MAX_SEGMENTS` imports.
//! - After `fork` the child is a fresh ACL process: both caches, made by the parent, are
//!   forgotten there (nothing is freed or unexported). Each cache belongs to one process
//!   generation ([`PerGeneration`]), so a fork while another thread holds one (during an export,
//!   a whitelisting or an import: their ACL calls run under it) leaves the child a fresh,
//!   unlocked cache rather than a lock no thread of it will let go.

use super::api::{AclApi, DrvMemHandle, ACL_ERROR_INVALID_PARAM, VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION};
use super::{api, enable_peer};
use crate::backend::per_generation::PerGeneration;
use crate::backend::runtime::{self, Stream};
use crate::backend::{ExportOptions, Exported, ImportRequest, IpcEvent, Mapping, PeerAccess, SegmentedMemory};
use crate::error::{Error, Result};
use crate::handle::segments::{SegmentTable, DEVSHARE_SEGMENTS_ACL};
use crate::handle::DevshareHandle;
use std::collections::HashMap;
use std::ffi::c_void;

/// A cache of this process generation (a forked child, whose ACL runtime starts afresh, starts
/// with an empty one; the parent's entries are forgotten there, nothing is freed).
struct PerProcess<T> {
    map: HashMap<u64, T>,
}

impl<T> Default for PerProcess<T> {
    fn default() -> Self {
        PerProcess { map: HashMap::new() }
    }
}

type Cache<T> = PerGeneration<PerProcess<T>>;

/// Give a cache's table back when it is empty, so an idle library holds no memory.
fn shrink<T>(c: &mut PerProcess<T>) {
    if c.map.is_empty() {
        c.map = HashMap::new();
    }
}

// ---------------------------------------------------------------------------------------------
// Export

/// One physical handle this process exported.
struct PhysExport {
    shareable: u64,
    device: i32,
    no_pid_check: bool,
    /// Live exporters listing the handle (once per listing); 0: retired (see the module doc).
    exporters: usize,
    /// Pids already whitelisted on the shareable handle (CANN keeps at most 64).
    allowed: Vec<i32>,
}

/// Held across the export and whitelisting calls (one export of a handle at a time).
static EXPORTS: Cache<PhysExport> = PerGeneration::new();

/// The first of `handles` this process exported (it cannot import that one).
fn exported_here(handles: &[u64]) -> Option<u64> {
    let cache = EXPORTS.lock();
    if cache.map.is_empty() {
        return None;
    }
    let ours: std::collections::HashSet<u64> = cache.map.values().map(|e| e.shareable).collect();
    handles.iter().copied().find(|s| ours.contains(s))
}

/// The shareable handle of `phys` (exported now, or cached); one more exporter listing it.
fn export_one(
    api: &AclApi,
    cache: &mut PerProcess<PhysExport>,
    phys: u64,
    device: i32,
    no_pid_check: bool,
) -> Result<u64> {
    let flags = if no_pid_check { VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION } else { 0 };
    if let Some(e) = cache.map.get_mut(&phys) {
        if e.exporters > 0 {
            if e.device != device {
                return Err(Error::InvalidArgument(format!(
                    "physical handle {phys:#x} is already exported on device {}, not {device}",
                    e.device
                )));
            }
            if e.no_pid_check != no_pid_check {
                return Err(Error::InvalidArgument(format!(
                    "physical handle {phys:#x} is already exported {} pid validation (CANN exports a \
                     physical handle once); export it again with the same DEVSHARE_EXPORT_NO_PID_CHECK setting",
                    if e.no_pid_check { "without" } else { "with" }
                )));
            }
            e.exporters += 1;
            return Ok(e.shareable);
        }
        // Retired: the same live handle (exported before: CANN refuses a second export, and the
        // cached shareable handle still stands) or a new one with the same value (exports
        // afresh). Only that refusal means "still live": any other error is returned.
        match api.mem_export_to_shareable_handle(DrvMemHandle(phys as usize as *mut c_void), flags) {
            Ok(s) => {
                *e = PhysExport { shareable: s, device, no_pid_check, exporters: 1, allowed: Vec::new() };
                return Ok(s);
            }
            Err(err) => {
                let refused_again = matches!(err, Error::Vendor { code: ACL_ERROR_INVALID_PARAM, .. });
                if !refused_again || e.device != device || e.no_pid_check != no_pid_check {
                    return Err(err);
                }
                e.exporters = 1;
                return Ok(e.shareable);
            }
        }
    }
    let s = api.mem_export_to_shareable_handle(DrvMemHandle(phys as usize as *mut c_void), flags)?;
    cache.map.insert(phys, PhysExport { shareable: s, device, no_pid_check, exporters: 1, allowed: Vec::new() });
    Ok(s)
}

/// One exporter fewer listing `phys`.
fn unexport_one(cache: &mut PerProcess<PhysExport>, phys: u64) {
    if let Some(e) = cache.map.get_mut(&phys) {
        e.exporters = e.exporters.saturating_sub(1);
    }
}

/// A C producer's segmented allocation, exported.
struct AclSegmentsExport {
    device: i32,
    base: *mut u8,
    segment_size: u64,
    physical: Vec<u64>,
    /// `physical.len()` shareable handles, u64 little-endian: the handles' segment table.
    table: Vec<u8>,
    no_pid_check: bool,
}

// SAFETY: the base is device memory addressed by a plain pointer, never dereferenced here; the
// rest is plain data, and the cache it updates is behind a mutex.
unsafe impl Send for AclSegmentsExport {}
// SAFETY: as for Send; shared access only reads the fields.
unsafe impl Sync for AclSegmentsExport {}

impl AclSegmentsExport {
    fn shareables(&self) -> impl Iterator<Item = u64> + '_ {
        self.table.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
    }
}

impl Drop for AclSegmentsExport {
    /// The shareable handles stay valid as long as the physical memory (the producer's to
    /// free): nothing to undo in ACL, only the count of exporters.
    fn drop(&mut self) {
        let mut cache = EXPORTS.lock();
        for &p in &self.physical {
            unexport_one(&mut cache, p);
        }
    }
}

impl Exported for AclSegmentsExport {
    fn ptr(&self) -> *mut u8 {
        self.base
    }
    fn size(&self) -> u64 {
        self.segment_size * self.physical.len() as u64
    }
    fn key(&self) -> &[u8] {
        &[]
    }
    fn device_index(&self) -> i32 {
        self.device
    }
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn segments(&self) -> Option<(u64, u16, &[u8])> {
        Some((self.segment_size, DEVSHARE_SEGMENTS_ACL, &self.table))
    }
    /// Whitelist `pid` on every segment's shareable handle (once per handle and pid).
    fn allow_pid(&self, pid: i32) -> Result<()> {
        if self.no_pid_check {
            return Ok(());
        }
        let api = api()?;
        let _g = api.bind(self.device)?;
        let mut cache = EXPORTS.lock();
        for (&phys, s) in self.physical.iter().zip(self.shareables()) {
            let Some(e) = cache.map.get_mut(&phys).filter(|e| e.shareable == s) else {
                return Err(Error::Internal(format!(
                    "physical handle {phys:#x} of a live export is not in the export cache"
                )));
            };
            if !e.allowed.contains(&pid) {
                api.mem_set_pid_to_shareable_handle(s, &[pid])?;
                e.allowed.push(pid);
            }
        }
        Ok(())
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        runtime::prepare_share(api()?, self.device, Stream(stream), event)
    }
}

/// [`Backend::export_segments`](crate::backend::Backend::export_segments) for acl.
pub(super) fn export_segments(
    device: i32,
    mem: &SegmentedMemory<'_>,
    opts: &ExportOptions,
) -> Result<Box<dyn Exported>> {
    let api = api()?;
    api.vmm_available()?;
    if let Some(i) = mem.physical.iter().position(|&p| p == 0) {
        return Err(Error::InvalidArgument(format!("physical[{i}] is NULL, not an aclrtDrvMemHandle")));
    }
    let _g = api.bind(device)?;
    let mut cache = EXPORTS.lock();
    let mut table = Vec::with_capacity(mem.physical.len() * 8);
    for (i, &phys) in mem.physical.iter().enumerate() {
        match export_one(api, &mut cache, phys, device, opts.no_pid_check) {
            Ok(s) => table.extend_from_slice(&s.to_le_bytes()),
            Err(e) => {
                for &p in &mem.physical[..i] {
                    unexport_one(&mut cache, p);
                }
                return Err(in_segment(e, i, mem.physical.len(), &format!("physical handle {phys:#x}")));
            }
        }
    }
    drop(cache);
    Ok(Box::new(AclSegmentsExport {
        device,
        base: mem.base,
        segment_size: mem.segment_size,
        physical: mem.physical.to_vec(),
        table,
        no_pid_check: opts.no_pid_check,
    }))
}

/// Name the segment a vendor error happened at.
fn in_segment(e: Error, i: usize, n: usize, what: &str) -> Error {
    match e {
        Error::Vendor { call, code, message } => {
            Error::Vendor { call, code, message: format!("segment {i} of {n} ({what}): {message}") }
        }
        e => e,
    }
}

// ---------------------------------------------------------------------------------------------
// Import

/// One shareable handle imported in this process.
struct Page {
    drv: DrvMemHandle,
    device: i32,
    /// Segments mapped from it, over all imports of this process.
    users: usize,
}

/// Held across the import calls (one import of a shareable handle at a time).
static PAGES: Cache<Page> = PerGeneration::new();

/// A segmented allocation mapped in this process. Built step by step: dropping it undoes
/// exactly the steps done (also after a failure part-way through the import).
struct AclSegMapping {
    device: i32,
    segment_size: u64,
    count: u64,
    /// The reservation (null until reserved).
    base: *mut u8,
    /// Segments mapped so far (from the first).
    mapped: u64,
    /// Shareable handles this mapping holds one user of (imported or cached).
    pages: Vec<u64>,
}

// SAFETY: the mapping is device memory addressed by a plain pointer, never dereferenced here;
// its drop runs once (when the registry drops the last reference), and the page cache it shares
// with concurrent imports and drops of other mappings is behind a mutex.
unsafe impl Send for AclSegMapping {}
// SAFETY: as for Send; shared access only reads the fields.
unsafe impl Sync for AclSegMapping {}

impl Mapping for AclSegMapping {
    fn base(&self) -> *mut u8 {
        self.base
    }
    /// Exactly the reservation: `count x segment_size`.
    fn size(&self) -> u64 {
        self.count * self.segment_size
    }
    fn device(&self) -> Option<i32> {
        Some(self.device)
    }
}

impl AclSegMapping {
    fn segment(&self, i: u64) -> *mut c_void {
        self.base.wrapping_add((i * self.segment_size) as usize).cast()
    }
}

impl Drop for AclSegMapping {
    /// torch_npu's order: synchronise the device, unmap every segment, release the address
    /// range, then free each imported handle whose last user this was.
    ///
    /// When the device cannot be bound (or the runtime is gone), nothing is unmapped; the users
    /// are still given back, but a page whose last user this was stays imported (and cached,
    /// with no users: a later import of it takes it again), since its segments stay mapped.
    fn drop(&mut self) {
        let api = api().ok();
        let bound = api.and_then(|api| api.bind(self.device).ok());
        if let (Some(api), Some(_)) = (api, &bound) {
            if self.mapped > 0 {
                let _ = api.synchronize_device();
            }
            for i in 0..self.mapped {
                let _ = api.unmap_mem(self.segment(i));
            }
            if !self.base.is_null() {
                let _ = api.release_mem_address(self.base.cast());
            }
        }
        if !self.pages.is_empty() {
            let mut pages = PAGES.lock();
            for s in self.pages.drain(..) {
                let last = match pages.map.get_mut(&s) {
                    Some(p) => {
                        p.users = p.users.saturating_sub(1);
                        p.users == 0
                    }
                    None => false,
                };
                if let (true, Some(api), Some(_)) = (last, api, &bound) {
                    if let Some(p) = pages.map.remove(&s) {
                        let _ = api.free_physical(p.drv);
                    }
                }
            }
            shrink(&mut pages);
        }
        drop(bound);
    }
}

/// Import (or take one more user of) every shareable handle of `handles` on `device` (bound),
/// recording each in `m.pages`; the imported physical handles, in order.
fn acquire_pages(api: &AclApi, m: &mut AclSegMapping, handles: &[u64]) -> Result<Vec<DrvMemHandle>> {
    let mut pages = PAGES.lock();
    let mut drvs = Vec::with_capacity(handles.len());
    for (i, &s) in handles.iter().enumerate() {
        let drv = match pages.map.get_mut(&s) {
            Some(p) if p.device != m.device => {
                return Err(Error::Unsupported(format!(
                    "segment {i} (shareable handle {s:#x}) is already imported on device {} in this process, \
                     and CANN allows one import of a shareable handle per process: import it on device {} too",
                    p.device, p.device
                )));
            }
            Some(p) => {
                p.users += 1;
                p.drv
            }
            None => {
                let drv = api.mem_import_from_shareable_handle(s, m.device).map_err(|e| {
                    in_segment(e, i, handles.len(), &format!("shareable handle {s:#x} on device {}", m.device))
                })?;
                pages.map.insert(s, Page { drv, device: m.device, users: 1 });
                drv
            }
        };
        m.pages.push(s);
        drvs.push(drv);
    }
    Ok(drvs)
}

/// [`Backend::import_segmented`](crate::backend::Backend::import_segmented) for acl.
pub(super) fn import_segmented(
    h: &DevshareHandle,
    t: &SegmentTable<'_>,
    req: &ImportRequest,
) -> Result<Box<dyn Mapping>> {
    if req.read_only {
        return Err(Error::Unsupported("ACL imports cannot be mapped read-only".into()));
    }
    if t.seg.kind != DEVSHARE_SEGMENTS_ACL {
        return Err(Error::InvalidArgument(format!("segment table kind {} is not acl's", t.seg.kind)));
    }
    let api = api()?;
    api.vmm_available()?;
    let handles: Vec<u64> = t.acl_handles().collect();
    let count = handles.len() as u64;
    let total = t
        .seg
        .segment_size
        .checked_mul(count)
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| Error::bad_size("ext", "count x segment_size does not fit this process's address space"))?;
    if let Some(s) = exported_here(&handles) {
        return Err(Error::Unsupported(format!(
            "shareable handle {s:#x} was exported by this process, and CANN does not support importing \
             in the exporting process: use the memory directly"
        )));
    }
    let device = req.device.unwrap_or(h.device_index);
    let _g = api.bind(device)?;
    if device != h.device_index {
        match req.peer {
            // No import flag exists for shareable handles: the default enables peer access
            // with the call, like Explicit. (Unverified on hardware: whether CANN needs it.)
            PeerAccess::ByImportFlag | PeerAccess::Explicit => enable_peer(api, device, h.device_index)?,
            PeerAccess::None => {}
        }
    }
    let mut m = AclSegMapping {
        device,
        segment_size: t.seg.segment_size,
        count,
        base: std::ptr::null_mut(),
        mapped: 0,
        pages: Vec::with_capacity(handles.len()),
    };
    // From here on, `?` drops `m`, which undoes what was done. The address range comes first:
    // a size ACL cannot reserve fails before any shareable handle is imported.
    let va = api.reserve_mem_address(total as usize)?;
    if va.is_null() {
        return Err(Error::Internal("aclrtReserveMemAddress returned success and a NULL address".into()));
    }
    m.base = va.cast();
    let drvs = acquire_pages(api, &mut m, &handles)?;
    for (i, drv) in drvs.into_iter().enumerate() {
        api.map_mem(m.segment(i as u64), t.seg.segment_size as usize, drv).map_err(|e| {
            in_segment(
                e,
                i,
                handles.len(),
                &format!("shareable handle {:#x}, {} bytes", handles[i], t.seg.segment_size),
            )
        })?;
        m.mapped += 1;
    }
    Ok(Box::new(m))
}
