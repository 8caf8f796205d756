//! Status codes, the crate's one error type, and the thread-local error detail.
//!
//! Every failure in devshare is an [`Error`]; each variant maps to exactly one C status code
//! ([`Status`]). Status values are part of the ABI: they are never renumbered, only added.

use std::cell::RefCell;

/// Status codes returned by every `devshare_*` function that can fail.
///
/// `DEVSHARE_STATUS_OK` (0) is success; every error is negative. Values are stable across releases:
/// new codes may be added, existing ones are never renumbered or reused.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// A required pointer argument was NULL.
    NullArgument = -1,
    /// An argument was out of range or inconsistent (the message names it).
    InvalidArgument = -2,
    /// The output buffer is too small; the required size was stored where the call says.
    BufferTooSmall = -3,
    /// Encoded handle bytes end before the encoding does.
    Truncated = -10,
    /// Encoded handle bytes do not start with the devshare magic.
    BadMagic = -11,
    /// A version, flag, field, record or backend from a devshare this library does not understand
    /// (a newer handle layout or encoding, a struct tail or flag of a newer caller), named in
    /// the message.
    UnsupportedVersion = -12,
    /// The checksum of the encoded handle does not match its contents.
    ChecksumMismatch = -13,
    /// Handle text is malformed (wrong prefix, character outside the alphabet).
    BadText = -14,
    /// The length recorded in the encoding disagrees with the input (trailing bytes).
    BadLength = -15,
    /// A handle field is invalid (the message names the field).
    InvalidHandle = -20,
    /// The storage (offset + size) extends beyond the exported allocation.
    StorageOutOfBounds = -21,
    /// The tensor (offset, shape and strides) extends beyond its storage.
    TensorOutOfBounds = -22,
    /// `ndim` is above `DEVSHARE_MAX_NDIM`.
    BadNdim = -23,
    /// The dtype is unknown or not supported.
    BadDtype = -24,
    /// The key is too long, too short or not of the form its backend requires.
    BadKey = -25,
    /// A size, offset, shape or stride is negative or overflows.
    BadSize = -26,
    /// The handle was made on another machine (host identity differs).
    WrongHost = -27,
    /// The backend's vendor runtime could not be loaded or is not built in.
    BackendUnavailable = -30,
    /// The operation is not supported for this backend or handle form.
    Unsupported = -31,
    /// The exported object no longer exists (the exporter closed it).
    NotFound = -32,
    /// A system call failed; `devshare_last_vendor_error()` holds `errno`.
    Os = -33,
    /// The vendor runtime returned an error; `devshare_last_vendor_error()` holds its code.
    Vendor = -34,
    /// A wait ran out of time.
    Timeout = -35,
    /// References are still outstanding.
    Busy = -36,
    /// The handle's reference was already returned (its ref-counter slot is 0); ask the producer
    /// for a new handle.
    AlreadyReleased = -37,
    /// The exported object is not what the handle says (size or layout mismatch).
    Mismatch = -38,
    /// A shared memory object failed devshare's trust checks, made on the opened descriptor before
    /// anything is written: its name is outside the families devshare speaks (its own
    /// `/devshare_<pid>_<hex>` and `/devshare_rc_<pid>_<hex>`, PyTorch's `/torch_<pid>_<n>...`),
    /// another user owns it, group or others may access it, its size is not the layout's, or its
    /// contents are not what its producer records (an in-flight flag it did not send, a
    /// ref-counter slot that is neither 0 nor 1). Nothing was changed.
    Untrusted = -39,
    /// The other end of a channel is gone (its process exited or closed it), or the channel
    /// was closed: nothing more will arrive on it.
    Closed = -40,
    /// A bug in devshare: a panic was caught at the C boundary. Please report it.
    Internal = -99,
}

