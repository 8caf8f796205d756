"""devshare.get_cmake_dir / get_include / get_library / get_pkgconfig_dir and python -m devshare,
from the source checkout (no wheel tree: devshare/_lib is absent). The wheel's own layout is
tested by tests/wheel/run.sh (scripts/test.sh)."""

import os
import pathlib
import subprocess
import sys

import pytest

import devshare
from devshare import _paths

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG_PARENT = str(pathlib.Path(devshare.__file__).resolve().parents[1])


def _run(*args):
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    return subprocess.run([sys.executable, "-m", "devshare", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.skipif(_paths.PREFIX.exists(), reason="a wheel-installed package")
def test_checkout_has_no_wheel_tree():
    assert devshare.get_include() == str(ROOT / "include")
    for fn in (devshare.get_cmake_dir, devshare.get_library, devshare.get_pkgconfig_dir):
        with pytest.raises(FileNotFoundError, match="carries no library"):
            fn()
    res = _run("--includes")
    assert res.returncode == 0 and res.stdout.strip() == f"-I{ROOT / 'include'}", res
    res = _run("--cmake-dir")
    assert res.returncode == 1 and "carries no library" in res.stderr, res


def test_paths_are_exported_and_documented():
    for name in ("get_cmake_dir", "get_include", "get_library", "get_pkgconfig_dir"):
        assert name in devshare.__all__ and callable(getattr(devshare, name))
        assert name in devshare.__doc__
    res = _run("--version")
    assert res.returncode == 0 and res.stdout.strip() == devshare.__version__
    res = _run()
    assert res.returncode == 0 and "--cmake-dir" in res.stdout


def test_wheel_library_is_tried_first():
    cands = devshare._lib._candidates()
    assert cands[0][1] == str(_paths.LIBDIR / "libdevshare.so.1"), cands[0]
