#!/usr/bin/env bash
# The C/C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer, in their own build tree:
#   - the library built by nightly Rust with AddressSanitizer
#     (RUSTFLAGS=-Zsanitizer=address cargo +nightly build --target <host triple>, dev profile),
#   - the C/C++ tests, examples and demos built by the C compiler with
#     -fsanitize=address,undefined -fno-sanitize-recover=all,
#   - run by CTest with ASAN_OPTIONS / UBSAN_OPTIONS halt_on_error=1: any report fails its test.
# (cmake -DDEVSHARE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug; see CMakeLists.txt.)
#
# Usage: bash scripts/sanitize.sh [build-dir]          (default build-asan)
#
# Needs the nightly toolchain (rustup toolchain install nightly). Without it this prints a
# SKIPPED line and exits 0, unless DEVSHARE_REQUIRE_SANITIZER=1 (then it fails).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build="${1:-build-asan}"

if ! nightly="$(cargo +nightly --version 2>&1)"; then
    echo "SKIPPED: sanitizer run (scripts/sanitize.sh): \`cargo +nightly\` does not work here" \
         "(install it with: rustup toolchain install nightly): ${nightly}"
    [[ "${DEVSHARE_REQUIRE_SANITIZER:-0}" == 1 ]] && exit 1
    exit 0
fi
echo "== sanitizer run with ${nightly} and $(${CC:-cc} --version | head -n1)"

export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

start=$SECONDS
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DDEVSHARE_SANITIZE=ON -DDEVSHARE_WERROR=ON
cmake --build "$build" -j2
ctest --test-dir "$build" --output-on-failure
echo "== sanitizer run passed in $((SECONDS - start)) s"
