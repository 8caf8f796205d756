//! The cuda backend: NVIDIA GPU memory shared with legacy CUDA IPC memory handles, over the
//! driver API (`libcuda.so.1`, loaded at run time; its typed wrapper is `api.rs`).
//!
//! - Export: the whole `cuMemAlloc` block around the caller's pointer (`cuMemGetAddressRange`),
//!   its handle fetched once per block per process (`cuIpcGetMemHandle`, cached while any
//!   exporter of the block lives); handles carry the caller's offset and the device UUID.
//! - Import: `cuIpcOpenMemHandle` with lazy peer access once per handle per process — the import
//!   registry caches it, because the driver refuses a second open — on the device whose UUID the
//!   handle names; `cuIpcCloseMemHandle` when the last import is released.
//! - Segmented (VMM) memory (`vmm.rs`): PyTorch's expandable segments ('e' handles, version 2)
//!   and a C producer's `cuMemCreate` + `cuMemMap` buffers.
//!   - export ([`Backend::export_segments`]): each physical handle is checked against the address
//!     it is said to be mapped at (`cuMemRetainAllocationHandle`), then exported once per process
//!     (`cuMemExportToShareableHandle`, cached per handle while any exporter of it lives, as
//!     PyTorch caches each segment's shareable handle) as a POSIX fd that stays open in this
//!     process, for consumers to take with `pidfd_getfd`, or as a 64-byte fabric handle. The
//!     segment table holds the fd numbers (`i32`) or the fabric handles; the handle carries this
//!     process's pid. devshare never calls `PR_SET_PTRACER` on its own (`devshare_allow_ptrace`
//!     does, when the caller asks).
//!   - import ([`Backend::import_segmented`]): on the device chosen as for IPC handles, each
//!     segment's physical memory is imported once per process while any mapping uses it (cached
//!     per fabric handle, or per producer pid and fd number and the request's scope: once per
//!     channel connection that received it, once for plain imports): `pidfd_open` of the producer once,
//!     `pidfd_getfd` of the fd, `cuMemImportFromShareableHandle`, and the stolen fd closed at once;
//!     fabric handles are imported directly. Then exactly `count x segment_size` of address space
//!     is reserved (`cuMemAddressReserve`; PyTorch reserves far more), each segment mapped in
//!     order (`cuMemMap`) and the importing device granted read-write access over the range (read
//!     only for read-only imports; `cuMemSetAccess`). Teardown: synchronize, `cuMemUnmap` each
//!     segment, `cuMemRelease` the imported handles no other mapping uses, `cuMemAddressFree`. A
//!     failure part way undoes everything done so far.
//! - Every driver call runs with the device's primary context current on the calling thread; the
//!   thread's previous context is made current again afterwards.

mod api;
mod vmm;

use super::runtime::{self, Runtime, Stream};
use super::{Backend, ExportOptions, Exported, ImportRequest, IpcEvent, Mapping, PeerAccess, Probe, SegmentedMemory};
use crate::error::{Error, Result};
use crate::fork::Stamp;
use crate::handle::segments::SegmentTable;
use crate::handle::{DevshareHandle, Validated, DEVSHARE_BACKEND_CUDA};
use crate::loader::OnDemand;
use api::{CudaApi, DevPtr, IntPointerAttribute, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, HANDLE_LEN};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock, Weak};

static RUNTIME: OnDemand<Runtime<CudaApi>> = OnDemand::new(|| Ok(Runtime::new(CudaApi::load()?)));

/// The loaded driver (see [`OnDemand::get`]).
fn api() -> Result<&'static Runtime<CudaApi>> {
    RUNTIME.get()
}

/// The UUID of the device with this ordinal.
fn uuid(api: &CudaApi, ordinal: c_int) -> Result<[u8; 16]> {
    api.device_get_uuid(api.device_get(ordinal)?)
}

