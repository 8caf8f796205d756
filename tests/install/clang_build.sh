#!/usr/bin/env bash
# The build with Clang (CC=clang, CXX=clang++; also the compiler cargo's build script uses for the
# test stand-ins), every C/C++ warning an error (-Wall -Wextra -Werror):
#   - CMAKE_BUILD_TYPE=Release: every target, `cmake --install` into a fresh prefix whose files
#     are checked, and the C and C++ API tests run;
#   - RelWithDebInfo and Debug: the library and test_raii (the C++ API with exceptions), an
#     install, and cpp_raii run.
# The three trees share one cargo target directory (Release and RelWithDebInfo both build cargo's
# release profile, so the second compiles no Rust). Clang is required: without it the test fails
# (scripts/setup.sh installs it).
# Usage: clang_build.sh SOURCE_DIR BUILD_DIR
# Environment: CMAKE (cmake), CTEST (ctest), CLANG (clang), CLANGXX (clang++).
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 <source dir> <scratch build dir>" >&2; exit 2; }
source_dir="$1"
build="$2"
CMAKE="${CMAKE:-cmake}"
CTEST="${CTEST:-$(dirname "$CMAKE")/ctest}"
[[ -x "$CTEST" ]] || CTEST=ctest

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

clang="$(command -v "${CLANG:-clang}")" || fail "no clang (scripts/setup.sh installs it)"
clangxx="$(command -v "${CLANGXX:-clang++}")" || fail "no clang++ (scripts/setup.sh installs it)"
export CC="$clang" CXX="$clangxx"
echo "== $("$clang" --version | head -1)"
cargo_dir="$build/cargo"

# configure TYPE: the tree $build/TYPE, with Clang and -Werror.
configure() {
    local tree="$build/$1"
    echo "== configure $tree (CMAKE_BUILD_TYPE=$1, Clang, DEVSHARE_WERROR=ON)"
    "$CMAKE" -S "$source_dir" -B "$tree" -DCMAKE_BUILD_TYPE="$1" -DDEVSHARE_WERROR=ON \
        -DCMAKE_C_COMPILER="$clang" -DCMAKE_CXX_COMPILER="$clangxx" \
        -DDEVSHARE_CARGO_TARGET_DIR="$cargo_dir" >/dev/null
    grep -q 'set(CMAKE_CXX_COMPILER_ID "Clang")' "$tree"/CMakeFiles/*/CMakeCXXCompiler.cmake ||
        fail "$tree is not configured with Clang"
}

# build TYPE [TARGET...]: build the tree (every target when none is named); show the errors.
build_tree() {
    local type="$1"
    shift
    local targets=()
    (($#)) && targets=(--target "$@")
    echo "== build $type: ${*:-every target}"
    "$CMAKE" --build "$build/$type" -j2 "${targets[@]}" >"$build/$type-build.log" 2>&1 || {
        grep -E "error|warning" "$build/$type-build.log" | head -40 >&2
        fail "the Clang $type build failed (log: $build/$type-build.log)"
    }
}

# install TYPE: into $build/prefix-TYPE, then check its files.
install_tree() {
    local prefix="$build/prefix-$1"
    rm -rf "$prefix"
    echo "== install $1 into $prefix"
    "$CMAKE" --install "$build/$1" --prefix "$prefix" >/dev/null
    for f in include/devshare.h include/devshare.hpp include/devshare/view.hpp lib/libdevshare.so \
            lib/libdevshare.a lib/cmake/devshare/devshareConfig.cmake lib/pkgconfig/devshare.pc; do
        if [[ ! -e "$prefix/$f" ]] && [[ ! -e "$prefix/${f/lib\//lib64/}" ]]; then
            fail "the $1 install lacks $f"
        fi
    done
}

configure Release
build_tree Release
install_tree Release
"$CTEST" --test-dir "$build/Release" --output-on-failure \
    -R '^(c_api|cpp_raii|cpp_raii_noexcept|cpp_raii_channel|cpp_raii_nodiscard)$'

for type in RelWithDebInfo Debug; do
    configure "$type"
    build_tree "$type" devshare_cargo test_raii
    install_tree "$type"
    "$CTEST" --test-dir "$build/$type" --output-on-failure -R '^cpp_raii$'
done
echo "ok: Clang builds Release (every target), RelWithDebInfo and Debug with -Werror, installs each, and the C++ tests pass"
