//! DLPack export of imports. The DLPack types are declared, not defined, in devshare.h: include
//! `dlpack.h` (1.x) for their layout.

use super::import::DevshareImport;
use super::{arg, arg_mut, boundary};
use crate::dlpack;

/// DLPack's `DLManagedTensorVersioned` (defined in dlpack.h; opaque here).
pub struct DLManagedTensorVersioned {
    _opaque: [u8; 0],
}
/// DLPack's legacy `DLManagedTensor` (defined in dlpack.h; opaque here).
pub struct DLManagedTensor {
    _opaque: [u8; 0],
}

/// A `DLManagedTensorVersioned` (DLPack 1.1) view of an import: data points at the tensor's first
/// element (byte_offset 0), shape and strides in elements, device CPU (host), CUDA (cuda) or
/// ExtDev (acl), flags READ_ONLY for read-only imports. It holds its own reference to the
/// import: release the import whenever you like; the view stays valid until its `deleter` runs,
/// which releases that reference (and, if it was the last, returns the handle's reference).
#[no_mangle]
pub unsafe extern "C" fn devshare_import_to_dlpack_versioned(
    imp: *const DevshareImport,
    out: *mut *mut DLManagedTensorVersioned,
) -> i32 {
    boundary("devshare_import_to_dlpack_versioned", || {
        let i = ffi!(arg(imp, "import"))?;
        let out = ffi!(arg_mut(out, "out"))?;
        *out = dlpack::versioned(i.inner()).cast();
        Ok(())
    })
}

/// The same as a legacy `DLManagedTensor` (no version, no flags: it cannot say read-only).
#[no_mangle]
pub unsafe extern "C" fn devshare_import_to_dlpack(imp: *const DevshareImport, out: *mut *mut DLManagedTensor) -> i32 {
    boundary("devshare_import_to_dlpack", || {
        let i = ffi!(arg(imp, "import"))?;
        let out = ffi!(arg_mut(out, "out"))?;
        *out = dlpack::legacy(i.inner()).cast();
        Ok(())
    })
}
