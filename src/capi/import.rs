//! Importer functions: import a handle, look at the mapping (and, for a channel item, its pool
//! and slot), give a channel item back early, release it.

use super::abi::{init, read_input, sized_struct, write_output, SizedStruct};
use super::{arg, arg_mut, arg_slice, boundary};
use crate::backend::{ImportRequest, PeerAccess};
use crate::error::Error;
use crate::handle::DevshareHandle;
use crate::import::{import, import_full, Import};
use std::ffi::{c_char, c_void};

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
// The C pointer is a `Box<DevshareImport>`, laid out as the import it wraps (checked below): a
// received item's import is made in a box of its own and handed out as that box, one
// allocation. (Not `repr(transparent)`: the header keeps the type opaque.)
pub struct DevshareImport(Import);

// One field, at offset 0, of the same size and alignment: a box of one is a box of the other.
static_assertions::assert_eq_size!(DevshareImport, Import);
static_assertions::assert_eq_align!(DevshareImport, Import);
static_assertions::const_assert_eq!(std::mem::offset_of!(DevshareImport, 0), 0);

impl DevshareImport {
    pub(crate) fn new(imp: Import) -> DevshareImport {
        DevshareImport(imp)
    }

    /// The C pointer of an import boxed already (the import is not moved, no second box).
    pub(crate) fn into_raw(imp: Box<Import>) -> *mut DevshareImport {
        // DevshareImport is laid out as Import (asserted above): the same box.
        Box::into_raw(imp).cast::<DevshareImport>()
    }

    pub(crate) fn inner(&self) -> &Import {
        &self.0
    }

    pub(crate) fn into_inner(self) -> Import {
        self.0
    }

    /// The box of the import, as it lies (the inverse of [`Self::into_raw`]).
    pub(crate) fn into_boxed_import(self: Box<Self>) -> Box<Import> {
        // SAFETY: DevshareImport is laid out as Import (asserted above).
        unsafe { Box::from_raw(Box::into_raw(self).cast::<Import>()) }
    }
}

/// Options for `devshare_import`; initialise with
/// `devshare_import_options_init(&options, sizeof options)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareImportOptions {
    /// Size of this struct in the caller's header (`devshare_import_options_init` sets it).
    pub struct_size: u32,
    /// `DEVSHARE_IMPORT_*` bits.
    pub flags: u32,
    /// Device to import on, or `DEVSHARE_DEVICE_FROM_HANDLE` (the default).
    pub device: i32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Backend stream that will use the data (event waits are ordered on it); NULL: block.
    /// Unused by the host backend.
    pub stream: *mut c_void,
}

sized_struct!(
    DevshareImportOptions,
    "DevshareImportOptions",
    first_size = 24,
    sum = 4 * 4 + 8,
    defaults = DevshareImportOptions {
        struct_size: 0,
        flags: 0,
        device: DEVSHARE_DEVICE_FROM_HANDLE,
        reserved: 0,
        stream: std::ptr::null_mut(),
    }
);

/// Where an import lies in this process, from `devshare_import_info`. Initialise with
/// `devshare_import_info_init(&info, sizeof info)` before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareImportInfo {
    /// Size of this struct in the caller's header; on return, the bytes the library filled in.
    pub struct_size: u32,
    /// Device the allocation was imported on (0 for host).
    pub device: i32,
    /// The tensor's first element (valid until the import is released).
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
    /// Reserved, zero.
    pub reserved: u32,
}

sized_struct!(
    DevshareImportInfo,
    "DevshareImportInfo",
    first_size = 72,
    sum = 4 + 4 + 8 * 7 + 2 + 2 + 4,
    defaults = DevshareImportInfo {
        struct_size: 0,
        device: 0,
        data: std::ptr::null_mut(),
        storage: std::ptr::null_mut(),
        base: std::ptr::null_mut(),
        alloc_size: 0,
        storage_size: 0,
        numel: 0,
        element_size: 0,
        backend: 0,
        read_only: 0,
        reserved: 0,
    }
);

impl Default for DevshareImportOptions {
    fn default() -> Self {
        DevshareImportOptions { struct_size: std::mem::size_of::<Self>() as u32, ..Self::defaults() }
    }
}

/// Initialise `DevshareImportOptions` of `size` bytes (pass `sizeof *options`) with the
/// defaults: read-write, the handle's device, no stream.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_options_init(options: *mut DevshareImportOptions, size: u32) -> i32 {
    boundary("devshare_import_options_init", || ffi!(init(options, size, "options")))
}

/// Initialise `DevshareImportInfo` of `size` bytes (pass `sizeof *info`) for
/// `devshare_import_info`.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_info_init(info: *mut DevshareImportInfo, size: u32) -> i32 {
    boundary("devshare_import_info_init", || ffi!(init(info, size, "info")))
}

