//! The ACL IPC key: the one place its rules are written.
//!
//! `aclrtIpcMemGetExportKey` writes a C string into a 65-byte buffer and leaves the bytes after
//! the NUL unspecified. A handle carries the key as those 65 bytes with zeros after the NUL, so
//! that equal keys are equal bytes. Handle validation checks that form ([`check_acl_key`]); what
//! comes from the runtime or from a torch_npu tuple is brought into it ([`AclKey::normalize`]).

use crate::error::{Error, Result};
use std::ffi::CStr;

/// Size of an ACL IPC key buffer, NUL included.
pub(crate) const ACL_KEY_LEN: usize = 65;

/// Length, terminator and emptiness: where the key's NUL is.
fn nul_position(key: &[u8]) -> Result<usize> {
    if key.len() != ACL_KEY_LEN {
        return Err(Error::BadKey(format!("ACL IPC key must be {ACL_KEY_LEN} bytes, got {}", key.len())));
    }
    match key.iter().position(|&b| b == 0) {
        None => Err(Error::BadKey(format!("ACL IPC key has no NUL terminator in its {ACL_KEY_LEN} bytes"))),
        Some(0) => Err(Error::BadKey("ACL IPC key is empty".into())),
        Some(n) => Ok(n),
    }
}

/// Whether `key` is an ACL IPC key in the form handles carry: exactly 65 bytes, a non-empty C
/// string, zeros after its NUL. A malformed key is `BadKey`; non-zero bytes after the NUL are an
/// invalid handle field, like every other unused byte of a handle.
pub(crate) fn check_acl_key(key: &[u8]) -> Result<()> {
    let n = nul_position(key)?;
    if key[n..].iter().any(|&b| b != 0) {
        return Err(Error::invalid("key", "bytes after the ACL key's NUL must be 0"));
    }
    Ok(())
}

/// An ACL IPC key in the form handles carry (see [`check_acl_key`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct AclKey([u8; ACL_KEY_LEN]);

impl AclKey {
    /// The key in 65 bytes that the runtime or a torch_npu tuple wrote: the bytes after the NUL,
    /// which they leave unspecified, become zeros.
    pub(crate) fn normalize(raw: &[u8]) -> Result<AclKey> {
        let n = nul_position(raw)?;
        let mut key = [0u8; ACL_KEY_LEN];
        key[..n].copy_from_slice(&raw[..n]);
        debug_assert!(check_acl_key(&key).is_ok());
        Ok(AclKey(key))
    }

    /// The 65 bytes, as a handle carries them.
    pub(crate) fn as_bytes(&self) -> &[u8; ACL_KEY_LEN] {
        &self.0
    }

    /// The key as the runtime's `const char *` arguments take it.
    pub(crate) fn as_c_str(&self) -> &CStr {
        CStr::from_bytes_until_nul(&self.0).expect("an AclKey holds a NUL")
    }
}

/// The key's characters (for messages).
impl std::fmt::Display for AclKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.as_c_str().to_string_lossy())
    }
}

impl std::fmt::Debug for AclKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AclKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    fn raw(text: &[u8], tail: u8) -> Vec<u8> {
        let mut v = text.to_vec();
        v.push(0);
        v.resize(ACL_KEY_LEN, tail);
        v
    }

    #[test]
    fn a_key_with_garbage_after_its_nul_normalizes_to_zeros_and_then_checks() {
        let k = AclKey::normalize(&raw(b"ipc-key-1", 0xa5)).unwrap();
        assert_eq!(&k.as_bytes()[..], &raw(b"ipc-key-1", 0)[..]);
        check_acl_key(k.as_bytes()).unwrap();
        assert_eq!(k.to_string(), "ipc-key-1");
        assert_eq!(k.as_c_str().to_bytes(), b"ipc-key-1");
    }

    #[test]
    fn check_refuses_a_non_zero_tail_as_an_invalid_handle_field() {
        let e = check_acl_key(&raw(b"k", 1)).unwrap_err();
        assert_eq!(e.status(), Status::InvalidHandle, "{e}");
    }

    #[test]
    fn wrong_length_missing_nul_and_empty_keys_are_bad_keys_in_both() {
        let short = raw(b"k", 0)[..64].to_vec();
        let no_nul = vec![b'k'; ACL_KEY_LEN];
        let empty = raw(b"", 7);
        for bad in [&short, &no_nul, &empty] {
            assert_eq!(check_acl_key(bad).unwrap_err().status(), Status::BadKey);
            assert_eq!(AclKey::normalize(bad).unwrap_err().status(), Status::BadKey);
        }
        assert!(check_acl_key(&no_nul).unwrap_err().to_string().contains("NUL"));
    }
}
