#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# header_compile.sh [REV] [RUNS]: what including the C++ API costs one translation unit, the
# devshare.hpp of git revision REV (default b4dfa1c, the last single-file header, 1.2) against
# this checkout's devshare.hpp and its per-concept headers, in the same run, alternating, best
# of RUNS (default 7), compiler CPU time (user + system). Two measures per header: -fsyntax-only of a TU that only includes it, and
# -O2 -c of c_examples/consumer.cpp (a real consumer) against it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev=${1:-b4dfa1c} runs=${2:-7} cxx=${CXX:-g++}
work=$(mktemp -d "${TMPDIR:-/tmp}/devshare-hdr.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old"
cp include/devshare.h "$work/old/"
git show "$rev:include/devshare.hpp" >"$work/old/devshare.hpp"
git show "$rev:c_examples/consumer.cpp" >"$work/old_consumer.cpp"

# CPU time (user + system) of the compiler, in ms: steadier than wall time on a shared machine.
ms() {
    /usr/bin/time -f '%U %S' -o "$work/t" "$@" >/dev/null 2>&1
    awk '{ printf "%d\n", ($1 + $2) * 1000 }' "$work/t"
}
declare -A best
measure() { # name, command...
    local name=$1 t
    shift
    t=$(ms "$@")
    [[ -z ${best[$name]:-} || $t -lt ${best[$name]} ]] && best[$name]=$t
    return 0
}
echo '#include "devshare.hpp"' >"$work/umbrella.cpp"
echo '#include "devshare/import.hpp"' >"$work/import.cpp"
echo '#include "devshare/channel.hpp"' >"$work/channel.cpp"
for _ in $(seq "$runs"); do
    measure "old devshare.hpp, syntax only" "$cxx" -std=c++17 -fsyntax-only -I "$work/old" "$work/umbrella.cpp"
    measure "new devshare.hpp, syntax only" "$cxx" -std=c++17 -fsyntax-only -I include "$work/umbrella.cpp"
    measure "new devshare/import.hpp alone" "$cxx" -std=c++17 -fsyntax-only -I include "$work/import.cpp"
    measure "new devshare/channel.hpp alone" "$cxx" -std=c++17 -fsyntax-only -I include "$work/channel.cpp"
    measure "consumer.cpp -O2 -c, old header" "$cxx" -std=c++17 -O2 -c -I "$work/old" "$work/old_consumer.cpp" -o "$work/a.o"
    measure "consumer.cpp -O2 -c, new header" "$cxx" -std=c++17 -O2 -c -I include c_examples/consumer.cpp -o "$work/b.o"
done
echo "$cxx $("$cxx" -dumpfullversion), best of $runs, old = $rev"
for k in "old devshare.hpp, syntax only" "new devshare.hpp, syntax only" "new devshare/import.hpp alone" \
         "new devshare/channel.hpp alone" "consumer.cpp -O2 -c, old header" "consumer.cpp -O2 -c, new header"; do
    printf '  %-34s %5d ms\n' "$k" "${best[$k]}"
done
