//! Backends: where allocations come from and how another process maps them.
//!
//! A backend is one module implementing [`Backend`]; [`get`] finds it by its
//! `DEVSHARE_BACKEND_*` id: [`host`] (POSIX shared memory), [`acl`] (Ascend NPU, ACL IPC keys)
//! and [`cuda`] (NVIDIA GPU, CUDA IPC handles). The vendor runtimes are loaded on first use
//! ([`runtime`]), so one binary runs on machines with neither.

pub mod acl;
pub(crate) mod adopted;
pub mod cuda;
pub mod host;
pub(crate) mod memfd;
pub(crate) mod per_generation;
pub mod pidfd;
pub mod runtime;

use crate::error::{Error, Result};
use crate::handle::{DevshareHandle, Validated};

/// How an import on a device other than the exporter's gets peer access.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PeerAccess {
    /// Ask the import call to enable it (ACL `ENABLE_PEER_ACCESS`, CUDA `LAZY_ENABLE_PEER_ACCESS`),
    /// as PyTorch and torch_npu do.
    #[default]
    ByImportFlag,
    /// Enable it with the runtime's peer-access call first (`aclrtDeviceEnablePeerAccess`), then
    /// import with flags 0.
    Explicit,
    /// Import with flags 0 and enable nothing: a cross-device import then fails unless the
    /// caller enabled peer access itself.
    None,
}

/// What an importer asked for, after argument checks.
#[derive(Clone, Copy, Debug)]
pub struct ImportRequest {
    /// Map read-only (writes fault) instead of read-write.
    pub read_only: bool,
    /// Device to import on; `None` means the handle's device.
    pub device: Option<i32>,
    /// Stream of the backend that will read the data: event waits are ordered on it. Null means
    /// "no stream": the wait blocks the calling thread.
    pub stream: *mut std::ffi::c_void,
    /// How cross-device imports get peer access.
    pub peer: PeerAccess,
    /// Who memory known only by its producer's fd numbers (a segmented CUDA export's pages) is
    /// mapped and cached for: 0, the whole process; else one importer alone (a channel
    /// connection), which is told when the producer closes them, before anything names other
    /// memory under the same numbers. Memory known by an identity of its own (a memfd, a device
    /// handle or name) is cached for the whole process whatever this says.
    pub scope: u64,
}

impl Default for ImportRequest {
    fn default() -> Self {
        ImportRequest {
            read_only: false,
            device: None,
            stream: std::ptr::null_mut(),
            peer: PeerAccess::default(),
            scope: 0,
        }
    }
}

/// Descriptors of a segmented CUDA export's segments that arrived next to its handle (passed
/// over a channel with `SCM_RIGHTS`), by the producer's pid and fd number: the segmented import
/// imports these instead of taking the producer's fds with `pidfd_getfd`. Each is used once;
/// what is not used is closed with this.
#[derive(Default)]
pub struct PassedFds(std::sync::Mutex<Vec<((i32, i32), std::os::fd::OwnedFd)>>);

impl PassedFds {
    /// The descriptors, by (producer pid, the producer's fd number).
    pub fn new(fds: Vec<((i32, i32), std::os::fd::OwnedFd)>) -> PassedFds {
        PassedFds(std::sync::Mutex::new(fds))
    }

    /// The descriptor passed for the producer's fd `fd`, if one was (once).
    pub(crate) fn take(&self, pid: i32, fd: i32) -> Option<std::os::fd::OwnedFd> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let i = v.iter().position(|(k, _)| *k == (pid, fd))?;
        Some(v.swap_remove(i).1)
    }
}

/// What an exporter asked for, after argument checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExportOptions {
    /// ACL: export the key without pid validation (anyone may import it), as torch_npu does.
    /// By default only pids added with `allow_pid` may import.
    pub no_pid_check: bool,
    /// CUDA segmented exports: share 64-byte fabric handles instead of POSIX fds.
    pub fabric: bool,
}

