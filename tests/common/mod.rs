//! What the Rust integration tests share: the stand-in runtimes (`tests/standin/`, built next to
//! the library by build.rs) and the child-process roles some tests run.

#![allow(dead_code)] // each test binary uses part of it

pub mod fuse;

/// Which stand-in runtime.
#[derive(Clone, Copy, Debug)]
pub enum StandIn {
    /// The ACL runtime (`libascendcl.so`), selected with `DEVSHARE_ACL_LIBRARY`.
    Acl,
    /// The CUDA driver (`libcuda.so.1`), selected with `DEVSHARE_CUDA_LIBRARY`.
    Cuda,
}

/// Point devshare at the stand-in `which` and load it here too (for its test hooks). Its log of
/// broken rules goes to `DEVSHARE_STANDIN_LOG`: a file named for `tag` and this process unless
/// the variable is set already (a child process keeps its parent's).
pub fn load(which: StandIn, tag: &str) -> libloading::Library {
    let (file, var) = match which {
        StandIn::Acl => ("acl/libascendcl.so", "DEVSHARE_ACL_LIBRARY"),
        StandIn::Cuda => ("cuda/libcuda.so.1", "DEVSHARE_CUDA_LIBRARY"),
    };
    let path = format!("{}/{file}", env!("DEVSHARE_STANDIN_DIR"));
    std::env::set_var(var, &path);
    if std::env::var_os("DEVSHARE_STANDIN_LOG").is_none() {
        let log = std::env::temp_dir().join(format!("devshare_{tag}_{}.log", std::process::id()));
        std::env::set_var("DEVSHARE_STANDIN_LOG", &log);
    }
    // SAFETY: the stand-ins are plain C libraries without initialisers that need anything.
    unsafe { libloading::Library::new(&path) }.expect("the stand-ins are built by build.rs")
}

/// A child process running this test binary's ignored test `role_test` (a role of a
/// multi-process test), with `envs` set.
pub fn role(role_test: &str, envs: &[(&str, &std::ffi::OsStr)]) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    c.args(["--ignored", "--exact", role_test, "--nocapture", "--test-threads=1"]);
    for (k, v) in envs {
        c.env(k, v);
    }
    c
}

/// Why PyTorch's tuple fields `a` are refused: the status and the message.
pub fn refusal(a: &devshare::torch::TorchArgs<'_>) -> (devshare::Status, String) {
    let e = devshare::torch::handle_from_torch(a).unwrap_err();
    (e.status(), e.to_string())
}

/// The ACL stand-in, loaded (see [`load`]) and initialised, with the calls the ACL tests make.
pub struct Acl {
    pub malloc: unsafe extern "C" fn(*mut *mut std::ffi::c_void, usize, std::ffi::c_int) -> std::ffi::c_int,
    pub free: unsafe extern "C" fn(*mut std::ffi::c_void) -> std::ffi::c_int,
    pub set_device: unsafe extern "C" fn(i32) -> std::ffi::c_int,
    pub violations: unsafe extern "C" fn() -> std::ffi::c_int,
    pub open_imports: unsafe extern "C" fn(*const std::ffi::c_char) -> std::ffi::c_int,
    pub set_delay: unsafe extern "C" fn(*const std::ffi::c_char, std::ffi::c_uint) -> std::ffi::c_int,
    pub lib: libloading::Library,
}

/// The ACL stand-in for the test `tag` (its log's name), initialised (`aclInit`).
pub fn acl(tag: &str) -> Acl {
    let lib = load(StandIn::Acl, tag);
    // SAFETY: the stand-in is a plain C library; the symbols have these C signatures
    // (tests/standin/acl/acl_standin.h).
    unsafe {
        let init: unsafe extern "C" fn(*const std::ffi::c_char) -> std::ffi::c_int = *lib.get(b"aclInit").unwrap();
        init(std::ptr::null());
        Acl {
            malloc: *lib.get(b"aclrtMalloc").unwrap(),
            free: *lib.get(b"aclrtFree").unwrap(),
            set_device: *lib.get(b"aclrtSetDevice").unwrap(),
            violations: *lib.get(b"aclsi_violation_count").unwrap(),
            open_imports: *lib.get(b"aclsi_open_imports").unwrap(),
            set_delay: *lib.get(b"aclsi_set_delay").unwrap(),
            lib,
        }
    }
}
