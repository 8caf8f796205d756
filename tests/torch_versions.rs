//! Storage-handle formats of every PyTorch and torch_npu version: reading CUDA 'e' version 3,
//! writing the format a consumer's torch reads, and the version bridge — checked against a
//! test-side reader that does what PyTorch's own readers do (`version <= own`, the header size
//! of its own version, fd or fabric by its own rule).

use devshare::dtype::DevshareDType;
use devshare::handle::segments::*;
use devshare::handle::*;
use devshare::torch::{
    convert_storage_handle, format_for_torch_version, handle_from_torch, handle_from_torch_full, handle_to_torch_as,
    parse_storage_handle, StorageHandle, TorchArgs, TorchFormat,
};
use devshare::Status;

const MIB: u64 = 1 << 20;
const F32: DevshareDType = DevshareDType { code: 2, bits: 32, lanes: 1 };
const V2: TorchFormat = TorchFormat::Version(2);
const V3: TorchFormat = TorchFormat::Version(3);

fn fds(list: &[i32]) -> Vec<u8> {
    list.iter().flat_map(|f| f.to_ne_bytes()).collect()
}

fn fabric(n: usize) -> Vec<u8> {
    (0..n * 64).map(|i| (i * 7 + 3) as u8).collect()
}

/// A PyTorch 2.5-2.12 'e' handle, with garbage padding.
fn cuda_e2(pid: i32, segment_size: u64, n: u64, records: &[u8]) -> Vec<u8> {
    let mut v = vec![2u8, b'e'];
    v.extend_from_slice(&pid.to_ne_bytes());
    v.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
    v.extend_from_slice(&segment_size.to_ne_bytes());
    v.extend_from_slice(&n.to_ne_bytes());
    v.extend_from_slice(records);
    v
}

/// A PyTorch 2.13+ 'e' handle, with garbage in both padding words.
fn cuda_e3(pid: i32, segment_size: u64, n: u64, handle_type: i32, records: &[u8]) -> Vec<u8> {
    let mut v = vec![3u8, b'e'];
    v.extend_from_slice(&pid.to_ne_bytes());
    v.extend_from_slice(&[0x11, 0x22, 0x33, 0x44]);
    v.extend_from_slice(&segment_size.to_ne_bytes());
    v.extend_from_slice(&n.to_ne_bytes());
    v.extend_from_slice(&handle_type.to_ne_bytes());
    v.extend_from_slice(&[0x55, 0x66, 0x77, 0x88]);
    v.extend_from_slice(records);
    v
}

fn args(handle: &[u8]) -> TorchArgs<'_> {
    TorchArgs {
        backend: DEVSHARE_BACKEND_CUDA,
        dtype: F32,
        shape: &[1024],
        strides: None,
        tensor_offset: 0,
        device: 0,
        producer_pid: 0,
        handle,
        storage_size: 4096,
        storage_offset: 8192,
        ref_name: b"/torch_777_99_1",
        ref_slot: 3,
        event_handle: &[],
        event_sync_required: false,
    }
}

// --- A reader that does what PyTorch's does ------------------------------------------------------

/// What a PyTorch consumer understood a CUDA storage handle to be.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    Raw([u8; 64]),
    C(u8, [u8; 64]),
    E { pid: i32, segment_size: u64, fabric: bool, records: Vec<u8> },
}

/// PyTorch `own` (2: 2.5-2.12, 3: 2.13+) reading `bytes` (`fabric_config`: its own setting, which
/// a version-2 reader uses to decide the record kind). Errors are PyTorch's own messages.
fn pytorch_reads(own: u8, bytes: &[u8], fabric_config: bool) -> Result<Read, String> {
    if bytes.len() == 64 {
        return Ok(Read::Raw(bytes.try_into().unwrap()));
    }
    let version = bytes[0];
    if version > own {
        return Err("received sharable handle from a future version of torch".into());
    }
    match bytes[1] {
        b'c' => Ok(Read::C(version, bytes[2..66].try_into().map_err(|_| "short 'c' handle")?)),
        b'e' => {
            // The reader's own header, whatever the version byte says.
            let header = if own >= 3 { 32 } else { 24 };
            let p = &bytes[2..];
            if p.len() < header {
                return Err("truncated ShareHeader".into());
            }
            let pid = i32::from_ne_bytes(p[0..4].try_into().unwrap());
            let segment_size = u64::from_ne_bytes(p[8..16].try_into().unwrap());
            let n = u64::from_ne_bytes(p[16..24].try_into().unwrap()) as usize;
            let fabric = if own >= 3 {
                match i32::from_ne_bytes(p[24..28].try_into().unwrap()) {
                    0 => fabric_config,
                    1 => false,
                    2 => true,
                    _ => return Err("Unknown Expandable_Segments_Handle_Type in IPC share header".into()),
                }
            } else {
                fabric_config
            };
            let records = &p[header..];
            if records.len() != n * if fabric { 64 } else { 4 } {
                return Err(format!("{} record bytes for {n} segments", records.len()));
            }
            Ok(Read::E { pid, segment_size, fabric, records: records.to_vec() })
        }
        t => Err(format!("unknown handle type {t}")),
    }
}

