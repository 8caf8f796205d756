#!/usr/bin/env bash
# devshare's real-GPU test suite, in one command (see tests/gpu/README.md):
#
#     bash tests/gpu/run.sh [bundle-dir] [gpu_cases.py options]
#
# bundle-dir (default build/gpu-bundle) is what scripts/gpu_bundle.sh made: libdevshare.so,
# libdevshare.so.1 (its soname) and gpu_tool. Needs python3 with PyTorch built with CUDA (PYTHON=... picks
# another interpreter) and an NVIDIA GPU; no Rust. Options after the bundle go to gpu_cases.py:
# --only NAME,... (case names, or leading words of names: `--only measure` runs both measurements),
# --list, --dry-run (no GPU, no torch needed).
#
# Prints PASS <case> / FAIL <case>: why / SKIP <case>: why per case, then a Markdown table of the
# cases (one row each: verdict, seconds, detail), an "ENV: GPU ...; driver ...; torch ..." line and
# a final "SUMMARY: N passed, M failed, K skipped"; exits nonzero on any FAIL.
#
# Time bounds: each case runs in its own process with its own timeout (60 to 150 s); no case starts
# after 440 s (gpu_cases.py RUN_BUDGET_S) and a case never runs past that budget; this script stops
# everything at 470 s (10 s more to kill), so a run ends within 8 minutes whatever hangs.
# DEVSHARE_GPU_LIMIT_S=N sets that stop to N s instead (the cases' budget to N - 30 s, or N / 2
# under a minute): a caller's
# own time limit would not reach the suite under `timeout`, which runs in a process group of its
# own.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

bundle=build/gpu-bundle
if [[ $# -gt 0 && "$1" != -* ]]; then
    bundle=$1
    shift
fi

fail_setup() {
    echo "FAIL setup: $*"
    echo "SUMMARY: 0 passed, 1 failed, 0 skipped"
    exit 1
}

[[ -d "$bundle" ]] || fail_setup "bundle directory '$bundle' not found: run 'bash scripts/gpu_bundle.sh' on a machine with Rust and copy build/gpu-bundle here"
bundle=$(cd "$bundle" && pwd)
for f in libdevshare.so gpu_tool; do
    [[ -e "$bundle/$f" ]] || fail_setup "$bundle/$f is missing: rebuild the bundle with 'bash scripts/gpu_bundle.sh'"
done

PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || fail_setup "python interpreter '$PY' not found (set PYTHON=/path/to/python with torch+CUDA)"

export DEVSHARE_LIBRARY="$bundle/libdevshare.so"
export DEVSHARE_GPU_BUNDLE="$bundle"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

limit=${DEVSHARE_GPU_LIMIT_S:-470}
[[ "$limit" =~ ^[0-9]+$ ]] && ((limit >= 10)) || fail_setup "DEVSHARE_GPU_LIMIT_S=$limit: a whole number of seconds, 10 or more"
# No case starts past this, 30 s before the stop (half of a stop under a minute).
export DEVSHARE_GPU_RUN_BUDGET_S=$((limit >= 60 ? limit - 30 : limit / 2))
if command -v timeout >/dev/null 2>&1; then
    timeout -k 10 "$limit" "$PY" -u tests/gpu/gpu_cases.py --bundle "$bundle" "$@"
    rc=$?
else
    "$PY" -u tests/gpu/gpu_cases.py --bundle "$bundle" "$@"
    rc=$?
fi
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "FAIL run: the suite exceeded its ${limit} s limit and was stopped"
    echo "SUMMARY: 0 passed, 1 failed, 0 skipped (incomplete: see the lines above)"
    exit 1
fi
exit $rc
