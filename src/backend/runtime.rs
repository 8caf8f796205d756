//! Finding vendor runtime libraries at run time with `libloading`, so that one binary runs on
//! machines with and without them, and the helpers the vendor backends share.

use crate::error::{Error, Result};

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

/// A function from a loaded library, copied out (the caller keeps the library alive).
pub(crate) fn sym<T: Copy>(lib: &libloading::Library, lib_name: &str, name: &str) -> Result<T> {
    // SAFETY: the caller names the symbol with its C signature as `T`.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| Error::BackendUnavailable(format!("{lib_name} has no {name}: {e}")))
}

/// The first of several names that the library exports (e.g. `cuMemAlloc_v2`, then `cuMemAlloc`).
pub(crate) fn sym_any<T: Copy>(lib: &libloading::Library, lib_name: &str, names: &[&str]) -> Result<T> {
    let mut last = None;
    for name in names {
        match sym(lib, lib_name, name) {
            Ok(f) => return Ok(f),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one name"))
}

/// Text from a C string returned by a vendor runtime (empty for NULL).
pub(crate) fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: vendor runtimes return NUL-terminated strings that outlive this call.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Drop the cache entries whose export is gone (and the table itself when empty, so an idle
/// library holds no memory).
pub(crate) fn forget_dead<K, V>(cache: &std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<K, std::sync::Weak<V>>>>) {
    if let Some(cache) = cache.get() {
        let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
        c.retain(|_, w| w.strong_count() > 0);
        if c.is_empty() {
            *c = std::collections::HashMap::new();
        }
    }
}