// --- Reading version 3 ------------------------------------------------------------------------

#[test]
fn cuda_v3_e_handles_parse_like_v2_ones_whatever_their_padding() {
    let records = fds(&[17, 18, 40]);
    let v2 = parse_storage_handle(DEVSHARE_BACKEND_CUDA, &cuda_e2(4321, 2 * MIB, 3, &records)).unwrap();
    for handle_type in [1, 0] {
        let v3 = cuda_e3(4321, 2 * MIB, 3, handle_type, &records);
        assert_eq!(parse_storage_handle(DEVSHARE_BACKEND_CUDA, &v3).unwrap(), v2, "type {handle_type}");
        // And the handles built from the tuples are the same handle.
        assert_eq!(
            handle_from_torch(&args(&v3)).unwrap(),
            handle_from_torch(&args(&cuda_e2(4321, 2 * MIB, 3, &records))).unwrap()
        );
    }
    let rec = fabric(2);
    for handle_type in [2, 0] {
        let d = handle_from_torch_full(&args(&cuda_e3(99, 20 * MIB, 2, handle_type, &rec))).unwrap();
        let seg = segments(&d.handle).unwrap().unwrap();
        assert_eq!((seg.kind, seg.count, seg.segment_size), (DEVSHARE_SEGMENTS_CUDA_FABRIC, 2, 20 * MIB));
        assert_eq!(SegmentTable::of(&d.handle, None).unwrap().unwrap().table, &rec[..]);
    }
    // Padding differs between two shares of one segment: the handles are still equal.
    let mut other = cuda_e3(4321, 2 * MIB, 3, 1, &records);
    other[6..10].copy_from_slice(&[9, 9, 9, 9]);
    other[30..34].copy_from_slice(&[7, 7, 7, 7]);
    assert_eq!(
        handle_from_torch(&args(&other)).unwrap(),
        handle_from_torch(&args(&cuda_e3(4321, 2 * MIB, 3, 1, &records))).unwrap()
    );
}

#[test]
fn every_malformed_v3_e_form_is_refused_by_name() {
    let one_fd = fds(&[5]);
    let cases: Vec<(Vec<u8>, Status, &str)> = vec![
        (cuda_e3(9, 2 * MIB, 1, 7, &one_fd), Status::InvalidHandle, "handle type 7"),
        (cuda_e3(9, 2 * MIB, 1, -1, &one_fd), Status::InvalidHandle, "handle type -1"),
        // The type disagrees with the records' length.
        (cuda_e3(9, 2 * MIB, 1, 2, &one_fd), Status::BadLength, "handle type 2 (fabric records)"),
        (cuda_e3(9, 2 * MIB, 1, 1, &fabric(1)), Status::BadLength, "handle type 1 (POSIX fd records)"),
        (cuda_e3(9, 2 * MIB, 2, 0, &fds(&[5, 6, 7])), Status::BadLength, "neither 8"),
        // A 24-byte (version-2) header under version byte 3 ends inside the 32-byte header.
        (
            {
                let mut v = cuda_e2(9, 2 * MIB, 1, &[]);
                v[0] = 3;
                v
            },
            Status::BadLength,
            "32 needed",
        ),
        (cuda_e3(0, 2 * MIB, 1, 1, &one_fd), Status::InvalidHandle, "pid 0"),
        (cuda_e3(9, 2 * MIB, 0, 1, &[]), Status::InvalidHandle, "zero segments"),
        (cuda_e3(9, 3 * MIB, 1, 1, &one_fd), Status::BadSize, "granularity"),
        (
            {
                let mut v = cuda_e3(9, 2 * MIB, 1, 1, &one_fd);
                v[0] = 4;
                v
            },
            Status::UnsupportedVersion,
            "version 4",
        ),
        (
            {
                let mut v = cuda_e3(9, 2 * MIB, 1, 1, &one_fd);
                v[0] = 1;
                v
            },
            Status::UnsupportedVersion,
            "version 1",
        ),
    ];
    for (bytes, status, words) in cases {
        let e = handle_from_torch(&args(&bytes)).unwrap_err();
        assert_eq!(e.status(), status, "{words}: {e}");
        assert!(e.to_string().contains(words), "{e} should say {words:?}");
    }
}

