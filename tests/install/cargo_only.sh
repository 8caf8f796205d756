#!/usr/bin/env bash
# The README's build without CMake: cargo alone, then a C program against the cargo output.
#
#   tests/install/cargo_only.sh <cargo target dir> <release|debug>
#
# Runs `cargo build [--release]` with CARGO_TARGET_DIR=<cargo target dir> (CTest passes the build
# tree's, where it has nothing to do after `cmake --build`), then exactly what the README says:
#     cc app.c -I include -L target/release -ldevshare -Wl,-rpath,"$PWD/target/release"
# and runs the program: it must find libdevshare.so.MAJOR (the soname, a link build.rs makes) in
# that directory and print the right version.
# Environment: CC (cc), CARGO (cargo), DEVSHARE_SOURCE_DIR (the checkout).

set -euo pipefail

[[ $# -eq 2 ]] || { echo "usage: $0 <cargo target dir> <release|debug>" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source_dir="${DEVSHARE_SOURCE_DIR:-$(cd "$here/../.." && pwd)}"
target_dir="$1"
profile="$2"
CC="${CC:-cc}"
CARGO="${CARGO:-cargo}"

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
unset LD_LIBRARY_PATH LD_PRELOAD

case "$profile" in
release) profile_args=(--release) ;;
debug) profile_args=() ;;
*) fail "profile must be release or debug, not $profile" ;;
esac

cd "$source_dir"
echo "== CARGO_TARGET_DIR=$target_dir cargo build ${profile_args[*]}"
CARGO_TARGET_DIR="$target_dir" "$CARGO" build "${profile_args[@]}"
out="$(cd "$target_dir/$profile" && pwd)"

version="$(sed -n 's/^version[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' Cargo.toml | head -n1)"
major="${version%%.*}"
[[ -f "$out/libdevshare.so" ]] || fail "cargo made no $out/libdevshare.so"
[[ "$(readlink "$out/libdevshare.so.$major")" == libdevshare.so ]] ||
    fail "$out/libdevshare.so.$major is not a link to libdevshare.so"

work="$(mktemp -d "${TMPDIR:-/tmp}/devshare-cargo-only.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "== $CC app.c -I include -L $out -ldevshare -Wl,-rpath,$out"
( set -x; "$CC" -std=c11 -Wall -Wextra -Werror "$here/pkgconfig_main.c" -I include -o "$work/app" \
    -L "$out" -ldevshare -Wl,-rpath,"$out" )

readelf -d "$work/app" | grep -q "NEEDED.*\[libdevshare.so.$major\]" ||
    fail "the program does not need libdevshare.so.$major"
resolved="$(ldd "$work/app" | awk '$1 ~ /^libdevshare/ {print $3}')"
echo "libdevshare resolves to $resolved"
[[ -n "$resolved" && "$(readlink -f "$resolved")" == "$out/libdevshare.so" ]] ||
    fail "libdevshare resolves to '$resolved', not to $out/libdevshare.so"
"$work/app" || fail "the program failed"
echo "PASS: cargo-only build"
