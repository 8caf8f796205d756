#!/usr/bin/env bash
# Install a configured and built devshare build tree into a fresh temporary prefix and use the
# installed package the way a user would.
#
#   tests/install/run.sh find_package <build-dir>
#       cmake --install, then configure, build and run tests/cmake_consumer against the prefix
#       (find_package(devshare 1.0 CONFIG REQUIRED); devshare::devshare and
#       devshare::devshare_static, the latter without libdevshare.so according to ldd); and the
#       version rule: find_package(devshare M.m) accepts the package iff M is its major version
#       and m <= its minor version.
#   tests/install/run.sh pkgconfig <build-dir>
#       cmake --install, then compile a C program with `pkg-config devshare` (shared library)
#       and with `pkg-config --static devshare-static` (static library: no libdevshare.so
#       according to ldd), and run both.
#
# Either way the programs must use the installed copy, never the build tree's library.
# Environment: CMAKE (cmake), CC (cc), CXX (c++), PKG_CONFIG (pkg-config).
# The temporary prefix and build directories are removed on exit.

set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source_dir="${DEVSHARE_SOURCE_DIR:-$(cd "$here/../.." && pwd)}"
CMAKE="${CMAKE:-cmake}"
CC="${CC:-cc}"
CXX="${CXX:-c++}"
PKG_CONFIG="${PKG_CONFIG:-pkg-config}"

