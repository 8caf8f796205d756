//! DLPack (dlpack.h 1.x) views of imports: `DLManagedTensorVersioned` and the legacy
//! `DLManagedTensor`. Each view holds its own reference to the import; its deleter releases it.

use crate::handle::{DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA, DEVSHARE_BACKEND_HOST, DEVSHARE_MAX_NDIM};
use crate::import::Import;
use static_assertions::assert_eq_size;
use std::ffi::c_void;

/// DLPack version this library produces.
pub(crate) const DLPACK_MAJOR: u32 = 1;
pub(crate) const DLPACK_MINOR: u32 = 1;
/// `DLManagedTensorVersioned::flags` bit: the tensor is read-only.
pub(crate) const DLPACK_FLAG_READ_ONLY: u64 = 1;

/// DLPack device types devshare produces.
pub(crate) const KDL_CPU: i32 = 1;
pub(crate) const KDL_CUDA: i32 = 2;
/// torch_npu tensors show up as `kDLExtDev` today.
pub(crate) const KDL_EXT_DEV: i32 = 12;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DlDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DlTensor {
    pub data: *mut c_void,
    pub device: DlDevice,
    pub ndim: i32,
    pub dtype: crate::dtype::DevshareDType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DlManagedTensor {
    pub dl_tensor: DlTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DlPackVersion {
    pub major: u32,
    pub minor: u32,
}

#[repr(C)]
pub struct DlManagedTensorVersioned {
    pub version: DlPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DlTensor,
}

assert_eq_size!(DlTensor, [u8; 48]);
assert_eq_size!(DlManagedTensor, [u8; 64]);
assert_eq_size!(DlManagedTensorVersioned, [u8; 80]);

/// DLPack device of an import.
pub fn device_of(imp: &Import) -> DlDevice {
    let device_id = imp.view().device;
    match imp.handle().backend {
        DEVSHARE_BACKEND_CUDA => DlDevice { device_type: KDL_CUDA, device_id },
        DEVSHARE_BACKEND_ACL => DlDevice { device_type: KDL_EXT_DEV, device_id },
        DEVSHARE_BACKEND_HOST => DlDevice { device_type: KDL_CPU, device_id: 0 },
        other => unreachable!("validated handles have a known backend, not {other}"),
    }
}

/// The allocation behind a DLPack view: the managed struct first, so a pointer to it is a
/// pointer to the whole context.
#[repr(C)]
struct Ctx<M> {
    managed: M,
    shape: [i64; DEVSHARE_MAX_NDIM],
    strides: [i64; DEVSHARE_MAX_NDIM],
    import: Import,
}

/// The tensor description of `imp`; `wrap` fills in shape and strides.
fn tensor_of(imp: &Import) -> DlTensor {
    DlTensor {
        data: imp.view().data.cast(),
        device: device_of(imp),
        ndim: imp.handle().ndim as i32,
        dtype: imp.handle().dtype,
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// The two managed-tensor forms, for the code they share.
trait Managed: Sized {
    fn parts(&mut self) -> (&mut *mut c_void, &mut DlTensor);
}

impl Managed for DlManagedTensorVersioned {
    fn parts(&mut self) -> (&mut *mut c_void, &mut DlTensor) {
        (&mut self.manager_ctx, &mut self.dl_tensor)
    }
}

impl Managed for DlManagedTensor {
    fn parts(&mut self) -> (&mut *mut c_void, &mut DlTensor) {
        (&mut self.manager_ctx, &mut self.dl_tensor)
    }
}

/// Box `managed` with its shape, strides and own reference to `imp`, and point it at them.
fn wrap<M: Managed>(imp: &Import, managed: M) -> *mut M {
    let h = imp.handle();
    let ctx = Box::into_raw(Box::new(Ctx { managed, shape: h.shape, strides: h.strides, import: imp.clone_ref() }));
    // SAFETY: ctx is a live, uniquely owned allocation until the deleter runs.
    unsafe {
        let (manager_ctx, t) = (*ctx).managed.parts();
        *manager_ctx = ctx.cast();
        t.shape = (*ctx).shape.as_mut_ptr();
        t.strides = (*ctx).strides.as_mut_ptr();
        &mut (*ctx).managed
    }
}

/// The deleter of both forms: free the context and release its import reference.
unsafe extern "C" fn delete<M>(m: *mut M) {
    if !m.is_null() {
        // SAFETY: m is the first field of a Ctx<M> made by `wrap` and is deleted once.
        let ctx = unsafe { Box::from_raw(m.cast::<Ctx<M>>()) };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || ctx.import.release()));
    }
}

/// A `DLManagedTensorVersioned` holding its own reference to `imp`.
pub fn versioned(imp: &Import) -> *mut DlManagedTensorVersioned {
    let flags = if imp.view().read_only { DLPACK_FLAG_READ_ONLY } else { 0 };
    wrap(
        imp,
        DlManagedTensorVersioned {
            version: DlPackVersion { major: DLPACK_MAJOR, minor: DLPACK_MINOR },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DlManagedTensorVersioned>),
            flags,
            dl_tensor: tensor_of(imp),
        },
    )
}

/// A legacy `DLManagedTensor` holding its own reference to `imp` (no read-only flag exists in
/// this form: do not hand read-only imports to consumers that write).
pub fn legacy(imp: &Import) -> *mut DlManagedTensor {
    wrap(
        imp,
        DlManagedTensor {
            dl_tensor: tensor_of(imp),
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DlManagedTensor>),
        },
    )
}
