//! The checked-in C header is exactly what cbindgen generates from the sources now.

#[test]
fn checked_in_header_equals_cbindgen_output() {
    let generated =
        std::fs::read_to_string(env!("DEVSHARE_GENERATED_HEADER")).expect("build.rs writes the generated header");
    let checked_in = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/devshare.h"))
        .expect("include/devshare.h exists");
    assert!(
        generated == checked_in,
        "include/devshare.h is stale: regenerate it with `DEVSHARE_REGENERATE_HEADER=1 cargo build` \
         and commit it"
    );
}

#[test]
fn header_version_macros_match_the_crate_version() {
    use devshare::capi::error::*;
    assert_eq!(DEVSHARE_VERSION_MAJOR.to_string(), env!("CARGO_PKG_VERSION_MAJOR"));
    assert_eq!(DEVSHARE_VERSION_MINOR.to_string(), env!("CARGO_PKG_VERSION_MINOR"));
    assert_eq!(DEVSHARE_VERSION_PATCH.to_string(), env!("CARGO_PKG_VERSION_PATCH"));
    assert_eq!(
        DEVSHARE_VERSION,
        (DEVSHARE_VERSION_MAJOR << 16) | (DEVSHARE_VERSION_MINOR << 8) | DEVSHARE_VERSION_PATCH
    );
    assert_eq!(devshare_version(), DEVSHARE_VERSION);
}
