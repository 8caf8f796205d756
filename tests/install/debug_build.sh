#!/usr/bin/env bash
# CMAKE_BUILD_TYPE=Debug builds the library with cargo's dev profile (no --release) and the whole
# build follows it: the library and the test stand-ins come from <target>/debug, nothing is built
# in <target>/release, and C tests run against them.
#
#   tests/install/debug_build.sh <source dir> <scratch build dir>
#
# The scratch build directory is kept, so a later run only rebuilds what changed.
# Environment: CMAKE (cmake), CC, CXX.

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

compilers=()
[[ -n "${CC:-}" ]] && compilers+=(-DCMAKE_C_COMPILER="$CC")
[[ -n "${CXX:-}" ]] && compilers+=(-DCMAKE_CXX_COMPILER="$CXX")
echo "== configure $build (CMAKE_BUILD_TYPE=Debug)"
"$CMAKE" -S "$source_dir" -B "$build" -DCMAKE_BUILD_TYPE=Debug -DDEVSHARE_WERROR=ON "${compilers[@]}" >/dev/null
# A build left behind by another build type would hide what this one makes.
rm -rf "$build/cargo/release"
echo "== build test_api, test_acl, test_cuda"
"$CMAKE" --build "$build" -j2 --target test_api test_acl test_cuda

out="$build/cargo/debug"
for f in libdevshare.so libdevshare.a standin/acl/libascendcl.so standin/cuda/libcuda.so.1; do
    [[ -f "$out/$f" ]] || fail "no $out/$f"
done
[[ ! -e "$build/cargo/release" ]] || fail "the Debug build made $build/cargo/release"

echo "== C tests of the Debug build"
"$CTEST" --test-dir "$build" --output-on-failure -R '^(c_api|c_acl_standin|c_cuda_standin)$'
echo "PASS: Debug build"