/// Each visible device's UUID, by ordinal (read once: they do not change in a process).
static UUIDS: OnceLock<Vec<[u8; 16]>> = OnceLock::new();

// ---------------------------------------------------------------------------------------------
// Export

/// One exported `cuMemAlloc` block and its IPC handle, shared by every exporter of it in this
/// process (the driver hands out the handle once per block; devshare asks once).
struct Block {
    handle: [u8; HANDLE_LEN],
    base: DevPtr,
    size: u64,
    device: c_int,
    uuid: [u8; 16],
}

type BlockCache = Mutex<HashMap<(c_int, DevPtr), Weak<Block>>>;
static BLOCKS: OnceLock<BlockCache> = OnceLock::new();

fn attribute(api: &CudaApi, attr: IntPointerAttribute, ptr: DevPtr, what: &str) -> Result<u32> {
    api.pointer_get_attribute(attr, ptr)
        .map_err(|e| Error::InvalidArgument(format!("{ptr:#x} is not CUDA device memory ({what}): {e}")))
}

fn export_block(api: &Runtime<CudaApi>, device: c_int, ptr: DevPtr, size: u64) -> Result<(Arc<Block>, u64)> {
    let _g = api.bind(device)?;
    if attribute(api, IntPointerAttribute::IsLegacyCudaIpcCapable, ptr, "IPC capability")? == 0 {
        return Err(Error::Unsupported(format!(
            "memory at {ptr:#x} cannot be exported with cuIpcGetMemHandle: VMM memory \
             (cuMemCreate, e.g. PyTorch expandable segments) and stream-ordered pool memory \
             (cudaMallocAsync) are not legacy-IPC capable; allocate it with cudaMalloc / cuMemAlloc"
        )));
    }
    let ordinal = attribute(api, IntPointerAttribute::DeviceOrdinal, ptr, "device ordinal")? as c_int;
    if ordinal != device {
        return Err(Error::InvalidArgument(format!(
            "{ptr:#x} is memory of CUDA device {ordinal}, not of device {device}"
        )));
    }
    let (base, bsize) = api.mem_get_address_range(ptr)?;
    let offset = ptr - base;
    if offset.checked_add(size).map_or(true, |end| end > bsize as u64) {
        return Err(Error::InvalidArgument(format!(
            "[{ptr:#x}, +{size}) runs past the end of its {bsize}-byte allocation at {base:#x}"
        )));
    }
    let mut cache = BLOCKS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(b) = cache.get(&(device, base)).and_then(Weak::upgrade) {
        return Ok((b, offset));
    }
    let handle = api.ipc_get_mem_handle(base)?;
    let block = Arc::new(Block { handle, base, size: bsize as u64, device, uuid: uuid(api, device)? });
    cache.retain(|_, w| w.strong_count() > 0);
    cache.insert((device, base), Arc::downgrade(&block));
    Ok((block, offset))
}

impl Drop for Block {
    fn drop(&mut self) {
        runtime::forget_dead(&BLOCKS);
    }
}

struct CudaExport {
    block: Arc<Block>,
    offset: u64,
    len: u64,
}

impl Exported for CudaExport {
    fn ptr(&self) -> *mut u8 {
        self.block.base as *mut u8
    }
    fn size(&self) -> u64 {
        self.block.size
    }
    fn key(&self) -> &[u8] {
        &self.block.handle
    }
    fn device_index(&self) -> i32 {
        self.block.device
    }
    fn device_uuid(&self) -> [u8; 16] {
        self.block.uuid
    }
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn window(&self) -> (u64, u64) {
        (self.offset, self.len)
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        runtime::prepare_share(api()?, self.block.device, Stream(stream), event)
    }
}

// ---------------------------------------------------------------------------------------------
// Import

/// An IPC import (closed on drop), or this process's own allocation (freed on drop: a remote
/// channel consumer's copy of a CUDA pool, `owned`).
struct CudaMapping {
    base: DevPtr,
    size: u64,
    device: c_int,
    owned: bool,
}

