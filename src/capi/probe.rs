//! Capability probe: which backends can be used in this process, and why not.

use super::{arg_mut, boundary};
use crate::backend;
use crate::handle::backend_name;
use std::ffi::c_char;

/// What `devshare_probe` found out about one backend.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareBackendInfo {
    /// `DEVSHARE_BACKEND_*`.
    pub backend: u16,
    /// 1 when the backend can export and import in this process.
    pub usable: u16,
    /// Reserved, zero.
    pub reserved: u32,
    /// Backend name ("host", "acl", "cuda"), NUL-terminated.
    pub name: [c_char; 16],
    /// What was found, or why it is unusable (library tried, environment variable to set),
    /// NUL-terminated, truncated to fit.
    pub detail: [c_char; 512],
}

fn fill(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = *b as c_char;
    }
    dst[n..].fill(0);
}

/// Report whether `backend` is usable here. Unknown backend ids are
/// `DEVSHARE_STATUS_INVALID_ARGUMENT`; an unusable backend is `DEVSHARE_STATUS_OK` with `usable = 0`.
#[no_mangle]
pub unsafe extern "C" fn devshare_probe(backend: u16, out: *mut DevshareBackendInfo) -> i32 {
    boundary("devshare_probe", || {
        let out = unsafe { arg_mut(out, "out") }?;
        let p = backend::get(backend)?.probe();
        out.backend = backend;
        out.usable = u16::from(p.usable);
        out.reserved = 0;
        fill(&mut out.name, backend_name(backend));
        fill(&mut out.detail, &p.detail);
        Ok(())
    })
}