fn request(o: &DevshareImportOptions) -> crate::error::Result<ImportRequest> {
    let known = DEVSHARE_IMPORT_READ_ONLY | DEVSHARE_IMPORT_PEER_ACCESS_CALL | DEVSHARE_IMPORT_NO_PEER_ACCESS;
    if o.flags & !known != 0 {
        return Err(Error::UnsupportedVersion(format!(
            "options.flags: bits {:#x} are not import flags this library knows",
            o.flags & !known
        )));
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
        scope: 0,
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
        let h = ffi!(arg(handle, "handle"))?;
        let out = ffi!(arg_mut(out, "out"))?;
        let req = ffi!(request_from(options))?;
        *out = Box::into_raw(Box::new(DevshareImport::new(import(h, req)?)));
        Ok(())
    })
}

/// The import request from C options (NULL: the defaults).
///
/// # Safety
/// `options` is NULL or valid for its `struct_size`.
pub(crate) unsafe fn request_from(options: *const DevshareImportOptions) -> crate::error::Result<ImportRequest> {
    if options.is_null() {
        return Ok(ImportRequest::default());
    }
    request(&ffi!(read_input(options, "options"))?)
}

/// Import a handle from its byte encoding (`devshare_handle_encode`,
/// `devshare_exporter_share_encoded`). Unlike decoding into a `DevshareHandle` first, this also
/// imports segmented handles whose segment table is too long for the struct (it travels in the
/// encoding). Release with `devshare_import_release`.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_encoded(
    buf: *const u8,
    len: usize,
    options: *const DevshareImportOptions,
    out: *mut *mut DevshareImport,
) -> i32 {
    boundary("devshare_import_encoded", || {
        let out = ffi!(arg_mut(out, "out"))?;
        if buf.is_null() {
            return Err(Error::NullArgument("buf"));
        }
        let d = crate::handle::encode::decode_full(ffi!(arg_slice(buf, len, "buf"))?)?;
        let req = ffi!(request_from(options))?;
        *out = Box::into_raw(Box::new(DevshareImport::new(import_full(&d.handle, d.table.as_deref(), req)?)));
        Ok(())
    })
}

/// Import a handle from its text form, like `devshare_import_encoded` (NUL-terminated `text`).
#[no_mangle]
pub unsafe extern "C" fn devshare_import_text(
    text: *const std::ffi::c_char,
    options: *const DevshareImportOptions,
    out: *mut *mut DevshareImport,
) -> i32 {
    boundary("devshare_import_text", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let t = ffi!(arg(text, "text"))?;
        let t = ffi!(std::ffi::CStr::from_ptr(t)).to_str().map_err(|_| Error::BadText("text is not UTF-8".into()))?;
        let d = crate::handle::text::from_text_full(t)?;
        let req = ffi!(request_from(options))?;
        *out = Box::into_raw(Box::new(DevshareImport::new(import_full(&d.handle, d.table.as_deref(), req)?)));
        Ok(())
    })
}

/// Return a handle's reference without importing it: for a consumer that received a handle it
/// will not use (validated first; decrements its ref-counter slot once). Refused with
/// `DEVSHARE_STATUS_BUSY` while an import in this process holds that reference (releasing the
/// import returns it), and with `DEVSHARE_STATUS_ALREADY_RELEASED` when it was already returned.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_discard(handle: *const DevshareHandle) -> i32 {
    boundary("devshare_handle_discard", || crate::import::discard_handle(ffi!(arg(handle, "handle"))?))
}

/// Pointers and sizes of an import, into `*out` (initialised with `devshare_import_info_init`).
#[no_mangle]
pub unsafe extern "C" fn devshare_import_info(imp: *const DevshareImport, out: *mut DevshareImportInfo) -> i32 {
    boundary("devshare_import_info", || {
        let i = &ffi!(arg(imp, "import"))?.0;
        ffi!(write_output(out, info_of(i), "out"))
    })
}

/// What `devshare_import_info` reports of an import (`struct_size` is set on writing).
fn info_of(i: &crate::import::Import) -> DevshareImportInfo {
    let v = i.view();
    let h = i.handle();
    DevshareImportInfo {
        struct_size: 0,
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
        reserved: 0,
    }
}

/// A copy of the handle an import was made from (shape, strides, dtype ...).
#[no_mangle]
pub unsafe extern "C" fn devshare_import_handle(imp: *const DevshareImport, out: *mut DevshareHandle) -> i32 {
    boundary("devshare_import_handle", || {
        let i = &ffi!(arg(imp, "import"))?.0;
        *ffi!(arg_mut(out, "out"))? = *i.handle();
        Ok(())
    })
}

/// For an import that is a pool item: the pool's id (> 0) and the slot. Any other import is
/// `DEVSHARE_STATUS_INVALID_ARGUMENT`. Either out-pointer may be NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_pool_slot(imp: *const DevshareImport, pool: *mut u32, slot: *mut u32) -> i32 {
    boundary("devshare_import_pool_slot", || {
        let i = ffi!(arg(imp, "import"))?.inner();
        let (p, s) = i.pool_slot().ok_or_else(|| Error::InvalidArgument("the import is not a pool item".into()))?;
        if let Some(o) = ffi!(pool.as_mut()) {
            *o = p;
        }
        if let Some(o) = ffi!(slot.as_mut()) {
            *o = s;
        }
        Ok(())
    })
}

