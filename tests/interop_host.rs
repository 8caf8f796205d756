//! PyTorch file_system interop pieces on the Rust side: in-flight references, adopting an
//! existing object, DLPack views.

use devshare::backend::ImportRequest;
use devshare::dlpack;
use devshare::dtype::DevshareDType;
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT;
use devshare::import::import;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn header_count(name: &[u8]) -> Option<i32> {
    let path = std::path::Path::new("/dev/shm").join(std::str::from_utf8(&name[1..]).unwrap());
    let bytes = std::fs::read(path).ok()?;
    Some(i32::from_ne_bytes(bytes[..4].try_into().unwrap()))
}

fn desc(shape: &[i64], inflight: bool) -> TensorDesc<'_> {
    TensorDesc {
        dtype: DevshareDType::new(2, 32, 1),
        shape,
        strides: None,
        storage_offset: 0,
        storage_size: None,
        tensor_offset: 0,
        inflight,
        ..Default::default()
    }
}

#[test]
fn inflight_handle_survives_exporter_close_and_first_import_takes_the_reference_over() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let exp = Exporter::host_alloc(64).unwrap();
    unsafe { *exp.ptr().cast::<f32>() = 2.5 };
    let h = exp.share(&desc(&[16], true)).unwrap();
    assert_ne!(h.flags & DEVSHARE_HANDLE_FLAG_INFLIGHT, 0);
    let name = h.key_bytes().to_vec();
    assert_eq!(header_count(&name), Some(2), "exporter + the in-flight reference");
    drop(exp);
    assert_eq!(header_count(&name), Some(1), "the in-flight reference keeps the object");
    let a = import(&h, ImportRequest::default()).unwrap();
    assert_eq!(header_count(&name), Some(1), "mapped (+1) and took the in-flight one over (-1)");
    let b = import(&h, ImportRequest::default()).unwrap();
    assert_eq!(header_count(&name), Some(1), "a second import of the same handle takes nothing over");
    assert_eq!(unsafe { *b.view().data.cast::<f32>() }, 2.5);
    a.release();
    b.release();
    assert_eq!(header_count(&name), None, "the last holder unlinked it");
}

#[test]
fn adopted_object_is_shared_without_copy_and_counted_like_any_holder() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Stand-in for a PyTorch-created object: another exporter's allocation.
    let owner = Exporter::host_alloc(256).unwrap();
    let name = owner.share_bytes().unwrap().key_bytes().to_vec();
    let adopted = Exporter::host_adopt(&name, 256).unwrap();
    assert_eq!(header_count(&name), Some(2));
    unsafe { *owner.ptr().add(100) = 9 };
    assert_eq!(unsafe { *adopted.ptr().add(100) }, 9, "same memory, no copy");
    let h = adopted.share(&desc(&[64], true)).unwrap();
    let imp = import(&h, ImportRequest::default()).unwrap();
    assert_eq!(unsafe { *imp.view().data.add(100) }, 9);
    assert_eq!(adopted.outstanding().unwrap(), 1);
    imp.release();
    assert_eq!(adopted.outstanding().unwrap(), 0);
    drop(owner);
    assert_eq!(header_count(&name), Some(1), "the adopter still holds it");
    drop(adopted);
    assert_eq!(header_count(&name), None, "the adopter was the last holder and unlinked it");

    let missing = format!("/devshare_{}_{}", std::process::id(), "0".repeat(32));
    let err = Exporter::host_adopt(missing.as_bytes(), 16).err().unwrap();
    assert_eq!(err.status(), devshare::Status::NotFound, "{err}");
    let err = Exporter::host_adopt(b"/devshare_no_such_object", 16).err().unwrap();
    assert_eq!(err.status(), devshare::Status::Untrusted, "not a devshare or PyTorch name: {err}");
    let owner = Exporter::host_alloc(16).unwrap();
    let name = owner.share_bytes().unwrap().key_bytes().to_vec();
    let err = Exporter::host_adopt(&name, 17).err().unwrap();
    assert_eq!(err.status(), devshare::Status::Mismatch, "{err}");
    let err = Exporter::host_adopt(b"../etc/passwd", 16).err().unwrap();
    assert_eq!(err.status(), devshare::Status::InvalidArgument, "{err}");
}

#[test]
fn dlpack_view_describes_the_tensor_and_its_deleter_returns_the_reference() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let exp = Exporter::host_alloc(4096).unwrap();
    let h = exp
        .share(&TensorDesc {
            dtype: DevshareDType::new(0, 64, 1),
            shape: &[3, 4],
            strides: Some(&[1, 3]),
            storage_offset: 1024,
            storage_size: Some(2048),
            tensor_offset: 5,
            inflight: false,
            ..Default::default()
        })
        .unwrap();
    let imp = import(&h, ImportRequest::default()).unwrap();
    let m = dlpack::versioned(&imp);
    let legacy = dlpack::legacy(&imp);
    imp.release();
    assert_eq!(exp.outstanding().unwrap(), 1, "the DLPack views still hold the reference");
    unsafe {
        let t = &(*m).dl_tensor;
        assert_eq!((*m).version.major, 1);
        assert_eq!((*m).flags, 0);
        assert_eq!(t.device, dlpack::DlDevice { device_type: 1, device_id: 0 });
        assert_eq!(t.ndim, 2);
        assert_eq!(t.dtype, DevshareDType::new(0, 64, 1));
        assert_eq!(std::slice::from_raw_parts(t.shape, 2), &[3, 4]);
        assert_eq!(std::slice::from_raw_parts(t.strides, 2), &[1, 3]);
        assert_eq!(t.byte_offset, 0);
        let base = (*legacy).dl_tensor.data as usize - (1024 + 5 * 8);
        *((base + 1024 + 5 * 8) as *mut i64) = -7;
        assert_eq!(*t.data.cast::<i64>(), -7);
        ((*m).deleter.unwrap())(m);
        assert_eq!(exp.outstanding().unwrap(), 1);
        ((*legacy).deleter.unwrap())(legacy);
    }
    assert_eq!(exp.outstanding().unwrap(), 0, "the last deleter returned the reference");
}
