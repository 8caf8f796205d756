"""The package itself: numpy without torch, finding the library, version check, pip install."""

import ctypes
import importlib.util
import os
import pathlib
import shutil
import sys
import textwrap

import devshare
from conftest import PYTHON_DIR, python_env, run, tensor_tool

NUMPY_ONLY = textwrap.dedent("""
    import gc, subprocess, sys
    sys.modules["torch"] = None  # any "import torch" now raises ImportError
    import numpy as np
    import devshare

    a = devshare.empty((3, 4), "float32", like="numpy")
    a[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = devshare.share(a[:, 1::2])
    assert h.dtype_name == "float32" and h.numpy_dtype() == np.float32
    b = devshare.open(h, like="numpy")
    assert np.array_equal(b, a[:, 1::2])
    b[0, 0] = -1
    assert a[0, 1] == -1 and devshare.outstanding(a) == 1
    del b
    gc.collect()
    assert devshare.outstanding(a) == 0

    # The C side sees the array too.
    out = subprocess.run([sys.argv[1], "open", devshare.share(a[2]).to_text()],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "info code=2 bits=32 lanes=1 ndim=1 shape=4 strides=1 numel=4", out
    assert out[1] == "data " + a[2].tobytes().hex() and out[2] == "released", out
    assert devshare.outstanding(a) == 0

    h = devshare.share(a)
    try:
        devshare.open(h, like="torch")
    except ImportError as e:
        assert "torch" in str(e)
    else:
        raise AssertionError("like='torch' worked without torch")
    devshare.open(h, like="numpy")  # nothing was imported above: take the reference back here
    gc.collect()
    assert devshare.outstanding(a) == 0
    try:
        devshare.empty((2,), "float32")  # like="torch" is the default
    except ImportError:
        pass
    else:
        raise AssertionError("empty() made a torch tensor without torch")
    assert sys.modules["torch"] is None
    print("ok")
""")


