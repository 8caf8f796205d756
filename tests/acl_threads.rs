//! The acl backend from many threads of one process, over the ACL stand-in runtime (built by
//! build.rs): threads that never bound a device import and release concurrently, cached and
//! cold, on two devices; every reference comes back exactly once, closes equal imports, and the
//! stand-in records no rule violation.

mod common;

use devshare::backend::{ExportOptions, ImportRequest};
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::DEVSHARE_BACKEND_ACL;
use devshare::import::import;
use std::ffi::{c_void, CString};
use std::sync::Arc;

fn runtime() -> common::Acl {
    common::acl("acl_threads")
}

#[test]
fn threads_import_and_release_concurrently_and_every_reference_returns_once() {
    let rt = runtime();
    const SIZE: usize = 2 << 20;
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: stand-in calls with valid arguments.
    unsafe {
        assert_eq!((rt.set_device)(0), 0);
        assert_eq!((rt.malloc)(&mut ptr, SIZE, 0), 0, "aclrtMalloc 2 MiB HUGE_FIRST");
    }
    // Export without pid validation: this process imports its own key.
    let exp = Arc::new(
        Exporter::export(
            DEVSHARE_BACKEND_ACL,
            0,
            ptr.cast(),
            SIZE as u64,
            &ExportOptions { no_pid_check: true, ..Default::default() },
        )
        .unwrap(),
    );
    let desc = |offset: u64| TensorDesc {
        shape: &[4096],
        storage_offset: offset,
        storage_size: Some(4096),
        ..Default::default()
    };
    // One held import per device keeps the key open there; threads then hit the cache.
    let held0 = import(&exp.share(&desc(0)).unwrap(), ImportRequest::default()).unwrap();
    let held1 = import(&exp.share(&desc(0)).unwrap(), ImportRequest { device: Some(1), ..Default::default() }).unwrap();
    let key = CString::new(&held0.handle().key[..held0.handle().key.iter().position(|&b| b == 0).unwrap()]).unwrap();

    const THREADS: usize = 8;
    const ROUNDS: usize = 200;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let exp = exp.clone();
            s.spawn(move || {
                let device = (t % 2) as i32;
                for r in 0..ROUNDS {
                    let h = exp.share(&desc(((t * ROUNDS + r) % 512) as u64 * 4096)).unwrap();
                    let a = import(&h, ImportRequest { device: Some(device), ..Default::default() }).unwrap();
                    let b = a.clone_ref();
                    assert_eq!(a.view().data, b.view().data);
                    assert_eq!(a.view().device, device);
                    a.release();
                    b.release();
                }
            });
        }
    });
    // SAFETY: stand-in query.
    assert_eq!(unsafe { (rt.open_imports)(key.as_ptr()) }, 2, "one ACL import per device while held");
    assert_eq!(exp.outstanding().unwrap(), 2, "only the two held references are outstanding");
    held0.release();
    held1.release();
    assert_eq!(exp.outstanding().unwrap(), 0);
    // SAFETY: stand-in queries and free.
    unsafe {
        assert_eq!((rt.open_imports)(key.as_ptr()), 0, "closes equal imports");
        // Cold path from threads: nothing held, every import opens and closes the key.
        std::thread::scope(|s| {
            for t in 0..4 {
                let exp = exp.clone();
                s.spawn(move || {
                    for _ in 0..50 {
                        let h = exp.share(&desc(0)).unwrap();
                        import(&h, ImportRequest { device: Some(t % 2), ..Default::default() }).unwrap().release();
                    }
                });
            }
        });
        assert_eq!(exp.outstanding().unwrap(), 0);
        assert_eq!((rt.open_imports)(key.as_ptr()), 0);
        Arc::try_unwrap(exp).ok().expect("threads are done").check_close(false).unwrap();
        assert_eq!((rt.set_device)(0), 0);
        assert_eq!((rt.free)(ptr), 0);
        assert_eq!((rt.violations)(), 0, "the stand-in recorded no rule violation");
    }
}
