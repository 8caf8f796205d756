#!/usr/bin/env bash
# What a packager builds: CMAKE_BUILD_TYPE=Release (cargo's release profile, -O2 C/C++), every
# target with -Werror (GCC's optimiser reports warnings the unoptimised build never sees), then
# `cmake --install` into a fresh prefix, whose files are checked; and the same project configured
# with -DBUILD_TESTING=OFF (sharing the first tree's cargo build), which builds the library and
# no test, example or benchmark.
# Usage: release_build.sh SOURCE_DIR BUILD_DIR
# Environment: CMAKE (cmake), CC, CXX.
set -euo pipefail
source_dir="$1"
build="$2"
CMAKE="${CMAKE:-cmake}"

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

compilers=()
[[ -n "${CC:-}" ]] && compilers+=(-DCMAKE_C_COMPILER="$CC")
[[ -n "${CXX:-}" ]] && compilers+=(-DCMAKE_CXX_COMPILER="$CXX")
rm -rf "$build/prefix" "$build/lib-only"
echo "== configure $build/full (CMAKE_BUILD_TYPE=Release, DEVSHARE_WERROR=ON)"
"$CMAKE" -S "$source_dir" -B "$build/full" -DCMAKE_BUILD_TYPE=Release -DDEVSHARE_WERROR=ON \
    "${compilers[@]}" >/dev/null
echo "== build every target"
"$CMAKE" --build "$build/full" -j2 >"$build/full-build.log" 2>&1 || {
    grep -E "error|Error" "$build/full-build.log" | head -40 >&2
    fail "the Release build failed (log: $build/full-build.log)"
}
echo "== install into $build/prefix"
"$CMAKE" --install "$build/full" --prefix "$build/prefix" >/dev/null
for f in include/devshare.h include/devshare.hpp include/devshare/channel.hpp lib/libdevshare.so \
        lib/libdevshare.a lib/cmake/devshare/devshareConfig.cmake lib/pkgconfig/devshare.pc; do
    if [[ ! -e "$build/prefix/$f" ]] && [[ ! -e "$build/prefix/${f/lib\//lib64/}" ]]; then
        fail "the install lacks $f"
    fi
done

echo "== configure $build/lib-only (BUILD_TESTING=OFF), cargo's build shared"
"$CMAKE" -S "$source_dir" -B "$build/lib-only" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
    -DDEVSHARE_CARGO_TARGET_DIR="$build/full/cargo" "${compilers[@]}" >/dev/null
targets="$("$CMAKE" --build "$build/lib-only" --target help)"
for t in test_api test_raii channel_handoff producer demo; do
    if grep -qw -- "$t" <<<"$targets"; then
        fail "BUILD_TESTING=OFF still defines the target $t"
    fi
done
"$CMAKE" --build "$build/lib-only" -j2 >/dev/null
echo "ok: Release builds every target with -Werror and installs; BUILD_TESTING=OFF builds the library only"
