//! Capability probe: which backends can be used in this process, and why not.

use super::abi::{init, sized_struct, write_output, SizedStruct};
use super::boundary;
use crate::backend;
use crate::handle::backend_name;
use std::ffi::c_char;

/// What `devshare_probe` found out about one backend. Initialise with
/// `devshare_backend_info_init(&info, sizeof info)` before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareBackendInfo {
    /// Size of this struct in the caller's header; on return, the bytes the library filled in.
    pub struct_size: u32,
    /// `DEVSHARE_BACKEND_*`.
    pub backend: u16,
    /// 1 when the backend can export and import in this process.
    pub usable: u16,
    /// Backend name ("host", "acl", "cuda"), NUL-terminated.
    pub name: [c_char; 16],
    /// What was found, or why it is unusable (library tried, environment variable to set),
    /// NUL-terminated, truncated to fit.
    pub detail: [c_char; 512],
}

sized_struct!(
    DevshareBackendInfo,
    "DevshareBackendInfo",
    first_size = 536,
    sum = 4 + 2 + 2 + 16 + 512,
    defaults = DevshareBackendInfo { struct_size: 0, backend: 0, usable: 0, name: [0; 16], detail: [0; 512] }
);

/// Initialise `DevshareBackendInfo` of `size` bytes (pass `sizeof *info`) for `devshare_probe`.
#[no_mangle]
pub unsafe extern "C" fn devshare_backend_info_init(info: *mut DevshareBackendInfo, size: u32) -> i32 {
    boundary("devshare_backend_info_init", || ffi!(init(info, size, "info")))
}

fn fill(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = *b as c_char;
    }
    dst[n..].fill(0);
}

/// `devshare_probe` target (not a handle backend): how this process's remote (`tcp://`) channels
/// move items: on the authenticated connection (name "stream", always usable), or, with
/// `DEVSHARE_REMOTE_DATA=ucx`, as UCX puts (name "ucx"; `libucp.so.0`, loaded at run time,
/// `DEVSHARE_UCX_LIBRARY` names another).
pub const DEVSHARE_PROBE_REMOTE: u16 = 256;

/// Report whether `backend` is usable here, into `*out` (initialised with
/// `devshare_backend_info_init`): a `DEVSHARE_BACKEND_*`, or `DEVSHARE_PROBE_REMOTE` for remote
/// channels (name: the data path this process takes, "stream" or "ucx"; detail: that path and
/// UCX's version and path, or why it does not load). Unknown
/// ids are `DEVSHARE_STATUS_INVALID_ARGUMENT`; an unusable backend is `DEVSHARE_STATUS_OK` with
/// `usable = 0`.
#[no_mangle]
pub unsafe extern "C" fn devshare_probe(backend: u16, out: *mut DevshareBackendInfo) -> i32 {
    boundary("devshare_probe", || {
        let mut info = DevshareBackendInfo::defaults();
        info.backend = backend;
        if backend == DEVSHARE_PROBE_REMOTE {
            let (path, usable, detail) = crate::channel::remote_probe();
            info.usable = u16::from(usable);
            fill(&mut info.name, path);
            fill(&mut info.detail, &detail);
        } else {
            let p = backend::get(backend)?.probe();
            info.usable = u16::from(p.usable);
            fill(&mut info.name, backend_name(backend));
            fill(&mut info.detail, &p.detail);
        }
        ffi!(write_output(out, info, "out"))
    })
}
