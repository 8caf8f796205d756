//! The handle format: byte and text round trips, and every kind of rejection.

use devshare::dtype::DevshareDType;
use devshare::handle::encode::{decode, encode, DEVSHARE_HANDLE_MAX_ENCODED_SIZE};
use devshare::handle::text::{from_text, to_text, DEVSHARE_HANDLE_MAX_TEXT_SIZE};
use devshare::handle::*;
use devshare::Status;

/// A valid host handle of `ndim` dimensions (each of size 2, contiguous float32) at a storage
/// offset and element offset that are not zero.
fn sample(ndim: usize) -> DevshareHandle {
    let mut h = DevshareHandle {
        backend: DEVSHARE_BACKEND_HOST,
        producer_pid: 1234,
        host_id: [7; 16],
        dtype: DevshareDType::new(2, 32, 1),
        ndim: ndim as u32,
        alloc_size: 1 << 20,
        storage_offset: 4096,
        storage_size: 8192,
        tensor_offset: 3,
        ..Default::default()
    };
    let mut stride = 1;
    for i in (0..ndim).rev() {
        h.shape[i] = 2;
        h.strides[i] = stride;
        stride *= 2;
    }
    let key = b"/devshare_1234_00112233445566778899aabbccddeeff";
    h.key[..key.len()].copy_from_slice(key);
    h.key_len = key.len() as u32;
    let rc = b"/devshare_rc_1234_ffeeddccbbaa99887766554433221100";
    h.ref_name[..rc.len()].copy_from_slice(rc);
    h.ref_name_len = rc.len() as u32;
    h.ref_slot = 17;
    h
}