usage() {
    echo "usage: $0 find_package|pkgconfig <build-dir>" >&2
    exit 2
}
[[ $# -eq 2 ]] || usage
mode="$1"
build_dir="$(cd "$2" && pwd)"

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

# Nothing but the prefix may provide the library.
unset LD_LIBRARY_PATH LD_PRELOAD

work="$(mktemp -d "${TMPDIR:-/tmp}/devshare-install-test.XXXXXX")"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

echo "== cmake --install $build_dir --prefix $prefix"
"$CMAKE" --install "$build_dir" --prefix "$prefix"

version="$(sed -n 's/^Version: //p' "$build_dir/devshare.pc")"
[[ -n "$version" ]] || fail "no Version in $build_dir/devshare.pc"
major="${version%%.*}"
minor="${version#*.}"
minor="${minor%%.*}"
libdir="$prefix/lib"

echo "== checking the installed files"
for f in "lib/libdevshare.so.$version" lib/libdevshare.a include/devshare.h include/devshare.hpp \
         include/devshare/error.hpp include/devshare/exporter.hpp include/devshare/pool.hpp \
         lib/cmake/devshare/devshareConfig.cmake lib/cmake/devshare/devshareConfigVersion.cmake \
         lib/pkgconfig/devshare.pc lib/pkgconfig/devshare-static.pc; do
    [[ -f "$prefix/$f" && ! -L "$prefix/$f" ]] || fail "$f is not installed as a file"
done
[[ "$(readlink "$libdir/libdevshare.so.$major")" == "libdevshare.so.$version" ]] ||
    fail "lib/libdevshare.so.$major does not link to libdevshare.so.$version"
[[ "$(readlink "$libdir/libdevshare.so")" == "libdevshare.so.$major" ]] ||
    fail "lib/libdevshare.so does not link to libdevshare.so.$major"
readelf -d "$libdir/libdevshare.so.$version" | grep -q "Library soname: \[libdevshare.so.$major\]" ||
    fail "the installed library's soname is not libdevshare.so.$major"
real_lib="$(readlink -f "$libdir/libdevshare.so.$version")"
ls -l "$libdir"

# check_shared <exe> [env...]: <exe> needs libdevshare.so.<major>, which resolves into the
# prefix, and nothing in its RPATH/RUNPATH points into the build tree.
check_shared() {
    local exe="$1"
    shift
    readelf -d "$exe" | grep -q "NEEDED.*\[libdevshare.so.$major\]" ||
        fail "$exe does not need libdevshare.so.$major"
    if readelf -d "$exe" | grep -E 'R(UN)?PATH' | grep -qF "$build_dir"; then
        fail "$exe has an RPATH into the build tree: $(readelf -d "$exe" | grep -E 'R(UN)?PATH')"
    fi
    local resolved
    resolved="$(env "$@" ldd "$exe" | awk '$1 ~ /^libdevshare/ {print $3}')"
    echo "$exe: libdevshare resolves to $resolved"
    [[ -n "$resolved" && "$(readlink -f "$resolved")" == "$real_lib" ]] ||
        fail "$exe resolves libdevshare to '$resolved', not to the installed $real_lib"
}

# check_loaded <output> <expected file>: the program reported (via dladdr) that
# devshare_version() came from <expected file>.
check_loaded() {
    local loaded
    loaded="$(sed -n 's/^library: //p' <<<"$1")"
    [[ -n "$loaded" && "$(readlink -f "$loaded")" == "$(readlink -f "$2")" ]] ||
        fail "devshare_version() was loaded from '$loaded', expected $2"
}

case "$mode" in
find_package)
    consumer_build="$work/consumer-build"
    echo "== configuring tests/cmake_consumer against $prefix"
    "$CMAKE" -S "$source_dir/tests/cmake_consumer" -B "$consumer_build" \
        -DCMAKE_PREFIX_PATH="$prefix" \
        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
        -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX"
    found_dir="$(sed -n 's/^devshare_DIR:PATH=//p' "$consumer_build/CMakeCache.txt")"
    [[ "$(readlink -f "$found_dir")" == "$(readlink -f "$libdir/cmake/devshare")" ]] ||
        fail "find_package found devshare in '$found_dir', not in the prefix"
    "$CMAKE" --build "$consumer_build" --verbose

    shared="$consumer_build/roundtrip_shared"
    static="$consumer_build/roundtrip_static"
    check_shared "$shared"
    bash "$here/no_shared_devshare.sh" "$static" >/dev/null ||
        fail "$static is not linked statically against devshare (tests/install/no_shared_devshare.sh)"

    echo "== $shared"
    out="$("$shared")" || { echo "$out"; fail "$shared failed"; }
    echo "$out"
    check_loaded "$out" "$real_lib"

    echo "== $static"
    out="$("$static")" || { echo "$out"; fail "$static failed"; }
    echo "$out"
    check_loaded "$out" "$static"

    # The version rule, with find_package itself: devshare M.m is accepted iff M is the
    # package's major version and M.m is not newer than the package.
    echo "== find_package(devshare <requested>) against $version"
    probe="$work/version-probe"
    mkdir -p "$probe"
    cat >"$probe/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.16)
project(devshare_version_probe NONE)
find_package(devshare ${REQUESTED} CONFIG)
message(STATUS "devshare_FOUND=${devshare_FOUND}")
CMAKE
    accepted=("$major.0" "$major.$minor" "$version")
    rejected=("$((major - 1)).0" "$((major - 1)).1" "$((major + 1)).0" "$major.$((minor + 1))")
    mapfile -t requests < <(printf '%s\n' "${accepted[@]}" "${rejected[@]}" | awk '!seen[$0]++')
    for requested in "${requests[@]}"; do
        want=0
        for a in "${accepted[@]}"; do [[ "$a" == "$requested" ]] && want=1; done
        rm -rf "$probe/build"
        found="$("$CMAKE" -S "$probe" -B "$probe/build" -DREQUESTED="$requested" \
            -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF 2>&1 |
            sed -n 's/.*devshare_FOUND=//p')"
        if [[ "$want" == 1 ]]; then
            [[ "$found" == 1 ]] || fail "find_package(devshare $requested) rejects $version"
            echo "   $requested: accepted"
        else
            [[ "$found" != 1 ]] || fail "find_package(devshare $requested) accepts $version"
            echo "   $requested: rejected"
        fi
    done
    ;;

