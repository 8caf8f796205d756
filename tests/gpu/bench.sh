#!/usr/bin/env bash
# The share-once benchmarks on a real GPU, for both of PyTorch's CUDA allocators (see
# tests/gpu/README.md, "Benchmarks"):
#
#     bash tests/gpu/bench.sh [bundle-dir] [--scale N] [--reps N] [--budget SECONDS]
#
# For the plain caching allocator and for expandable segments: bench/kv_block.py --device cuda
# (one KV block, a view of a registered cache, round trip sleeping and with both ends spinning,
# against the Queue), then bench/state_dict.py --device cuda (the 7B-shaped state dict, by
# default at full size, 13.5 GB of bfloat16: first sync and steady state, devshare registered
# and not, against PyTorch's CUDA IPC as torch.multiprocessing.Queue does it, in the same run). Needs what tests/gpu/run.sh needs (the bundle's
# libdevshare.so, python3 with PyTorch built with CUDA); no Rust. Each command is bounded (180 s
# for a state dict, 90 s for a KV block, and none past --budget: a command that would get under
# 30 s is skipped); the whole script ends within 9 minutes, or its budget. Each state dict
# approach's figures are printed as it finishes; one that fails is a "failed" row, the others
# still run. Prints each benchmark's Markdown table; exits nonzero
# when one failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

bundle=build/gpu-bundle
if [[ $# -gt 0 && "$1" != -* ]]; then
    bundle=$1
    shift
fi
scale=1
reps=5
budget=540
while [[ $# -gt 0 ]]; do
    case "$1" in
        --scale) scale=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        *) echo "unknown option $1"; exit 2 ;;
    esac
done
[[ -e "$bundle/libdevshare.so" ]] || { echo "FAIL setup: $bundle/libdevshare.so is missing"; exit 1; }
bundle=$(cd "$bundle" && pwd)
PY=${PYTHON:-python3}
export DEVSHARE_LIBRARY="$bundle/libdevshare.so"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Registering a 13.5 GB state dict in expandable segments holds PyTorch's segment fds and
# devshare's copies of them (well over a thousand): the soft limit goes up to the hard one.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
echo "open files: soft limit $(ulimit -Sn), hard $(ulimit -Hn)"

failed=0
start=$SECONDS
# Each command's own limit, cut to what is left of the budget (less 5 s to kill it): a caller's
# time limit on this script would not reach a command under `timeout`, which runs in a process
# group of its own.
run() {
    local limit=$1
    shift
    local left=$((budget - (SECONDS - start) - 5))
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        echo "== skipped ($((left + 5)) s of the ${budget} s budget left): $*"
        return 0
    fi
    echo "== (at most ${limit} s) $*"
    timeout -k 5 "$limit" "$PY" -u "$@"
    local rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "FAIL ($rc): $*"
        failed=1
    fi
}
# The KV blocks first (about a minute for both allocators): a budget cut short then costs the
# last state dict, not everything after the first.
for alloc in plain expandable; do
    run 90 bench/kv_block.py --device cuda --alloc "$alloc" --count 2000
done
for alloc in plain expandable; do
    run 180 bench/state_dict.py --device cuda --alloc "$alloc" --scale "$scale" --reps "$reps"
done
exit $failed
