//! Finding vendor runtime libraries at run time with `libloading`, so that one binary runs on
//! machines with and without them.

use crate::error::{Error, Result};

/// Load the first library that opens: the path in `env_var` if set, else each candidate name
/// through the default loader path. Returns the library and the name that loaded.
pub fn load(env_var: &str, candidates: &[&str]) -> Result<(libloading::Library, String)> {
    let mut tried = Vec::new();
    let mut names: Vec<String> = Vec::new();
    if let Ok(path) = std::env::var(env_var) {
        if !path.is_empty() {
            names.push(path);
        }
    }
    names.extend(candidates.iter().map(|s| s.to_string()));
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

/// Like [`load`] but only reports the name that loaded.
pub fn find(env_var: &str, candidates: &[&str]) -> Result<String> {
    load(env_var, candidates).map(|(_, name)| name)
}