pkgconfig)
    export PKG_CONFIG_PATH="$libdir/pkgconfig"
    echo "== pkg-config with PKG_CONFIG_PATH=$PKG_CONFIG_PATH"
    for pc in devshare devshare-static; do
        [[ "$("$PKG_CONFIG" --modversion "$pc")" == "$version" ]] ||
            fail "pkg-config --modversion $pc is not $version"
        [[ "$(readlink -f "$("$PKG_CONFIG" --variable=libdir "$pc")")" == "$(readlink -f "$libdir")" ]] ||
            fail "pkg-config's libdir for $pc is not $libdir"
        grep -q '^# Version rule: MAJOR.MINOR.PATCH. A program built against MAJOR.m runs with every library' \
            "$libdir/pkgconfig/$pc.pc" || fail "$pc.pc does not state the version rule"
    done
    # The rule as the .pc file states it: >= M.m and < M+1.
    "$PKG_CONFIG" --exists "devshare >= $major.0" "devshare < $((major + 1))" ||
        fail "pkg-config does not accept 'devshare >= $major.0' 'devshare < $((major + 1))'"
    ! "$PKG_CONFIG" --exists "devshare >= $major.$((minor + 1))" ||
        fail "pkg-config accepts 'devshare >= $major.$((minor + 1))'"
    ! "$PKG_CONFIG" --exists "devshare < $major" || fail "pkg-config accepts 'devshare < $major'"

    read -ra cflags <<<"$("$PKG_CONFIG" --cflags devshare)"
    read -ra libs <<<"$("$PKG_CONFIG" --libs devshare)"
    read -ra static_libs <<<"$("$PKG_CONFIG" --static --libs devshare-static)"
    read -ra static_libs_plain <<<"$("$PKG_CONFIG" --libs devshare-static)"
    echo "cflags:                              ${cflags[*]}"
    echo "--libs devshare:                     ${libs[*]}"
    echo "--static --libs devshare-static:     ${static_libs[*]}"
    # The native libraries are cargo's answer for this build (CMakeLists.txt asks
    # `cargo rustc --print native-static-libs`), not a list kept by hand.
    read -ra native <<<"$(cat "$build_dir/devshare_native_static_libs.txt")"
    ((${#native[@]})) || fail "no native libraries recorded in $build_dir/devshare_native_static_libs.txt"
    for lib in "${native[@]}"; do
        [[ " ${static_libs[*]} " == *" $lib "* ]] || fail "pkg-config --static --libs devshare-static lacks $lib"
    done
    archive=""
    for flag in "${static_libs[@]}"; do
        [[ "$flag" == */libdevshare.a ]] && archive="$flag"
    done
    [[ -n "$archive" && "$(readlink -f "$archive")" == "$(readlink -f "$libdir/libdevshare.a")" ]] ||
        fail "pkg-config --static --libs devshare-static does not name $libdir/libdevshare.a"
    for flag in "${static_libs[@]}"; do
        [[ "$flag" != -ldevshare ]] || fail "pkg-config --static --libs devshare-static gives -ldevshare"
    done
    [[ "${static_libs_plain[*]}" == "${static_libs[*]}" ]] ||
        fail "pkg-config --libs devshare-static differs from --static --libs devshare-static"

    warn=(-std=c11 -Wall -Wextra -Werror)
    echo "== shared link"
    ( set -x; "$CC" "${warn[@]}" "${cflags[@]}" "$here/pkgconfig_main.c" -o "$work/pc_shared" "${libs[@]}" )
    check_shared "$work/pc_shared" LD_LIBRARY_PATH="$libdir"
    LD_LIBRARY_PATH="$libdir" "$work/pc_shared" || fail "pc_shared failed"

    echo "== static link: the flags as pkg-config gives them"
    read -ra static_cflags <<<"$("$PKG_CONFIG" --cflags devshare-static)"
    ( set -x; "$CC" "${warn[@]}" "${static_cflags[@]}" "$here/pkgconfig_main.c" -o "$work/pc_static" "${static_libs[@]}" )
    bash "$here/no_shared_devshare.sh" "$work/pc_static" || fail "pc_static is not linked statically"
    ;;

*)
    usage
    ;;
esac

echo "PASS: install $mode"
