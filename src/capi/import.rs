//! Importer functions: import a handle, look at the mapping, release it.

use super::{arg, arg_mut, boundary};
use crate::backend::{ImportRequest, PeerAccess};
use crate::error::Error;
use crate::handle::DevshareHandle;
use crate::import::{import, Import};
use std::ffi::c_void;

/// `DevshareImportOptions::flags`: map the data read-only (writes through the pointer fault).
/// The shm object must still be writable by the caller: the mapping count in its header is
/// updated on import and release.
pub const DEVSHARE_IMPORT_READ_ONLY: u32 = 1;
/// Import flag (acl): enable peer access with `aclrtDeviceEnablePeerAccess` before importing on
/// a device other than the exporter's, and import with flags 0, instead of passing the import
/// call's enable-peer-access flag (the default, as torch_npu does).
pub const DEVSHARE_IMPORT_PEER_ACCESS_CALL: u32 = 2;
/// Import flag (acl, cuda): pass no peer-access flag and enable nothing; a cross-device import
/// then fails unless the caller enabled peer access itself.
pub const DEVSHARE_IMPORT_NO_PEER_ACCESS: u32 = 4;
/// `DevshareImportOptions::device` value: import on the device the handle names.
pub const DEVSHARE_DEVICE_FROM_HANDLE: i32 = -1;

/// One import of a handle (opaque). Imports may be made and released on any thread; one import
/// object must not be released twice or used after release.
pub struct DevshareImport(Import);

impl DevshareImport {
    pub(crate) fn inner(&self) -> &Import {
        &self.0
    }
}

/// Options for `devshare_import`; initialise with `devshare_import_options_init`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareImportOptions {
    /// `sizeof(DevshareImportOptions)`.
    pub struct_size: u32,
    /// `DEVSHARE_IMPORT_*` bits.
    pub flags: u32,
    /// Device to import on, or `DEVSHARE_DEVICE_FROM_HANDLE`.
    pub device: i32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Backend stream that will use the data (event waits are ordered on it); NULL: block.
    /// Unused by the host backend.
    pub stream: *mut c_void,
}

/// Where an import lies in this process, from `devshare_import_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareImportInfo {
    /// The tensor's first element.
    pub data: *mut c_void,
    /// The storage's first byte.
    pub storage: *mut c_void,
    /// The allocation's first byte.
    pub base: *mut c_void,
    /// Allocation size in bytes (as the handle says).
    pub alloc_size: u64,
    /// Storage size in bytes.
    pub storage_size: u64,
    /// Number of elements of the tensor.
    pub numel: u64,
    /// Bytes per element.
    pub element_size: u64,
    /// `DEVSHARE_BACKEND_*`.
    pub backend: u16,
    /// 1 when mapped read-only.
    pub read_only: u16,
    /// Device the allocation was imported on (0 for host).
    pub device: i32,
}

impl Default for DevshareImportOptions {
    fn default() -> Self {
        DevshareImportOptions {
            struct_size: std::mem::size_of::<DevshareImportOptions>() as u32,
            flags: 0,
            device: DEVSHARE_DEVICE_FROM_HANDLE,
            reserved: 0,
            stream: std::ptr::null_mut(),
        }
    }
}

/// Fill `*options` with the defaults: read-write, the handle's device, no stream.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_options_init(options: *mut DevshareImportOptions) -> i32 {
    boundary("devshare_import_options_init", || {
        *unsafe { arg_mut(options, "options") }? = DevshareImportOptions::default();
        Ok(())
    })
}

