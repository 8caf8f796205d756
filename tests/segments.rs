//! Segmented (expandable-segment, VMM) handles: the handle form, its validation, how long
//! segment tables travel (byte and text encodings, PyTorch tuples), and the 'e' storage-handle
//! forms of torch_npu and PyTorch CUDA in both directions.

mod common;

use devshare::dtype::DevshareDType;
use devshare::handle::encode::{decode, decode_full, encode, encode_full_into};
use devshare::handle::segments::*;
use devshare::handle::text::{from_text_full, to_text_full};
use devshare::handle::*;
use devshare::torch::{
    handle_from_torch, handle_from_torch_full, handle_to_torch_full, parse_storage_handle, StorageHandle, TorchArgs,
};
use devshare::Status;

const MIB: u64 = 1 << 20;
const F16: DevshareDType = DevshareDType { code: 2, bits: 16, lanes: 1 };

/// A torch_npu 'e' storage handle: `[1]['e'][u64 segment_size][u64 n][n x u64]`.
fn npu_e(segment_size: u64, handles: &[u64]) -> Vec<u8> {
    let mut v = vec![1u8, b'e'];
    v.extend_from_slice(&segment_size.to_ne_bytes());
    v.extend_from_slice(&(handles.len() as u64).to_ne_bytes());
    for h in handles {
        v.extend_from_slice(&h.to_ne_bytes());
    }
    v
}

/// A PyTorch CUDA version-2 'e' handle with garbage in the header's padding.
fn cuda_e(pid: i32, segment_size: u64, n: u64, records: &[u8]) -> Vec<u8> {
    let mut v = vec![2u8, b'e'];
    v.extend_from_slice(&pid.to_ne_bytes());
    v.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]); // uninitialised padding in PyTorch
    v.extend_from_slice(&segment_size.to_ne_bytes());
    v.extend_from_slice(&n.to_ne_bytes());
    v.extend_from_slice(records);
    v
}

fn fds(list: &[i32]) -> Vec<u8> {
    list.iter().flat_map(|f| f.to_ne_bytes()).collect()
}

fn args<'a>(backend: u16, handle: &'a [u8], storage_offset: u64, storage_size: u64) -> TorchArgs<'a> {
    TorchArgs {
        backend,
        dtype: F16,
        shape: &[16],
        strides: None,
        tensor_offset: 0,
        device: 0,
        producer_pid: 0,
        handle,
        storage_size,
        storage_offset,
        ref_name: b"/torch_777_99_1",
        ref_slot: 3,
        event_handle: &[],
        event_sync_required: false,
    }
}

#[test]
fn torch_npu_e_handle_becomes_a_segmented_handle_with_the_storage_relative_to_the_first_segment() {
    let bytes = npu_e(20 * MIB, &[0x1111, 0x2222, 0x3333]);
    let a = args(DEVSHARE_BACKEND_ACL, &bytes, 25 * MIB, 30 * MIB);
    let h = handle_from_torch(&a).unwrap();
    assert_ne!(h.flags & DEVSHARE_HANDLE_FLAG_SEGMENTED, 0);
    assert_eq!(h.alloc_size, 60 * MIB);
    assert_eq!((h.storage_offset, h.storage_size), (25 * MIB, 30 * MIB));
    let seg = segments(&h).unwrap().unwrap();
    assert_eq!((seg.segment_size, seg.count, seg.kind, seg.inline), (20 * MIB, 3, DEVSHARE_SEGMENTS_ACL, true));
    let t = SegmentTable::of(&h, None).unwrap().unwrap();
    assert_eq!(t.acl_handles().collect::<Vec<_>>(), vec![0x1111, 0x2222, 0x3333]);
    // And back: stock torch_npu gets the same bytes.
    assert_eq!(handle_to_torch_full(&h, None).unwrap().handle, bytes);
}

