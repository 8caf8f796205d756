#!/usr/bin/env bash
# Build devshare here (cargo build --release) and assemble build/gpu-bundle/ for the real-GPU test
# suite (tests/gpu): libdevshare.so, its soname libdevshare.so.1 (a copy, not a link, so that the
# bundle survives any copy), the C helper gpu_tool and bench/user_pays.py's C end channel_handoff
# (both built against include/devshare.h, linked to the bundle's libdevshare.so with rpath
# $ORIGIN), and BUILD_INFO (what it was built from). Nothing else goes in. The GPU machine needs
# no Rust: copy the bundle (and the checkout, for tests/gpu and python/) and run
#     bash tests/gpu/run.sh build/gpu-bundle
# The bundle also holds sync_cost (tests/gpu/sync_cost.c), which measures an interprocess event
# against a stream-written flag word on the GPU; it needs only the driver, loaded at run time.
# Usage: bash scripts/gpu_bundle.sh [out-dir]     (default build/gpu-bundle)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
out=${1:-build/gpu-bundle}
CC=${CC:-gcc}

command -v cargo >/dev/null 2>&1 || { echo "gpu_bundle: cargo (Rust) is required to build the library" >&2; exit 1; }
command -v "$CC" >/dev/null 2>&1 || { echo "gpu_bundle: C compiler '$CC' not found" >&2; exit 1; }

echo "== cargo build --release"
cargo build --release

target_dir=${CARGO_TARGET_DIR:-$root/target}
lib="$target_dir/release/libdevshare.so"
[[ -f "$lib" ]] || { echo "gpu_bundle: $lib was not built" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out"
cp -L "$lib" "$out/libdevshare.so"
soname=$(readelf -d "$out/libdevshare.so" 2>/dev/null | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
[[ -n "$soname" ]] || { echo "gpu_bundle: $lib has no soname" >&2; exit 1; }
if [[ "$soname" != libdevshare.so ]]; then
    cp "$out/libdevshare.so" "$out/$soname"
fi

echo "== $CC tests/gpu/gpu_tool.c"
"$CC" -std=c11 -O2 -g -Wall -Wextra -Werror -Iinclude -o "$out/gpu_tool" tests/gpu/gpu_tool.c \
    -L"$out" -ldevshare -ldl -Wl,-rpath,'$ORIGIN'

# The bundle must be usable on its own: gpu_tool finds libdevshare through $ORIGIN.
"$out/gpu_tool" layout >/dev/null

# The C end of bench/user_pays.py (the per-item handoff against a pipe and the Queue), so that
# it runs from the bundle as is: DEVSHARE_LIBRARY=<bundle>/libdevshare.so python3 bench/user_pays.py
echo "== $CC bench/channel_handoff.c"
"$CC" -std=c11 -O2 -g -Wall -Wextra -Werror -pthread -Iinclude -o "$out/channel_handoff" bench/channel_handoff.c \
    -L"$out" -ldevshare -Wl,-rpath,'$ORIGIN'

echo "== $CC tests/gpu/sync_cost.c"
"$CC" -std=c11 -O2 -g -Wall -Wextra -Werror -o "$out/sync_cost" tests/gpu/sync_cost.c -ldl

# What it was built from, for tests/gpu/session.sh's summary.
echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git describe --always --dirty 2>/dev/null || echo 'no git'), $(rustc --version 2>/dev/null)" \
    > "$out/BUILD_INFO"

glibc=$( { objdump -T "$out/libdevshare.so" "$out/gpu_tool" "$out/channel_handoff" "$out/sync_cost" 2>/dev/null || true; } \
    | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n1)
echo "== $out:"
ls -l "$out"
echo "   newest glibc symbol version needed: ${glibc:-unknown} (the GPU machine's glibc must be at least that)"
echo "   next: copy $out and the checkout to the GPU machine, then: bash tests/gpu/run.sh $out"
