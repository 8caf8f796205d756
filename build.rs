//! Runs cbindgen over the C surface (configured in cbindgen.toml) and writes the header to
//! `$OUT_DIR/devshare.h`. The checked-in `include/devshare.h` is refreshed from it when
//! `DEVSHARE_REGENERATE_HEADER=1` is set; `tests/header.rs` fails when the two differ.
//!
//! It also compiles the test-only runtime stand-ins (`tests/standin/`: a `libascendcl.so` and a
//! `libcuda.so.1` over host shared memory) with the `cc` crate's compiler into
//! `<target>/<profile>/standin/{acl,cuda}/`. They are never linked into devshare; the tests point
//! `DEVSHARE_ACL_LIBRARY` / `DEVSHARE_CUDA_LIBRARY` at them.

use std::path::{Path, PathBuf};

/// Compile one stand-in into a shared library at `out`.
fn standin(dir: &Path, src: &str, out: &Path) {
    let src = dir.join(src);
    println!("cargo:rerun-if-changed={}", src.display());
    std::fs::create_dir_all(out.parent().expect("a parent")).expect("create the stand-in directory");
    let soname = out.file_name().expect("a file name").to_string_lossy().into_owned();
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .opt_level(2)
        .debug(true)
        .pic(true)
        .warnings(true)
        .extra_warnings(true)
        .flag("-std=c11")
        .define("_GNU_SOURCE", None)
        .get_compiler();
    let status = compiler
        .to_command()
        .args(["-shared", "-pthread", &format!("-Wl,-soname,{soname}"), "-o"])
        .arg(out)
        .arg(&src)
        .arg("-lrt")
        .status()
        .expect("run the C compiler for a test stand-in");
    assert!(status.success(), "compiling {} failed", src.display());
}

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
    // Stand-ins next to the library in <target>/<profile>/ (OUT_DIR is <target>/<profile>/build/<pkg>/out).
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo"));
    let profile_dir = out_dir.ancestors().nth(3).expect("OUT_DIR is inside the target directory").join("standin");
    let standins = dir.join("tests/standin");
    if standins.join("acl/acl_standin.c").exists() {
        standin(&standins, "acl/acl_standin.c", &profile_dir.join("acl/libascendcl.so"));
    }
    if standins.join("cuda/cuda_standin.c").exists() {
        standin(&standins, "cuda/cuda_standin.c", &profile_dir.join("cuda/libcuda.so.1"));
    }
    println!("cargo:rustc-env=DEVSHARE_STANDIN_DIR={}", profile_dir.display());
    if std::env::var_os("DEVSHARE_REGENERATE_HEADER").is_some() {
        std::fs::copy(&out, dir.join("include/devshare.h")).expect("write include/devshare.h");
    }
}
