#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# nodiscard_check.sh CXX INCLUDE_DIR PROBE_FILE
#
# Compiles PROBE_FILE (tests/c/test_raii_nodiscard.cpp) with -fsyntax-only twice: with
# exceptions and -DPROBE_THROWING, and with -fno-exceptions. Each line marked "// probe" discards
# the result of one devshare.hpp function; the compiler must warn -Wunused-result ([[nodiscard]])
# on exactly those lines (the PROBE_THROWING block only in the first build), and on no other line.
set -u
cxx=$1 include=$2 probe=$3
name=$(basename "$probe")
failed=0

expected_lines() { # $1: 1 to keep the PROBE_THROWING block
    awk -v keep="$1" '
        /^#if defined\(PROBE_THROWING\)/ { inblock = 1; next }
        inblock && /^#endif/ { inblock = 0; next }
        /\/\/ probe/ && (!inblock || keep) { print NR }' "$probe"
}

run() { # $1: mode name, $2: keep throwing block, rest: flags
    local mode=$1 keep=$2
    shift 2
    local out
    out=$("$cxx" -std=c++17 -fsyntax-only -Wunused-result -I "$include" "$@" "$probe" 2>&1)
    if printf '%s\n' "$out" | grep -q "error:"; then
        printf '%s\n' "$out" | grep "error:" | head -20
        echo "FAIL - $mode: the probe file does not compile"
        failed=1
        return
    fi
    local warned expected
    warned=$(printf '%s\n' "$out" | grep -E "unused-result" | grep -oE "$name:[0-9]+" | cut -d: -f2 | LC_ALL=C sort -u)
    expected=$(expected_lines "$keep" | LC_ALL=C sort -u)
    local n_expected missing extra
    n_expected=$(printf '%s\n' "$expected" | grep -c .)
    missing=$(LC_ALL=C comm -23 <(printf '%s\n' "$expected") <(printf '%s\n' "$warned") | grep . || true)
    extra=$(LC_ALL=C comm -13 <(printf '%s\n' "$expected") <(printf '%s\n' "$warned") | grep . || true)
    if [ -z "$missing" ] && [ -z "$extra" ]; then
        echo "ok - $mode: all $n_expected discarded results warn ([[nodiscard]])"
    else
        for l in $missing; do
            echo "    no [[nodiscard]] warning for line $l: $(sed -n "${l}p" "$probe" | sed 's/^ *//')"
        done
        for l in $extra; do
            echo "    unexpected warning on line $l: $(sed -n "${l}p" "$probe" | sed 's/^ *//')"
        done
        echo "FAIL - $mode: [[nodiscard]] is missing or misplaced"
        failed=1
    fi
}

run "with exceptions (try_ and throwing forms)" 1 -DPROBE_THROWING
run "-fno-exceptions (try_ forms)" 0 -fno-exceptions
exit $failed
