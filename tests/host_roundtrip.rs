//! Host backend, in one process: export, import, cache, release, ref-counter, /dev/shm hygiene.

use devshare::backend::ImportRequest;
use devshare::dtype::DevshareDType;
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::DevshareHandle;
use devshare::import::{cached_allocations, import};
use devshare::Status;
use std::sync::Mutex;

/// Tests in this file look at process-wide state (the registry, /proc/self/maps): one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn shm_exists(name: &[u8]) -> bool {
    std::path::Path::new("/dev/shm").join(std::str::from_utf8(&name[1..]).unwrap()).exists()
}

fn mappings_of(name: &[u8]) -> usize {
    let name = std::str::from_utf8(&name[1..]).unwrap();
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains(name)).count()
}

fn f32_2d(exp: &Exporter, rows: i64, cols: i64) -> DevshareHandle {
    exp.share(&TensorDesc {
        dtype: DevshareDType::new(2, 32, 1),
        shape: &[rows, cols],
        strides: None,
        storage_offset: 0,
        storage_size: None,
        tensor_offset: 0,
        inflight: false,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn import_sees_exported_data_and_writes_back() {
    let _g = lock();
    let exp = Exporter::host_alloc(4 * 12).unwrap();
    let data = exp.ptr().cast::<f32>();
    for i in 0..12 {
        unsafe { *data.add(i) = i as f32 };
    }
    let h = f32_2d(&exp, 3, 4);
    let imp = import(&h, ImportRequest::default()).unwrap();
    let p = imp.view().data.cast::<f32>();
    assert_ne!(p, data, "the import is a separate mapping");
    for i in 0..12 {
        assert_eq!(unsafe { *p.add(i) }, i as f32);
    }
    unsafe { *p.add(5) = 42.0 };
    assert_eq!(unsafe { *data.add(5) }, 42.0);
    assert_eq!(exp.outstanding().unwrap(), 1);
    imp.release();
    assert_eq!(exp.outstanding().unwrap(), 0);
    assert_eq!(exp.slot_value(&h), Some(0));
}

#[test]
fn import_twice_maps_once_and_unmaps_after_last_release() {
    let _g = lock();
    let exp = Exporter::host_alloc(1 << 16).unwrap();
    let h = exp.share_bytes().unwrap();
    let name = h.key_bytes().to_vec();
    let before = mappings_of(&name);
    let cached = cached_allocations();
    let a = import(&h, ImportRequest::default()).unwrap();
    let b = import(&h, ImportRequest::default()).unwrap();
    assert_eq!(a.view().base, b.view().base);
    assert_eq!(mappings_of(&name), before + 1);
    assert_eq!(cached_allocations(), cached + 1);
    a.release();
    assert_eq!(exp.outstanding().unwrap(), 1, "the handle is still held by the second import");
    b.release();
    assert_eq!(exp.outstanding().unwrap(), 0);
    assert_eq!(cached_allocations(), cached);
    assert_eq!(mappings_of(&name), before);
}

#[test]
fn exporter_close_keeps_importer_mapping_valid_and_last_release_unlinks() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    unsafe { *exp.ptr() = 7 };
    let h = exp.share_bytes().unwrap();
    let name = h.key_bytes().to_vec();
    let rc = h.ref_name_bytes().to_vec();
    let imp = import(&h, ImportRequest::default()).unwrap();
    drop(exp);
    assert!(shm_exists(&name), "the importer still counts in the header: not unlinked yet");
    assert_eq!(unsafe { *imp.view().data }, 7);
    imp.release();
    assert!(!shm_exists(&name));
    assert!(!shm_exists(&rc));
}

#[test]
fn released_handle_cannot_be_imported_again() {
    let _g = lock();
    let exp = Exporter::host_alloc(64).unwrap();
    let h = exp.share_bytes().unwrap();
    import(&h, ImportRequest::default()).unwrap().release();
    let err = import(&h, ImportRequest::default()).err().unwrap();
    assert_eq!(err.status(), Status::AlreadyReleased, "{err}");
}

#[test]
fn handle_claiming_more_than_the_object_holds_is_refused() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let mut h = exp.share_bytes().unwrap();
    let cached = cached_allocations();
    h.alloc_size = 1 << 20;
    h.storage_size = 1 << 20;
    h.shape[0] = 1 << 20;
    let err = import(&h, ImportRequest::default()).err().unwrap();
    assert_eq!(err.status(), Status::Mismatch, "{err}");
    assert_eq!(cached_allocations(), cached);
}

#[test]
fn a_consumer_that_never_releases_keeps_the_object_until_the_exporter_unlinks_it() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let h = exp.share_bytes().unwrap();
    let (name, rc) = (h.key_bytes().to_vec(), h.ref_name_bytes().to_vec());
    let imp = import(&h, ImportRequest::default()).unwrap();
    // A consumer that never releases (as if it crashed): its mapping stays, its count stays.
    // (Leaked on purpose: other tests in this file only compare registry sizes relatively.)
    std::mem::forget(imp);
    exp.unlink_names();
    drop(exp);
    assert!(!shm_exists(&name), "unlink_names removed the data object");
    assert!(!shm_exists(&rc), "unlink_names removed the ref-counter");
}
