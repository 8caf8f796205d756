"""Shared fixtures and helpers for the Python tests.

Environment (set by the CMake test; defaults suit a source checkout built with CMake):
  DEVSHARE_LIBRARY       full path of libdevshare.so
  DEVSHARE_TEST_BIN_DIR  directory holding the tensor_tool test program

Nothing here skips: a missing torch, numpy or tensor_tool makes the tests that need it fail.
"""

from __future__ import annotations

import gc
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON_DIR = ROOT / "python"
if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

import devshare  # noqa: E402

SHM = pathlib.Path("/dev/shm")
# Names of the shm objects devshare, PyTorch and the CUDA stand-in create: <prefix>_<pid>_...
_SHM_NAME = re.compile(r"^(?:devshare_rc|devshare|torch|cusi_[a-z]+)_(\d+)_")

# Processes the tests started (tensor_tool, Python children): their shm objects count as ours.
CHILD_PIDS: set[int] = set()


def bin_dir() -> pathlib.Path:
    d = os.environ.get("DEVSHARE_TEST_BIN_DIR")
    return pathlib.Path(d) if d else ROOT / "build"


def tensor_tool() -> str:
    path = bin_dir() / "tensor_tool"
    assert path.is_file(), (f"{path} is missing: build it (cmake --build build --target tensor_tool) "
                            f"or set DEVSHARE_TEST_BIN_DIR")
    return str(path)


def shm_objects() -> set[str]:
    return {p.name for p in SHM.iterdir()}


def ours(names) -> list[str]:
    """The names among `names` that this test process or its children created."""
    pids = {os.getpid()} | CHILD_PIDS
    out = []
    for n in names:
        m = _SHM_NAME.match(n)
        if m and int(m.group(1)) in pids:
            out.append(n)
    return sorted(out)


@pytest.fixture(autouse=True)
def no_shm_leaks():
    """After every test, /dev/shm holds nothing new from this process or its children."""
    before = shm_objects()
    yield
    gc.collect()
    devshare.collect()
    leaked = ours(shm_objects() - before)
    assert not leaked, f"left in /dev/shm: {leaked}"


def spawn(args, **kw) -> subprocess.Popen:
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    CHILD_PIDS.add(p.pid)
    return p


def run(args, timeout=60, **kw) -> subprocess.CompletedProcess:
    p = spawn(args, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{args[:2]} timed out; stdout={out!r} stderr={err!r}")
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def python_env(**extra) -> dict:
    """Environment for a child Python that imports devshare from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def maps_count(name: bytes | str) -> int:
    """How many of this process's mappings are of shm object `name` (with or without '/')."""
    if isinstance(name, bytes):
        name = name.decode()
    needle = "/dev/shm/" + name.lstrip("/")
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip("\n").endswith(needle))


def header_count(name: bytes | str) -> int:
    """The mapping count in the 64-byte header of a file_system-layout shm object."""
    if isinstance(name, bytes):
        name = name.decode()
    with open("/dev/shm/" + name.lstrip("/"), "rb") as f:
        return int.from_bytes(f.read(4), "little", signed=True)