impl Mapping for CudaMapping {
    fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn device(&self) -> Option<i32> {
        Some(self.device)
    }
}

impl Drop for CudaMapping {
    /// Close the handle this mapping opened (or free the allocation), once, after this
    /// process's work.
    fn drop(&mut self) {
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                let _ = api.ctx_synchronize();
                let _ = if self.owned { api.mem_free(self.base) } else { api.ipc_close_mem_handle(self.base) };
            }
        }
    }
}

/// The device to import on: the caller's choice, else the local device with the handle's UUID
/// (ordinals differ between processes with different `CUDA_VISIBLE_DEVICES`), else the
/// handle's device index.
fn target_device(api: &CudaApi, h: &DevshareHandle, req: &ImportRequest) -> Result<c_int> {
    if let Some(d) = req.device {
        return Ok(d);
    }
    if h.device_uuid == [0; 16] {
        return Ok(h.device_index);
    }
    let uuids = match UUIDS.get() {
        Some(u) => u,
        None => {
            let u = (0..api.device_get_count()?).map(|d| uuid(api, d)).collect::<Result<Vec<_>>>()?;
            UUIDS.get_or_init(|| u)
        }
    };
    if let Some(d) = uuids.iter().position(|u| *u == h.device_uuid) {
        return Ok(d as c_int);
    }
    Err(Error::Mismatch(format!(
        "no visible CUDA device has the handle's UUID {} (is it hidden by CUDA_VISIBLE_DEVICES?); \
         pass options.device to import on a device of your choice",
        h.device_uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )))
}

pub(crate) struct Cuda;
pub(crate) static CUDA: Cuda = Cuda;

impl Backend for Cuda {
    fn id(&self) -> u16 {
        DEVSHARE_BACKEND_CUDA
    }

    fn probe(&self) -> Probe {
        match api() {
            Err(e) => Probe { usable: false, detail: e.to_string() },
            Ok(api) => match api.device_get_count() {
                Ok(n) if n > 0 => Probe {
                    usable: true,
                    detail: format!("{} loaded (driver API {}), {n} device(s)", api.name(), api.driver_version()),
                },
                Ok(_) => Probe { usable: false, detail: format!("{} loaded but it reports no device", api.name()) },
                Err(e) => Probe { usable: false, detail: format!("{} loaded; {e}", api.name()) },
            },
        }
    }

    fn export(&self, device: i32, ptr: *mut u8, size: u64, _: &ExportOptions) -> Result<Box<dyn Exported>> {
        let api = api()?;
        let (block, offset) = export_block(api, device, ptr as DevPtr, size)?;
        Ok(Box::new(CudaExport { block, offset, len: size }))
    }

