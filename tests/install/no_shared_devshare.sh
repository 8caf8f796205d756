#!/usr/bin/env bash
# tests/install/no_shared_devshare.sh <program>: the program was linked against libdevshare.a
# (no libdevshare.so needed, none loaded according to ldd), and it runs.
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 <program>" >&2; exit 2; }
exe="$1"
unset LD_LIBRARY_PATH LD_PRELOAD
fail() {
    echo "FAIL: $*" >&2
    exit 1
}
echo "== ldd $exe"
ldd "$exe"
if readelf -d "$exe" | grep -q 'NEEDED.*\[libdevshare'; then
    fail "$exe needs libdevshare.so: $(readelf -d "$exe" | grep 'NEEDED.*libdevshare')"
fi
if ldd "$exe" | grep -q libdevshare; then
    fail "ldd $exe lists libdevshare"
fi
"$exe" || fail "$exe failed"
echo "PASS: $exe is linked statically against devshare"
