//! The C surface. Every `extern "C"` function is a thin shell: check arguments, call one Rust
//! function, map its `Result` to a status and stash the message. All of them run their body
//! inside [`boundary`] (or [`boundary_value`]), so no panic crosses into C.
//!
//! The pointer contracts of the `unsafe extern "C"` functions are the C header's conventions
//! (valid or NULL, sizes as passed); they are documented there once rather than in a `# Safety`
//! section per function.
#![allow(clippy::missing_safety_doc)]

/// Call one of this module's pointer helpers (or another `unsafe fn` that only dereferences
/// the calling C function's own pointer arguments) under the C header's pointer contract.
macro_rules! ffi {
    ($e:expr) => {{
        // SAFETY: the C header's pointer contract, stated once at its top: every pointer an
        // exported function receives is NULL or valid (aligned, initialised, for the sizes
        // passed with it) for the duration of the call, and objects are not used after their
        // release. The helpers called here check NULL before they dereference.
        unsafe { $e }
    }};
}

// cbindgen writes the header's declarations in the order of these modules: the channel's
// files first and together, then the others.
mod abi;
pub mod channel;
pub mod connection;
pub mod pool;

pub mod dlpack;
pub mod error;
pub mod export;
pub mod handle;
pub mod import;
pub mod probe;
pub mod torch;

use crate::error::{set_last_error, Error, Result, Status};
use std::panic::{catch_unwind, AssertUnwindSafe};

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Run `f` for the C function `name`: `DEVSHARE_STATUS_OK` on success; on error, its status with the
/// message recorded for `devshare_last_error`; on panic, `DEVSHARE_STATUS_INTERNAL`.
pub(crate) fn boundary(name: &'static str, f: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::Ok as i32,
        Ok(Err(e)) => {
            set_last_error(name, &e);
            e.status() as i32
        }
        Err(p) => {
            set_last_error(name, &Error::Internal(panic_text(&*p)));
            Status::Internal as i32
        }
    }
}

/// Like [`boundary`] for functions that return a value instead of a status: `fallback` on panic.
pub(crate) fn boundary_value<T>(name: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        set_last_error(name, &Error::Internal(panic_text(&*p)));
        fallback
    })
}

/// A shared reference from a C pointer, or `NullArgument` naming the parameter.
///
/// # Safety
/// A non-null `p` must point to a valid, properly aligned `T` for the returned lifetime.
pub(crate) unsafe fn arg<'a, T>(p: *const T, what: &'static str) -> Result<&'a T> {
    // SAFETY: the caller guarantees validity when non-null.
    match unsafe { p.as_ref() } {
        Some(r) => Ok(r),
        None => Err(Error::NullArgument(what)),
    }
}

/// A mutable reference from a C pointer, or `NullArgument` naming the parameter.
///
/// # Safety
/// As for [`arg`], and no other reference to `*p` may be live.
pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, what: &'static str) -> Result<&'a mut T> {
    // SAFETY: the caller guarantees validity when non-null.
    match unsafe { p.as_mut() } {
        Some(r) => Ok(r),
        None => Err(Error::NullArgument(what)),
    }
}

/// A slice from a C pointer and length; NULL is allowed only for length 0.
///
/// # Safety
/// A non-null `p` must point to `len` valid `T`s.
pub(crate) unsafe fn arg_slice<'a, T>(p: *const T, len: usize, what: &'static str) -> Result<&'a [T]> {
    if p.is_null() {
        return if len == 0 { Ok(&[]) } else { Err(Error::NullArgument(what)) };
    }
    // No object is larger than isize::MAX bytes: such a length cannot be what the caller has.
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Error::InvalidArgument(format!("{what}: length {len} is larger than any buffer")));
    }
    // SAFETY: the caller guarantees p points to len elements (and len fits an object, above).
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// A C timeout in milliseconds: negative waits forever.
pub(crate) fn timeout(ms: i32) -> Option<std::time::Duration> {
    u64::try_from(ms).ok().map(std::time::Duration::from_millis)
}

/// A channel address (`devshare_channel_listen`, `devshare_channel_connect`) from a C string.
///
/// # Safety
/// `address` is NULL or a NUL-terminated string.
pub(crate) unsafe fn address<'a>(address: *const std::ffi::c_char) -> Result<&'a str> {
    if address.is_null() {
        return Err(Error::NullArgument("address"));
    }
    // SAFETY: non-null, NUL-terminated (contract).
    let s = unsafe { std::ffi::CStr::from_ptr(address) };
    s.to_str().map_err(|_| Error::InvalidArgument("address is not UTF-8".into()))
}

/// Copy `bytes` plus a NUL into a C buffer of `cap` bytes; `BufferTooSmall` when it does not fit.
/// `len_out` (if not NULL) receives the length without the NUL either way.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes; `len_out` NULL or valid.
pub(crate) unsafe fn write_out(bytes: &[u8], nul: bool, buf: *mut u8, cap: usize, len_out: *mut usize) -> Result<()> {
    // SAFETY: len_out is NULL or valid (contract).
    if let Some(l) = unsafe { len_out.as_mut() } {
        *l = bytes.len();
    }
    let needed = bytes.len() + usize::from(nul);
    if buf.is_null() || cap < needed {
        return Err(Error::BufferTooSmall { needed, given: if buf.is_null() { 0 } else { cap }, unit: "bytes" });
    }
    // SAFETY: buf has cap >= needed writable bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
        if nul {
            *buf.add(bytes.len()) = 0;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::last_error_message;

    #[test]
    fn a_panic_becomes_an_internal_status_with_its_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let status = boundary("devshare_test_fn", || panic!("boom {}", 7));
        std::panic::set_hook(prev);
        assert_eq!(status, Status::Internal as i32);
        assert_eq!(last_error_message(), "devshare_test_fn: internal error: boom 7");
    }

    #[test]
    fn errors_are_reported_with_the_function_name_and_status() {
        let status = boundary("devshare_test_fn", || Err(Error::NullArgument("out")));
        assert_eq!(status, Status::NullArgument as i32);
        assert_eq!(last_error_message(), "devshare_test_fn: out: argument is NULL");
        assert_eq!(boundary("devshare_test_fn", || Ok(())), 0);
        assert_eq!(last_error_message(), "devshare_test_fn: out: argument is NULL", "kept on success");
    }

    #[test]
    fn every_status_has_distinct_text_and_round_trips_its_code() {
        let mut seen = std::collections::HashSet::new();
        for s in Status::ALL {
            assert!(seen.insert(s.as_str()), "duplicate text for {s:?}");
            assert_eq!(Status::from_code(s as i32), Some(s));
        }
    }
}
