#!/usr/bin/env bash
# Everything a short loan of a GPU machine should run, in one command within one time budget
# (see tests/gpu/README.md, "One command for a short loan"):
#
#     bash tests/gpu/session.sh [bundle-dir] [--budget SECONDS] [--out DIR]
#
# In order, each only when the time left allows it:
#   1. tests/gpu/run.sh, the real-GPU suite (up to 470 s; about 100 s on an H100);
#   2. sync_cost from the bundle (tests/gpu/sync_cost.c: an interprocess event against a flag word
#      written and waited on by the streams, each checked against a busy producer stream), when
#      the suite's preflight passed and at least 150 s are left (at most 45 s);
#   3. tests/gpu/bench.sh, the share-once benchmarks for both allocators, when the suite's
#      preflight passed (the state dict at full size when at least 300 s are left, else at
#      --scale 2; skipped under 150 s), with all but 100 s of what is left;
#   4. bench/user_pays.py, the per-item handoff on this machine's CPUs (--quick under 190 s left,
#      skipped under 70 s).
# Each part's output goes to the terminal and to DIR/<part>.txt (DIR: --out, default $OUT when
# set, else build/gpu-session); DIR/summary.txt says what ran, how long, and its exit status.
# --budget (default 560) is the wall time the whole command may take; it stops a part that
# would run past it. Exits nonzero when a part that ran failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

bundle=build/gpu-bundle
if [[ $# -gt 0 && "$1" != -* ]]; then
    bundle=$1
    shift
fi
budget=560
out=${OUT:-build/gpu-session}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --budget) budget=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "unknown option $1"; exit 2 ;;
    esac
done
mkdir -p "$out"
: > "$out/summary.txt"
start=$SECONDS
failed=0

left() { echo $((budget - (SECONDS - start))); }

# What ran where: the machine, the checkout and the bundle (scripts/gpu_bundle.sh writes
# BUILD_INFO: the commit it was built from), so that a failure can be placed.
{
    echo "== environment"
    echo "   date: $(date -u +%Y-%m-%dT%H:%M:%SZ); kernel $(uname -r); $(nproc) CPUs; open files hard limit $(ulimit -Hn)"
    echo "   glibc: $(ldd --version 2>/dev/null | head -n1)"
    echo "   GPUs: $(nvidia-smi -L 2>/dev/null | tr '\n' ';' || echo 'nvidia-smi not found')"
    echo "   checkout: $(git -C "$root" describe --always --dirty 2>/dev/null || echo 'not a git checkout')"
    echo "   bundle: $(cat "$bundle/BUILD_INFO" 2>/dev/null || echo 'no BUILD_INFO')"
} 2>&1 | tee -a "$out/summary.txt"

# part NAME LIMIT COMMAND...: run it for at most LIMIT seconds (and never past the budget).
part() {
    local name=$1 limit=$2
    shift 2
    local rest
    rest=$(left)
    ((limit > rest)) && limit=$rest
    if ((limit <= 0)); then
        skip "$name" "no time left"
        return 0
    fi
    local t0=$SECONDS
    echo "== $name (at most ${limit} s): $*" | tee -a "$out/summary.txt"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "   $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
    ((rc != 0)) && failed=1
    return 0
}
skip() {
    echo "== $1 skipped: $2" | tee -a "$out/summary.txt"
}

# The suite's and the benchmarks' own limits are told to them: this script's `timeout` would not
# reach their commands, each under a `timeout` of its own (a process group of its own).
suite_limit=$(($(left) < 480 ? $(left) : 480))
part suite "$suite_limit" env DEVSHARE_GPU_LIMIT_S=$((suite_limit - 10)) bash tests/gpu/run.sh "$bundle"
if ! grep -q "^PASS preflight" "$out/suite.txt"; then
    skip benchmarks "no usable GPU (the suite's preflight did not pass)"
else
    if (($(left) >= 150)); then
        part sync_cost 45 "$bundle/sync_cost"
    else
        skip sync_cost "$(left) s left"
    fi
    if (($(left) >= 300)); then
        limit=$(($(left) - 100))
        part bench "$limit" bash tests/gpu/bench.sh "$bundle" --budget $((limit - 10))
    elif (($(left) >= 150)); then
        limit=$(($(left) - 70))
        part bench "$limit" bash tests/gpu/bench.sh "$bundle" --scale 2 --reps 3 --budget $((limit - 10))
    else
        skip bench "$(left) s left"
    fi
fi
user_pays=(env DEVSHARE_LIBRARY="$(cd "$bundle" && pwd)/libdevshare.so" PYTHONPATH="$root/python" "${PYTHON:-python3}" -u bench/user_pays.py)
if (($(left) >= 190)); then
    part user_pays 180 "${user_pays[@]}"
elif (($(left) >= 70)); then
    part user_pays 60 "${user_pays[@]}" --quick
else
    skip user_pays "$(left) s left"
fi
echo "== session: $((SECONDS - start)) s of the ${budget} s budget; outputs in $out" | tee -a "$out/summary.txt"
exit $failed
