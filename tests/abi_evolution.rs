//! The evolution rules of the handle format, as a later devshare would use them: handles and
//! encodings built by hand the way a newer writer would make them, read by today's library.
//! What a reader may skip is read; what it must understand and does not is refused with
//! `UnsupportedVersion`, naming the feature.

use devshare::dtype::DevshareDType;
use devshare::handle::encode::{decode, encode, DEVSHARE_HANDLE_MAX_ENCODED_SIZE};
use devshare::handle::text::{from_text, to_text};
use devshare::handle::*;
use devshare::Status;

fn sample() -> DevshareHandle {
    let mut h = DevshareHandle {
        backend: DEVSHARE_BACKEND_HOST,
        producer_pid: 42,
        dtype: DevshareDType::new(2, 32, 1),
        ndim: 1,
        alloc_size: 4096,
        storage_size: 4096,
        ..Default::default()
    };
    h.shape[0] = 1024;
    h.strides[0] = 1;
    h.set_key_for_tests(b"/devshare_42_abi");
    h
}

trait KeyForTests {
    fn set_key_for_tests(&mut self, key: &[u8]);
}
impl KeyForTests for DevshareHandle {
    fn set_key_for_tests(&mut self, key: &[u8]) {
        self.key[..key.len()].copy_from_slice(key);
        self.key_len = key.len() as u32;
    }
}

/// Append an extension record to the handle's `ext` area.
fn push_ext(h: &mut DevshareHandle, kind: u16, data: &[u8]) {
    let at = h.ext_len as usize;
    h.ext[at..at + 2].copy_from_slice(&kind.to_le_bytes());
    h.ext[at + 2..at + 4].copy_from_slice(&(data.len() as u16).to_le_bytes());
    h.ext[at + 4..at + 4 + data.len()].copy_from_slice(data);
    h.ext_len = (at + 4 + data.len()) as u16;
}

/// A future writer's handle: layout 1.7, a "may ignore" flag and a skippable record.
fn future_handle() -> DevshareHandle {
    let mut h = sample();
    h.layout_minor = 7;
    h.flags |= 1 << 20;
    push_ext(&mut h, 0x0042, b"a hint an old reader may skip");
    h
}

#[test]
fn a_future_minor_handle_with_skippable_flags_and_records_is_read() {
    let h = future_handle();
    validate(&h).unwrap();
    assert_eq!(ext_records(h.ext_bytes()).unwrap().len(), 1);
    // What the reader skips survives its re-encoding, bytes and text; a decoded handle is
    // laid out by the decoder, so it carries the decoder's layout_minor.
    let ours = DevshareHandle { layout_minor: DEVSHARE_HANDLE_LAYOUT_MINOR, ..h };
    assert_eq!(decode(&encode(&h).unwrap()).unwrap(), ours);
    assert_eq!(from_text(&to_text(&h).unwrap()).unwrap(), ours);
}

#[test]
fn an_unknown_must_understand_flag_is_refused_by_name() {
    let mut h = future_handle();
    h.flags |= 1 << 9;
    let err = validate(&h).unwrap_err();
    assert_eq!(err.status(), Status::UnsupportedVersion);
    assert!(err.to_string().contains("flag bit 9 (0x200)"), "{err}");
    assert!(err.to_string().contains("layout 1.7"), "{err}");
}

#[test]
fn an_unknown_must_understand_record_is_refused_by_name() {
    let mut h = future_handle();
    push_ext(&mut h, 0x8003, &[1, 2, 3, 4]);
    let err = validate(&h).unwrap_err();
    assert_eq!(err.status(), Status::UnsupportedVersion);
    assert!(err.to_string().contains("extension record type 0x8003"), "{err}");
}

#[test]
fn malformed_extension_records_are_invalid_not_skipped() {
    let mut h = sample();
    push_ext(&mut h, 0x0042, b"abc");
    h.ext[2] = 60; // claims more bytes than ext_len covers
    assert_eq!(validate(&h).unwrap_err().status(), Status::InvalidHandle);
    let mut h = sample();
    push_ext(&mut h, 0, b"");
    assert!(validate(&h).unwrap_err().to_string().contains("type 0"));
    let mut h = sample();
    push_ext(&mut h, 0x0042, b"abc");
    h.ext_len -= 5; // cuts the record's header
    h.ext[h.ext_len as usize..].fill(0);
    assert_eq!(validate(&h).unwrap_err().status(), Status::InvalidHandle);
}

#[test]
fn another_layout_major_version_or_an_unknown_backend_is_unsupported() {
    let mut h = sample();
    h.layout_version = 2;
    assert_eq!(validate(&h).unwrap_err().status(), Status::UnsupportedVersion);
    let mut h = sample();
    h.backend = 4;
    let err = validate(&h).unwrap_err();
    assert_eq!(err.status(), Status::UnsupportedVersion);
    assert!(err.to_string().contains("backend 4"), "{err}");
}

/// Re-frame `bytes` (an encoding) with a new minor and extra sections, fixing length and CRC.
fn with_sections(bytes: &[u8], minor: u16, sections: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut out = bytes[..bytes.len() - 4].to_vec();
    out[6..8].copy_from_slice(&minor.to_le_bytes());
    for (kind, data) in sections {
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(data);
    }
    let total = (out.len() + 4) as u32;
    out[8..12].copy_from_slice(&total.to_le_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

#[test]
fn a_future_encoding_with_skippable_sections_of_any_length_is_read() {
    let h = future_handle();
    let big = vec![0x5a; 40_000]; // longer than any handle this version writes
    let bytes = with_sections(&encode(&h).unwrap(), 9, &[(0x0007, big), (0x0100, vec![])]);
    assert!(bytes.len() > DEVSHARE_HANDLE_MAX_ENCODED_SIZE);
    assert_eq!(decode(&bytes).unwrap(), DevshareHandle { layout_minor: DEVSHARE_HANDLE_LAYOUT_MINOR, ..h });
}

#[test]
fn a_must_understand_section_is_refused_by_name() {
    let bytes = with_sections(&encode(&sample()).unwrap(), 2, &[(0x0007, vec![1]), (0x8011, vec![0; 8])]);
    let err = decode(&bytes).unwrap_err();
    assert_eq!(err.status(), Status::UnsupportedVersion);
    assert!(err.to_string().contains("section type 0x8011"), "{err}");
}

#[test]
fn an_encoding_of_format_minor_0_without_extension_block_is_still_read() {
    // devshare 0.1 wrote minor 0: the body ends after the event, no ext block, no sections.
    let h = sample();
    let bytes = encode(&h).unwrap();
    let body_end = bytes.len() - 4 - 1; // drop the 1-byte ext_len (ext is empty)
    let mut old = bytes[..body_end].to_vec();
    old[6..8].copy_from_slice(&0u16.to_le_bytes());
    let total = (old.len() + 4) as u32;
    old[8..12].copy_from_slice(&total.to_le_bytes());
    let crc = crc32fast::hash(&old);
    old.extend_from_slice(&crc.to_le_bytes());
    assert_eq!(decode(&old).unwrap(), h);
}

#[test]
fn another_encoding_major_version_is_unsupported() {
    let mut bytes = encode(&sample()).unwrap();
    bytes[4] = 2;
    let n = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
    let err = decode(&bytes).unwrap_err();
    assert_eq!(err.status(), Status::UnsupportedVersion);
    assert!(err.to_string().contains("format version 2"), "{err}");
}
