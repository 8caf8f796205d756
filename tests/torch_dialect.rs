//! PyTorch / torch_npu tuple fields to handles and back: every storage-handle
//! form parses or fails with the status that names it.

mod common;

use devshare::dtype::DevshareDType;
use devshare::handle::{DEVSHARE_BACKEND_ACL, DEVSHARE_BACKEND_CUDA, DEVSHARE_HANDLE_FLAG_EVENT};
use devshare::torch::{handle_from_torch, handle_to_torch, parse_storage_handle, TorchArgs};
use devshare::Status;

const F32: DevshareDType = DevshareDType { code: 2, bits: 32, lanes: 1 };

fn acl_key() -> Vec<u8> {
    let mut k = b"npu_ipc_key_0123456789abcdef".to_vec();
    k.push(0);
    k.resize(65, 0xa5); // bytes after the NUL are unspecified: garbage here
    k
}

fn args<'a>(backend: u16, handle: &'a [u8]) -> TorchArgs<'a> {
    TorchArgs {
        backend,
        dtype: F32,
        shape: &[4, 8],
        strides: None,
        tensor_offset: 3,
        device: 1,
        producer_pid: 0,
        handle,
        storage_size: 4096,
        storage_offset: 2 * 1024 * 1024 - 4096,
        ref_name: b"/torch_4242_1234567890_7",
        ref_slot: 17,
        event_handle: &[0u8; 64],
        event_sync_required: false,
    }
}

#[test]
fn torch_npu_version_1_c_handle_parses_and_normalises_the_key_after_its_nul() {
    let mut bytes = vec![1u8, b'c'];
    bytes.extend_from_slice(&acl_key());
    assert_eq!(bytes.len(), 67);
    let h = handle_from_torch(&args(DEVSHARE_BACKEND_ACL, &bytes)).unwrap();
    assert_eq!(h.backend, DEVSHARE_BACKEND_ACL);
    assert_eq!(h.key_len, 65);
    let n = b"npu_ipc_key_0123456789abcdef".len();
    assert_eq!(&h.key[..n], b"npu_ipc_key_0123456789abcdef");
    assert!(h.key[n..].iter().all(|&b| b == 0), "garbage after the NUL is zeroed");
    assert_eq!(h.device_index, 1);
    assert_eq!(h.storage_offset, 2 * 1024 * 1024 - 4096);
    assert_eq!(h.storage_size, 4096);
    assert_eq!(h.alloc_size, 2 * 1024 * 1024, "allocation size known only up to the storage's end");
    assert_eq!(h.ref_name_bytes(), b"/torch_4242_1234567890_7");
    assert_eq!(h.ref_slot, 17);
    assert_eq!(h.producer_pid, 4242, "pid read from the ref-counter name");
    assert_eq!((h.ndim, h.dims(), h.stride_dims()), (2, &[4i64, 8][..], &[8i64, 1][..]));
    assert_eq!(h.tensor_offset, 3);
    assert_eq!(h.flags, 0);
}

#[test]
fn legacy_65_byte_acl_key_parses_like_the_c_form() {
    let legacy = acl_key();
    let mut c_form = vec![1u8, b'c'];
    c_form.extend_from_slice(&legacy);
    assert_eq!(
        handle_from_torch(&args(DEVSHARE_BACKEND_ACL, &legacy)).unwrap(),
        handle_from_torch(&args(DEVSHARE_BACKEND_ACL, &c_form)).unwrap()
    );
}

#[test]
fn acl_handle_versions_other_than_1_are_refused_naming_the_version() {
    let mut v2 = vec![2u8, b'c'];
    v2.extend_from_slice(&acl_key());
    let (s, m) = common::refusal(&args(DEVSHARE_BACKEND_ACL, &v2));
    assert_eq!(s, Status::UnsupportedVersion);
    assert!(m.contains("version 2"), "{m}");
}

#[test]
fn truncated_and_unterminated_acl_keys_are_bad_keys() {
    let mut truncated = vec![1u8, b'c'];
    truncated.extend_from_slice(&acl_key()[..60]);
    assert_eq!(common::refusal(&args(DEVSHARE_BACKEND_ACL, &truncated)).0, Status::BadKey);
    let no_nul = vec![b'k'; 65];
    let (s, m) = common::refusal(&args(DEVSHARE_BACKEND_ACL, &no_nul));
    assert_eq!(s, Status::BadKey);
    assert!(m.contains("NUL"), "{m}");
    let mut empty = vec![0u8; 65];
    empty[1] = b'x';
    assert_eq!(common::refusal(&args(DEVSHARE_BACKEND_ACL, &empty)).0, Status::BadKey);
}