def test_numpy_works_without_torch():
    res = run([sys.executable, "-c", NUMPY_ONLY, tensor_tool()], env=python_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "ok"


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEVSHARE_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(extra)
    return env


def _pip_install(target: pathlib.Path):
    args = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target)]
    if importlib.util.find_spec("setuptools") is not None:
        args.append("--no-build-isolation")  # no network needed
    build = target.parent / "pip-build"
    shutil.copytree(PYTHON_DIR, build, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    res = run(args + [str(build)], timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (target / "devshare" / "__init__.py").is_file()


def test_pip_install_and_library_search(tmp_path):
    target = tmp_path / "site"
    _pip_install(target)
    probe = "import devshare; print(devshare.__file__); print(devshare.library_path)"

    # DEVSHARE_LIBRARY: used as given.
    res = run([sys.executable, "-c", probe],
              env=_clean_env(PYTHONPATH=str(target), DEVSHARE_LIBRARY=devshare.library_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(target / "devshare" / "__init__.py"), devshare.library_path]

    # Nothing anywhere: the error lists every place it looked.
    res = run([sys.executable, "-c", probe], env=_clean_env(PYTHONPATH=str(target)))
    assert res.returncode != 0
    assert "LibraryNotFoundError" in res.stderr
    assert "DEVSHARE_LIBRARY: not set" in res.stderr
    assert str(target / "devshare" / "libdevshare.so") in res.stderr
    assert "system loader: libdevshare.so.1" in res.stderr

    # An explicit DEVSHARE_LIBRARY that does not load is an error, not a silent fallback.
    res = run([sys.executable, "-c", probe],
              env=_clean_env(PYTHONPATH=str(target), DEVSHARE_LIBRARY=str(tmp_path / "nope.so")))
    assert res.returncode != 0 and str(tmp_path / "nope.so") in res.stderr

    # A library next to the package is found.
    shutil.copy(devshare.library_path, target / "devshare" / "libdevshare.so")
    res = run([sys.executable, "-c", probe], env=_clean_env(PYTHONPATH=str(target)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[1] == str(target / "devshare" / "libdevshare.so")

    # The installed package works end to end.
    roundtrip = ("import devshare, numpy as np; a = devshare.empty(4, 'int64', like='numpy'); "
                 "a[:] = 5; b = devshare.open(devshare.share(a), like='numpy'); "
                 "assert (b == 5).all(); del b; assert devshare.outstanding(a) == 0; print('ok')")
    res = run([sys.executable, "-c", roundtrip], env=_clean_env(PYTHONPATH=str(target)))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_source_checkout_finds_its_build_directory():
    probe = "import devshare; print(devshare.library_path)"
    res = run([sys.executable, "-c", probe], env=_clean_env(PYTHONPATH=str(PYTHON_DIR)))
    assert res.returncode == 0, res.stderr
    path = pathlib.Path(res.stdout.strip())
    root = PYTHON_DIR.parent
    assert path.parent in (root / "build/cargo/release", root / "target/release")
    assert path.name in ("libdevshare.so", "libdevshare.so.1")


def test_build_directory_search_takes_the_soname_too():
    """A checkout's build folders are searched for libdevshare.so and its soname libdevshare.so.1
    (a build that left only the soname), then the system loader gets the soname."""
    from devshare import _lib

    cands = _lib._candidates()
    targets = [t for _, t in cands]
    assert _lib._SONAME == "libdevshare.so.1"
    root = _lib._checkout_root()
    assert root is not None
    for sub in ("build/cargo/release", "target/release"):
        for name in ("libdevshare.so", "libdevshare.so.1"):
            assert str(root / sub / name) in targets
    assert cands[-1] == ("system loader", "libdevshare.so.1")


class _FakeVersion:
    def __init__(self, major, minor, patch=0):
        v = major << 16 | minor << 8 | patch
        self.devshare_version = lambda: v


def test_version_rule():
    """Same major, library minor >= the minor the package was written for (ABI 1.0)."""
    from devshare import _lib

    assert (_lib.EXPECTED_MAJOR, _lib.EXPECTED_MINOR) == (1, 0)
    doc = " ".join(_lib._version_problem.__doc__.split())
    assert "major version must equal" in doc and "minor version must be at least" in doc
    assert _lib._version_problem(_FakeVersion(1, 0)) is None
    assert _lib._version_problem(_FakeVersion(1, 0, 7)) is None
    assert _lib._version_problem(_FakeVersion(1, 5)) is None  # newer minor: only additions
    older = _lib._version_problem(_FakeVersion(0, 9))
    assert older is not None and "0.9.0" in older and "major version 1" in older
    newer_major = _lib._version_problem(_FakeVersion(2, 0))
    assert newer_major is not None and "2.0.0" in newer_major and "incompatible" in newer_major


def test_version_rule_older_minor(monkeypatch):
    """A library older than the package's minor is refused (it may lack what the package uses)."""
    from devshare import _lib

    monkeypatch.setattr(_lib, "EXPECTED_MINOR", 3)
    msg = _lib._version_problem(_FakeVersion(1, 2, 9))
    assert msg is not None and "1.2.9" in msg and "older than the ABI 1.3" in msg
    assert _lib._version_problem(_FakeVersion(1, 3)) is None
    assert _lib._version_problem(_FakeVersion(1, 4)) is None


def test_loader_applies_the_version_rule(monkeypatch):
    """_try_load with the real library reporting another version (monkeypatched): 1.0 and 1.5
    load, 0.9 and 2.0 are refused with the reason."""
    from devshare import _lib

    real_cdll = _lib.ctypes.CDLL

    class Reporting:
        def __init__(self, v):
            self._lib = real_cdll(devshare.library_path)
            self._v = v

        def __getattr__(self, name):
            if name == "devshare_version":
                return _FakeVersion(*self._v).devshare_version
            return getattr(self._lib, name)

    for v, ok in (((1, 0), True), ((1, 5), True), ((0, 9), False), ((2, 0), False)):
        monkeypatch.setattr(_lib.ctypes, "CDLL", lambda path, v=v: Reporting(v))
        lib, why = _lib._try_load(devshare.library_path)
        assert (lib is not None) == ok, (v, why)
        if not ok:
            assert f"library version {v[0]}.{v[1]}.0" in why, why
    monkeypatch.setattr(_lib.ctypes, "CDLL", real_cdll)
    assert devshare.library_version.startswith("1.")


def test_library_errors_never_crash_the_interpreter():
    # Misuse at the ctypes level still comes back as a devshare.Error with the library's text.
    from devshare import _lib

    try:
        _lib.call(_lib.lib.devshare_exporter_share, None, None, None)
    except devshare.Error as e:
        assert e.status == devshare.Status.NULL_ARGUMENT
        assert "devshare_exporter_share" in e.message
    else:
        raise AssertionError("NULL exporter accepted")
    try:
        _lib.call(_lib.lib.devshare_host_adopt, b"/no_such_devshare_object", 16,
                  ctypes.byref(_lib.ExporterP()), None)
    except devshare.Error as e:
        # Not a devshare or PyTorch name: refused before it is opened.
        assert e.status == devshare.Status.UNTRUSTED and "no_such_devshare_object" in e.message
    else:
        raise AssertionError("adopting a missing object worked")


def test_star_import_does_not_shadow_builtin_open():
    # issue 13 item 4: `from devshare import *` must leave the builtin open alone.
    import builtins

    ns: dict = {}
    exec("from devshare import *", ns)
    assert "open" not in ns
    exec("f = open", ns)
    assert ns["f"] is builtins.open
    # devshare.open is still there, and everything else of the API is exported.
    assert devshare.open is devshare._api.open and "open" not in devshare.__all__
    for name in ("share", "empty", "wait", "outstanding", "Handle", "Error", "library_path",
                 "library_version", *devshare.__all__):
        assert name in ns, name
    assert set(devshare.__all__) <= set(dir(devshare))


def test_library_path_and_version_are_documented_accessors():
    from devshare import _lib

    # library_path: what was passed to the loader, here DEVSHARE_LIBRARY's full path, and the
    # file this process really mapped.
    assert isinstance(devshare.library_path, str) and devshare.library_path == _lib.library_path
    if os.environ.get("DEVSHARE_LIBRARY"):
        assert devshare.library_path == os.environ["DEVSHARE_LIBRARY"]
    real = os.path.realpath(devshare.library_path)
    with open("/proc/self/maps") as f:
        assert any(line.rstrip("\n").endswith(real) for line in f), real
    # library_version: the loaded library's devshare_version() as MAJOR.MINOR.PATCH.
    v = int(_lib.lib.devshare_version())
    assert devshare.library_version == f"{v >> 16}.{(v >> 8) & 0xFF}.{v & 0xFF}"
    # Both documented: in the package docstring (help(devshare)) and the Python page of the docs.
    for name in ("library_path", "library_version"):
        assert name in devshare.__doc__, name
    readme = (PYTHON_DIR.parent / "docs" / "python.md").read_text()
    assert "devshare.library_path" in readme and "devshare.library_version" in readme
