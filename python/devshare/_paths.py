"""Where the wheel's C/C++ side is: the library, headers, CMake package and pkg-config files.

A wheel built from the repository (the root pyproject.toml, scikit-build-core over the CMake
build) carries ``cmake --install``'s tree inside the package, as ``devshare/_lib/``::

    _lib/lib/libdevshare.so.1        (and libdevshare.so, libdevshare.so.1.20.0, libdevshare.a)
    _lib/include/devshare.h, devshare.hpp
    _lib/lib/cmake/devshare/         find_package(devshare)
    _lib/lib/pkgconfig/              devshare.pc, devshare-static.pc
    _lib/share/devshare/examples/    the examples (each a small project with a README)

A C/C++ stage built against these and this package, imported in the same process, use one
libdevshare (the package loads ``_lib/lib/libdevshare.so.1`` first; a program linked against it
names the same soname). These functions need no library loaded: ``python -m devshare`` uses them.

Imports no module of the package.
"""

from __future__ import annotations

import pathlib

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
#: The install tree inside the package (present in a wheel; absent in a source checkout).
PREFIX = _PACKAGE_DIR / "_lib"
#: The directory holding libdevshare inside the package.
LIBDIR = PREFIX / "lib"
SONAME = "libdevshare.so.1"


#: The examples inside the package (present in a wheel).
EXAMPLES = PREFIX / "share" / "devshare" / "examples"


def _checkout_include() -> pathlib.Path | None:
    root = _PACKAGE_DIR.parent.parent
    if _PACKAGE_DIR.parent.name == "python" and (root / "include" / "devshare.h").is_file():
        return root / "include"
    return None


def _need(path: pathlib.Path, what: str) -> str:
    if not path.exists():
        raise FileNotFoundError(
            f"{what} not found at {path}: this devshare package carries no library (a source "
            f"checkout or the pure-Python package); install the platform wheel built from the "
            f"repository (pip install <repo> or python -m build), or use the CMake install's "
            f"lib/cmake/devshare")
    return str(path)


def get_cmake_dir() -> str:
    """The directory of ``devshareConfig.cmake``: pass it as ``-DCMAKE_PREFIX_PATH`` (or
    ``-Ddevshare_DIR``) to a CMake project that calls ``find_package(devshare)``."""
    return _need(PREFIX / "lib" / "cmake" / "devshare", "the devshare CMake package")


def get_include() -> str:
    """The directory holding ``devshare.h`` and ``devshare.hpp`` (the wheel's, else the source
    checkout's ``include/``)."""
    if (PREFIX / "include" / "devshare.h").is_file():
        return str(PREFIX / "include")
    inc = _checkout_include()
    if inc is not None:
        return str(inc)
    return _need(PREFIX / "include", "devshare.h")


def get_library() -> str:
    """The full path of the wheel's shared library (``.../_lib/lib/libdevshare.so.1``), the one
    ``import devshare`` loads unless ``DEVSHARE_LIBRARY`` names another
    (``devshare.library_path`` says which was loaded)."""
    return _need(LIBDIR / SONAME, "libdevshare")


def get_pkgconfig_dir() -> str:
    """The directory of ``devshare.pc`` and ``devshare-static.pc`` (for ``PKG_CONFIG_PATH``;
    their prefix is relative to their own location, ``${pcfiledir}/../..``)."""
    return _need(PREFIX / "lib" / "pkgconfig", "the devshare pkg-config files")


def get_examples_dir() -> str:
    """The directory of the examples (``cpp_stage``, ``pool_to_python``, ``reconnect``,
    ``weight_sync``; each a small project whose README says how to run it): the wheel's, else the
    source checkout's ``examples/``."""
    if EXAMPLES.is_dir():
        return str(EXAMPLES)
    root = _PACKAGE_DIR.parent.parent
    if _PACKAGE_DIR.parent.name == "python" and (root / "examples").is_dir():
        return str(root / "examples")
    return _need(EXAMPLES, "the devshare examples")
