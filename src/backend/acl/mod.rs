//! The acl backend: Ascend NPU memory shared with ACL IPC keys, over the runtime
//! (`libascendcl.so`, loaded at run time; its typed wrapper is `api.rs`).
//!
//! - Export: one key per exported range per process (`aclrtIpcMemGetExportKey`, cached while
//!   any exporter of it lives), with pid validation unless asked otherwise; the exporter closes
//!   the key (`aclrtIpcMemClose`) when its last exporter goes, which `Exporter::check_close`
//!   allows only once every reference was released.
//! - Import: `aclrtIpcMemImportByKey` once per (key, device) per process — the import registry
//!   caches it — and `aclrtIpcMemClose` when the last import of it is released, after a device
//!   synchronisation, so closes equal imports.
//! - Sizes: CANN does not report how large the allocation behind a key is, so a key import's
//!   size is bounded by what the runtime does report — the importing device's memory
//!   (`aclrtGetMemInfo`, HBM, or DDR on devices without HBM): a handle whose `alloc_size` is
//!   larger is refused before anything is imported, and the mapping's size is that bound, never
//!   "unknown". Within it `alloc_size` is trusted. Segmented imports know their size exactly
//!   (what devshare reserved and mapped).
//! - Segmented (VMM) memory — torch_npu's expandable segments ('e' handles) and a C producer's
//!   `aclrtMallocPhysical` memory — is exported and imported by shareable handle: `vmm.rs`.
//! - ACL contexts are per thread: every call runs with the device bound on the calling thread
//!   (`aclrtSetDevice`), and the thread's previous device is bound again afterwards.

mod api;
mod vmm;

use super::runtime::{self, prune, Runtime, Stream};
use super::{Backend, ExportOptions, Exported, ImportRequest, IpcEvent, Mapping, PeerAccess, Probe, SegmentedMemory};
use crate::error::{Error, Result};
use crate::handle::segments::SegmentTable;
use crate::handle::{AclKey, DevshareHandle, Validated, DEVSHARE_BACKEND_ACL};
use crate::loader::OnDemand;
use api::{AclApi, EXPORT_FLAG_DISABLE_PID_VALIDATION, IMPORT_FLAG_ENABLE_PEER_ACCESS, MEM_ATTR_DDR, MEM_ATTR_HBM};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Smallest page size of device memory; exported ranges must be whole pages.
const PAGE: u64 = 4096;

static RUNTIME: OnDemand<Runtime<AclApi>> = OnDemand::new(|| Ok(Runtime::new(AclApi::load()?)));

/// The loaded runtime (see [`OnDemand::get`]).
fn api() -> Result<&'static Runtime<AclApi>> {
    RUNTIME.get()
}

/// This process's bare tgid (`aclrtDeviceGetBareTgid`, asked with device 0 bound on this
/// thread for the call): the pid ACL exporters whitelist for it. `None` when no ACL runtime
/// with a device is usable here, or when the runtime was initialised by a process this one was
/// forked from (a forked child must not call it).
pub(crate) fn bare_tgid() -> Option<i32> {
    if RUNTIME.inherited() || !ACL.probe().usable {
        return None;
    }
    ACL.local_pid(0).ok().filter(|&p| p > 0)
}

// ---------------------------------------------------------------------------------------------
// Export

/// One exported range and its key; shared by every exporter of the same range in this process.
/// The last one to go closes the key.
struct KeyEntry {
    key: AclKey,
    device: i32,
    ptr: usize,
    size: u64,
    no_pid_check: bool,
}

impl Drop for KeyEntry {
    /// Exporter-side destroy, under the cache lock: a concurrent export of the same range then
    /// either finds this entry dead and exports afresh after the close, never a key being closed.
    fn drop(&mut self) {
        let cache = EXPORTS.get().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()));
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                let _ = api.ipc_mem_close(self.key.as_c_str());
            }
        }
        if let Some(mut c) = cache {
            prune(&mut c);
        }
    }
}