/// A C producer's VMM allocation to export: `count` equal segments mapped back to back at
/// `base`, one physical allocation handle per segment (`aclrtDrvMemHandle` /
/// `CUmemGenericAllocationHandle`, as `u64`).
#[derive(Clone, Copy, Debug)]
pub struct SegmentedMemory<'a> {
    /// Where the first segment is mapped in this process.
    pub base: *mut u8,
    /// Bytes per segment.
    pub segment_size: u64,
    /// The physical handles, in address order.
    pub physical: &'a [u64],
}

/// An interprocess event an exporter recorded for one share; dropping it destroys it.
pub trait IpcEvent: Send + Sync {
    /// The 64 handle bytes a consumer opens (the same for every record of the event).
    fn handle(&self) -> [u8; crate::handle::DEVSHARE_EVENT_HANDLE_SIZE];
    /// Record the event again, on `stream` (null: the device's legacy stream) of its device:
    /// what an event reused for a later share does. Only once no consumer can still be about to
    /// wait on its previous record (every share that carried it came back).
    fn record_again(&self, stream: *mut std::ffi::c_void) -> Result<()>;
}

/// Another process's interprocess event, opened here and kept open: waited on again for each
/// record its producer makes (a channel connection keeps the events its producer promised to
/// keep alive, instead of opening and destroying one per wait). Dropping it destroys this
/// process's copy, with its device bound.
pub trait OpenedEvent: Send {
    /// Make `stream` wait for the event's latest record (null: block this thread until it
    /// completed).
    fn wait(&self, stream: *mut std::ffi::c_void) -> Result<()>;
}

/// An allocation mapped into this process. Dropping it undoes the mapping (unmap, IPC close).
pub trait Mapping: Send + Sync {
    /// Start of the allocation in this process.
    fn base(&self) -> *mut u8;
    /// Bytes of the allocation that are really mapped (checked against the handle's
    /// `alloc_size`; imports never form a pointer beyond it). Where the runtime does not report
    /// the size (ACL keys) an upper bound it does report (the device's memory), below which the
    /// handle's `alloc_size` is trusted.
    fn size(&self) -> u64;
    /// Take over the in-flight reference a `DEVSHARE_HANDLE_FLAG_INFLIGHT` handle carries.
    fn take_over_inflight(&self) {}
    /// The device the allocation is mapped on, when the backend chose it (CUDA maps by device
    /// UUID); `None`: the requested device.
    fn device(&self) -> Option<i32> {
        None
    }
}

/// An allocation this process exports. Dropping it ends the export (and frees what it owns).
pub trait Exported: Send + Sync {
    /// Start of the allocation in this process.
    fn ptr(&self) -> *mut u8;
    /// Size of the allocation in bytes.
    fn size(&self) -> u64;
    /// Export key as it goes into the handle.
    fn key(&self) -> &[u8];
    /// Device index in this process.
    fn device_index(&self) -> i32;
    /// Device UUID, all zero when unknown.
    fn device_uuid(&self) -> [u8; 16] {
        [0; 16]
    }
    /// Whether importers keep the memory alive on their own after the exporter closes (true for
    /// host shared memory). When false, closing with outstanding references is refused unless
    /// forced.
    fn survives_exporter_close(&self) -> bool;
    /// For a segmented export: segment size, `DEVSHARE_SEGMENTS_*` kind and the segment table
    /// (little-endian records) that goes into its handles.
    fn segments(&self) -> Option<(u64, u16, &[u8])> {
        None
    }
    /// Remove the allocation's name now, if it has one that importers open by (host shm).
    fn unlink(&self) {}
    /// The descriptor that travels next to this export's handles over a channel, for exports
    /// that have no name (a sealed host memfd); such exports are shareable only over a channel.
    fn channel_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// For a segmented export whose table lists this process's fds (CUDA POSIX fds): each
    /// distinct fd once, in the order of its first record. A channel passes them with
    /// `SCM_RIGHTS`, so its consumers need no `pidfd_getfd`.
    fn segment_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        Vec::new()
    }
    /// Add one in-flight reference for a handle about to be sent (host: header count + 1).
    fn add_inflight(&self) -> Result<()> {
        Err(Error::Unsupported("in-flight references exist only for host memory".into()))
    }
    /// The range the caller exported, as (byte offset in the allocation, length). The allocation
    /// can be larger than what was asked for (CUDA exports the whole `cuMemAlloc` block).
    fn window(&self) -> (u64, u64) {
        (0, self.size())
    }
    /// Let the process whose pid is `pid` (as the importer's `local_pid` reports it) import.
    /// Backends without a pid whitelist accept every pid and do nothing.
    fn allow_pid(&self, _pid: i32) -> Result<()> {
        Ok(())
    }
    /// Before a handle travels: record an interprocess event on `stream` (returned, to be kept
    /// alive until the consumer released the handle), or with `event == false` synchronise
    /// `stream` (null: the whole device) so the data is complete when the consumer reads it.
    fn prepare_share(&self, _stream: *mut std::ffi::c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        if event {
            return Err(Error::Unsupported("host memory has no interprocess events".into()));
        }
        Ok(None)
    }
}