impl Status {
    /// Short fixed text for a status, NUL-terminated for `devshare_status_str`.
    pub fn as_cstr(self) -> &'static std::ffi::CStr {
        match self {
            Status::Ok => c"ok",
            Status::NullArgument => c"null argument",
            Status::InvalidArgument => c"invalid argument",
            Status::BufferTooSmall => c"buffer too small",
            Status::Truncated => c"truncated handle bytes",
            Status::BadMagic => c"not a devshare handle (bad magic)",
            Status::UnsupportedVersion => c"unsupported version or feature",
            Status::ChecksumMismatch => c"handle checksum mismatch",
            Status::BadText => c"malformed handle text",
            Status::BadLength => c"handle length mismatch",
            Status::InvalidHandle => c"invalid handle field",
            Status::StorageOutOfBounds => c"storage extends beyond the allocation",
            Status::TensorOutOfBounds => c"tensor extends beyond its storage",
            Status::BadNdim => c"ndim above the maximum",
            Status::BadDtype => c"unknown or unsupported dtype",
            Status::BadKey => c"malformed export key",
            Status::BadSize => c"negative or overflowing size",
            Status::WrongHost => c"handle was made on another host",
            Status::BackendUnavailable => c"backend unavailable",
            Status::Unsupported => c"unsupported operation",
            Status::NotFound => c"exported object not found",
            Status::Os => c"operating system error",
            Status::Vendor => c"vendor runtime error",
            Status::Timeout => c"timed out",
            Status::Busy => c"references outstanding",
            Status::AlreadyReleased => c"handle reference already released",
            Status::Mismatch => c"exported object does not match the handle",
            Status::Untrusted => c"shared object failed the trust checks (name, owner, mode, size or contents)",
            Status::Closed => c"the other end of the channel is gone",
            Status::Internal => c"internal error (panic caught)",
        }
    }

    /// Short fixed text for a status.
    pub fn as_str(self) -> &'static str {
        self.as_cstr().to_str().expect("status texts are ASCII")
    }

    /// All statuses, for lookups and tests.
    pub(crate) const ALL: [Status; 30] = [
        Status::Ok,
        Status::NullArgument,
        Status::InvalidArgument,
        Status::BufferTooSmall,
        Status::Truncated,
        Status::BadMagic,
        Status::UnsupportedVersion,
        Status::ChecksumMismatch,
        Status::BadText,
        Status::BadLength,
        Status::InvalidHandle,
        Status::StorageOutOfBounds,
        Status::TensorOutOfBounds,
        Status::BadNdim,
        Status::BadDtype,
        Status::BadKey,
        Status::BadSize,
        Status::WrongHost,
        Status::BackendUnavailable,
        Status::Unsupported,
        Status::NotFound,
        Status::Os,
        Status::Vendor,
        Status::Timeout,
        Status::Busy,
        Status::AlreadyReleased,
        Status::Mismatch,
        Status::Untrusted,
        Status::Closed,
        Status::Internal,
    ];

    /// The status with this numeric value, if any.
    pub fn from_code(code: i32) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| *s as i32 == code)
    }
}