#[test]
fn bytes_and_text_round_trip_for_every_dimensionality() {
    for ndim in 0..=DEVSHARE_MAX_NDIM {
        let h = sample(ndim);
        let bytes = encode(&h).unwrap();
        assert!(bytes.len() <= DEVSHARE_HANDLE_MAX_ENCODED_SIZE);
        assert_eq!(decode(&bytes).unwrap(), h, "bytes, ndim {ndim}");
        let text = to_text(&h).unwrap();
        assert!(text.len() < DEVSHARE_HANDLE_MAX_TEXT_SIZE);
        assert!(text.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_:".contains(&c)), "{text}");
        assert_eq!(from_text(&text).unwrap(), h, "text, ndim {ndim}");
        assert_eq!(from_text(&format!("  {text}\n")).unwrap(), h, "whitespace is ignored");
    }
}

#[test]
fn largest_handle_fits_the_documented_maxima() {
    let mut h = sample(DEVSHARE_MAX_NDIM);
    h.backend = DEVSHARE_BACKEND_ACL;
    h.key = [b'k'; DEVSHARE_KEY_CAPACITY];
    h.key[64..].fill(0);
    h.key_len = 65;
    let rc = [b'r'; DEVSHARE_REF_NAME_CAPACITY];
    h.ref_name = rc;
    h.ref_name[0] = b'/';
    h.ref_name_len = DEVSHARE_REF_NAME_CAPACITY as u32;
    h.flags = DEVSHARE_HANDLE_FLAG_EVENT;
    h.event_handle = [0xee; 64];
    assert_eq!(decode(&encode(&h).unwrap()).unwrap(), h);
    assert_eq!(from_text(&to_text(&h).unwrap()).unwrap(), h);
    // A host key of the full capacity minus nothing: the largest encoding.
    let mut h = sample(DEVSHARE_MAX_NDIM);
    h.key = [b'a'; DEVSHARE_KEY_CAPACITY];
    h.key[0] = b'/';
    h.key_len = DEVSHARE_KEY_CAPACITY as u32;
    h.ref_name = h.ref_name.map(|_| b'r');
    h.ref_name[0] = b'/';
    h.ref_name_len = DEVSHARE_REF_NAME_CAPACITY as u32;
    // A full extension area: one skippable record of 108 data bytes.
    h.ext[..4].copy_from_slice(&[0x42, 0x00, 108, 0]);
    h.ext[4..].fill(0x77);
    h.ext_len = DEVSHARE_HANDLE_EXT_CAPACITY as u16;
    let bytes = encode(&h).unwrap();
    assert_eq!(bytes.len(), DEVSHARE_HANDLE_MAX_ENCODED_SIZE - 64, "all but the event");
    assert_eq!(decode(&bytes).unwrap(), h);
    assert!(to_text(&h).unwrap().len() < DEVSHARE_HANDLE_MAX_TEXT_SIZE);
}

/// Offsets of fields in the encoding of `sample(_)` (fixed part of the body).
mod at {
    pub const VERSION: usize = 4;
    pub const NDIM: usize = 14;
    pub const KEY_LEN: usize = 15;
    pub const ALLOC_SIZE: usize = 60;
    pub const STORAGE_OFFSET: usize = 68;
    pub const TENSOR_OFFSET: usize = 84;
    pub const DTYPE_CODE: usize = 92;
    pub const SHAPE0: usize = 96;
}

/// Overwrite bytes of an encoding and fix up its checksum, so that only the field is wrong.
fn patched(h: &DevshareHandle, offset: usize, new: &[u8]) -> Vec<u8> {
    let mut b = encode(h).unwrap();
    b[offset..offset + new.len()].copy_from_slice(new);
    let n = b.len() - 4;
    let crc = crc32(&b[..n]);
    b[n..].copy_from_slice(&crc.to_le_bytes());
    b
}

fn crc32(data: &[u8]) -> u32 {
    // Bitwise CRC-32 (IEEE), independent of the library's implementation.
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn rejects(bytes: &[u8], status: Status, field: &str) {
    let err = decode(bytes).expect_err("must be rejected");
    assert_eq!(err.status(), status, "{err}");
    assert!(err.to_string().contains(field), "message {err:?} should name {field:?}");
}

#[test]
fn decode_rejects_truncated_input() {
    let b = encode(&sample(2)).unwrap();
    rejects(&b[..b.len() - 1], Status::Truncated, "header says");
    rejects(&b[..10], Status::Truncated, "shorter than");
    rejects(&b[..0], Status::Truncated, "shorter than");
}

#[test]
fn decode_rejects_wrong_magic() {
    let mut b = encode(&sample(2)).unwrap();
    b[0] = b'X';
    rejects(&b, Status::BadMagic, "DVSH");
    rejects(b"{\"not\": \"a handle\"}", Status::BadMagic, "DVSH");
}

#[test]
fn decode_rejects_unknown_version() {
    rejects(&patched(&sample(2), at::VERSION, &2u16.to_le_bytes()), Status::UnsupportedVersion, "version 2");
}

#[test]
fn decode_rejects_checksum_mismatch() {
    let mut b = encode(&sample(2)).unwrap();
    b[at::ALLOC_SIZE] ^= 1;
    rejects(&b, Status::ChecksumMismatch, "crc32");
}

#[test]
fn decode_rejects_trailing_bytes() {
    let mut b = encode(&sample(2)).unwrap();
    b.push(0);
    rejects(&b, Status::BadLength, "trailing");
}

#[test]
fn decode_rejects_storage_beyond_allocation() {
    let h = sample(2);
    let off = h.alloc_size - h.storage_size + 1;
    rejects(&patched(&h, at::STORAGE_OFFSET, &off.to_le_bytes()), Status::StorageOutOfBounds, "alloc_size");
}

#[test]
fn decode_rejects_tensor_beyond_storage() {
    let h = sample(2);
    // 2 x 5000 float32 = 40000 bytes, in an 8192-byte storage.
    rejects(&patched(&h, at::SHAPE0 + 8, &5000i64.to_le_bytes()), Status::TensorOutOfBounds, "storage");
    // An element offset that starts past the end of the storage.
    rejects(&patched(&h, at::TENSOR_OFFSET, &2048i64.to_le_bytes()), Status::TensorOutOfBounds, "tensor_offset");
}

#[test]
fn decode_rejects_ndim_above_maximum() {
    rejects(&patched(&sample(2), at::NDIM, &[9]), Status::BadNdim, "ndim");
}

#[test]
fn decode_rejects_unknown_dtype() {
    rejects(&patched(&sample(2), at::DTYPE_CODE, &[99]), Status::BadDtype, "dtype");
    rejects(&patched(&sample(2), at::DTYPE_CODE + 1, &[12]), Status::BadDtype, "dtype");
}

#[test]
fn decode_rejects_oversized_key() {
    rejects(&patched(&sample(2), at::KEY_LEN, &[200]), Status::BadKey, "key");
}

#[test]
fn decode_rejects_negative_and_overflowing_sizes() {
    let h = sample(2);
    rejects(&patched(&h, at::ALLOC_SIZE, &u64::MAX.to_le_bytes()), Status::BadSize, "alloc_size");
    rejects(&patched(&h, at::TENSOR_OFFSET, &(-1i64).to_le_bytes()), Status::BadSize, "tensor_offset");
    rejects(&patched(&h, at::SHAPE0, &(-2i64).to_le_bytes()), Status::BadSize, "shape");
    rejects(&patched(&h, at::SHAPE0 + 16, &(-1i64).to_le_bytes()), Status::BadSize, "strides");
    let mut huge = sample(2);
    huge.shape[..2].copy_from_slice(&[1 << 40, 1 << 40]);
    huge.strides[..2].copy_from_slice(&[0, 0]);
    rejects(&raw_with_dims(&huge), Status::BadSize, "shape");
    let mut far = sample(2);
    far.strides[..2].copy_from_slice(&[1 << 62, 1 << 62]);
    rejects(&raw_with_dims(&far), Status::BadSize, "strides");
}

/// Re-encode `h` with arbitrary dimensions by patching the shape and stride bytes of a valid
/// encoding of the same dimensionality.
fn raw_with_dims(h: &DevshareHandle) -> Vec<u8> {
    let base = sample(h.ndim as usize);
    let mut b = encode(&base).unwrap();
    let n = h.ndim as usize;
    for i in 0..n {
        b[at::SHAPE0 + 8 * i..][..8].copy_from_slice(&h.shape[i].to_le_bytes());
        b[at::SHAPE0 + 8 * (n + i)..][..8].copy_from_slice(&h.strides[i].to_le_bytes());
    }
    let len = b.len() - 4;
    let crc = crc32(&b[..len]);
    b[len..].copy_from_slice(&crc.to_le_bytes());
    b
}

#[test]
fn text_with_a_typo_or_wrong_prefix_is_rejected() {
    let text = to_text(&sample(3)).unwrap();
    let mut typo = text.clone().into_bytes();
    let i = typo.len() / 2;
    typo[i] = if typo[i] == b'A' { b'B' } else { b'A' };
    let err = from_text(std::str::from_utf8(&typo).unwrap()).unwrap_err();
    assert!(
        matches!(err.status(), Status::ChecksumMismatch | Status::BadMagic | Status::Truncated | Status::BadLength),
        "{err}"
    );
    let err = from_text(&text.replacen('Q', "*", 1).replacen('A', "*", 1)).unwrap_err();
    assert_eq!(err.status(), Status::BadText, "{err}");
    assert!(err.to_string().contains("'*'"), "{err}");
    let err = from_text(&text["devshare1:".len()..]).unwrap_err();
    assert_eq!(err.status(), Status::BadText);
    assert!(err.to_string().contains("devshare1:"), "{err}");
}

/// A way to break a handle, the status it must give, and the field the message must name.
type Breakage = (fn(&mut DevshareHandle), Status, &'static str);

#[test]
fn validate_names_the_field_that_is_wrong() {
    let cases: Vec<Breakage> = vec![
        (|h| h.struct_size = 100, Status::UnsupportedVersion, "struct_size"),
        (|h| h.layout_version = 2, Status::UnsupportedVersion, "layout_version"),
        (|h| h.backend = 0, Status::InvalidHandle, "backend"),
        (|h| h.backend = 9, Status::UnsupportedVersion, "backend 9"),
        (|h| h.flags = 0x80, Status::UnsupportedVersion, "flag bit 7"),
        (|h| h.device_index = 1, Status::InvalidHandle, "device_index"),
        (|h| h.producer_pid = -1, Status::InvalidHandle, "producer_pid"),
        (|h| h.shape[7] = 1, Status::InvalidHandle, "shape"),
        (|h| h.key[h.key_len as usize] = b'x', Status::InvalidHandle, "key"),
        (|h| h.key[3] = b'/', Status::BadKey, "key"),
        (|h| h.key_len = 129, Status::BadKey, "key"),
        (|h| h.ref_slot = 10_000, Status::InvalidHandle, "ref_slot"),
        (|h| h.ref_name[1] = b' ', Status::InvalidHandle, "ref_name"),
        (|h| h.event_handle[0] = 1, Status::InvalidHandle, "event_handle"),
        (|h| h.reserved1 = 1, Status::InvalidHandle, "reserved1"),
        (|h| h.ext[5] = 1, Status::InvalidHandle, "ext"),
        (|h| h.ext_len = 113, Status::InvalidHandle, "ext_len"),
        (|h| h.dtype.lanes = 0, Status::BadDtype, "dtype"),
        (|h| h.storage_size = h.alloc_size, Status::StorageOutOfBounds, "storage_offset"),
    ];
    for (mutate, status, field) in cases {
        let mut h = sample(2);
        mutate(&mut h);
        let err = validate(&h).unwrap_err();
        assert_eq!(err.status(), status, "{field}: {err}");
        assert!(err.to_string().contains(field), "{err} should name {field}");
    }
}

#[test]
fn acl_and_cuda_keys_must_have_their_vendor_lengths() {
    let mut h = sample(1);
    h.backend = DEVSHARE_BACKEND_CUDA;
    h.key = [0; DEVSHARE_KEY_CAPACITY];
    h.key[..64].fill(0xab);
    h.key_len = 64;
    validate(&h).unwrap();
    h.key_len = 66;
    h.key[64..66].fill(1);
    assert_eq!(validate(&h).unwrap_err().status(), Status::BadKey);
    h.backend = DEVSHARE_BACKEND_ACL;
    h.key_len = 65;
    h.key = [0; DEVSHARE_KEY_CAPACITY];
    h.key[..65].fill(b'k');
    let err = validate(&h).unwrap_err();
    assert_eq!(err.status(), Status::BadKey);
    assert!(err.to_string().contains("NUL"), "{err}");
    h.key[40] = 0;
    let err = validate(&h).unwrap_err();
    assert_eq!(err.status(), Status::InvalidHandle, "bytes after the NUL must be zero: {err}");
    h.key[41..65].fill(0);
    validate(&h).unwrap();
}

#[test]
fn empty_and_zero_dimensional_tensors_are_valid() {
    let mut h = sample(0);
    validate(&h).unwrap();
    h = sample(2);
    h.shape[0] = 0;
    h.tensor_offset = 2048; // at the very end of an 8192-byte float32 storage
    assert_eq!(validate(&h).unwrap().numel, 0);
}