    fn import_device(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<i32> {
        target_device(api()?, h, req)
    }

    fn import(&self, h: &DevshareHandle, _: &Validated, req: &ImportRequest) -> Result<Box<dyn Mapping>> {
        if req.read_only {
            return Err(Error::Unsupported("CUDA imports cannot be mapped read-only".into()));
        }
        if h.producer_pid == std::process::id() as i32 {
            return Err(Error::Unsupported(
                "this process exported the handle, and a CUDA IPC handle cannot be opened in the \
                 process that exported it: use the exporter's own pointer"
                    .into(),
            ));
        }
        let api = api()?;
        let device = target_device(api, h, req)?;
        let _g = api.bind(device)?;
        let flags = if req.peer == PeerAccess::None { 0 } else { CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS };
        let mut handle = [0u8; HANDLE_LEN];
        handle.copy_from_slice(h.key_bytes());
        let base = api.ipc_open_mem_handle(handle, flags)?;
        // Owned from here on: on an error below, its drop closes the handle.
        let mut mapping = CudaMapping { base, size: 0, device, owned: false };
        let (_, size) = api.mem_get_address_range(base)?;
        mapping.size = size as u64;
        Ok(Box::new(mapping))
    }

    fn import_segmented(
        &self,
        h: &DevshareHandle,
        segments: &SegmentTable<'_>,
        _: &Validated,
        req: &ImportRequest,
        passed: Option<&super::PassedFds>,
    ) -> Result<Box<dyn Mapping>> {
        let api = api()?;
        let device = target_device(api, h, req)?;
        Ok(Box::new(vmm::import_segmented(api, device, segments, req, passed)?))
    }

    fn export_segments(
        &self,
        device: i32,
        mem: &SegmentedMemory<'_>,
        opts: &ExportOptions,
    ) -> Result<Box<dyn Exported>> {
        let api = api()?;
        Ok(Box::new(vmm::export_segments(api, device, mem, opts)?))
    }

    fn adopt(&self, h: &DevshareHandle, segments: Option<&SegmentTable<'_>>) -> Result<Box<dyn Exported>> {
        super::adopted::check(self, h)?;
        let api = api()?;
        let uuid = uuid(api, h.device_index)?;
        Ok(Box::new(super::adopted::Adopted::new(&CudaAdopt, h, segments, uuid)?))
    }

    fn wait_event(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<()> {
        let api = api()?;
        runtime::wait_event(api, target_device(api, h, req)?, h.event_handle, Stream(req.stream))
    }

    fn open_event(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<Box<dyn super::OpenedEvent>> {
        let api = api()?;
        runtime::open_event(api, target_device(api, h, req)?, h.event_handle)
    }

    fn synchronize(&self, device: i32) {
        if let Ok(api) = api() {
            api.synchronize(device);
        }
    }

    fn alloc_private(&self, device: i32, len: u64) -> Result<Box<dyn Mapping>> {
        let api = api()?;
        let count = api.device_get_count()?;
        if device < 0 || device >= count {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {device}: this process sees {count} CUDA device(s) (CUDA_VISIBLE_DEVICES?)"
            )));
        }
        let _g = api.bind(device)?;
        let base = api.mem_alloc(len)?;
        Ok(Box::new(CudaMapping { base, size: len, device, owned: true }))
    }

    unsafe fn pin_host(&self, device: i32, ptr: *mut u8, len: usize) -> Option<Box<dyn Send>> {
        let api = api().ok()?;
        let _g = api.bind(device).ok()?;
        // SAFETY: the caller's promise: mapped until the guard goes.
        unsafe { api.mem_host_register(ptr, len) }.ok()?;
        Some(Box::new(Pinned { ptr: ptr as usize, device, generation: Stamp::now() }))
    }

    unsafe fn copy(&self, device: i32, to_host: bool, dst: *mut u8, src: *const u8, len: usize) -> Result<()> {
        let api = api()?;
        let _g = api.bind(device)?;
        if to_host {
            // SAFETY: the caller's promise for the host side; the driver checks the device side.
            unsafe { api.memcpy_dtoh(dst, src as DevPtr, len) }
        } else {
            // SAFETY: as above.
            unsafe { api.memcpy_htod(dst as DevPtr, src, len) }
        }
    }
}

/// Host memory pinned by [`Cuda::pin_host`]; unpinned when dropped.
struct Pinned {
    ptr: usize,
    device: i32,
    /// The fork generation that pinned it.
    generation: Stamp,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A forked child's copy was never registered in the child's driver state.
        if !self.generation.is_current() {
            return;
        }
        if let Ok(api) = api() {
            if let Ok(_g) = api.bind(self.device) {
                // SAFETY: registered by pin_host at this address, still mapped (its contract).
                let _ = unsafe { api.mem_host_unregister(self.ptr as *mut u8) };
            }
        }
    }
}

/// What adopted CUDA exports (PyTorch's allocator) need from the driver: events on its streams.
struct CudaAdopt;

impl super::adopted::AdoptRuntime for CudaAdopt {
    fn prepare_share(&self, device: i32, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        runtime::prepare_share(api()?, device, Stream(stream), event)
    }
}