// --- Writing the consumer's format ---------------------------------------------------------------

/// A C VMM producer's handle (what `devshare_export_segments` + share make): 3 fd segments.
fn c_vmm_handle(kind: u16, table: &[u8]) -> DevshareHandle {
    let mut h = DevshareHandle {
        backend: DEVSHARE_BACKEND_CUDA,
        producer_pid: 4242,
        dtype: F32,
        ndim: 1,
        storage_offset: 4096,
        storage_size: 2 * MIB,
        ..Default::default()
    };
    h.shape[0] = (MIB / 2) as i64;
    h.strides[0] = 1;
    set_segments(&mut h, 2 * MIB, kind, table).unwrap();
    validate(&h).unwrap();
    h
}

#[test]
fn a_c_vmm_handle_written_as_v3_and_v2_is_read_by_the_matching_pytorch_and_misread_by_the_other() {
    let table: Vec<u8> = [30i32, 31, 32].iter().flat_map(|f| f.to_le_bytes()).collect();
    let h = c_vmm_handle(DEVSHARE_SEGMENTS_CUDA_FD, &table);
    let want = Read::E { pid: 4242, segment_size: 2 * MIB, fabric: false, records: fds(&[30, 31, 32]) };

    let v3 = handle_to_torch_as(&h, None, V3).unwrap().handle;
    assert_eq!((v3[0], v3[1], v3.len()), (3, b'e', 34 + 12));
    assert_eq!(pytorch_reads(3, &v3, false).unwrap(), want, "PyTorch 2.13+ reads version 3");
    assert!(pytorch_reads(2, &v3, false).unwrap_err().contains("future version"), "2.12 refuses it");

    let v2 = handle_to_torch_as(&h, None, V2).unwrap().handle;
    assert_eq!((v2[0], v2[1], v2.len()), (2, b'e', 26 + 12));
    assert_eq!(pytorch_reads(2, &v2, false).unwrap(), want, "PyTorch 2.5-2.12 read version 2");
    // PyTorch 2.13+ applies its 32-byte header to version 2: the first fd (30) is taken as the
    // handle type and refused.
    assert!(pytorch_reads(3, &v2, false).unwrap_err().contains("Unknown Expandable_Segments_Handle_Type"));
    // With fd numbers that happen to be valid types, it reads the wrong records instead.
    let small: Vec<u8> = [1i32, 0, 32].iter().flat_map(|f| f.to_le_bytes()).collect();
    let v2_small = handle_to_torch_as(&c_vmm_handle(DEVSHARE_SEGMENTS_CUDA_FD, &small), None, V2).unwrap().handle;
    assert_ne!(
        pytorch_reads(3, &v2_small, false),
        Ok(Read::E { pid: 4242, segment_size: 2 * MIB, fabric: false, records: fds(&[1, 0, 32]) })
    );

    // The default (what 1.1 wrote) is version 2; 'c' handles stay the raw 64 bytes in every format.
    assert_eq!(handle_to_torch_as(&h, None, TorchFormat::Default).unwrap().handle, v2);
    let raw = [0xabu8; 64];
    let c = handle_from_torch(&args(&raw)).unwrap();
    for f in [TorchFormat::Default, TorchFormat::Unversioned, TorchFormat::Version(1), V2, V3] {
        let bytes = handle_to_torch_as(&c, None, f).unwrap().handle;
        assert_eq!(bytes, vec![0xab; 64], "{f:?}");
        assert_eq!(pytorch_reads(2, &bytes, false).unwrap(), pytorch_reads(3, &bytes, false).unwrap());
    }
}

#[test]
fn fabric_segments_go_to_v3_with_their_type_and_are_refused_for_v2() {
    let table = fabric(2);
    let h = c_vmm_handle(DEVSHARE_SEGMENTS_CUDA_FABRIC, &table);
    let v3 = handle_to_torch_as(&h, None, V3).unwrap().handle;
    // Read right even by a consumer whose own setting says fds: the type is in the header.
    assert_eq!(
        pytorch_reads(3, &v3, false).unwrap(),
        Read::E { pid: 4242, segment_size: 2 * MIB, fabric: true, records: table.clone() }
    );
    let e = handle_to_torch_as(&h, None, V2).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
    assert!(e.to_string().contains("no handle type"), "{e}");
    for f in [TorchFormat::Unversioned, TorchFormat::Version(1)] {
        assert_eq!(handle_to_torch_as(&h, None, f).unwrap_err().status(), Status::Unsupported, "{f:?}");
    }
}

