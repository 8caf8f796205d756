#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# headers_check.sh CXX INCLUDE_DIR
#
# The C++ headers one by one: each of include/devshare/*.hpp and devshare.hpp compiles as the
# only include of a translation unit (-Wall -Wextra -Wpedantic -Werror) in C++17 with and
# without exceptions, and in C++23 where the compiler has it (Result is then std::expected). A
# 1.2 spelling still compiles and its warning names the replacement (devshare/compat.hpp). Then
# prints, without asserting anything, how long one translation unit including each header takes.
set -u
cxx=$1 include=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/devshare-headers.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0
modes=("-std=c++17" "-std=c++17 -fno-exceptions")
if echo '#include <expected>' | "$cxx" -std=c++23 -x c++ -fsyntax-only - 2>/dev/null; then
    modes+=("-std=c++23" "-std=c++23 -fno-exceptions")
else
    echo "# SKIP C++23: $cxx has no -std=c++23 with <expected>"
fi
headers=("$include"/devshare/*.hpp "$include/devshare.hpp")
for h in "${headers[@]}"; do
    name=${h#"$include"/}
    [[ $name == devshare/compat.hpp ]] && continue  # included by exporter.hpp, channel.hpp, pool.hpp
    printf '#include "%s"\n#include "%s"\nint main() { return 0; }\n' "$name" "$name" >"$work/tu.cpp"
    for mode in "${modes[@]}"; do
        # shellcheck disable=SC2086
        if out=$("$cxx" $mode -Wall -Wextra -Wpedantic -Werror -I "$include" -fsyntax-only "$work/tu.cpp" 2>&1); then
            echo "ok - $name compiles on its own ($mode), included twice"
        else
            printf '%s\n' "$out" | head -20
            echo "FAIL - $name does not compile on its own ($mode)"
            failed=1
        fi
    done
done

cat >"$work/old.cpp" <<'CPP'
#include "devshare.hpp"
float f(devshare::Exporter& e, float* p) { return e.share(p, {4}).numel() == 4 ? 1.0f : 0.0f; }
CPP
out=$("$cxx" -std=c++17 -Wall -I "$include" -fsyntax-only "$work/old.cpp" 2>&1)
if [[ $? -eq 0 ]] && grep -q "deprecated: devshare 1.3: use share(devshare::describe" <<<"$out"; then
    echo "ok - a 1.2 spelling (Exporter::share(first, shape)) compiles, deprecated with its replacement named"
else
    printf '%s\n' "$out" | head -20
    echo "FAIL - the 1.2 spelling Exporter::share(first, shape) does not compile with a deprecation naming describe"
    failed=1
fi

echo "# compile time of one translation unit including the header (-std=c++17 -fsyntax-only, best of 3):"
for h in "${headers[@]}"; do
    name=${h#"$include"/}
    printf '#include "%s"\n' "$name" >"$work/tu.cpp"
    best=
    for _ in 1 2 3; do
        t0=$(date +%s%N)
        "$cxx" -std=c++17 -I "$include" -fsyntax-only "$work/tu.cpp" >/dev/null 2>&1
        t=$(( ($(date +%s%N) - t0) / 1000000 ))
        [[ -z $best || $t -lt $best ]] && best=$t
    done
    printf '#   %-24s %5d ms\n' "$name" "$best"
done
exit $failed
