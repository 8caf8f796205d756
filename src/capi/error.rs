//! Status text, the thread-local last error, and the library version.

use super::boundary_value;
use crate::error::{copy_last_error, last_vendor_code, Status};
use std::ffi::c_char;

// DEVSHARE_VERSION_MAJOR, _MINOR, _PATCH and DEVSHARE_VERSION: written by build.rs from the
// version in Cargo.toml (cbindgen reads the same file for the header's macros).
include!(concat!(env!("OUT_DIR"), "/version.rs"));

static UNKNOWN: &std::ffi::CStr = c"unknown status";

/// Fixed text for a status code ("unknown status" for values this library does not define).
/// The string is static: do not free it.
#[no_mangle]
pub extern "C" fn devshare_status_str(status: i32) -> *const c_char {
    boundary_value("devshare_status_str", UNKNOWN.as_ptr(), || {
        Status::from_code(status).map_or(UNKNOWN.as_ptr(), |s| s.as_cstr().as_ptr())
    })
}

/// Copy the calling thread's last error message (which function failed and why) into `buf`,
/// NUL-terminated and truncated to `cap` bytes. Returns the message's full length without the
/// NUL, so a caller can size a buffer with `devshare_last_error(NULL, 0) + 1`. Successful calls
/// leave the message alone; it describes the most recent failure on this thread.
#[no_mangle]
pub unsafe extern "C" fn devshare_last_error(buf: *mut c_char, cap: usize) -> usize {
    boundary_value("devshare_last_error", 0, || {
        if buf.is_null() || cap == 0 {
            return copy_last_error(&mut []);
        }
        // SAFETY: the caller passes cap writable bytes at buf.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), cap) };
        copy_last_error(out)
    })
}

/// The errno or vendor runtime error code of the calling thread's last failure (0 when it had
/// none), for `DEVSHARE_STATUS_OS` and `DEVSHARE_STATUS_VENDOR`.
#[no_mangle]
pub extern "C" fn devshare_last_vendor_error() -> i64 {
    boundary_value("devshare_last_vendor_error", 0, last_vendor_code)
}

/// The library's version as `(major << 16) | (minor << 8) | patch`. A program built against
/// header `DEVSHARE_VERSION` works with any library of the same major version and a minor version
/// at least as high.
#[no_mangle]
pub extern "C" fn devshare_version() -> u32 {
    DEVSHARE_VERSION
}
