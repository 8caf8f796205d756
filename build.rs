//! Runs cbindgen over the C surface (configured in cbindgen.toml) and writes the header to
//! `$OUT_DIR/devshare.h`. The checked-in `include/devshare.h` is refreshed from it when
//! `DEVSHARE_REGENERATE_HEADER=1` is set; `tests/header.rs` fails when the two differ.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo")).join("devshare.h");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=DEVSHARE_REGENERATE_HEADER");
    // The shared library's soname carries the ABI (major) version.
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("set by cargo");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libdevshare.so.{major}");
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    cbindgen::generate_with_config(&dir, config)
        .expect("cbindgen could not parse the crate")
        .write_to_file(&out);
    println!("cargo:rustc-env=DEVSHARE_GENERATED_HEADER={}", out.display());
    if std::env::var_os("DEVSHARE_REGENERATE_HEADER").is_some() {
        std::fs::copy(&out, dir.join("include/devshare.h")).expect("write include/devshare.h");
    }
}