/// Usability report of one backend.
#[derive(Clone, Debug)]
pub struct Probe {
    pub usable: bool,
    pub detail: String,
}

/// One way of sharing memory.
pub trait Backend: Sync {
    /// `DEVSHARE_BACKEND_*` id.
    fn id(&self) -> u16;
    /// Whether the backend can be used in this process, and why not.
    fn probe(&self) -> Probe;
    /// Export existing memory `[ptr, ptr + size)` on `device`.
    fn export(&self, device: i32, ptr: *mut u8, size: u64, opts: &ExportOptions) -> Result<Box<dyn Exported>>;
    /// The device an import of `h` goes to: `req.device` when given, else the backend's choice
    /// (default: the handle's device index). The import registry caches by this device.
    fn import_device(&self, h: &DevshareHandle, req: &ImportRequest) -> Result<i32> {
        Ok(req.device.unwrap_or(h.device_index))
    }
    /// Map the allocation a validated handle names (`req.device` is set, by `import_device`).
    fn import(&self, h: &DevshareHandle, v: &Validated, req: &ImportRequest) -> Result<Box<dyn Mapping>>;
    /// Map a segmented allocation (a validated handle with `DEVSHARE_HANDLE_FLAG_SEGMENTED` and
    /// its table): import every segment on `req.device`, reserve exactly
    /// `count x segment_size` of address space and map the segments into it, in order.
    /// `passed`: descriptors that arrived with the handle, used instead of the producer's.
    fn import_segmented(
        &self,
        h: &DevshareHandle,
        _segments: &crate::handle::segments::SegmentTable<'_>,
        _v: &Validated,
        _req: &ImportRequest,
        _passed: Option<&PassedFds>,
    ) -> Result<Box<dyn Mapping>> {
        Err(Error::Unsupported(format!("{} memory cannot be segmented", h.backend_name())))
    }
    /// Export a C producer's segmented (VMM) allocation on `device`.
    fn export_segments(
        &self,
        _device: i32,
        _mem: &SegmentedMemory<'_>,
        _opts: &ExportOptions,
    ) -> Result<Box<dyn Exported>> {
        Err(Error::Unsupported(format!(
            "the {} backend exports no segmented memory",
            crate::handle::backend_name(self.id())
        )))
    }
    /// Adopt a validated device handle that another exporter in this process made (PyTorch's or
    /// torch_npu's allocator): an export whose handles name tensors inside the handle's storage
    /// (see [`adopted`]). `segments`: its segment table, when segmented.
    fn adopt(
        &self,
        h: &DevshareHandle,
        _segments: Option<&crate::handle::segments::SegmentTable<'_>>,
    ) -> Result<Box<dyn Exported>> {
        Err(Error::Unsupported(format!(
            "{} handles cannot be adopted: adopt device handles (cuda, acl); host memory is adopted \
             by name (devshare_host_adopt)",
            h.backend_name()
        )))
    }
    /// For a handle with `DEVSHARE_HANDLE_FLAG_EVENT`: open its event, make `req.stream` wait on
    /// it (or block when there is no stream), destroy it. Runs for every import of such a handle.
    fn wait_event(&self, h: &DevshareHandle, _req: &ImportRequest) -> Result<()> {
        Err(Error::Unsupported(format!("{} handles carry no interprocess event", h.backend_name())))
    }
    /// Open the event of a handle with `DEVSHARE_HANDLE_FLAG_EVENT` on the device an import by
    /// `req` would use, to be waited on later and more than once ([`OpenedEvent`]).
    fn open_event(&self, h: &DevshareHandle, _req: &ImportRequest) -> Result<Box<dyn OpenedEvent>> {
        Err(Error::Unsupported(format!("{} handles carry no interprocess event", h.backend_name())))
    }
    /// Before a consumer returns a reference to its producer: make sure this process's work on
    /// `device` is finished (PyTorch synchronises the stream that used the memory).
    fn synchronize(&self, _device: i32) {}
    /// `len` bytes of device memory on `device` that this process allocates for itself (no
    /// export, no import: a remote channel consumer's copy of a pool), as a mapping that frees it
    /// when dropped.
    fn alloc_private(&self, _device: i32, _len: u64) -> Result<Box<dyn Mapping>> {
        Err(Error::Unsupported(format!(
            "the {} backend allocates no private device memory",
            crate::handle::backend_name(self.id())
        )))
    }
    /// Copy `len` bytes of this process's memory on `device` at `src` to host memory at `dst`
    /// (`to_host`), or host memory at `src` to device memory at `dst`; returns once the bytes
    /// are there.
    ///
    /// # Safety
    /// The host side is `len` valid bytes (writable at `dst` for `to_host`); the device side is
    /// checked by the runtime.
    unsafe fn copy(&self, _device: i32, _to_host: bool, _dst: *mut u8, _src: *const u8, _len: usize) -> Result<()> {
        Err(Error::Unsupported(format!(
            "the {} backend copies no device memory",
            crate::handle::backend_name(self.id())
        )))
    }
    /// Pin `len` bytes of host memory at `ptr` for copies to and from `device` at the device's
    /// speed (CUDA: `cuMemHostRegister`); the guard unpins it when dropped. `None` where the
    /// backend pins nothing or pinning failed: [`Self::copy`] still works, at pageable speed.
    ///
    /// # Safety
    /// `ptr..ptr + len` is host memory that stays mapped until the guard is dropped.
    unsafe fn pin_host(&self, _device: i32, _ptr: *mut u8, _len: usize) -> Option<Box<dyn Send>> {
        None
    }
    /// The pid an exporter must pass to `allow_pid` for this process to import on `device`.
    fn local_pid(&self, _device: i32) -> Result<i32> {
        Ok(std::process::id() as i32)
    }
}

/// Every backend, indexed by nothing in particular: [`get`] looks them up by id.
pub static BACKENDS: [&dyn Backend; 3] = [&host::HOST, &acl::ACL, &cuda::CUDA];

/// The pid this process gives its peers to admit it: the bare tgid as the ACL runtime reports
/// it (what an ACL exporter must whitelist: the host pid, also inside a container) when an ACL
/// runtime with a device is usable in this process — asking binds device 0 on this thread for
/// the call, then restores the thread's device — else `getpid()`. A transport announces it
/// without knowing which vendor needs it.
pub(crate) fn pid_for_peers() -> i32 {
    acl::bare_tgid().unwrap_or(std::process::id() as i32)
}

/// The backend with this id.
pub fn get(id: u16) -> Result<&'static dyn Backend> {
    BACKENDS.iter().copied().find(|b| b.id() == id).ok_or_else(|| {
        Error::InvalidArgument(format!("backend {id} is not a known backend (1 = host, 2 = acl, 3 = cuda)"))
    })
}