#[test]
fn cuda_v2_e_handles_are_told_apart_by_length_fd_or_fabric() {
    let fd_bytes = cuda_e(4321, 2 * MIB, 3, &fds(&[17, 18, 40]));
    let h = handle_from_torch(&args(DEVSHARE_BACKEND_CUDA, &fd_bytes, 4096, MIB)).unwrap();
    let t = SegmentTable::of(&h, None).unwrap().unwrap();
    assert_eq!(t.seg.kind, DEVSHARE_SEGMENTS_CUDA_FD);
    assert_eq!(t.fds().collect::<Vec<_>>(), vec![17, 18, 40]);
    assert_eq!(h.producer_pid, 4321, "the header's pid wins over the ref-counter name's");
    // Re-encoded for a stock consumer with zeroed padding: compare fields, not bytes.
    let back = handle_to_torch_full(&h, None).unwrap().handle;
    assert_eq!(back[..6], fd_bytes[..6]);
    assert_eq!(back[10..], fd_bytes[10..]);

    let fabric: Vec<u8> = (0..2 * 64).map(|i| i as u8).collect();
    let fab_bytes = cuda_e(4321, 2 * MIB, 2, &fabric);
    let d = handle_from_torch_full(&args(DEVSHARE_BACKEND_CUDA, &fab_bytes, 0, 4 * MIB)).unwrap();
    let seg = segments(&d.handle).unwrap().unwrap();
    assert_eq!((seg.kind, seg.count, seg.inline), (DEVSHARE_SEGMENTS_CUDA_FABRIC, 2, true));
}

#[test]
fn every_malformed_e_form_gets_its_own_status() {
    let cases: Vec<(u16, Vec<u8>, Status, &str)> = vec![
        (DEVSHARE_BACKEND_ACL, npu_e(20 * MIB, &[]), Status::InvalidHandle, "zero segments"),
        (DEVSHARE_BACKEND_ACL, npu_e(20 * MIB, &[1, 2])[..30].to_vec(), Status::BadLength, "says 2 segments"),
        (DEVSHARE_BACKEND_ACL, vec![1, b'e', 0, 0], Status::BadLength, "inside its header"),
        (DEVSHARE_BACKEND_ACL, npu_e(0, &[1]), Status::BadSize, "granularity"),
        (DEVSHARE_BACKEND_ACL, npu_e(3 * MIB, &[1]), Status::BadSize, "granularity"),
        (DEVSHARE_BACKEND_ACL, npu_e(1 << 62, &[1, 2, 3]), Status::BadSize, "overflows"),
        (
            DEVSHARE_BACKEND_ACL,
            {
                let mut v = npu_e(2 * MIB, &[1]);
                v[0] = 2;
                v
            },
            Status::UnsupportedVersion,
            "version 2",
        ),
        (DEVSHARE_BACKEND_CUDA, cuda_e(9, 2 * MIB, 3, &fds(&[1, 2])), Status::BadLength, "neither 12"),
        (DEVSHARE_BACKEND_CUDA, cuda_e(0, 2 * MIB, 1, &fds(&[5])), Status::InvalidHandle, "pid 0"),
        (DEVSHARE_BACKEND_CUDA, cuda_e(9, 2 * MIB, 2, &fds(&[5, -1])), Status::InvalidHandle, "fd -1 is negative"),
        (
            DEVSHARE_BACKEND_CUDA,
            {
                let mut v = cuda_e(9, 2 * MIB, 1, &fds(&[5]));
                v[0] = 4;
                v
            },
            Status::UnsupportedVersion,
            "version 4",
        ),
        (
            DEVSHARE_BACKEND_CUDA,
            {
                let mut v = cuda_e(9, 2 * MIB, 1, &fds(&[5]));
                v[0] = 1;
                v
            },
            Status::UnsupportedVersion,
            "version 1",
        ),
        (DEVSHARE_BACKEND_CUDA, cuda_e(9, 2 * MIB, 0, &[]), Status::InvalidHandle, "zero segments"),
    ];
    for (backend, bytes, status, words) in cases {
        let (s, m) = common::refusal(&args(backend, &bytes, 0, 4096));
        assert_eq!(s, status, "{words}: {m}");
        assert!(m.contains(words), "{m} should say {words:?}");
    }
    // The storage past the last segment.
    let bytes = npu_e(2 * MIB, &[1, 2]);
    let (s, m) = common::refusal(&args(DEVSHARE_BACKEND_ACL, &bytes, 3 * MIB, 2 * MIB));
    assert_eq!(s, Status::StorageOutOfBounds, "{m}");
}

fn segmented_handle(n: usize) -> (DevshareHandle, Vec<u8>) {
    let mut h = DevshareHandle {
        backend: DEVSHARE_BACKEND_ACL,
        producer_pid: 55,
        dtype: F16,
        ndim: 1,
        storage_offset: 20 * MIB + 512,
        storage_size: 40 * MIB,
        ..Default::default()
    };
    h.shape[0] = (20 * MIB) as i64;
    h.strides[0] = 1;
    let table: Vec<u8> = (0..n as u64).flat_map(|i| (0xabc0_0000 + i).to_le_bytes()).collect();
    set_segments(&mut h, 20 * MIB, DEVSHARE_SEGMENTS_ACL, &table).unwrap();
    (h, table)
}

