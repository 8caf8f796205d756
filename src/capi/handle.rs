//! Handle functions: init, validate, encode / decode, text.

use super::{arg, arg_mut, arg_slice, boundary, write_out};
use crate::error::Error;
use crate::handle::{encode, text, validate, DevshareHandle};
use std::ffi::{c_char, CStr};

/// Reset `*handle` to an empty handle of this library's layout (`struct_size` and
/// `layout_version` set, everything else zero). Use it before filling a handle field by field.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_init(handle: *mut DevshareHandle) -> i32 {
    boundary("devshare_handle_init", || {
        *ffi!(arg_mut(handle, "handle"))? = DevshareHandle::default();
        Ok(())
    })
}

/// Check every field of a handle: versions, backend, key form, dtype, ndim, and that the tensor
/// lies inside its storage and the storage inside the allocation. The last error names the
/// first field that is wrong.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_validate(handle: *const DevshareHandle) -> i32 {
    boundary("devshare_handle_validate", || validate(ffi!(arg(handle, "handle"))?).map(|_| ()))
}

/// Encode a valid handle into `buf` (at most `DEVSHARE_HANDLE_MAX_ENCODED_SIZE` bytes).
/// `*len_out` receives the encoded length, also when `buf` is NULL or too small
/// (`DEVSHARE_STATUS_BUFFER_TOO_SMALL`). `len_out` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_encode(
    handle: *const DevshareHandle,
    buf: *mut u8,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_handle_encode", || {
        let bytes = encode::encode(ffi!(arg(handle, "handle"))?)?;
        ffi!(write_out(&bytes, false, buf, cap, len_out))
    })
}

/// Decode and validate `len` encoded bytes into `*out`. Each kind of damage has its own status
/// (truncated, bad magic, version, checksum, length, and one per invalid field).
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_decode(buf: *const u8, len: usize, out: *mut DevshareHandle) -> i32 {
    boundary("devshare_handle_decode", || {
        let out = ffi!(arg_mut(out, "out"))?;
        if buf.is_null() {
            return Err(Error::NullArgument("buf"));
        }
        *out = encode::decode(ffi!(arg_slice(buf, len, "buf"))?)?;
        Ok(())
    })
}

/// Write the text form of a valid handle (`devshare1:` + URL-safe base64), NUL-terminated, into
/// `buf` (`DEVSHARE_HANDLE_MAX_TEXT_SIZE` always suffices). `*len_out` receives the length
/// without the NUL, also when the buffer is too small. `len_out` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_to_text(
    handle: *const DevshareHandle,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> i32 {
    boundary("devshare_handle_to_text", || {
        let s = text::to_text(ffi!(arg(handle, "handle"))?)?;
        ffi!(write_out(s.as_bytes(), true, buf.cast(), cap, len_out))
    })
}

/// Parse and validate handle text (NUL-terminated; surrounding whitespace is ignored).
#[no_mangle]
pub unsafe extern "C" fn devshare_handle_from_text(text: *const c_char, out: *mut DevshareHandle) -> i32 {
    boundary("devshare_handle_from_text", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let t = ffi!(arg(text, "text"))?;
        let t = ffi!(CStr::from_ptr(t)).to_str().map_err(|_| Error::BadText("text is not UTF-8".into()))?;
        *out = text::from_text(t)?;
        Ok(())
    })
}
