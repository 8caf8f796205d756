//! fork (issue 11, item 6): a child forked after imports forgets the imports it inherited
//! without releasing them; the parent's counts and references are unchanged, and the parent
//! releases as usual. One test in this binary, so that `fork` runs with no other test thread.

use devshare::backend::ImportRequest;
use devshare::dtype::DevshareDType;
use devshare::export::{Exporter, TensorDesc};
use devshare::import::{cached_allocations, import};
use devshare::Status;

fn header_count(name: &[u8]) -> Option<i32> {
    let path = std::path::Path::new("/dev/shm").join(std::str::from_utf8(&name[1..]).unwrap());
    let bytes = std::fs::read(path).ok()?;
    Some(i32::from_ne_bytes(bytes[..4].try_into().unwrap()))
}

/// Run `child` in a forked child (exit status 0 when it returns true) and wait for it.
fn in_child(child: impl FnOnce() -> bool) -> i32 {
    // SAFETY: the child only runs `child` (devshare calls, no locks held by other threads: this
    // binary has one test) and leaves with _exit, running no destructors or atexit handlers.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(false);
        // SAFETY: _exit ends the child at once.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut st = 0;
    // SAFETY: pid is our child; st a valid out-parameter.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(libc::WIFEXITED(st), "child died: status {st:#x}");
    libc::WEXITSTATUS(st)
}

#[test]
fn a_forked_child_forgets_inherited_imports_without_releasing_them() {
    let exp = Exporter::host_alloc(4096).unwrap();
    let desc =
        |inflight| TensorDesc { dtype: DevshareDType::new(1, 8, 1), shape: &[4096], inflight, ..Default::default() };
    let h = exp.share(&desc(false)).unwrap();
    let pending = exp.share(&desc(true)).unwrap();
    let (data, rc) = (h.key_bytes().to_vec(), h.ref_name_bytes().to_vec());
    let a = import(&h, ImportRequest::default()).unwrap();
    let b = a.clone_ref();
    let ro = import(&h, ImportRequest { read_only: true, ..Default::default() }).unwrap();
    unsafe { *a.view().data = 7 };
    let counts = || (header_count(&data), header_count(&rc), exp.outstanding().unwrap(), exp.slot_value(&h));
    let before = counts();
    // Data: exporter, the pending in-flight count, the read-write and the read-only mapping.
    // Ref-counter: exporter and the pending in-flight share. References: h's and pending's.
    assert_eq!(before, (Some(4), Some(2), 2, Some(1)));

    // The child drops every inherited import (and the exporter), then checks that the registry
    // forgot them; none of it may reach the parent's objects.
    let code = in_child(|| {
        // SAFETY: the child's copies of the parent's objects, each dropped once here; the
        // originals are never dropped in the child (it leaves with _exit).
        let (a, b, ro, exp) =
            unsafe { (std::ptr::read(&a), std::ptr::read(&b), std::ptr::read(&ro), std::ptr::read(&exp)) };
        let seen = unsafe { *b.view().data } == 7; // the inherited mapping is still readable
        let c = b.clone_ref();
        drop(a);
        b.release();
        c.release();
        drop(ro);
        // Even closing with DEVSHARE_CLOSE_UNLINK removes nothing of the parent's.
        if exp.prepare_close(true, true).is_err() {
            return false;
        }
        drop(exp);
        seen && cached_allocations() == 0
    });
    assert_eq!(code, 0, "the child saw the data and forgot its imports");
    assert_eq!(counts(), before, "the child changed the parent's header counts or references");
    assert_eq!(cached_allocations(), 2);

    // A child may import on its own: that import counts for itself and is released normally.
    // It also takes the pending in-flight reference over, so the parent cannot take it twice.
    let code = in_child(|| {
        let Ok(mine) = import(&pending, ImportRequest::default()) else { return false };
        let ok = unsafe { *mine.view().data } == 7 && cached_allocations() == 1;
        mine.release();
        ok && cached_allocations() == 0
    });
    assert_eq!(code, 0, "the child's own import worked");
    assert_eq!(counts().0, Some(3), "the child's import and take-over left one count less: the in-flight one");
    let err = import(&pending, ImportRequest::default()).err().expect("taken over already");
    assert_eq!(err.status(), Status::AlreadyReleased, "{err}");

    // The parent releases as usual.
    drop((a, b, ro));
    assert_eq!(exp.outstanding().unwrap(), 0);
    assert_eq!(header_count(&data), Some(1));
    drop(exp);
    assert_eq!((header_count(&data), header_count(&rc)), (None, None), "nothing left in /dev/shm");
}
