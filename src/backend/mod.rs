//! Backends: where allocations come from and how another process maps them.
//!
//! A backend is one module implementing [`Backend`]; [`get`] finds it by its
//! `DEVSHARE_BACKEND_*` id. Adding the ACL or CUDA backend means adding a module and one line in
//! [`BACKENDS`]; nothing else in the crate changes.

pub mod host;
pub mod runtime;

use crate::error::{Error, Result};
use crate::handle::{backend_name, DevshareHandle, Validated};

/// What an importer asked for, after argument checks.
#[derive(Clone, Copy, Debug, Default)]
pub struct ImportRequest {
    /// Map read-only (writes fault) instead of read-write.
    pub read_only: bool,
    /// Device to import on; `None` means the handle's device.
    pub device: Option<i32>,
}

/// An allocation mapped into this process. Dropping it undoes the mapping (unmap, IPC close).
pub trait Mapping: Send + Sync {
    /// Start of the allocation in this process.
    fn base(&self) -> *mut u8;
    /// Bytes of the allocation that are really mapped (checked against the handle).
    fn size(&self) -> u64;
    /// Take over the in-flight reference a `DEVSHARE_HANDLE_FLAG_INFLIGHT` handle carries.
    fn take_over_inflight(&self) {}
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
    /// Remove the allocation's name now, if it has one that importers open by (host shm).
    fn unlink(&self) {}
    /// Add one in-flight reference for a handle about to be sent (host: header count + 1).
    fn add_inflight(&self) -> Result<()> {
        Err(Error::Unsupported("in-flight references exist only for host memory".into()))
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
    fn export(&self, device: i32, ptr: *mut u8, size: u64) -> Result<Box<dyn Exported>>;
    /// Map the allocation a validated handle names.
    fn import(&self, h: &DevshareHandle, v: &Validated, req: &ImportRequest)
        -> Result<Box<dyn Mapping>>;
}

/// A backend id this build knows of but does not implement yet.
struct NotBuilt {
    id: u16,
    env_var: &'static str,
    candidates: &'static [&'static str],
}

impl NotBuilt {
    fn err(&self) -> Error {
        Error::BackendUnavailable(format!(
            "the {} backend is not part of this build of devshare yet",
            backend_name(self.id)
        ))
    }
}

impl Backend for NotBuilt {
    fn id(&self) -> u16 {
        self.id
    }
    fn probe(&self) -> Probe {
        let runtime = match runtime::find(self.env_var, self.candidates) {
            Ok(found) => format!("runtime {found} loads"),
            Err(e) => e.to_string(),
        };
        Probe { usable: false, detail: format!("{}; {runtime}", self.err()) }
    }
    fn export(&self, _: i32, _: *mut u8, _: u64) -> Result<Box<dyn Exported>> {
        Err(self.err())
    }
    fn import(&self, _: &DevshareHandle, _: &Validated, _: &ImportRequest) -> Result<Box<dyn Mapping>> {
        Err(self.err())
    }
}

static ACL: NotBuilt = NotBuilt {
    id: crate::handle::DEVSHARE_BACKEND_ACL,
    env_var: "DEVSHARE_ACL_LIBRARY",
    candidates: &["libascendcl.so", "libacl_rt.so"],
};
static CUDA: NotBuilt = NotBuilt {
    id: crate::handle::DEVSHARE_BACKEND_CUDA,
    env_var: "DEVSHARE_CUDA_LIBRARY",
    candidates: &["libcuda.so.1"],
};

/// Every backend, indexed by nothing in particular: [`get`] looks them up by id.
pub static BACKENDS: [&dyn Backend; 3] = [&host::HOST, &ACL, &CUDA];

/// The backend with this id.
pub fn get(id: u16) -> Result<&'static dyn Backend> {
    BACKENDS.iter().copied().find(|b| b.id() == id).ok_or_else(|| {
        Error::InvalidArgument(format!("backend {id} is not a known backend (1 = host, 2 = acl, 3 = cuda)"))
    })
}