type ExportCache = Mutex<HashMap<(i32, usize, u64), Weak<KeyEntry>>>;
static EXPORTS: OnceLock<ExportCache> = OnceLock::new();

fn export_key(
    api: &Runtime<AclApi>,
    device: i32,
    ptr: *mut u8,
    size: u64,
    no_pid_check: bool,
) -> Result<Arc<KeyEntry>> {
    let mut cache = EXPORTS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    let id = (device, ptr as usize, size);
    if let Some(entry) = cache.get(&id).and_then(Weak::upgrade) {
        // Unlock first: if the other exporter closes meanwhile, dropping `entry` here is the
        // last reference, and its drop takes the lock.
        drop(cache);
        if entry.no_pid_check != no_pid_check {
            return Err(Error::InvalidArgument(format!(
                "this range is already exported {} pid validation; export it again with the same \
                 DEVSHARE_EXPORT_NO_PID_CHECK setting",
                if entry.no_pid_check { "without" } else { "with" }
            )));
        }
        return Ok(entry);
    }
    let _g = api.bind(device)?;
    let flags = if no_pid_check { EXPORT_FLAG_DISABLE_PID_VALIDATION } else { 0 };
    let raw = api.ipc_mem_get_export_key(ptr.cast(), size as usize, flags)?;
    let key = AclKey::normalize(&raw).inspect_err(|_| {
        // The runtime returned a key it cannot have meant; destroy what it made, if the key
        // can be passed back at all.
        if let Ok(k) = CStr::from_bytes_until_nul(&raw) {
            let _ = api.ipc_mem_close(k);
        }
    })?;
    let entry = Arc::new(KeyEntry { key, device, ptr: ptr as usize, size, no_pid_check });
    cache.retain(|_, w| w.strong_count() > 0);
    cache.insert(id, Arc::downgrade(&entry));
    Ok(entry)
}

struct AclExport {
    entry: Arc<KeyEntry>,
}

impl Exported for AclExport {
    fn ptr(&self) -> *mut u8 {
        self.entry.ptr as *mut u8
    }
    fn size(&self) -> u64 {
        self.entry.size
    }
    fn key(&self) -> &[u8] {
        self.entry.key.as_bytes()
    }
    fn device_index(&self) -> i32 {
        self.entry.device
    }
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn allow_pid(&self, pid: i32) -> Result<()> {
        if self.entry.no_pid_check {
            return Ok(());
        }
        let api = api()?;
        let _g = api.bind(self.entry.device)?;
        api.ipc_mem_set_import_pid(self.entry.key.as_c_str(), &[pid])
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        runtime::prepare_share(api()?, self.entry.device, Stream(stream), event)
    }
}

// ---------------------------------------------------------------------------------------------
// Import

struct AclMapping {
    key: AclKey,
    base: *mut u8,
    device: i32,
    /// The most the allocation can be: the importing device's memory ([`device_memory`]).
    bound: u64,
}

// SAFETY: the mapping is device memory addressed by a plain pointer, never dereferenced here;
// its fields never change, and its drop runs once, when the registry drops the last reference.
unsafe impl Send for AclMapping {}
// SAFETY: as for Send; shared access only reads the fields.
unsafe impl Sync for AclMapping {}

impl Mapping for AclMapping {
    fn base(&self) -> *mut u8 {
        self.base
    }
    /// A bound, not the allocation's size (CANN does not report that): the importing device's
    /// memory. Handles claiming more are refused; below it `alloc_size` is trusted.
    fn size(&self) -> u64 {
        self.bound
    }
    fn device(&self) -> Option<i32> {
        Some(self.device)
    }
}

impl Drop for AclMapping {
    /// torch_npu's order: synchronise the device, then close this import of the key.
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                let _ = api.synchronize_device();
                let _ = api.ipc_mem_close(self.key.as_c_str());
            }
        }
    }
}

/// Memory of each device, as `aclrtGetMemInfo` reported it (asked once per device).
static DEVICE_MEMORY: OnceLock<Mutex<HashMap<i32, u64>>> = OnceLock::new();

