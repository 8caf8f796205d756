"""``python -m devshare``: where the wheel's C/C++ side is (the pybind11 convention).

    --cmake-dir       the CMake package directory (-DCMAKE_PREFIX_PATH=$(python -m devshare --cmake-dir))
    --includes        -I flags for devshare.h / devshare.hpp
    --libs            linker flags for the wheel's libdevshare (-L, -ldevshare, and an rpath to it)
    --pkgconfig-dir   the directory of devshare.pc / devshare-static.pc (PKG_CONFIG_PATH)
    --library         the full path of the wheel's libdevshare.so.1
    --examples-dir    the examples' directory (each a small project with a README)
    --version         the package version

Besides the package's ``__version__`` it uses only :mod:`devshare._paths`: it loads no library
itself.
"""

from __future__ import annotations

import argparse
import shlex
import sys

# The parent package's __init__ has run (python -m imports it first); the paths need nothing
# of it, the version is its own.
from . import __version__, _paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m devshare", description=__doc__.splitlines()[0])
    p.add_argument("--cmake-dir", "--cmakedir", action="store_true", help="CMake package directory")
    p.add_argument("--includes", action="store_true", help="-I flags for the headers")
    p.add_argument("--libs", action="store_true", help="linker flags for the wheel's libdevshare")
    p.add_argument("--pkgconfig-dir", action="store_true", help="pkg-config directory")
    p.add_argument("--library", action="store_true", help="full path of libdevshare.so.1")
    p.add_argument("--examples-dir", action="store_true", help="the examples' directory")
    p.add_argument("--version", action="store_true", help="package version")
    args = p.parse_args(argv)
    out = []
    try:
        if args.version:
            out.append(__version__)
        if args.cmake_dir:
            out.append(_paths.get_cmake_dir())
        if args.includes:
            out.append("-I" + shlex.quote(_paths.get_include()))
        if args.libs:
            d = str(_paths.LIBDIR)
            _paths.get_library()
            out.append(f"-L{shlex.quote(d)} -Wl,-rpath,{shlex.quote(d)} -ldevshare")
        if args.pkgconfig_dir:
            out.append(_paths.get_pkgconfig_dir())
        if args.library:
            out.append(_paths.get_library())
        if args.examples_dir:
            out.append(_paths.get_examples_dir())
    except FileNotFoundError as e:
        print(f"python -m devshare: {e}", file=sys.stderr)
        return 1
    if not out:
        p.print_help()
        return 0
    print(" ".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