#[test]
fn cuda_raw_and_prefixed_handles_of_versions_1_to_3_name_the_same_allocation() {
    let raw: Vec<u8> = (0..64).map(|i| i as u8 ^ 0x5a).collect();
    let base = handle_from_torch(&args(DEVSHARE_BACKEND_CUDA, &raw)).unwrap();
    assert_eq!(base.key_bytes(), &raw[..]);
    for v in 1..=3u8 {
        let mut p = vec![v, b'c'];
        p.extend_from_slice(&raw);
        assert_eq!(handle_from_torch(&args(DEVSHARE_BACKEND_CUDA, &p)).unwrap(), base, "version {v}");
    }
    let mut v4 = vec![4u8, b'c'];
    v4.extend_from_slice(&raw);
    let (s, m) = common::refusal(&args(DEVSHARE_BACKEND_CUDA, &v4));
    assert_eq!(s, Status::UnsupportedVersion);
    assert!(m.contains("version 4"), "{m}");
    assert_eq!(common::refusal(&args(DEVSHARE_BACKEND_CUDA, &raw[..63])).0, Status::BadKey);
    assert_eq!(common::refusal(&args(DEVSHARE_BACKEND_CUDA, &[])).0, Status::InvalidArgument, "empty storage");
}

#[test]
fn event_handle_must_be_64_bytes_only_when_sync_is_required() {
    let raw = [9u8; 64];
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    let short = [1u8; 63];
    a.event_handle = &short;
    a.event_sync_required = true;
    let (s, m) = common::refusal(&a);
    assert_eq!(s, Status::InvalidArgument);
    assert!(m.contains("63"), "{m}");
    // Old torch_npu builds send 8 garbage bytes and False: ignored.
    let garbage = [0xffu8; 8];
    a.event_handle = &garbage;
    a.event_sync_required = false;
    let h = handle_from_torch(&a).unwrap();
    assert_eq!(h.flags & DEVSHARE_HANDLE_FLAG_EVENT, 0);
    assert!(h.event_handle.iter().all(|&b| b == 0));
    let ev: Vec<u8> = (0..64).map(|i| i as u8 + 1).collect();
    a.event_handle = &ev;
    a.event_sync_required = true;
    let h = handle_from_torch(&a).unwrap();
    assert_eq!(h.flags & DEVSHARE_HANDLE_FLAG_EVENT, DEVSHARE_HANDLE_FLAG_EVENT);
    assert_eq!(&h.event_handle[..], &ev[..]);
}

#[test]
fn tensor_outside_its_storage_and_bad_ref_names_are_refused() {
    let raw = [1u8; 64];
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    a.tensor_offset = 1024; // 1024 + 31 elements of 4 bytes > 4096
    assert_eq!(common::refusal(&a).0, Status::TensorOutOfBounds);
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    a.ref_name = b"torch_no_slash";
    assert_eq!(common::refusal(&a).0, Status::InvalidArgument);
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    a.ref_name = b"";
    let h = handle_from_torch(&a).unwrap();
    assert_eq!((h.ref_name_len, h.producer_pid), (0, 0), "no release signal, pid unknown");
    a.producer_pid = 77;
    assert_eq!(handle_from_torch(&a).unwrap().producer_pid, 77);
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    a.storage_offset = u64::MAX;
    assert_eq!(common::refusal(&a).0, Status::BadSize);
}

#[test]
fn zero_byte_storages_are_refused_both_ways_because_pytorch_never_returns_their_reference() {
    let raw = [1u8; 64];
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    a.storage_size = 0;
    a.shape = &[0];
    a.tensor_offset = 0;
    let (s, m) = common::refusal(&a);
    assert_eq!(s, Status::InvalidArgument);
    assert!(m.contains("0 bytes"), "{m}");
    let mut h = handle_from_torch(&args(DEVSHARE_BACKEND_CUDA, &raw)).unwrap();
    h.storage_size = 0;
    h.shape[..2].copy_from_slice(&[0, 0]);
    h.tensor_offset = 0;
    let e = handle_to_torch(&h).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.to_string().contains("never"), "{e}");
}

#[test]
fn handles_go_back_to_the_tuple_a_stock_consumer_accepts() {
    let raw: Vec<u8> = (100..164).collect();
    let ev = [3u8; 64];
    let mut a = args(DEVSHARE_BACKEND_CUDA, &raw);
    a.event_handle = &ev;
    a.event_sync_required = true;
    let t = handle_to_torch(&handle_from_torch(&a).unwrap()).unwrap();
    assert_eq!(t.handle, raw, "cuda: the raw 64-byte form");
    assert_eq!((t.device, t.storage_size, t.storage_offset), (1, 4096, a.storage_offset));
    assert_eq!((t.ref_name.as_slice(), t.ref_slot), (&b"/torch_4242_1234567890_7"[..], 17));
    assert_eq!((t.event_handle, t.event_sync_required), (ev, true));

    let key = acl_key();
    let t = handle_to_torch(&handle_from_torch(&args(DEVSHARE_BACKEND_ACL, &key)).unwrap()).unwrap();
    assert_eq!(t.handle.len(), 67, "acl: the version-1 'c' form");
    assert_eq!(&t.handle[..2], &[1, b'c']);
    assert_eq!(
        parse_storage_handle(DEVSHARE_BACKEND_ACL, &t.handle).unwrap(),
        parse_storage_handle(DEVSHARE_BACKEND_ACL, &key).unwrap()
    );
    assert!(!t.event_sync_required && t.event_handle == [0; 64]);
}
