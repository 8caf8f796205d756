//! Loading a vendor library at run time, written once for the vendor runtimes (`backend::acl`,
//! `backend::cuda`) and UCX (`channel::tcp::ucx`): finding the library and its symbols
//! ([`load`], `Symbols`, `Optional`), loading it on first use (`OnDemand`, which also knows
//! whether a forked child inherited it), C text it returns (`c_text`) and the one form of a
//! vendor error (`vendor_error`).
//!
//! It sits below the backends and the channel so that a transport's vendor wrapper (UCX) needs
//! nothing from the backends.

use crate::error::{Error, Result};
use crate::fork::Stamp;
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------------
// Loading

/// Load the first library that opens: the path in `env_var` if set, else each candidate (a
/// path, or a bare name looked up on the default loader path). Returns the library and the name
/// that loaded; when none loads, the error lists every attempt.
pub fn load(env_var: &str, candidates: &[String]) -> Result<(libloading::Library, String)> {
    let mut tried = Vec::new();
    let mut names: Vec<String> = Vec::new();
    if let Ok(path) = std::env::var(env_var) {
        if !path.is_empty() {
            names.push(path);
        }
    }
    names.extend(candidates.iter().cloned());
    for name in names {
        // SAFETY: loading a vendor runtime runs its initialisers; that is the documented way to
        // use these libraries and the reason devshare loads them only on demand.
        match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => return Ok((lib, name)),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(Error::BackendUnavailable(format!(
        "no runtime library could be loaded (set {env_var} to its full path); tried {}",
        tried.join("; ")
    )))
}

/// A loaded runtime library, read by a typed wrapper while it fills its tables of function
/// pointers; the wrapper keeps it ([`Symbols::into_library`]) for as long as it keeps them.
pub(crate) struct Symbols {
    lib: libloading::Library,
    name: String,
}

impl Symbols {
    /// [`load`] the runtime.
    pub(crate) fn open(env_var: &str, candidates: &[String]) -> Result<Symbols> {
        let (lib, name) = load(env_var, candidates)?;
        Ok(Symbols { lib, name })
    }

    /// The name the library loaded by.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A function the wrapper cannot do without: missing, the runtime is unavailable.
    ///
    /// # Safety
    /// `T` must be the C signature of `name` (an `unsafe extern "C" fn`).
    pub(crate) unsafe fn required<T: Copy>(&self, name: &str) -> Result<T> {
        // SAFETY: the caller names the symbol with its C signature as `T`.
        unsafe { self.lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| Error::BackendUnavailable(format!("{} has no {name}: {e}", self.name)))
    }

    /// The first of several names the library exports (e.g. `cuEventDestroy_v2`, then
    /// `cuEventDestroy`); the error is the last name's.
    ///
    /// # Safety
    /// `T` must be the C signature of every name.
    pub(crate) unsafe fn first_of<T: Copy>(&self, names: &[&str]) -> Result<T> {
        let mut last = None;
        for name in names {
            // SAFETY: the caller's promise covers every name.
            match unsafe { self.required(name) } {
                Ok(f) => return Ok(f),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one name"))
    }

    /// A single function that some versions of the runtime lack.
    ///
    /// # Safety
    /// `T` must be the C signature of `name`.
    pub(crate) unsafe fn optional<T: Copy>(&self, name: &str) -> Option<T> {
        // SAFETY: the caller's promise.
        unsafe { self.required(name) }.ok()
    }

    /// The library, to keep loaded while its functions are used.
    pub(crate) fn into_library(self) -> libloading::Library {
        self.lib
    }
}

/// A group of functions that only some versions of a runtime export (the ACL IPC event calls;
/// the VMM calls): loaded together, or absent with the reason, which every typed call of the
/// group then returns as `Unsupported`. A runtime without the group still loads.
pub(crate) struct Optional<T>(std::result::Result<T, Error>);

impl<T> Optional<T> {
    /// Fill the group with `fill` (which reads every symbol of it with [`Symbols::required`]);
    /// when one is missing, the group is absent and its calls fail with `missing: <why>`, e.g.
    /// "this ACL runtime has no IPC events: libascendcl.so has no aclrtIpcGetEventHandle".
    pub(crate) fn load(missing: &str, fill: impl FnOnce() -> Result<T>) -> Optional<T> {
        Optional(fill().map_err(|e| Error::Unsupported(format!("{missing}: {e}"))))
    }

    /// The group's functions, or why the runtime has none.
    pub(crate) fn get(&self) -> Result<&T> {
        self.0.as_ref().map_err(Clone::clone)
    }
}

/// A library loaded (and initialised) on first use: a vendor runtime with the contexts devshare
/// made in it (`backend::runtime::Runtime`), or UCX.
pub(crate) struct OnDemand<T> {
    /// The library, and the stamp of the process that loaded it (a forked child inherits the
    /// loaded library, not its initialisation).
    cell: OnceLock<(T, Stamp)>,
    load: fn() -> Result<T>,
}

impl<T> OnDemand<T> {
    /// A library that `load` loads (and initialises) on first use.
    pub(crate) const fn new(load: fn() -> Result<T>) -> OnDemand<T> {
        OnDemand { cell: OnceLock::new(), load }
    }

    /// Whether the runtime was loaded (and initialised) by a process this one was forked from:
    /// then this process must not call it.
    pub(crate) fn inherited(&self) -> bool {
        self.cell.get().is_some_and(|(_, stamp)| !stamp.is_current())
    }

    /// The loaded runtime. Only success is kept: a failed load is tried again next time (the
    /// library may have been installed or `DEVSHARE_*_LIBRARY` set meanwhile), and leaves nothing
    /// allocated. Two threads loading at once both succeed; one result is kept.
    pub(crate) fn get(&self) -> Result<&T> {
        if let Some((rt, _)) = self.cell.get() {
            return Ok(rt);
        }
        let loaded = (self.load)()?;
        Ok(&self.cell.get_or_init(|| (loaded, Stamp::now())).0)
    }
}

/// Text from a C string returned by a vendor runtime (empty for NULL).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that stays valid during this call.
pub(crate) unsafe fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's promise; the text is copied out before returning.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------------------------------------
// Errors

/// The one form of a vendor runtime error: `call` failed with `code`. The message is what the
/// code means (`meaning`: from the vendor's documentation, or its own error-name call), a `hint`
/// at the usual cause in parentheses, and what the runtime said most recently (`recent`); when
/// all three are empty, it points at the runtime's log.
pub(crate) fn vendor_error(call: &str, code: i32, meaning: &str, hint: &str, recent: &str, lib_name: &str) -> Error {
    let mut message = meaning.to_string();
    if !hint.is_empty() {
        if message.is_empty() {
            message.push_str(hint);
        } else {
            message = format!("{message} ({hint})");
        }
    }
    if !recent.is_empty() {
        if !message.is_empty() {
            message.push_str("; ");
        }
        message.push_str("runtime says: ");
        message.push_str(recent.trim());
    }
    if message.is_empty() {
        message = format!("see the {lib_name} log");
    }
    Error::Vendor { call: call.into(), code: code.into(), message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    fn message(e: Error) -> String {
        match e {
            Error::Vendor { message, .. } => message,
            e => panic!("not a vendor error: {e}"),
        }
    }

    #[test]
    fn vendor_errors_say_meaning_then_hint_then_what_the_runtime_said() {
        let e = vendor_error(
            "aclrtIpcMemImportByKey",
            207_006,
            "no permission",
            "",
            " not whitelisted\n",
            "libascendcl.so",
        );
        assert_eq!(e.status(), Status::Vendor);
        assert_eq!(e.vendor_code(), 207_006);
        assert_eq!(message(e), "no permission; runtime says: not whitelisted");
        let e = vendor_error(
            "cuIpcOpenMemHandle",
            201,
            "CUDA_ERROR_INVALID_CONTEXT: invalid context",
            "same process",
            "",
            "libcuda.so.1",
        );
        assert_eq!(message(e), "CUDA_ERROR_INVALID_CONTEXT: invalid context (same process)");
    }

    #[test]
    fn a_vendor_error_with_nothing_to_say_points_at_the_runtime_log() {
        let e = vendor_error("aclrtSetDevice", 1, "", "", "", "libascendcl.so");
        assert_eq!(message(e), "see the libascendcl.so log");
    }

    #[test]
    fn an_absent_optional_group_is_unsupported_and_says_why() {
        let group: Optional<u8> = Optional::load("this runtime has no VMM calls", || {
            Err(Error::BackendUnavailable("libx.so has no xMemMap".into()))
        });
        let e = group.get().unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        assert!(
            e.to_string().contains("this runtime has no VMM calls: backend unavailable: libx.so has no xMemMap"),
            "{e}"
        );
        assert_eq!(*Optional::load("unused", || Ok(7u8)).get().unwrap(), 7);
    }

    #[test]
    fn a_failed_load_is_not_kept() {
        static TRIES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        fn load() -> Result<u8> {
            if TRIES.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                Err(Error::BackendUnavailable("not yet".into()))
            } else {
                Ok(7)
            }
        }
        static RT: OnDemand<u8> = OnDemand::new(load);
        assert!(RT.get().is_err());
        assert!(RT.get().is_ok());
        assert!(RT.get().is_ok());
        assert_eq!(TRIES.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
