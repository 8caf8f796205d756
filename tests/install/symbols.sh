#!/usr/bin/env bash
# Check libdevshare.so's exported symbols against the rules in cmake/devshare.map:
#
#   tests/install/symbols.sh <libdevshare.so> <devshare.h> <version MAJOR.MINOR.PATCH>
#
# - the soname is libdevshare.so.MAJOR;
# - every defined dynamic symbol is a devshare_* symbol (nothing of Rust's runtime or of the
#   dependencies: rust_*, _ZN*, ...), except the version nodes' own names (GNU ld's ABS symbols);
# - every one carries a default version DEVSHARE_MAJOR.n with n <= MINOR (DEVSHARE_1.0 in 1.0);
# - every function the header declares is exported, and every exported function is declared.
#
# Tools: readelf (binutils).

set -euo pipefail

[[ $# -eq 3 ]] || { echo "usage: $0 <libdevshare.so> <devshare.h> <version>" >&2; exit 2; }
lib="$1"
header="$2"
version="$3"
major="${version%%.*}"
rest="${version#*.}"
minor="${rest%%.*}"

failures=0
fail() {
    echo "FAIL: $*" >&2
    failures=$((failures + 1))
}

[[ -f "$lib" ]] || { echo "FAIL: no $lib" >&2; exit 1; }
echo "== $lib (version $version)"

soname="$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')"
[[ "$soname" == "libdevshare.so.$major" ]] || fail "soname is '$soname', not libdevshare.so.$major"

# Defined symbols of .dynsym: "<bind> <type> <ndx> <name[@@version]>".
mapfile -t defined < <(readelf --dyn-syms -W "$lib" |
    awk '$1 ~ /^[0-9]+:$/ && $7 != "UND" && $5 != "LOCAL" {print $5, $4, $7, $8}')

exported=()
for entry in "${defined[@]}"; do
    read -r bind type ndx name <<<"$entry"
    sym="${name%%@*}"
    ver=""
    if [[ "$name" == *@@* ]]; then
        ver="${name#*@@}"
    elif [[ "$name" == *@* ]]; then
        fail "$sym has the non-default version '${name#*@}' (every symbol's version must be its default)"
        continue
    fi
    if [[ "$ndx" == ABS && "$sym" == DEVSHARE_* && ( -z "$ver" || "$sym" == "$ver" ) ]]; then
        # GNU ld's symbol for a version node (an ABS DEVSHARE_1.0).
        [[ "$sym" =~ ^DEVSHARE_${major}\.([0-9]+)$ && "${BASH_REMATCH[1]}" -le "$minor" ]] ||
            fail "unexpected version node $sym"
        continue
    fi
    if [[ "$sym" != devshare_* ]]; then
        fail "exports $sym ($bind $type${ver:+, version $ver}): only devshare_* symbols may be exported"
        continue
    fi
    if [[ -z "$ver" ]]; then
        fail "$sym has no symbol version (expected DEVSHARE_$major.n, n <= $minor)"
    elif [[ ! "$ver" =~ ^DEVSHARE_${major}\.([0-9]+)$ ]] || ((BASH_REMATCH[1] > minor)); then
        fail "$sym has version $ver (expected DEVSHARE_$major.n, n <= $minor)"
    fi
    exported+=("$sym")
done
((${#exported[@]})) || fail "no devshare_* symbol is exported"

# Functions declared in the header (comment lines left out).
mapfile -t declared < <(grep -v -E '^[[:space:]]*(//|/?\*)' "$header" |
    grep -o -E '\bdevshare_[a-z0-9_]+\(' | tr -d '(' | sort -u)
((${#declared[@]})) || fail "no devshare_* function found in $header"
mapfile -t exported < <(printf '%s\n' "${exported[@]}" | sort -u)

missing="$(comm -23 <(printf '%s\n' "${declared[@]}") <(printf '%s\n' "${exported[@]}"))"
extra="$(comm -13 <(printf '%s\n' "${declared[@]}") <(printf '%s\n' "${exported[@]}"))"
[[ -z "$missing" ]] || fail "declared in $header but not exported: $(echo $missing)"
[[ -z "$extra" ]] || fail "exported but not declared in $header: $(echo $extra)"

versions="$(readelf --dyn-syms -W "$lib" | awk '$7 != "UND" {print $8}' | grep -o '@@DEVSHARE_[0-9.]*' |
    sort | uniq -c | tr -s ' ' | tr '\n' ';')"
echo "exported: ${#exported[@]} devshare_* symbols; declared in the header: ${#declared[@]}; versions:${versions}"
if ((failures)); then
    exit 1
fi
echo "PASS: symbols"
