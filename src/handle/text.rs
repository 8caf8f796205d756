//! The text form of a handle: `devshare1:` followed by the byte encoding in unpadded
//! URL-safe base64. Safe in environment variables, JSON strings and command lines.

use super::encode::{
    decode_full, encode_full_into, Decoded, DEVSHARE_HANDLE_DECODE_LIMIT, DEVSHARE_HANDLE_MAX_ENCODED_SIZE,
};
use super::DevshareHandle;
use crate::error::{Error, Result};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

/// Prefix of every handle text.
pub const TEXT_PREFIX: &str = "devshare1:";
/// Largest handle text this library writes, including the terminating NUL that the C API
/// writes. Like `DEVSHARE_HANDLE_MAX_ENCODED_SIZE`, a later minor version may write longer ones.
pub const DEVSHARE_HANDLE_MAX_TEXT_SIZE: usize = 819;
static_assertions::const_assert_eq!(
    DEVSHARE_HANDLE_MAX_TEXT_SIZE,
    TEXT_PREFIX.len() + (DEVSHARE_HANDLE_MAX_ENCODED_SIZE * 4).div_ceil(3) + 1
);

/// The text form of a valid handle.
pub fn to_text(h: &DevshareHandle) -> Result<String> {
    to_text_full(h, None)
}

/// The text form of a valid handle with its segment table when that is not inline.
pub fn to_text_full(h: &DevshareHandle, table: Option<&[u8]>) -> Result<String> {
    let mut bytes = Vec::new();
    encode_full_into(h, table, &mut bytes)?;
    let mut s = String::with_capacity(DEVSHARE_HANDLE_MAX_TEXT_SIZE);
    s.push_str(TEXT_PREFIX);
    URL_SAFE_NO_PAD.encode_string(&bytes, &mut s);
    Ok(s)
}

/// Parse and validate handle text. Surrounding ASCII whitespace (a trailing newline) is ignored.
pub fn from_text(text: &str) -> Result<DevshareHandle> {
    from_text_full(text).map(|d| d.handle)
}

/// Parse and validate handle text, keeping a segment table that travelled with it.
pub fn from_text_full(text: &str) -> Result<Decoded> {
    let t = text.trim_ascii();
    let body = t.strip_prefix(TEXT_PREFIX).ok_or_else(|| {
        Error::BadText(format!(
            "text must start with {TEXT_PREFIX:?}, got {:?}",
            t.chars().take(TEXT_PREFIX.len()).collect::<String>()
        ))
    })?;
    if body.len() > DEVSHARE_HANDLE_DECODE_LIMIT.div_ceil(3) * 4 {
        return Err(Error::BadText(format!("{} characters is longer than any handle", t.len())));
    }
    let bytes = URL_SAFE_NO_PAD.decode(body).map_err(|e| {
        Error::BadText(match e {
            base64::DecodeError::InvalidByte(at, c) => format!(
                "character {:?} at position {} is not in the URL-safe base64 alphabet",
                c as char,
                at + TEXT_PREFIX.len()
            ),
            other => format!("base64 body: {other}"),
        })
    })?;
    decode_full(&bytes)
}
