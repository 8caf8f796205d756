#!/usr/bin/env bash
# Install the system tools devshare's build and tests need, when they are missing (Debian/Ubuntu,
# apt-get): cmake, a C/C++ compiler (GCC, and Clang for the build_clang test), pkg-config,
# python3-venv for the test environment, and UCX (libucx0, and libucx-dev, whose headers the
# layout check compiles against) for the remote channel tests.
# Rust (cargo) must already be there. Safe to run again.
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
# tests/install/clang_build.sh builds with Clang too, and fails without it.
{ command -v clang && command -v clang++; } >/dev/null 2>&1 || missing+=(clang)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
# UCX for the remote channel tests (tests/remote_ucx.rs skip without it): libucp.so.0 must load by
# the loader's default search, i.e. be in the ld.so cache.
ld_cache="$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)"
[[ "${ld_cache}" == *$'\tlibucp.so.0 '* ]] || missing+=(libucx0)
[[ -f /usr/include/ucp/api/ucp.h ]] || missing+=(libucx-dev)
# Debian's python3 can only make a virtual environment (with pip) once python3-venv is there.
if [[ "${1:-}" == "--python" ]] && [[ ! -x .venv/bin/python ]] \
    && ! python3 -m ensurepip --version >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
if ((${#missing[@]})); then
    echo "== installing ${missing[*]}"
    sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        sudo=(sudo)
    fi
    "${sudo[@]}" apt-get update
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
command -v cargo >/dev/null 2>&1 || { echo "cargo (Rust) is required: https://rustup.rs" >&2; exit 1; }
