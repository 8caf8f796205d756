//! Finding the vendor runtimes: a runtime that is not there is "backend unavailable", and the
//! message lists every place that was tried, in order, with the variable that overrides them.

use devshare::backend::{get, ExportOptions};
use devshare::handle::{DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA};
use devshare::Status;

#[test]
fn missing_runtimes_are_unavailable_and_the_message_lists_what_was_tried() {
    std::env::set_var("DEVSHARE_ACL_LIBRARY", "/nonexistent/devshare-test/libascendcl.so");
    std::env::set_var("ASCEND_HOME_PATH", "/nonexistent/ascend-home");
    std::env::set_var("ASCEND_TOOLKIT_HOME", "/nonexistent/ascend-toolkit");
    std::env::set_var("DEVSHARE_CUDA_LIBRARY", "/nonexistent/devshare-test/libcuda.so.1");
    let acl = get(DEVSHARE_BACKEND_ACL).unwrap();
    let mut buf = [0u8; 4096];
    match acl.export(0, buf.as_mut_ptr(), 4096, &ExportOptions::default()) {
        // A machine with CANN installed in a default place loads it from there.
        Ok(_) => unreachable!("a 4 KiB host buffer is not ACL device memory"),
        Err(e) if e.status() == Status::BackendUnavailable => {
            let m = e.to_string();
            let order = [
                "DEVSHARE_ACL_LIBRARY",
                "/nonexistent/devshare-test/libascendcl.so",
                "/nonexistent/ascend-home/lib64/libascendcl.so",
                "/nonexistent/ascend-toolkit/lib64/libascendcl.so",
                "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so",
                "/usr/local/Ascend/cann/lib64/libascendcl.so",
                "libascendcl.so:",
                "/nonexistent/ascend-home/lib64/libacl_rt.so",
                "libacl_rt.so:",
            ];
            let mut at = 0;
            for want in order {
                let pos = m[at..].find(want).unwrap_or_else(|| panic!("{want:?} missing or out of order in: {m}"));
                at += pos + want.len();
            }
            assert!(!acl.probe().usable);
        }
        Err(e) => {
            // Loaded from a default location: then the export fails for another reason.
            assert!(acl.probe().usable, "{e}");
        }
    }
    let cuda = get(DEVSHARE_BACKEND_CUDA).unwrap();
    if !cuda.probe().usable {
        let e = cuda.export(0, buf.as_mut_ptr(), 4096, &ExportOptions::default()).err().unwrap();
        assert_eq!(e.status(), Status::BackendUnavailable);
        let m = e.to_string();
        assert!(
            m.contains("DEVSHARE_CUDA_LIBRARY")
                && m.contains("/nonexistent/devshare-test/libcuda.so.1")
                && m.contains("libcuda.so.1:"),
            "{m}"
        );
    }
}