/// The most one allocation can be on `device` (bound on this thread by the caller): the device's
/// total memory, `aclrtGetMemInfo(ACL_HBM_MEM)` (which CANN answers from DDR on devices without
/// HBM), else `ACL_DDR_MEM`. A runtime that reports neither leaves nothing to bound a key
/// import by: refused.
fn device_memory(api: &AclApi, device: i32) -> Result<u64> {
    let cache = DEVICE_MEMORY.get_or_init(Default::default);
    if let Some(&n) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&device) {
        return Ok(n);
    }
    let (_, hbm) = api.get_mem_info(MEM_ATTR_HBM)?;
    let total = if hbm > 0 { hbm } else { api.get_mem_info(MEM_ATTR_DDR)?.1 };
    if total == 0 {
        return Err(Error::Unsupported(format!(
            "aclrtGetMemInfo reports no memory on device {device} (HBM and DDR totals are 0), so \
             nothing bounds the size of an imported key's allocation, which CANN does not report: \
             refused rather than trusting the handle's alloc_size"
        )));
    }
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(device, total);
    Ok(total)
}

/// (importing device, peer) pairs for which this process enabled peer access.
static PEERS: OnceLock<Mutex<HashSet<(i32, i32)>>> = OnceLock::new();

/// Enable access from `device` (bound by the caller) to `peer`, once per process.
fn enable_peer(api: &AclApi, device: i32, peer: i32) -> Result<()> {
    let mut done = PEERS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if done.contains(&(device, peer)) {
        return Ok(());
    }
    api.device_enable_peer_access(peer, 0)?;
    done.insert((device, peer));
    Ok(())
}

pub(crate) struct Acl;
pub(crate) static ACL: Acl = Acl;

impl Backend for Acl {
    fn id(&self) -> u16 {
        DEVSHARE_BACKEND_ACL
    }

    fn probe(&self) -> Probe {
        match api() {
            Err(e) => Probe { usable: false, detail: e.to_string() },
            Ok(api) => match api.get_device_count() {
                Ok(n) if n > 0 => Probe { usable: true, detail: format!("{} loaded, {n} device(s)", api.name()) },
                Ok(_) => Probe { usable: false, detail: format!("{} loaded but it reports no device", api.name()) },
                Err(e) => Probe { usable: false, detail: format!("{} loaded; {e}", api.name()) },
            },
        }
    }

    fn export(&self, device: i32, ptr: *mut u8, size: u64, opts: &ExportOptions) -> Result<Box<dyn Exported>> {
        let api = api()?;
        if ptr as u64 % PAGE != 0 || size % PAGE != 0 {
            return Err(Error::InvalidArgument(format!(
                "ACL exports whole device pages, but [{ptr:p}, +{size}) is not {PAGE}-byte aligned \
                 (and huge-page memory needs 2 MiB alignment): allocate >= 2 MiB with a HUGE \
                 policy (aclrtMalloc with ACL_MEM_MALLOC_HUGE_FIRST) and export the whole allocation"
            )));
        }
        Ok(Box::new(AclExport { entry: export_key(api, device, ptr, size, opts.no_pid_check)? }))
    }