/// The one error type of the crate. Each variant corresponds to one [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("{0}: argument is NULL")]
    NullArgument(&'static str),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("buffer too small: {needed} {unit} needed, {given} given")]
    BufferTooSmall { needed: usize, given: usize, unit: &'static str },
    #[error("truncated handle: {0}")]
    Truncated(String),
    #[error("not a devshare handle: {0}")]
    BadMagic(String),
    #[error("unsupported version: {0}")]
    UnsupportedVersion(String),
    #[error("checksum mismatch: {0}")]
    ChecksumMismatch(String),
    #[error("malformed handle text: {0}")]
    BadText(String),
    #[error("length mismatch: {0}")]
    BadLength(String),
    #[error("invalid handle field {field}: {why}")]
    InvalidHandle { field: &'static str, why: String },
    #[error("storage out of bounds: {0}")]
    StorageOutOfBounds(String),
    #[error("tensor out of bounds: {0}")]
    TensorOutOfBounds(String),
    #[error("invalid handle field ndim: {0}")]
    BadNdim(String),
    #[error("invalid handle field dtype: {0}")]
    BadDtype(String),
    #[error("invalid handle field key: {0}")]
    BadKey(String),
    #[error("invalid handle field {field}: {why}")]
    BadSize { field: &'static str, why: String },
    #[error("wrong host: {0}")]
    WrongHost(String),
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("{call} failed: {message} (errno {errno})")]
    Os { call: String, errno: i32, message: String },
    #[error("{call} failed with vendor error {code}: {message}")]
    Vendor { call: String, code: i64, message: String },
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("busy: {0}")]
    Busy(String),
    #[error("already released: {0}")]
    AlreadyReleased(String),
    #[error("mismatch: {0}")]
    Mismatch(String),
    #[error("untrusted: {0}")]
    Untrusted(String),
    #[error("closed: {0}")]
    Closed(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// The C status code for this error.
    pub fn status(&self) -> Status {
        match self {
            Error::NullArgument(_) => Status::NullArgument,
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::BufferTooSmall { .. } => Status::BufferTooSmall,
            Error::Truncated(_) => Status::Truncated,
            Error::BadMagic(_) => Status::BadMagic,
            Error::UnsupportedVersion(_) => Status::UnsupportedVersion,
            Error::ChecksumMismatch(_) => Status::ChecksumMismatch,
            Error::BadText(_) => Status::BadText,
            Error::BadLength(_) => Status::BadLength,
            Error::InvalidHandle { .. } => Status::InvalidHandle,
            Error::StorageOutOfBounds(_) => Status::StorageOutOfBounds,
            Error::TensorOutOfBounds(_) => Status::TensorOutOfBounds,
            Error::BadNdim(_) => Status::BadNdim,
            Error::BadDtype(_) => Status::BadDtype,
            Error::BadKey(_) => Status::BadKey,
            Error::BadSize { .. } => Status::BadSize,
            Error::WrongHost(_) => Status::WrongHost,
            Error::BackendUnavailable(_) => Status::BackendUnavailable,
            Error::Unsupported(_) => Status::Unsupported,
            Error::NotFound(_) => Status::NotFound,
            Error::Os { .. } => Status::Os,
            Error::Vendor { .. } => Status::Vendor,
            Error::Timeout(_) => Status::Timeout,
            Error::Busy(_) => Status::Busy,
            Error::AlreadyReleased(_) => Status::AlreadyReleased,
            Error::Mismatch(_) => Status::Mismatch,
            Error::Untrusted(_) => Status::Untrusted,
            Error::Closed(_) => Status::Closed,
            Error::Internal(_) => Status::Internal,
        }
    }

    /// The errno or vendor error code carried by this error, 0 when none.
    pub fn vendor_code(&self) -> i64 {
        match self {
            Error::Os { errno, .. } => i64::from(*errno),
            Error::Vendor { code, .. } => *code,
            _ => 0,
        }
    }

    /// An `Os` error from the current `errno`, naming the call that failed.
    pub fn last_os(call: impl Into<String>) -> Error {
        let err = std::io::Error::last_os_error();
        Error::Os { call: call.into(), errno: err.raw_os_error().unwrap_or(0), message: err.to_string() }
    }

    pub(crate) fn invalid(field: &'static str, why: impl Into<String>) -> Error {
        Error::InvalidHandle { field, why: why.into() }
    }

    pub(crate) fn bad_size(field: &'static str, why: impl Into<String>) -> Error {
        Error::BadSize { field, why: why.into() }
    }
}

/// Shorthand used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

struct LastError {
    message: String,
    vendor_code: i64,
}

thread_local! {
    static LAST_ERROR: RefCell<LastError> = const {
        RefCell::new(LastError { message: String::new(), vendor_code: 0 })
    };
}

/// Record `err` as this thread's last error, prefixed with the C function that failed.
pub(crate) fn set_last_error(function: &str, err: &Error) {
    let message = format!("{function}: {err}");
    let code = err.vendor_code();
    LAST_ERROR.with(|e| {
        let mut e = e.borrow_mut();
        e.message = message;
        e.vendor_code = code;
    });
}

/// This thread's last error message (the most recent failure; successes leave it alone).
pub fn last_error_message() -> String {
    LAST_ERROR.with(|e| e.borrow().message.clone())
}

/// This thread's last errno / vendor error code (0 when none).
pub fn last_vendor_code() -> i64 {
    LAST_ERROR.with(|e| e.borrow().vendor_code)
}

/// Copy the last error message into `out` (NUL-terminated, truncated to fit); returns its full
/// length without the NUL.
pub(crate) fn copy_last_error(out: &mut [u8]) -> usize {
    LAST_ERROR.with(|e| {
        let e = e.borrow();
        let bytes = e.message.as_bytes();
        if !out.is_empty() {
            let n = bytes.len().min(out.len() - 1);
            out[..n].copy_from_slice(&bytes[..n]);
            out[n] = 0;
        }
        bytes.len()
    })
}
