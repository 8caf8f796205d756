//! Property tests: no input makes decoding panic, and nothing that passes validation points
//! outside its allocation (checked with independent 128-bit arithmetic).

use devshare::dtype::DevshareDType;
use devshare::handle::encode::{decode, encode};
use devshare::handle::text::from_text;
use devshare::handle::*;
use proptest::prelude::*;

/// Independent bounds check: the tensor lies in the storage, the storage in the allocation.
fn in_bounds(h: &DevshareHandle) -> bool {
    let elem = (h.dtype.bits as u128 / 8) * h.dtype.lanes as u128;
    let storage_end = h.storage_offset as u128 + h.storage_size as u128;
    if storage_end > h.alloc_size as u128 || h.tensor_offset < 0 {
        return false;
    }
    let n = h.ndim as usize;
    if h.shape[..n].contains(&0) {
        return (h.tensor_offset as u128) * elem <= h.storage_size as u128;
    }
    let mut last = h.tensor_offset as i128;
    for i in 0..n {
        if h.shape[i] < 0 || h.strides[i] < 0 {
            return false;
        }
        last += (h.shape[i] as i128 - 1) * h.strides[i] as i128;
    }
    ((last + 1) as u128) * elem <= h.storage_size as u128
}

fn valid_seed() -> DevshareHandle {
    let mut h = DevshareHandle {
        backend: DEVSHARE_BACKEND_HOST,
        producer_pid: 42,
        dtype: DevshareDType::new(2, 32, 1),
        ndim: 3,
        alloc_size: 1 << 16,
        storage_offset: 512,
        storage_size: 4096,
        tensor_offset: 1,
        ..Default::default()
    };
    h.shape[..3].copy_from_slice(&[4, 4, 4]);
    h.strides[..3].copy_from_slice(&[16, 4, 1]);
    let key = b"/devshare_42_0123456789abcdef";
    h.key[..key.len()].copy_from_slice(key);
    h.key_len = key.len() as u32;
    h
}

fn fix_crc(b: &mut [u8]) {
    let n = b.len() - 4;
    let crc = crc32fast::hash(&b[..n]);
    b[n..].copy_from_slice(&crc.to_le_bytes());
}

fn arb_i64() -> impl Strategy<Value = i64> {
    prop_oneof![-4i64..5000, any::<i64>(), Just(i64::MAX), Just(i64::MIN), (0u32..63).prop_map(|s| 1i64 << s)]
}

fn arb_u64() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..70_000, any::<u64>(), (0u32..64).prop_map(|s| 1u64 << s), Just(u64::MAX)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(h) = decode(&bytes) {
            prop_assert!(in_bounds(&h));
        }
    }

    #[test]
    fn arbitrary_bytes_with_valid_header_and_checksum_never_escape(
        body in proptest::collection::vec(any::<u8>(), 0..500),
    ) {
        let mut b = b"DVSH\x01\x00\x00\x00".to_vec();
        b.extend_from_slice(&((body.len() + 16) as u32).to_le_bytes());
        b.extend_from_slice(&body);
        b.extend_from_slice(&[0; 4]);
        fix_crc(&mut b);
        if let Ok(h) = decode(&b) {
            prop_assert!(in_bounds(&h), "{h:?}");
        }
    }

    #[test]
    fn mutated_valid_encodings_never_escape(
        edits in proptest::collection::vec((0usize..400, any::<u8>()), 1..8),
    ) {
        let mut b = encode(&valid_seed()).unwrap();
        let n = b.len() - 4;
        for (at, v) in edits {
            b[at % n] = v;
        }
        fix_crc(&mut b);
        if let Ok(h) = decode(&b) {
            prop_assert!(in_bounds(&h), "{h:?}");
            prop_assert_eq!(decode(&encode(&h).unwrap()).unwrap(), h);
        }
    }

    #[test]
    fn arbitrary_fields_pass_validation_only_in_bounds(
        ndim in 0u32..10,
        shape in proptest::array::uniform8(arb_i64()),
        strides in proptest::array::uniform8(arb_i64()),
        alloc in arb_u64(), off in arb_u64(), size in arb_u64(), toff in arb_i64(),
        code in 0u8..20, bits in prop_oneof![Just(8u8), Just(16), Just(32), Just(64), any::<u8>()],
        lanes in 0u16..3,
    ) {
        let mut h = valid_seed();
        h.ndim = ndim;
        h.shape = shape;
        h.strides = strides;
        for i in (ndim as usize).min(8)..8 { h.shape[i] = 0; h.strides[i] = 0; }
        h.alloc_size = alloc;
        h.storage_offset = off;
        h.storage_size = size;
        h.tensor_offset = toff;
        h.dtype = DevshareDType::new(code, bits, lanes);
        if validate(&h).is_ok() {
            prop_assert!(in_bounds(&h), "{h:?}");
            prop_assert_eq!(decode(&encode(&h).unwrap()).unwrap(), h);
        }
    }

    #[test]
    fn small_fields_near_the_bounds_pass_validation_only_in_bounds(
        ndim in 0u32..4,
        shape in proptest::array::uniform8(-1i64..5),
        strides in proptest::array::uniform8(-1i64..6),
        alloc in 0u64..300, off in 0u64..300, size in 0u64..300, toff in -1i64..40,
        bits in prop_oneof![Just(8u8), Just(16), Just(32), Just(64)],
    ) {
        let mut h = valid_seed();
        h.ndim = ndim;
        h.shape = shape;
        h.strides = strides;
        for i in ndim as usize..8 { h.shape[i] = 0; h.strides[i] = 0; }
        h.alloc_size = alloc;
        h.storage_offset = off;
        h.storage_size = size;
        h.tensor_offset = toff;
        h.dtype = DevshareDType::new(1, bits, 1);
        if validate(&h).is_ok() {
            prop_assert!(in_bounds(&h), "{h:?}");
        }
    }

    #[test]
    fn arbitrary_text_never_panics(s in "\\PC{0,700}") {
        let _ = from_text(&s);
        let _ = from_text(&format!("devshare1:{s}"));
    }
}