#[test]
fn acl_handles_are_written_as_torch_npu_version_1_or_unversioned_only() {
    let mut key = b"ipc-key-1".to_vec();
    key.resize(65, 0);
    let h = handle_from_torch(&TorchArgs { backend: DEVSHARE_BACKEND_ACL, ..args(&key) }).unwrap();
    let v1 = handle_to_torch_as(&h, None, TorchFormat::Version(1)).unwrap().handle;
    assert_eq!(&v1[..11], b"\x01cipc-key-1");
    assert_eq!(v1.len(), 67);
    assert_eq!(handle_to_torch_as(&h, None, TorchFormat::Default).unwrap().handle, v1);
    assert_eq!(handle_to_torch_as(&h, None, TorchFormat::Unversioned).unwrap().handle, v1[2..].to_vec());
    for f in [V2, V3] {
        let e = handle_to_torch_as(&h, None, f).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        assert!(e.to_string().contains("version 1 only"), "{e}");
    }
}

#[test]
fn torch_versions_map_to_the_format_they_read() {
    for (v, f) in [
        ("2.4.1", TorchFormat::Unversioned),
        ("1.13.1+cu117", TorchFormat::Unversioned),
        ("2.5.0", V2),
        ("2.11.0+cu128", V2),
        ("2.12", V2),
        ("2.13.0", V3),
        ("2.14.0a0+git1234567", V3),
        ("2.15.0+cpu", V3),
        ("3.0.0", V3),
    ] {
        assert_eq!(format_for_torch_version(DEVSHARE_BACKEND_CUDA, v).unwrap(), f, "{v}");
    }
    assert_eq!(format_for_torch_version(DEVSHARE_BACKEND_ACL, "2.7.1.post2").unwrap(), TorchFormat::Version(1));
    for bad in ["", "2", "two.13", "2.x", "+cu128"] {
        assert_eq!(
            format_for_torch_version(DEVSHARE_BACKEND_CUDA, bad).unwrap_err().status(),
            Status::InvalidArgument,
            "{bad:?}"
        );
    }
    assert_eq!(format_for_torch_version(DEVSHARE_BACKEND_HOST, "2.13").unwrap_err().status(), Status::InvalidArgument);
    for c in [0u32, 1, 2, 3, 0x100] {
        assert_eq!(TorchFormat::from_c(c).unwrap().to_c(), c);
    }
    for c in [4u32, 0xff, 0x101, u32::MAX] {
        assert_eq!(TorchFormat::from_c(c).unwrap_err().status(), Status::InvalidArgument, "{c:#x}");
    }
}

// --- The bridge ----------------------------------------------------------------------------------

#[test]
fn bridge_rewrites_e_handles_between_v2_and_v3_both_ways() {
    let records = fds(&[40, 41]);
    let from_v3 = cuda_e3(555, 20 * MIB, 2, 1, &records);
    let v2 = convert_storage_handle(DEVSHARE_BACKEND_CUDA, &from_v3, V2).unwrap();
    let want = Read::E { pid: 555, segment_size: 20 * MIB, fabric: false, records: records.clone() };
    assert_eq!(pytorch_reads(2, &v2, false).unwrap(), want, "torch 2.11 reads the bridged handle");
    let back = convert_storage_handle(DEVSHARE_BACKEND_CUDA, &v2, V3).unwrap();
    assert_eq!(pytorch_reads(3, &back, false).unwrap(), want, "and torch 2.13 reads it back");
    // Fields equal, padding zero: the same bytes as the original but for its padding.
    assert_eq!(back[..6], from_v3[..6]);
    assert_eq!(back[10..30], from_v3[10..30]);
    assert_eq!(back[34..], from_v3[34..]);
    assert_eq!((&back[6..10], &back[30..34]), (&[0u8; 4][..], &[0u8; 4][..]));
    // Same version in, same version out (canonical padding); handle type 0 becomes the real type.
    let typed = convert_storage_handle(DEVSHARE_BACKEND_CUDA, &cuda_e3(555, 20 * MIB, 2, 0, &records), V3).unwrap();
    assert_eq!(typed, back);
    // v2 fabric (told apart by length) to v3 names the type; v3 fabric to v2 is refused.
    let fab = fabric(1);
    let v3f = convert_storage_handle(DEVSHARE_BACKEND_CUDA, &cuda_e2(555, 2 * MIB, 1, &fab), V3).unwrap();
    assert_eq!(
        pytorch_reads(3, &v3f, false).unwrap(),
        Read::E { pid: 555, segment_size: 2 * MIB, fabric: true, records: fab }
    );
    let e = convert_storage_handle(DEVSHARE_BACKEND_CUDA, &v3f, V2).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
    // 'e' handles have no unversioned form, and CUDA 'e' has no version 1.
    for f in [TorchFormat::Unversioned, TorchFormat::Version(1)] {
        assert_eq!(
            convert_storage_handle(DEVSHARE_BACKEND_CUDA, &from_v3, f).unwrap_err().status(),
            Status::Unsupported
        );
    }
}