/// The name the producer gave this lease (`devshare_channel_send_named`, 1.11): `*name` points to
/// it (NUL-terminated UTF-8, at most `DEVSHARE_MAX_NAME_LEN` bytes; valid while the import
/// lives) and `*len` is its length without the NUL. An import without a name (a lease sent
/// without one, a pool item, an import of a handle): `*name` NULL and `*len` 0, status OK.
/// `len` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_name(
    imp: *const DevshareImport,
    name: *mut *const c_char,
    len: *mut usize,
) -> i32 {
    boundary("devshare_import_name", || {
        let i = ffi!(arg(imp, "import"))?.inner();
        let out = ffi!(arg_mut(name, "name"))?;
        let n = i.name();
        *out = n.map_or(std::ptr::null(), |n| n.as_ptr());
        if let Some(l) = ffi!(len.as_mut()) {
            *l = n.map_or(0, |n| n.to_bytes().len());
        }
        Ok(())
    })
}

/// Everything a receive loop reads of an item, in one call: what `devshare_import_info` writes
/// into `*info` (initialised with `devshare_import_info_init`), the handle
/// (`devshare_import_handle`) into `*handle`, and the pool id and slot
/// (`devshare_import_pool_slot`) into `*pool` and `*slot` — 0 and 0 for an item that is not a
/// pool slot (a lease, or any other import: pool ids start at 1). Each out pointer may be NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_describe(
    imp: *const DevshareImport,
    info: *mut DevshareImportInfo,
    handle: *mut DevshareHandle,
    pool: *mut u32,
    slot: *mut u32,
) -> i32 {
    boundary("devshare_import_describe", || {
        let i = ffi!(arg(imp, "import"))?.inner();
        if !info.is_null() {
            ffi!(write_output(info, info_of(i), "info"))?;
        }
        if let Some(h) = ffi!(handle.as_mut()) {
            *h = *i.handle();
        }
        let (p, s) = i.pool_slot().unwrap_or((0, 0));
        if let Some(o) = ffi!(pool.as_mut()) {
            *o = p;
        }
        if let Some(o) = ffi!(slot.as_mut()) {
            *o = s;
        }
        Ok(())
    })
}

/// For a channel item (a lease or pool slot from `devshare_connection_recv`): give it back to the
/// producer now — a lease stops counting in its export, a pool slot may be refilled — while the
/// import stays mapped until `devshare_import_release` (which then sends nothing). So a reader
/// that may still hold pointers into the item (a tensor over it) can return the item at once
/// and free the mapping later: what it reads meanwhile is whatever the producer writes there
/// next (for a pool slot, the next item), never a fault. A second call does nothing. Any other
/// import is `DEVSHARE_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn devshare_import_give_back(imp: *const DevshareImport) -> i32 {
    boundary("devshare_import_give_back", || ffi!(arg(imp, "import"))?.inner().give_back())
}

/// `devshare_import_give_back` for each of `imps[0..n]` (1.12), in one call: the leases of one
/// connection go back in as few messages as its producer reads (a 1.12 producer takes up to
/// 8192 in one), so a batch of any size fits the producer's socket even while it is not
/// reading, and nothing waits on the producer. NULL entries are skipped; an import that did not
/// come over a channel is `DEVSHARE_STATUS_INVALID_ARGUMENT`, naming its index, and then
/// nothing is given back. Items given back before send nothing. The imports stay mapped until
/// released.
#[no_mangle]
pub unsafe extern "C" fn devshare_imports_give_back(imps: *const *const DevshareImport, n: usize) -> i32 {
    boundary("devshare_imports_give_back", || {
        if n == 0 {
            return Ok(());
        }
        if imps.is_null() {
            return Err(Error::NullArgument("imps"));
        }
        // SAFETY: the caller passes n readable pointers (contract).
        let all = ffi!(std::slice::from_raw_parts(imps, n));
        let mut imports = Vec::with_capacity(n);
        for (i, &imp) in all.iter().enumerate() {
            // SAFETY: NULL or a live import (contract).
            let Some(imp) = ffi!(imp.as_ref()) else { continue };
            let imp = imp.inner();
            if imp.lease().is_none() {
                return Err(Error::InvalidArgument(format!(
                    "imps[{i}] did not come over a channel: its reference goes back when it is released"
                )));
            }
            imports.push(imp);
        }
        crate::channel::Connection::give_back_all(imports);
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
        // SAFETY: imp came from Box::into_raw in devshare_import and is released once, where it
        // lies (a pool item's box is kept for the slot's next item).
        Import::release_boxed(unsafe { Box::from_raw(imp) }.into_boxed_import());
        Ok(())
    })
}