fn request(o: &DevshareImportOptions) -> crate::error::Result<ImportRequest> {
    if o.struct_size as usize != std::mem::size_of::<DevshareImportOptions>() {
        return Err(Error::InvalidArgument(format!(
            "options.struct_size {} is not sizeof(DevshareImportOptions) (call \
             devshare_import_options_init)",
            o.struct_size
        )));
    }
    let known = DEVSHARE_IMPORT_READ_ONLY | DEVSHARE_IMPORT_PEER_ACCESS_CALL | DEVSHARE_IMPORT_NO_PEER_ACCESS;
    if o.flags & !known != 0 {
        return Err(Error::InvalidArgument(format!("unknown import flags {:#x}", o.flags)));
    }
    let peer = match (o.flags & DEVSHARE_IMPORT_PEER_ACCESS_CALL != 0, o.flags & DEVSHARE_IMPORT_NO_PEER_ACCESS != 0) {
        (false, false) => PeerAccess::ByImportFlag,
        (true, false) => PeerAccess::Explicit,
        (false, true) => PeerAccess::None,
        (true, true) => {
            return Err(Error::InvalidArgument(
                "DEVSHARE_IMPORT_PEER_ACCESS_CALL and DEVSHARE_IMPORT_NO_PEER_ACCESS exclude each other".into(),
            ))
        }
    };
    if o.device < DEVSHARE_DEVICE_FROM_HANDLE {
        return Err(Error::InvalidArgument(format!("options.device {} is negative", o.device)));
    }
    if o.reserved != 0 {
        return Err(Error::InvalidArgument("options.reserved must be 0".into()));
    }
    Ok(ImportRequest {
        read_only: o.flags & DEVSHARE_IMPORT_READ_ONLY != 0,
        device: (o.device != DEVSHARE_DEVICE_FROM_HANDLE).then_some(o.device),
        stream: o.stream,
        peer,
    })
}

/// Import the tensor a handle describes (`options` may be NULL for the defaults). The handle is
/// validated first; its allocation is mapped once per process and shared by every import of it.
/// Release with `devshare_import_release`.
#[no_mangle]
pub unsafe extern "C" fn devshare_import(
    handle: *const DevshareHandle,
    options: *const DevshareImportOptions,
    out: *mut *mut DevshareImport,
) -> i32 {
    boundary("devshare_import", || {
        let h = unsafe { arg(handle, "handle") }?;
        let out = unsafe { arg_mut(out, "out") }?;
        let req = match unsafe { options.as_ref() } {
            Some(o) => request(o)?,
            None => ImportRequest::default(),
        };
        *out = Box::into_raw(Box::new(DevshareImport(import(h, req)?)));
        Ok(())
    })
}

/// Return a handle's reference without importing it: for a consumer that received a handle it
/// will not use (validated first; decrements its ref-counter slot once). Refused with
/// `DEVSHARE_STATUS_BUSY` while an import in this process holds that reference (releasing the
/// import returns it), and with `DEVSHARE_STATUS_ALREADY_RELEASED` when it was already returned.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_discard(handle: *const DevshareHandle) -> i32 {
    boundary("devshare_handle_discard", || {
        let h = unsafe { arg(handle, "handle") }?;
        crate::handle::validate(h)?;
        if h.flags & crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT != 0 {
            // The in-flight count in the object's header is owed too: an import takes it over
            // and its release returns both.
            import(h, ImportRequest::default())?.release();
            return Ok(());
        }
        crate::import::discard(h.ref_name_bytes(), h.ref_slot)
    })
}

/// Pointers and sizes of an import.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_info(imp: *const DevshareImport, out: *mut DevshareImportInfo) -> i32 {
    boundary("devshare_import_info", || {
        let i = &unsafe { arg(imp, "import") }?.0;
        let out = unsafe { arg_mut(out, "out") }?;
        let v = i.view();
        let h = i.handle();
        *out = DevshareImportInfo {
            data: v.data.cast(),
            storage: v.storage.cast(),
            base: v.base.cast(),
            alloc_size: h.alloc_size,
            storage_size: h.storage_size,
            numel: i.validated().numel,
            element_size: i.validated().element_size,
            backend: h.backend,
            read_only: u16::from(v.read_only),
            device: v.device,
        };
        Ok(())
    })
}

/// A copy of the handle an import was made from (shape, strides, dtype ...).
#[no_mangle]
pub unsafe extern "C" fn devshare_import_handle(imp: *const DevshareImport, out: *mut DevshareHandle) -> i32 {
    boundary("devshare_import_handle", || {
        let i = &unsafe { arg(imp, "import") }?.0;
        *unsafe { arg_mut(out, "out") }? = *i.handle();
        Ok(())
    })
}

/// Release an import and free it: unmap when it was the process's last import of the
/// allocation, then return the handle's reference to the producer (its ref-counter slot drops
/// to 0) when it was the last import holding that handle.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_release(imp: *mut DevshareImport) -> i32 {
    boundary("devshare_import_release", || {
        if imp.is_null() {
            return Err(Error::NullArgument("import"));
        }
        // SAFETY: imp came from Box::into_raw in devshare_import and is released once.
        unsafe { Box::from_raw(imp) }.0.release();
        Ok(())
    })
}
