#!/usr/bin/env bash
# Install a configured and built devshare build tree into a fresh temporary prefix and use the
# installed package the way a user would.
#
#   tests/install/run.sh find_package <build-dir>
#       cmake --install, then configure, build and run tests/cmake_consumer against the prefix
#       (find_package(devshare 0.1 CONFIG REQUIRED); devshare::devshare and
#       devshare::devshare_static).
#   tests/install/run.sh pkgconfig <build-dir>
#       cmake --install, then compile a C program with `pkg-config devshare`, once linked
#       against the shared and once against the static library, and run both.
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
libdir="$prefix/lib"

echo "== checking the installed files"
for f in "lib/libdevshare.so.$version" lib/libdevshare.a include/devshare.h include/devshare.hpp \
         lib/cmake/devshare/devshareConfig.cmake lib/cmake/devshare/devshareConfigVersion.cmake \
         lib/pkgconfig/devshare.pc; do
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

# needs_devshare <exe>: whether <exe> records libdevshare as a needed shared library.
needs_devshare() {
    readelf -d "$1" | grep -q 'NEEDED.*\[libdevshare\.so'
}

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
    ! needs_devshare "$static" || fail "$static needs libdevshare.so; it should be linked statically"

    echo "== $shared"
    out="$("$shared")" || { echo "$out"; fail "$shared failed"; }
    echo "$out"
    check_loaded "$out" "$real_lib"

    echo "== $static"
    out="$("$static")" || { echo "$out"; fail "$static failed"; }
    echo "$out"
    check_loaded "$out" "$static"
    ;;

pkgconfig)
    export PKG_CONFIG_PATH="$libdir/pkgconfig"
    echo "== pkg-config with PKG_CONFIG_PATH=$PKG_CONFIG_PATH"
    [[ "$("$PKG_CONFIG" --modversion devshare)" == "$version" ]] ||
        fail "pkg-config --modversion devshare is not $version"
    [[ "$(readlink -f "$("$PKG_CONFIG" --variable=libdir devshare)")" == "$(readlink -f "$libdir")" ]] ||
        fail "pkg-config's libdir is not $libdir"
    read -ra cflags <<<"$("$PKG_CONFIG" --cflags devshare)"
    read -ra libs <<<"$("$PKG_CONFIG" --libs devshare)"
    read -ra static_libs <<<"$("$PKG_CONFIG" --static --libs devshare)"
    echo "cflags:       ${cflags[*]}"
    echo "libs:         ${libs[*]}"
    echo "static libs:  ${static_libs[*]}"
    for lib in -ldl -lgcc_s -lutil -lrt -lpthread -lm -lc; do
        [[ " ${static_libs[*]} " == *" $lib "* ]] || fail "pkg-config --static --libs lacks $lib"
    done

    warn=(-std=c11 -Wall -Wextra -Werror)
    echo "== shared link"
    ( set -x; "$CC" "${warn[@]}" "${cflags[@]}" "$here/pkgconfig_main.c" -o "$work/pc_shared" "${libs[@]}" )
    check_shared "$work/pc_shared" LD_LIBRARY_PATH="$libdir"
    LD_LIBRARY_PATH="$libdir" "$work/pc_shared" || fail "pc_shared failed"

    # Both libdevshare.so and libdevshare.a are in libdir; the linker prefers the .so for
    # -ldevshare, so a static link asks for the archive around that one flag.
    echo "== static link"
    static_link=()
    for flag in "${static_libs[@]}"; do
        if [[ "$flag" == -ldevshare ]]; then
            static_link+=(-Wl,-Bstatic -ldevshare -Wl,-Bdynamic)
        else
            static_link+=("$flag")
        fi
    done
    ( set -x; "$CC" "${warn[@]}" "${cflags[@]}" "$here/pkgconfig_main.c" -o "$work/pc_static" "${static_link[@]}" )
    ! needs_devshare "$work/pc_static" || fail "pc_static needs libdevshare.so"
    "$work/pc_static" || fail "pc_static failed"
    ;;

*)
    usage
    ;;
esac

echo "PASS: install $mode"