    fn import(&self, h: &DevshareHandle, _: &Validated, req: &ImportRequest) -> Result<Box<dyn Mapping>> {
        if req.read_only {
            return Err(Error::Unsupported("ACL imports cannot be mapped read-only".into()));
        }
        let api = api()?;
        let key = AclKey::normalize(h.key_bytes())?;
        let device = req.device.unwrap_or(h.device_index);
        let _g = api.bind(device)?;
        // CANN does not report the size of a key's allocation: the device's memory bounds it.
        // Refused before the import, so nothing needs closing.
        let bound = device_memory(api, device)?;
        if h.alloc_size > bound {
            return Err(Error::Mismatch(format!(
                "the handle's alloc_size {} is more than the memory of device {device} ({bound} bytes, \
                 aclrtGetMemInfo): no ACL allocation is that large, so the handle is wrong or forged; \
                 nothing was imported",
                h.alloc_size
            )));
        }
        let cross = device != h.device_index;
        let flags = match req.peer {
            PeerAccess::ByImportFlag => IMPORT_FLAG_ENABLE_PEER_ACCESS,
            PeerAccess::Explicit => {
                if cross {
                    enable_peer(api, device, h.device_index)?;
                }
                0
            }
            PeerAccess::None => 0,
        };
        let p = api.ipc_mem_import_by_key(key.as_c_str(), flags).map_err(|e| match e {
            Error::Vendor { call, code, message } => {
                Error::Vendor { call, code, message: format!("key {key} on device {device}: {message}") }
            }
            e => e,
        })?;
        if p.is_null() {
            // The import succeeded; close it again.
            let _ = api.ipc_mem_close(key.as_c_str());
            return Err(Error::Internal("aclrtIpcMemImportByKey returned success and a NULL pointer".into()));
        }
        // ACL does not report an imported allocation's size: the handles' alloc_size is trusted
        // up to the device's memory (a PyTorch tuple only tells where its own storage ends; later
        // storages of the same key may lie further in).
        Ok(Box::new(AclMapping { key, base: p.cast(), device, bound }))
    }

    fn import_segmented(
        &self,
        h: &DevshareHandle,
        segments: &SegmentTable<'_>,
        _: &Validated,
        req: &ImportRequest,
        _passed: Option<&super::PassedFds>,
    ) -> Result<Box<dyn Mapping>> {
        // ACL segments travel as shareable handles, never as descriptors.
        vmm::import_segmented(h, segments, req)
    }

    fn export_segments(
        &self,
        device: i32,
        mem: &SegmentedMemory<'_>,
        opts: &ExportOptions,
    ) -> Result<Box<dyn Exported>> {
        vmm::export_segments(device, mem, opts)
    }

    fn adopt(&self, h: &DevshareHandle, segments: Option<&SegmentTable<'_>>) -> Result<Box<dyn Exported>> {
        super::adopted::check(self, h)?;
        api()?;
        Ok(Box::new(super::adopted::Adopted::new(&AclAdopt, h, segments, [0; 16])?))
    }

    fn wait_event(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<()> {
        let device = req.device.unwrap_or(h.device_index);
        runtime::wait_event(api()?, device, h.event_handle, Stream(req.stream))
    }

    fn open_event(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<Box<dyn super::OpenedEvent>> {
        runtime::open_event(api()?, req.device.unwrap_or(h.device_index), h.event_handle)
    }

    fn synchronize(&self, device: i32) {
        if let Ok(api) = api() {
            api.synchronize(device);
        }
    }

    fn local_pid(&self, device: i32) -> Result<i32> {
        let api = api()?;
        let _g = api.bind(device)?;
        api.device_get_bare_tgid()
    }
}

/// What adopted ACL exports (torch_npu's allocator) need from the runtime: events on its
/// streams, and the pid whitelist of the key or shareable handles.
struct AclAdopt;

impl super::adopted::AdoptRuntime for AclAdopt {
    fn prepare_share(&self, device: i32, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        runtime::prepare_share(api()?, device, Stream(stream), event)
    }

    /// Best effort: torch_npu exports keys and shareable handles without pid validation (every
    /// release), where whitelisting changes nothing and a runtime may refuse it; for memory
    /// exported with validation the whitelist is what lets `pid` import. A refusal is not an
    /// error here: an import it would have allowed fails with the runtime's pid message.
    fn allow_pid(&self, a: &super::adopted::Adopted, pid: i32) -> Result<()> {
        let api = api()?;
        let _g = api.bind(a.device)?;
        match &a.segments {
            None => {
                let key = AclKey::normalize(&a.key)?;
                let _ = api.ipc_mem_set_import_pid(key.as_c_str(), &[pid]);
            }
            Some((_, _, table)) => {
                for c in table.chunks_exact(8) {
                    let _ =
                        api.mem_set_pid_to_shareable_handle(u64::from_le_bytes(c.try_into().expect("8 bytes")), &[pid]);
                }
            }
        }
        Ok(())
    }
}