#[test]
fn a_table_of_4096_segments_travels_in_the_byte_and_text_encodings() {
    let (h, table) = segmented_handle(4096); // 80 GiB of 20 MiB segments
    assert_eq!(h.alloc_size, 4096 * 20 * MIB);
    let seg = segments(&h).unwrap().unwrap();
    assert!(!seg.inline && h.key_len == 0, "32 KiB of records do not fit the struct");
    validate(&h).unwrap();
    // The struct alone cannot be imported, and says how to do it instead.
    let e = SegmentTable::of(&h, None).unwrap_err();
    assert!(e.to_string().contains("devshare_import_encoded"), "{e}");
    // Encoded with its table, decoded with it.
    let mut bytes = Vec::new();
    encode_full_into(&h, Some(&table), &mut bytes).unwrap();
    assert!(bytes.len() > table.len());
    let d = decode_full(&bytes).unwrap();
    assert_eq!((d.handle, d.table.as_deref()), (h, Some(&table[..])));
    let text = to_text_full(&h, Some(&table)).unwrap();
    assert_eq!(from_text_full(&text).unwrap().table.unwrap(), table);
    // Encoding without the table is refused; a table of another handle is refused.
    assert_eq!(encode(&h).unwrap_err().status(), Status::InvalidArgument);
    let mut other = table.clone();
    other[8] ^= 1;
    assert_eq!(encode_full_into(&h, Some(&other), &mut bytes).unwrap_err().status(), Status::ChecksumMismatch);
    assert_eq!(SegmentTable::of(&h, Some(&table[..table.len() - 8])).unwrap_err().status(), Status::BadLength);
}

#[test]
fn a_4096_segment_torch_npu_tuple_round_trips_through_its_table() {
    let handles: Vec<u64> = (1..=4096).collect();
    let bytes = npu_e(20 * MIB, &handles);
    let d = handle_from_torch_full(&args(DEVSHARE_BACKEND_ACL, &bytes, 0, 80 * 1024 * MIB)).unwrap();
    let table = d.table.clone().unwrap();
    assert_eq!(table.len(), 4096 * 8);
    assert_eq!(handle_to_torch_full(&d.handle, Some(&table)).unwrap().handle, bytes);
    assert!(handle_to_torch_full(&d.handle, None).is_err(), "the table is needed");
}

#[test]
fn small_tables_are_inline_and_a_plain_decode_keeps_them() {
    let (h, _) = segmented_handle(16); // 128 bytes: exactly the key area
    assert!(segments(&h).unwrap().unwrap().inline);
    assert_eq!(decode(&encode(&h).unwrap()).unwrap(), h);
    let (h, _) = segmented_handle(17);
    assert!(!segments(&h).unwrap().unwrap().inline);
}

#[test]
fn segmented_fields_are_validated_on_the_struct_too() {
    let (h, _) = segmented_handle(3);
    let mut bad = h;
    bad.alloc_size += 2 * MIB;
    assert_eq!(validate(&bad).unwrap_err().status(), Status::BadSize);
    let mut bad = h;
    bad.key[0] ^= 1; // the inline table no longer matches its checksum
    assert_eq!(validate(&bad).unwrap_err().status(), Status::ChecksumMismatch);
    let mut bad = h;
    bad.flags &= !DEVSHARE_HANDLE_FLAG_SEGMENTED;
    assert_eq!(validate(&bad).unwrap_err().status(), Status::InvalidHandle);
    let mut bad = h;
    bad.backend = DEVSHARE_BACKEND_HOST;
    assert!(validate(&bad).is_err());
    let mut bad = h;
    bad.ext[4 + 12] = 2; // kind (after the record header and segment_size, count): cuda fds on an acl handle
    assert_eq!(validate(&bad).unwrap_err().status(), Status::InvalidHandle);
}

#[test]
fn the_parser_reports_the_segments_of_every_form() {
    let StorageHandle::Segmented { segment_size, kind, pid, table } =
        parse_storage_handle(DEVSHARE_BACKEND_CUDA, &cuda_e(31, 20 * MIB, 2, &fds(&[3, 4]))).unwrap()
    else {
        panic!("not segmented")
    };
    assert_eq!((segment_size, kind, pid, table.len()), (20 * MIB, DEVSHARE_SEGMENTS_CUDA_FD, Some(31), 8));
}