#[test]
fn bridge_rewrites_c_handles_of_every_version_and_the_raw_form() {
    let key = [0x5au8; 64];
    let forms: Vec<(TorchFormat, Vec<u8>)> = vec![
        (TorchFormat::Unversioned, key.to_vec()),
        (TorchFormat::Version(1), [&[1u8, b'c'][..], &key].concat()),
        (V2, [&[2u8, b'c'][..], &key].concat()),
        (V3, [&[3u8, b'c'][..], &key].concat()),
    ];
    for (_, from) in &forms {
        for (to, want) in &forms {
            assert_eq!(&convert_storage_handle(DEVSHARE_BACKEND_CUDA, from, *to).unwrap(), want, "{to:?}");
        }
        assert_eq!(convert_storage_handle(DEVSHARE_BACKEND_CUDA, from, TorchFormat::Default).unwrap(), key.to_vec());
    }
    // What torch 2.13 wrote ([3]['c']) is refused by torch 2.11 and read once bridged to 2.
    let v3 = &forms[3].1;
    assert!(pytorch_reads(2, v3, false).unwrap_err().contains("future version"));
    let v2 = convert_storage_handle(DEVSHARE_BACKEND_CUDA, v3, format_for_torch_version(3, "2.11.0").unwrap()).unwrap();
    assert_eq!(pytorch_reads(2, &v2, false).unwrap(), Read::C(2, key));
}

#[test]
fn bridge_keeps_torch_npu_handles_at_version_1_and_refuses_other_versions() {
    let mut c = vec![1u8, b'c'];
    c.extend_from_slice(b"npu-key");
    c.resize(67, 0);
    c[60] = 0x77; // garbage after the NUL: normalized away
    let out = convert_storage_handle(DEVSHARE_BACKEND_ACL, &c, TorchFormat::Version(1)).unwrap();
    assert_eq!(&out[..9], b"\x01cnpu-key");
    assert_eq!(out.len(), 67);
    assert!(out[9..].iter().all(|&b| b == 0));
    assert_eq!(convert_storage_handle(DEVSHARE_BACKEND_ACL, &c, TorchFormat::Unversioned).unwrap(), out[2..].to_vec());
    assert_eq!(convert_storage_handle(DEVSHARE_BACKEND_ACL, &out[2..], TorchFormat::Default).unwrap(), out);

    let mut e = vec![1u8, b'e'];
    e.extend_from_slice(&(20 * MIB).to_ne_bytes());
    e.extend_from_slice(&2u64.to_ne_bytes());
    e.extend_from_slice(&0x1111u64.to_ne_bytes());
    e.extend_from_slice(&0x2222u64.to_ne_bytes());
    assert_eq!(convert_storage_handle(DEVSHARE_BACKEND_ACL, &e, TorchFormat::Version(1)).unwrap(), e);
    for f in [V2, V3, TorchFormat::Unversioned] {
        let err = convert_storage_handle(DEVSHARE_BACKEND_ACL, &e, f).unwrap_err();
        assert_eq!(err.status(), Status::Unsupported, "{f:?}");
    }
    // Malformed input keeps the status the tuple reader gives it.
    assert_eq!(convert_storage_handle(DEVSHARE_BACKEND_ACL, &e[..20], V2).unwrap_err().status(), Status::BadLength);
    let parsed = parse_storage_handle(DEVSHARE_BACKEND_ACL, &e).unwrap();
    assert!(matches!(parsed, StorageHandle::Segmented { pid: None, .. }));
}
