#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""devshare's real-GPU test suite (driven by tests/gpu/run.sh; see tests/gpu/README.md).

Needs python3 with PyTorch built with CUDA and a visible NVIDIA GPU, and a bundle made by
scripts/gpu_bundle.sh (libdevshare.so + gpu_tool). The library is called directly through
ctypes and through the C helper gpu_tool, so the suite does not depend on the Python package
working: it only loads the package's struct mirrors, python/devshare/_abi.py, by file path (no
library load; those mirrors are checked against the header by tests/python/test_abi_layout.py).
Versioned structs are made with their devshare_<struct>_init functions (struct_size set). One
case (python_package_cuda_api_shares_with_c_and_torch) uses the package's CUDA API when it is
there. Each case is named by the behaviour it checks.

Every case runs in its own child process (a fresh CUDA context, a hard timeout, a crash that
cannot take the run down) and reports on stdout:

    INFO <text>                       figures and details, shown indented under the case
    RESULT <PASS|FAIL|SKIP> <text>    the verdict (a child that dies without one FAILs)

The parent prints ``PASS <case>`` / ``FAIL <case>: why`` / ``SKIP <case>: why`` per case and
``SUMMARY: N passed, M failed, K skipped``; it exits 1 on any FAIL.

    gpu_cases.py --bundle DIR [--only NAME,...] [--list] [--dry-run]

``--only`` takes case names (``--list`` shows them), or leading words of names: ``measure``
selects both measurements.

``--dry-run`` needs no GPU and no torch: it checks the bundle, checks ``gpu_tool layout`` (the
lines of tests/c/abi_fields.h) against this checkout's header and the ctypes mirrors with
tests/python/abi_check.py (every struct and field, macro and status code), and round-trips
synthetic PyTorch tuples ('c' and expandable-segment 'e' forms, and the refused ones) through
devshare_handle_from_torch(_encoded) / to_text / gpu_tool describe, and runs the consumer logic
of cuda_pool_slots_replay_captured_graphs_without_recapture over a host pool with CPU stand-in
graphs (when torch is importable).
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import gc
import json
import os
import pathlib
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from ctypes import (
    POINTER,
    byref,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_void_p,
    cast,
    sizeof,
)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: The whole run must stay under 8 minutes (run.sh adds a hard stop at 470 s, and sets this 30 s
#: below its stop when told another: DEVSHARE_GPU_LIMIT_S).
RUN_BUDGET_S = float(os.environ.get("DEVSHARE_GPU_RUN_BUDGET_S", "440"))
PREFLIGHT_TIMEOUT_S = 120.0

# --- The C ABI (include/devshare.h) ------------------------------------------------------------


def _load_abi():
    """The Python package's ctypes mirrors of devshare.h (python/devshare/_abi.py), loaded by file
    path: the package itself is not imported and no library is loaded. The mirrors are checked
    field by field against the C header in the normal test run (tests/python/test_abi_layout.py),
    so this suite keeps no copies of its own. Found in this checkout, else where an installed
    devshare package lives."""
    import importlib.util  # noqa: PLC0415

    places = [ROOT / "python" / "devshare" / "_abi.py"]
    try:
        spec = importlib.util.find_spec("devshare")  # locates, does not import, the package
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        places += [pathlib.Path(d) / "_abi.py" for d in spec.submodule_search_locations]
    for path in places:
        if path.is_file():
            mspec = importlib.util.spec_from_file_location("_devshare_gpu_suite_abi", path)
            mod = importlib.util.module_from_spec(mspec)
            sys.modules[mspec.name] = mod
            mspec.loader.exec_module(mod)
            return mod
    raise ImportError(f"devshare's ABI module (_abi.py) not found in {[str(p) for p in places]}: "
                      f"run from a devshare checkout (tests/gpu/ next to python/devshare/)")


abi = _load_abi()


def _load_abi_check():
    """tests/python/abi_check.py (the layout checker of the normal test run: standard library
    only), loaded by file path from this checkout."""
    import importlib.util  # noqa: PLC0415

    path = ROOT / "tests" / "python" / "abi_check.py"
    if not path.is_file():
        raise ImportError(f"{path} not found: run from a devshare checkout (tests/gpu/ next to tests/python/)")
    mspec = importlib.util.spec_from_file_location("_devshare_gpu_suite_abi_check", path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[mspec.name] = mod
    mspec.loader.exec_module(mod)
    return mod

DType = abi.DType
TorchArgs = abi.TorchArgs
Handle = abi.HandleStruct
BackendInfo = abi.BackendInfo
BACKEND_CUDA = abi.BACKEND_CUDA
STATUS_OK = int(abi.Status.OK)
STATUS_BUFFER_TOO_SMALL = int(abi.Status.BUFFER_TOO_SMALL)
STATUS_UNSUPPORTED = int(abi.Status.UNSUPPORTED)
STATUS_UNSUPPORTED_VERSION = int(abi.Status.UNSUPPORTED_VERSION)
HANDLE_FLAG_EVENT = abi.HANDLE_FLAG_EVENT
HANDLE_MAX_TEXT_SIZE = abi.HANDLE_MAX_TEXT_SIZE
REF_COUNTER_HEADER = 64  # PyTorch's RefcountedMapAllocator header; slot k is at 64 + 8k
#: PyTorch's allocator settings, cleared in every case child unless the case sets them.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


class Lib:
    """The few devshare functions this suite calls directly."""

    def __init__(self, path: str):
        self.path = path
        d = ctypes.CDLL(path)
        d.devshare_version.restype = c_uint32
        d.devshare_version.argtypes = []
        d.devshare_status_str.restype = c_char_p
        d.devshare_status_str.argtypes = [c_int32]
        d.devshare_last_error.restype = c_size_t
        d.devshare_last_error.argtypes = [c_char_p, c_size_t]
        d.devshare_probe.restype = c_int32
        d.devshare_probe.argtypes = [c_uint16, POINTER(BackendInfo)]
        d.devshare_handle_from_torch.restype = c_int32
        d.devshare_handle_from_torch.argtypes = [POINTER(TorchArgs), POINTER(Handle)]
        d.devshare_handle_to_text.restype = c_int32
        d.devshare_handle_to_text.argtypes = [POINTER(Handle), c_char_p, c_size_t, POINTER(c_size_t)]
        d.devshare_handle_from_text.restype = c_int32
        d.devshare_handle_from_text.argtypes = [c_char_p, POINTER(Handle)]
        d.devshare_handle_from_torch_encoded.restype = c_int32
        d.devshare_handle_from_torch_encoded.argtypes = [POINTER(TorchArgs), c_void_p, c_size_t,
                                                         POINTER(c_size_t)]
        d.devshare_allow_ptrace.restype = c_int32
        d.devshare_allow_ptrace.argtypes = [c_int32]
        d.devshare_torch_handle_convert.restype = c_int32
        d.devshare_torch_handle_convert.argtypes = [c_uint16, c_char_p, c_size_t, c_uint32, c_void_p, c_size_t,
                                                    POINTER(c_size_t)]
        # devshare_<struct>_init for the structs this suite passes (struct_size and defaults).
        for cls in (Handle, TorchArgs, BackendInfo):
            fn = getattr(d, abi.INIT_FUNCTIONS[cls])
            fn.restype = c_int32
            # devshare_handle_init(T *); the others (T *, uint32_t size): DevshareHandle's size
            # never changes.
            fn.argtypes = [POINTER(cls)] if cls is Handle else [POINTER(cls), c_uint32]
        self.d = d

    def new(self, cls, **fields):
        """A ``cls`` made by its devshare_<struct>_init (struct_size set), then ``fields`` set."""
        s = cls()
        fn = getattr(self.d, abi.INIT_FUNCTIONS[cls])
        st = fn(byref(s)) if len(fn.argtypes) == 1 else fn(byref(s), sizeof(cls))
        if st != STATUS_OK:
            raise RuntimeError(f"{abi.INIT_FUNCTIONS[cls]}: {self.status_name(st)}: {self.last_error()}")
        names = {f[0] for f in cls._fields_}
        for k, v in fields.items():
            if k not in names:
                raise TypeError(f"{cls.__name__} has no field {k!r}")
            setattr(s, k, v)
        return s

    def convert(self, handle: bytes, fmt: int) -> bytes:
        """devshare_torch_handle_convert: a CUDA storage handle rewritten in format ``fmt``."""
        n = c_size_t()
        buf = ctypes.create_string_buffer(len(handle) + 8)
        st = self.d.devshare_torch_handle_convert(BACKEND_CUDA, handle, len(handle), fmt, buf, len(buf), byref(n))
        if st != STATUS_OK:
            raise CaseFail(f"devshare_torch_handle_convert: {self.status_name(st)}: {self.last_error()}")
        return buf.raw[: n.value]

    def version(self) -> str:
        v = int(self.d.devshare_version())
        return f"{v >> 16}.{(v >> 8) & 0xFF}.{v & 0xFF}"

    def last_error(self) -> str:
        buf = ctypes.create_string_buffer(2048)
        self.d.devshare_last_error(buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def status_name(self, st: int) -> str:
        s = self.d.devshare_status_str(st)
        return s.decode() if s else str(st)

    def probe_cuda(self) -> tuple[bool, str]:
        info = self.new(BackendInfo)
        st = self.d.devshare_probe(BACKEND_CUDA, byref(info))
        if st != STATUS_OK:
            return False, f"devshare_probe failed: {self.status_name(st)}: {self.last_error()}"
        return bool(info.usable), info.detail.decode("utf-8", "replace")

    def _torch_args(self, *, shape, strides, tensor_offset, dtype, device, handle: bytes,
                    storage_size, storage_offset, ref_name: bytes, ref_slot,
                    event_handle: bytes, event_sync, producer_pid=0):
        """(DevshareTorchArgs, buffers to keep alive while it is used)."""
        ndim = len(shape)
        shape_arr = (c_int64 * max(ndim, 1))(*shape)
        strides_arr = (c_int64 * max(ndim, 1))(*strides)
        keep = [shape_arr, strides_arr]

        def buf(b: bytes):
            arr = (c_uint8 * max(len(b), 1)).from_buffer_copy(b.ljust(1, b"\0"))
            keep.append(arr)
            return cast(arr, POINTER(c_uint8)), len(b)

        hp, hl = buf(handle)
        rp, rl = buf(ref_name)
        ep, el = buf(event_handle)
        a = self.new(
            TorchArgs, backend=BACKEND_CUDA, dtype=DType(*dtype), ndim=ndim,
            shape=cast(shape_arr, POINTER(c_int64)), strides=cast(strides_arr, POINTER(c_int64)),
            tensor_offset=tensor_offset, device=device, producer_pid=producer_pid,
            handle=hp, handle_len=hl, storage_size=storage_size, storage_offset=storage_offset,
            ref_name=rp, ref_name_len=rl, ref_slot=ref_slot, event_handle=ep,
            event_handle_len=el, event_sync_required=1 if event_sync else 0)
        return a, keep

    def from_torch_fields(self, **fields):
        """(status, Handle, message) from the fields of a reduce_tensor tuple."""
        a, keep = self._torch_args(**fields)
        h = self.new(Handle)
        st = self.d.devshare_handle_from_torch(byref(a), byref(h))
        msg = self.last_error() if st != STATUS_OK else ""
        del keep
        return st, h, msg

    def from_torch_text(self, **fields):
        """(status, text, message) from the fields of a reduce_tensor tuple, through
        devshare_handle_from_torch_encoded: the byte encoding, which also carries an expandable
        segment's table when it is too long for a DevshareHandle, as text ("devshare1:" +
        unpadded URL-safe base64, the form devshare_import_text reads)."""
        a, keep = self._torch_args(**fields)
        n = c_size_t()
        st = self.d.devshare_handle_from_torch_encoded(byref(a), None, 0, byref(n))
        if st == STATUS_BUFFER_TOO_SMALL:
            buf = ctypes.create_string_buffer(n.value)
            st = self.d.devshare_handle_from_torch_encoded(byref(a), buf, n.value, byref(n))
        del keep
        if st != STATUS_OK:
            return st, "", self.last_error()
        return st, text_of_encoding(buf.raw[: n.value]), ""

    def allow_ptrace(self, pid: int) -> None:
        """devshare_allow_ptrace: let `pid` (-1 any, 0 none) take this process's fds."""
        st = self.d.devshare_allow_ptrace(pid)
        if st != STATUS_OK:
            raise CaseFail(f"devshare_allow_ptrace({pid}): {self.status_name(st)}: {self.last_error()}")

    def torch_discard(self, **fields):
        """devshare_torch_discard (return a tuple's reference unopened): (status, message), or
        None when this library does not have it."""
        fn = getattr(self.d, "devshare_torch_discard", None)
        if fn is None:
            return None
        fn.restype = c_int32
        fn.argtypes = [POINTER(TorchArgs)]
        a, keep = self._torch_args(**fields)
        st = fn(byref(a))
        msg = self.last_error() if st != STATUS_OK else ""
        del keep
        return st, msg

    def to_text(self, h: Handle) -> str:
        n = c_size_t()
        cap = HANDLE_MAX_TEXT_SIZE
        for _ in range(2):  # a newer library may write longer text: it says how long
            buf = ctypes.create_string_buffer(cap)
            st = self.d.devshare_handle_to_text(byref(h), buf, len(buf), byref(n))
            if st != STATUS_BUFFER_TOO_SMALL:
                break
            cap = n.value + 1
        if st != STATUS_OK:
            raise CaseFail(f"devshare_handle_to_text: {self.status_name(st)}: {self.last_error()}")
        return buf.raw[: n.value].decode("ascii")


def text_of_encoding(data: bytes) -> str:
    """The text form of an encoded handle: "devshare1:" + unpadded URL-safe base64."""
    return "devshare1:" + base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def segments_of(h) -> dict | None:
    """A segmented DevshareHandle's description (its DEVSHARE_EXT_SEGMENTS record), or None."""
    if not h.flags & abi.HANDLE_FLAG_SEGMENTED:
        return None
    ext, i = bytes(h.ext[: h.ext_len]), 0
    while i + 4 <= len(ext):
        kind, n = int.from_bytes(ext[i:i + 2], "little"), int.from_bytes(ext[i + 2:i + 4], "little")
        d = ext[i + 4:i + 4 + n]
        if kind == abi.EXT_SEGMENTS and n == 20:
            return {"segment_size": int.from_bytes(d[0:8], "little"), "count": int.from_bytes(d[8:12], "little"),
                    "kind": {abi.SEGMENTS_CUDA_FD: "fd", abi.SEGMENTS_CUDA_FABRIC: "fabric",
                             abi.SEGMENTS_ACL: "acl"}.get(int.from_bytes(d[12:14], "little"), "?"),
                    "inline": bool(int.from_bytes(d[14:16], "little") & abi.SEGMENTS_INLINE)}
        i += 4 + n
    return None


def ptrace_scope() -> str | None:
    """Yama's kernel.yama.ptrace_scope, or None without Yama."""
    try:
        return pathlib.Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return None


def torch_dtype_to_dlpack(torch, dt) -> tuple[int, int, int]:
    table = {
        torch.float32: (2, 32, 1), torch.float64: (2, 64, 1), torch.float16: (2, 16, 1),
        torch.bfloat16: (4, 16, 1), torch.int8: (0, 8, 1), torch.int16: (0, 16, 1),
        torch.int32: (0, 32, 1), torch.int64: (0, 64, 1), torch.uint8: (1, 8, 1),
        torch.bool: (6, 8, 1),
    }
    if dt not in table:
        raise CaseFail(f"dtype {dt} is not mapped in this suite")
    return table[dt]


# --- Verdicts ----------------------------------------------------------------------------------


class CaseFail(Exception):
    pass


class CaseSkip(Exception):
    pass


def info(msg: str) -> None:
    for line in str(msg).splitlines() or [""]:
        print(f"INFO {line}", flush=True)


def check(cond, why: str) -> None:
    if not cond:
        raise CaseFail(why)


# --- Context shared by the cases (inside a case child) ------------------------------------------


class Ctx:
    def __init__(self, bundle: pathlib.Path):
        self.bundle = bundle
        self.tool = str(bundle / "gpu_tool")
        self.lib = Lib(os.environ.get("DEVSHARE_LIBRARY") or str(bundle / "libdevshare.so"))
        self._torch = None

    # torch, imported on first use (the C-only cases do not need it)
    @property
    def torch(self):
        if self._torch is None:
            import torch  # noqa: PLC0415

            if not torch.cuda.is_available():
                raise CaseFail("torch.cuda.is_available() is False")
            torch.cuda.init()
            self._torch = torch
            # gpu_tool writes PyTorch storage handles in this torch's format (2.13+: version 3).
            os.environ["DEVSHARE_GPU_TORCH_VERSION"] = str(torch.__version__)
        return self._torch

    @property
    def reductions(self):
        self.torch  # noqa: B018 - import and check
        import torch.multiprocessing.reductions as r  # noqa: PLC0415

        return r

    def torch_fields(self, args) -> dict:
        """The DevshareTorchArgs fields of the 15 args of reduce_tensor."""
        torch = self.torch
        check(len(args) == 15, f"reduce_tensor gave {len(args)} args, not 15")
        return dict(
            shape=list(args[1]), strides=list(args[2]), tensor_offset=int(args[3]),
            dtype=torch_dtype_to_dlpack(torch, args[5]), device=int(args[6]),
            handle=bytes(args[7] or b""), storage_size=int(args[8]),
            storage_offset=int(args[9]), ref_name=bytes(args[11] or b""),
            ref_slot=int(args[12] or 0), event_handle=bytes(args[13] or b""),
            event_sync=bool(args[14]))

    def args_to_handle(self, args, expect_ok=True):
        """devshare_handle_from_torch on the 15 args of reduce_tensor: (status, Handle, msg)."""
        st, h, msg = self.lib.from_torch_fields(**self.torch_fields(args))
        if expect_ok and st != STATUS_OK:
            raise CaseFail(f"devshare_handle_from_torch: {self.lib.status_name(st)} ({st}): {msg}")
        return st, h, msg

    def args_to_text(self, args) -> str:
        return self.lib.to_text(self.args_to_handle(args)[1])

    def args_to_text_full(self, args) -> str:
        """Text of the handle of a reduce_tensor tuple through devshare_handle_from_torch_encoded:
        also right for an expandable segment whose table does not fit a DevshareHandle."""
        st, text, msg = self.lib.from_torch_text(**self.torch_fields(args))
        if st != STATUS_OK:
            raise CaseFail(f"devshare_handle_from_torch_encoded: {self.lib.status_name(st)} ({st}): {msg}")
        return text

    def run_tool(self, argv, timeout, input_text=None) -> subprocess.CompletedProcess:
        cmd = [self.tool] + [str(a) for a in argv]
        try:
            r = subprocess.run(cmd, input=input_text, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CaseFail(f"gpu_tool {argv[0]} timed out after {timeout} s") from None
        if r.stderr.strip():
            sys.stderr.write(f"[gpu_tool {argv[0]} stderr]\n{r.stderr}")
        return r

    def consume(self, text, n, start, write, timeout=60) -> str:
        """gpu_tool consume; returns its OK line or raises CaseFail with its FAIL line."""
        r = self.run_tool(["consume", text, n, repr(float(start)), repr(float(write))], timeout)
        out = r.stdout.strip().splitlines()
        last = out[-1] if out else ""
        if r.returncode != 0 or not last.startswith("OK"):
            raise CaseFail(f"gpu_tool consume (rc {r.returncode}): {last or r.stderr.strip()[-400:]}")
        return last

    def producer(self, n, start, timeout_ms, mode="sync") -> "Producer":
        return Producer([self.tool, "produce", str(n), repr(float(start)), str(timeout_ms), mode])

    def producer_vmm(self, nseg, n, offset, start, timeout_ms, *options) -> "Producer":
        """gpu_tool produce-vmm: a C VMM (cuMemCreate + map) producer of nseg 2 MiB segments."""
        return Producer([self.tool, "produce-vmm", str(nseg), str(n), str(offset), repr(float(start)),
                         str(timeout_ms), *options])


class Producer:
    """A gpu_tool produce process whose stdout lines are read by a thread."""

    def __init__(self, cmd):
        self.cmd = cmd
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.err: list[str] = []
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_err(self):
        for line in self.p.stderr:
            self.err.append(line)
            sys.stderr.write(f"[gpu_tool produce] {line}")

    def wait_line(self, prefixes, timeout) -> str:
        if isinstance(prefixes, str):
            prefixes = (prefixes,)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CaseFail(f"gpu_tool produce: no {'/'.join(prefixes)} line within {timeout} s "
                               f"(seen: {self.seen[-3:]})")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                self.p.wait()
                raise CaseFail(f"gpu_tool produce exited (rc {self.p.returncode}) before a "
                               f"{'/'.join(prefixes)} line; last lines: {self.seen[-3:]} "
                               f"stderr: {''.join(self.err)[-400:].strip()}")
            self.seen.append(line)
            if line.startswith("FAIL"):
                raise CaseFail(f"gpu_tool produce: {line}")
            if line.startswith(prefixes):
                return line

    def handle_and_torch(self, timeout=60):
        h = self.wait_line("HANDLE", timeout).split(None, 1)[1]
        t = self.wait_line("TORCH", timeout).split()
        check(len(t) == 9, f"TORCH line has {len(t)} fields, not 9: {t}")

        def unhex(s):
            return b"" if s == "-" else bytes.fromhex(s)

        fields = {
            "device": int(t[1]), "handle": unhex(t[2]), "size": int(t[3]), "offset": int(t[4]),
            "ref_name": unhex(t[5]), "slot": int(t[6]), "event": unhex(t[7]), "sync": t[8] == "1",
        }
        return h, fields

    def finish(self, timeout=60) -> tuple[str, str]:
        """(RELEASED/TIMEOUT line, AFTER line); FAIL unless the producer exits 0."""
        rel = self.wait_line(("RELEASED", "TIMEOUT"), timeout)
        after = self.wait_line("AFTER", 30)
        try:
            rc = self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise CaseFail("gpu_tool produce did not exit after reporting") from None
        check(rel.startswith("RELEASED"), f"producer: {rel} (the consumer's reference never came back)")
        check(rc == 0, f"gpu_tool produce exited with {rc}")
        return rel, after

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def after_fields(line: str) -> dict:
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def read_ref_slot(name: bytes, slot: int):
    """The int64 in PyTorch's ref-counter object `name` at slot `slot` (None if it is gone)."""
    path = "/dev/shm/" + bytes(name).decode().lstrip("/")
    try:
        with open(path, "rb") as f:
            f.seek(REF_COUNTER_HEADER + 8 * int(slot))
            b = f.read(8)
    except OSError:
        return None
    return int.from_bytes(b, "little", signed=True) if len(b) == 8 else None


def decrement_ref_slot(name: bytes, slot: int) -> None:
    """Return a reference by hand, as a consumer would (used where no consumer can)."""
    path = "/dev/shm/" + bytes(name).decode().lstrip("/")
    with open(path, "r+b") as f:
        f.seek(REF_COUNTER_HEADER + 8 * int(slot))
        v = int.from_bytes(f.read(8), "little", signed=True)
        f.seek(REF_COUNTER_HEADER + 8 * int(slot))
        f.write((v - 1).to_bytes(8, "little", signed=True))


def describe_args(args) -> str:
    h = bytes(args[7] or b"")
    form = ("raw 64-byte" if len(h) == 64 else
            f"version {h[0]} '{chr(h[1])}' {len(h)}-byte" if len(h) >= 2 else f"{len(h)}-byte")
    return (f"storage handle: {form}; storage_size={args[8]} storage_offset={args[9]} "
            f"ref={bytes(args[11] or b'').decode(errors='replace')}[{args[12]}] "
            f"event_sync_required={bool(args[14])}")


def mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


# --- Cases ------------------------------------------------------------------------------------


def c_consumer_reads_and_writes_a_c_export_window(cx: Ctx):
    """C producer (gpu_tool produce) -> C consumer (gpu_tool consume), sync and event shares."""
    n = 1 << 18
    for mode, start, write in (("sync", 5.0, -3.0), ("event", 17.0, -4.0)):
        prod = cx.producer(n, start, 30000, mode)
        try:
            text, tf = prod.handle_and_torch()
            r = cx.run_tool(["describe", text], 30)
            info(f"{mode}: {r.stdout.strip()[:300]}")
            check(tf["sync"] == (mode == "event"),
                  f"{mode}: TORCH event_sync_required is {tf['sync']}")
            ok = cx.consume(text, n, start, write)
            info(f"{mode}: consumer: {ok}")
            rel, after = prod.finish()
            a = after_fields(after)
            check(a["first"] == write and a["last"] == write,
                  f"{mode}: producer sees {after}, expected the consumer's {write}")
            check(a["pad"] == -1.0, f"{mode}: the consumer wrote outside the tensor: {after}")
            info(f"{mode}: producer: {rel}; {after}")
        finally:
            prod.kill()
    return "C->C over a CUDA IPC handle with offset 256 B, sync and event shares; writes seen, reference returned"


def c_consumer_of_a_torch_tensor_returns_its_reference_and_the_block_is_freed(cx: Ctx):
    """torch producer (reduce_tensor) -> gpu_tool consume; writes, ref slot, ipc_collect."""
    torch, red = cx.torch, cx.reductions
    dev = torch.device("cuda", 0)
    n, start, write = 1 << 20, 1000.0, -5.0
    torch.cuda.synchronize()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    t = torch.arange(n, dtype=torch.float32, device=dev).add_(start)
    fn, args = red.reduce_tensor(t)
    check(fn is red.rebuild_cuda_tensor, f"reduce_tensor used {fn}, not rebuild_cuda_tensor")
    info(describe_args(args))
    text = cx.args_to_text(args)
    ref, slot = bytes(args[11]), int(args[12])
    before = read_ref_slot(ref, slot)
    check(before == 1, f"ref-counter slot before the consumer is {before}, expected 1")
    ok = cx.consume(text, n, start, write)
    info(f"consumer: {ok}")
    torch.cuda.synchronize()
    check(bool((t == write).all()), f"torch does not see the consumer's writes: t[0]={t[0].item()}")
    after = read_ref_slot(ref, slot)
    check(after == 0, f"ref-counter slot after the consumer released is {after}, expected 0")
    info(f"ref-counter {ref.decode()} slot {slot}: 1 -> 0")

    a_held, r_held = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    del t, fn, args
    gc.collect()
    a_del = torch.cuda.memory_allocated()
    torch.cuda.ipc_collect()
    a_col, r_col = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    r_empty = torch.cuda.memory_reserved()
    info(f"memory_allocated: base {mib(base_alloc)}, holding {mib(a_held)}, after del {mib(a_del)}, "
         f"after ipc_collect {mib(a_col)}")
    info(f"memory_reserved: base {mib(base_res)}, holding {mib(r_held)}, after ipc_collect "
         f"{mib(r_col)}, after empty_cache {mib(r_empty)}")
    check(a_col <= base_alloc and a_held - a_col >= 4 * n,
          f"memory_allocated did not drop after del + ipc_collect ({a_held} -> {a_col}, base {base_alloc})")
    check(r_empty < r_held, f"memory_reserved did not drop ({r_held} -> {r_empty})")

    # Limbo: the producer frees its tensor while the consumer still holds the reference; the
    # block must stay allocated (and intact) until the consumer releases, then ipc_collect frees it.
    start2 = 2000.0
    t2 = torch.arange(n, dtype=torch.float32, device=dev).add_(start2)
    torch.cuda.synchronize()
    _, args2 = red.reduce_tensor(t2)
    text2 = cx.args_to_text(args2)
    ref2, slot2 = bytes(args2[11]), int(args2[12])
    a_with = torch.cuda.memory_allocated()
    del t2, args2
    gc.collect()
    torch.cuda.ipc_collect()
    a_limbo = torch.cuda.memory_allocated()
    check(a_limbo >= a_with, f"the block was freed while the consumer's reference was outstanding "
          f"({a_with} -> {a_limbo})")
    ok = cx.consume(text2, n, start2, write)
    check(read_ref_slot(ref2, slot2) == 0, "limbo: slot not 0 after the consumer released")
    torch.cuda.ipc_collect()
    a_freed = torch.cuda.memory_allocated()
    info(f"limbo: allocated with tensor {mib(a_with)}, after del (slot 1) {mib(a_limbo)}, "
         f"after consumer release + ipc_collect {mib(a_freed)}")
    check(a_limbo - a_freed >= 4 * n, f"ipc_collect did not free the block after the release "
          f"({a_limbo} -> {a_freed})")
    return "values read, writes seen by torch, slot 1->0, block freed (also from limbo via ipc_collect)"


def c_consumer_holds_64_torch_tensors_packed_in_one_block(cx: Ctx):
    """64 x 1000 float32 tensors packed in one caching-allocator block, one consumer."""
    torch, red = cx.torch, cx.reductions
    dev = torch.device("cuda", 0)
    count, n = 64, 1000
    ts = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(count)]
    for i, t in enumerate(ts):
        torch.arange(n, out=t)
        t.add_(float(i * 1000))
    shares = [red.reduce_tensor(t)[1] for t in ts]
    groups: dict[bytes, list[int]] = {}
    for i, a in enumerate(shares):
        groups.setdefault(bytes(a[7]), []).append(i)
    sizes = sorted((len(v) for v in groups.values()), reverse=True)
    pairs = {(bytes(a[7]), int(a[9])) for a in shares}
    info(f"{count} tensors in {len(groups)} block(s) (tensors per block: {sizes}); storage offsets "
         f"{sorted(int(a[9]) for a in shares)[:6]}...; storage_size {shares[0][8]}")
    check(sizes[0] >= count // 2, f"expected the tensors packed in one block, got groups {sizes}")
    check(len(pairs) == count, "two tensors have the same (handle, storage offset)")
    lines = []
    for i, a in enumerate(shares):
        lines.append(f"{cx.args_to_text(a)} {n} {float(i * 1000)!r} {float(-(i + 1))!r}")
    r = cx.run_tool(["consume-many"], 90, "\n".join(lines) + "\n")
    out = r.stdout.strip().splitlines()
    fails = [ln for ln in out if ln.startswith("FAIL")]
    done = [ln for ln in out if ln.startswith("DONE")]
    check(not fails and r.returncode == 0, f"consume-many: {fails[:3] or out[-3:]}")
    info(f"consumer: {done[0] if done else out[-1:]}")
    torch.cuda.synchronize()
    bad = [i for i, t in enumerate(ts) if not bool((t == -(i + 1)).all())]
    check(not bad, f"tensors {bad[:5]} do not show the consumer's writes")
    slots = [read_ref_slot(bytes(a[11]), int(a[12])) for a in shares]
    check(all(s == 0 for s in slots), f"ref-counter slots after release: {slots[:8]}...")
    return f"{count} tensors from {len(groups)} block(s) read and written by one consumer; all slots 0"


def _storage_class(torch):
    """What reduce_tensor passes as arg 4 on this torch: type(tensor._typed_storage())."""
    probe = torch.empty(1, device="cuda")
    try:
        return type(probe._typed_storage())
    except AttributeError:
        return type(probe.untyped_storage())


def _c_to_torch(cx: Ctx, mode: str):
    torch, red = cx.torch, cx.reductions
    n, start, write = 1 << 18, 3.0, 9.0
    prod = cx.producer(n, start, 30000, mode)
    try:
        text, f = prod.handle_and_torch()
        info(f"TORCH fields: device {f['device']}, {len(f['handle'])}-byte handle, size {f['size']}, "
             f"offset {f['offset']}, ref {f['ref_name'].decode(errors='replace')}[{f['slot']}], "
             f"event_sync_required {f['sync']}")
        check(f["sync"] == (mode == "event"), f"event_sync_required is {f['sync']} for mode {mode}")
        storage_cls = _storage_class(torch)
        info(f"storage class (as reduce_tensor passes it): {storage_cls.__module__}.{storage_cls.__name__}")
        args = (torch.Tensor, torch.Size([n]), (1,), 0, storage_cls, torch.float32, f["device"],
                f["handle"], f["size"], f["offset"], False, f["ref_name"], f["slot"], f["event"],
                f["sync"])
        t = red.rebuild_cuda_tensor(*args)
        check(t.is_cuda and tuple(t.shape) == (n,) and t.dtype == torch.float32,
              f"rebuilt tensor is {t.device} {tuple(t.shape)} {t.dtype}")
        want = torch.arange(n, dtype=torch.float32, device=t.device).add_(start)
        check(bool(torch.equal(t, want)), f"values differ: t[:4]={t[:4].tolist()}, "
              f"expected {want[:4].tolist()}")
        t.fill_(write)
        torch.cuda.synchronize()
        del t, want
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        rel, after = prod.finish()
        a = after_fields(after)
        info(f"producer: {rel}; {after}")
        check(a["first"] == write and a["last"] == write, f"producer does not see torch's writes: {after}")
        check(a["pad"] == -1.0, f"torch wrote outside the tensor: {after}")
    finally:
        prod.kill()


def rebuild_cuda_tensor_opens_a_c_export(cx: Ctx):
    """gpu_tool produce (sync share) -> rebuild_cuda_tensor in torch."""
    _c_to_torch(cx, "sync")
    return "rebuild_cuda_tensor opened the C export (raw 64-byte handle, offset 256), values and writes ok, RELEASED"


def rebuild_cuda_tensor_waits_on_a_c_exports_event(cx: Ctx):
    """gpu_tool produce (DEVSHARE_SHARE_EVENT) -> rebuild_cuda_tensor waits on the IPC event."""
    _c_to_torch(cx, "event")
    return "torch consumer waited on devshare's IPC event; values and writes ok, RELEASED"


def c_consumer_waits_on_the_event_for_a_busy_torch_side_stream(cx: Ctx):
    """torch writes on a side stream behind ~1.5 s of GPU work and shares at once (event)."""
    torch, red = cx.torch, cx.reductions
    dev = torch.device("cuda", 0)
    n, start, write = 1 << 20, 11.0, -7.0
    # Keep the side stream busy with float32 matrix products: time a few, then queue ~1.5 s.
    a = torch.randn(4096, 4096, device=dev)
    b = torch.randn(4096, 4096, device=dev)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        torch.mm(a, b, out=c)
    e1.record()
    e1.synchronize()
    per_mm = max(e0.elapsed_time(e1) / 10, 1e-3)
    sleep_ms = 1500
    count = min(max(int(sleep_ms / per_mm), 1), 100_000)
    info(f"GPU work: {count} products of 4096 x 4096 float32 at {per_mm:.2f} ms each "
         f"(CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '<unset>')})")
    t = torch.zeros(n, dtype=torch.float32, device=dev)
    values = torch.arange(n, dtype=torch.float32, device=dev) + start
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(count):
            torch.mm(a, b, out=c)
        # A copy, not arange(out=): on torch 2.11 arange(out=) waited for the stream.
        t.copy_(values)
        busy_before = not s.query()
        t0 = time.monotonic()
        _, args = red.reduce_tensor(t)
    shared_at = time.monotonic()
    share_ms = (shared_at - t0) * 1000
    pending = not s.query()
    info(describe_args(args))
    info(f"side stream busy before the share: {busy_before}; reduce_tensor took {share_ms:.0f} ms; "
         f"busy after it: {pending} (GPU work ~{sleep_ms} ms)")
    check(busy_before, "the side stream had finished before the share, so the consumer's wait on "
          "the event could not be tested")
    # Whether torch's share waited for the stream itself (then nothing is left for the event).
    torch_waited = not pending and share_ms > sleep_ms / 2
    check(pending or torch_waited, "the side stream finished during the share, which took only "
          f"{share_ms:.0f} ms of the ~{sleep_ms} ms of work")
    check(bool(args[14]), "event_sync_required is False: torch synchronised instead of sending an "
          "event (more than 1000 events in flight?)")
    text = cx.args_to_text(args)
    h = cx.lib.new(Handle)
    check(cx.lib.d.devshare_handle_from_text(text.encode(), byref(h)) == STATUS_OK
          and h.flags & HANDLE_FLAG_EVENT, "the devshare handle does not carry the event flag")
    ok = cx.consume(text, n, start, write)
    took = (time.monotonic() - shared_at) * 1000
    info(f"consumer: {ok}; finished {took:.0f} ms after the share")
    torch.cuda.synchronize()
    check(bool((t == write).all()), "torch does not see the consumer's writes")
    check(read_ref_slot(bytes(args[11]), int(args[12])) == 0, "ref-counter slot not 0 after release")
    if torch_waited:
        raise CaseSkip(f"this torch's reduce_tensor waited for the side stream itself ({share_ms:.0f} "
                       "ms), so no work was left behind the event for the consumer to wait on "
                       "(values, writes and the event flag were checked)")
    check(took > sleep_ms / 3, f"the consumer finished {took:.0f} ms after the share, before the "
          f"side stream's ~{sleep_ms} ms of work could have ended: it did not wait on the event")
    return f"consumer read the side stream's values through the IPC event ({took:.0f} ms after share)"


def measure_cold_against_cached_cuda_import(cx: Ctx):
    """gpu_tool bench-import: cold (IPC open+close) vs cached import+release."""
    prod = cx.producer(1024, 0.0, 60000, "sync")
    try:
        text, _ = prod.handle_and_torch()
        r = cx.run_tool(["bench-import", text, 200], 50)
        out = r.stdout.strip().splitlines()
        check(r.returncode == 0 and out and out[-1] == "RELEASED", f"bench-import: {out[-2:]}")
        for ln in out:
            info(ln)
        rel, _ = prod.finish()
        stats = {}
        for ln in out:
            if ln.startswith(("COLD_US", "CACHED_US")):
                kv = dict(x.split("=") for x in ln.split()[1:])
                stats[ln.split()[0]] = float(kv["p50"])
        cold, cached = stats.get("COLD_US"), stats.get("CACHED_US")
        check(cold is not None and cached is not None, "missing COLD_US / CACHED_US lines")
        info(f"import+release p50: cold {cold:.1f} us, cached {cached:.1f} us, "
             f"ratio {cold / max(cached, 1e-3):.0f}x")
    finally:
        prod.kill()
    return f"measurement: cold {cold:.1f} us vs cached {cached:.1f} us per import+release (p50)"


def _queue_consumer(q, ack):
    """torch.multiprocessing consumer of measure_handoff_latency_against_torch_multiprocessing_queue
    (spawned): touch each tensor, drop it, answer."""
    import torch  # noqa: PLC0415

    torch.zeros(1, device="cuda")
    ack.put("ready")
    while True:
        x = q.get()
        if x is None:
            break
        v = float(x[0].item())
        del x
        ack.put(v)


def _p(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def measure_handoff_latency_against_torch_multiprocessing_queue(cx: Ctx):
    """Per-tensor handoff latency: devshare text handle over a pipe vs torch.multiprocessing.Queue."""
    torch, red = cx.torch, cx.reductions
    import torch.multiprocessing as mp  # noqa: PLC0415

    dev = torch.device("cuda", 0)
    iters, warm = 200, 10
    sizes = [("4 KiB", 4096), ("64 MiB", 64 << 20)]
    results: dict[tuple[str, str], list[float]] = {}

    serve = subprocess.Popen([cx.tool, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, bufsize=1)
    ctx = mp.get_context("spawn")
    q, ack = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_queue_consumer, args=(q, ack), daemon=True)
    try:
        line = serve.stdout.readline().strip()
        check(line == "READY", f"gpu_tool serve: {line!r}")
        proc.start()
        check(ack.get(timeout=90) == "ready", "torch.multiprocessing consumer did not start")
        for label, nbytes in sizes:
            n = nbytes // 4
            # devshare: reduce_tensor -> devshare_handle_from_torch -> text -> pipe -> import,
            # read element 0, release -> "OK"
            t = torch.full((n,), 1.5, dtype=torch.float32, device=dev)
            torch.cuda.synchronize()
            times = []
            for i in range(warm + iters):
                t0 = time.perf_counter()
                _, args = red.reduce_tensor(t)
                serve.stdin.write(cx.args_to_text(args) + "\n")
                serve.stdin.flush()
                line = serve.stdout.readline().strip()
                t1 = time.perf_counter()
                check(line.startswith("OK"), f"gpu_tool serve: {line!r}")
                if i >= warm:
                    times.append((t1 - t0) * 1e6)
            results[("devshare", label)] = times
            del t, args
            gc.collect()
            torch.cuda.ipc_collect()
            # torch.multiprocessing.Queue with the same tensor size
            t = torch.full((n,), 2.5, dtype=torch.float32, device=dev)
            torch.cuda.synchronize()
            times = []
            for i in range(warm + iters):
                t0 = time.perf_counter()
                q.put(t)
                v = ack.get(timeout=60)
                t1 = time.perf_counter()
                check(v == 2.5, f"torch consumer read {v}")
                if i >= warm:
                    times.append((t1 - t0) * 1e6)
            results[("torch.mp.Queue", label)] = times
            del t
            gc.collect()
            torch.cuda.ipc_collect()
        q.put(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        serve.stdin.close()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
    info(f"handoff latency, {iters} iterations after {warm} warm-up (producer share -> consumer "
         f"opened, touched, released, answered), microseconds")
    info(f"{'size':>8} | {'devshare p50':>12} {'p90':>8} | {'mp.Queue p50':>12} {'p90':>8} | "
         f"{'Queue/devshare':>14}")
    ratios = []
    for label, _ in sizes:
        d, tq = results[("devshare", label)], results[("torch.mp.Queue", label)]
        ratio = statistics.median(tq) / max(statistics.median(d), 1e-3)
        ratios.append(f"{label}: {ratio:.2f}x")
        info(f"{label:>8} | {statistics.median(d):12.1f} {_p(d, 0.9):8.1f} | "
             f"{statistics.median(tq):12.1f} {_p(tq, 0.9):8.1f} | {ratio:14.2f}")
    return "measurement: p50 Queue/devshare " + ", ".join(ratios)


def _es_args(cx: Ctx, t):
    """reduce_tensor of a tensor in an expandable segment: the args, or CaseSkip when this torch
    does not give an 'e' handle."""
    try:
        _, args = cx.reductions.reduce_tensor(t)
    except Exception as e:  # noqa: BLE001
        raise CaseSkip(f"this torch cannot share expandable-segment memory: {type(e).__name__}: "
                       f"{str(e)[:200]}") from None
    h = bytes(args[7] or b"")
    if len(h) < 2 or h[1:2] != b"e":
        _return_reference(cx, args)
        raise CaseSkip(f"torch shared a {len(h)}-byte non-'e' handle with "
                       f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r} "
                       f"(expandable segments not in use on this torch/driver?)")
    want = torch_handle_version(cx.torch.__version__)
    if h[0] != want:
        _return_reference(cx, args)
        raise CaseFail(f"torch {cx.torch.__version__} wrote an 'e' handle of version {h[0]}; interop.md "
                       f"says {want} (2.5-2.12: 2, 2.13 and later: 3)")
    return args


def torch_handle_version(version: str) -> int:
    """The storage-handle version a PyTorch release writes: 2.5-2.12 2, 2.13 and later 3."""
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2])
    return 3 if (major, minor) >= (2, 13) else 2


def _return_reference(cx: Ctx, args) -> None:
    """No consumer will open args: return its reference (devshare_torch_discard)."""
    if args[11]:
        r = cx.lib.torch_discard(**cx.torch_fields(args))
        if r is None:
            decrement_ref_slot(bytes(args[11]), int(args[12]))


def torch_expandable_segment_handles_read_as_segmented_handles(cx: Ctx):
    """expandable_segments:True producer -> 'e' handle -> devshare_handle_from_torch reads it."""
    torch = cx.torch
    info(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    t = torch.ones(1 << 20, dtype=torch.float32, device="cuda")
    try:
        _, args = cx.reductions.reduce_tensor(t)
    except Exception as e:  # noqa: BLE001
        raise CaseSkip(f"this torch cannot share expandable-segment memory: {type(e).__name__}: "
                       f"{str(e)[:200]}") from None
    h = bytes(args[7] or b"")
    if len(h) < 2 or h[1:2] != b"e" or h[0] != 2:
        try:
            if len(h) < 2 or h[1:2] != b"e":
                raise CaseSkip(f"torch shared a {len(h)}-byte non-'e' handle (expandable segments not "
                               f"in use on this torch/driver?)")
            _check_refused_version(cx, args, h[0])
        finally:
            _return_reference(cx, args)
        return (f"torch {torch.__version__} writes 'e' version {h[0]}: refused by name (its layout is "
                f"not confirmed); version 2 is what devshare reads")
    try:
        info(f"storage handle: {len(h)} bytes, version {h[0]} 'e'; {describe_args(args)}")
        st, hs, msg = cx.args_to_handle(args, expect_ok=False)
        info(f"devshare_handle_from_torch: {cx.lib.status_name(st)} ({st}) {msg}".rstrip())
        check(st == STATUS_OK, f"devshare_handle_from_torch refused an 'e' handle: {st}: {msg}")
        seg = segments_of(hs)
        check(seg is not None, f"the handle is not segmented (flags {hs.flags:#x})")
        info(f"segments: {seg}; producer_pid {hs.producer_pid} (this process {os.getpid()}); "
             f"alloc_size {hs.alloc_size}, storage_offset {hs.storage_offset}, storage_size {hs.storage_size}")
        check(hs.producer_pid == os.getpid(), f"producer_pid {hs.producer_pid} is not this process's")
        check(seg["kind"] in ("fd", "fabric") and seg["count"] >= 1
              and hs.alloc_size == seg["count"] * seg["segment_size"], f"segments {seg}")
        check(hs.storage_offset + hs.storage_size <= hs.alloc_size, "storage past the last segment")
    finally:
        _return_reference(cx, args)
        info(f"ref-counter slot after devshare_torch_discard: {read_ref_slot(bytes(args[11]), int(args[12]))}")
    return f"'e' handle read: {seg['count']} x {seg['segment_size']} B {seg['kind']} segments"


def c_consumers_read_torch_tensors_in_expandable_segments(cx: Ctx):
    """expandable_segments:True torch -> C consumer: packed storages, a storage spanning segments, a long table."""
    torch = cx.torch
    dev = torch.device("cuda", 0)
    info(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}; ptrace_scope "
         f"{ptrace_scope() or 'absent (no Yama)'}")
    # The consumers are this process's children, not its ancestors: under Yama ptrace_scope 1
    # they may not take our fds unless we say so (PyTorch never does; devshare only on request).
    cx.lib.allow_ptrace(-1)
    try:
        # 1. Several storages packed in one segment: 16 x 1000 float32 (small pool, 2 MiB segments).
        count, n = 16, 1000
        ts = [torch.arange(n, dtype=torch.float32, device=dev).add_(float(i * 1000)) for i in range(count)]
        torch.cuda.synchronize()
        shares = [_es_args(cx, ts[0])] + [cx.reductions.reduce_tensor(t)[1] for t in ts[1:]]
        handles = [cx.args_to_handle(a)[1] for a in shares]
        segs = [segments_of(h) for h in handles]
        check(all(segs), "a packed storage did not give a segmented handle")
        groups: dict[bytes, list[int]] = {}
        for h in handles:  # storages whose handles name the same segments (their inline tables)
            groups.setdefault(bytes(h.key[: h.key_len]), []).append(h.storage_offset)
        sizes = sorted((len(v) for v in groups.values()), reverse=True)
        info(f"packed: {count} storages in {len(groups)} segment list(s) (storages per list: {sizes}); "
             f"segments {segs[0]}; offsets {sorted(next(iter(groups.values())))[:5]}...")
        check(sizes[0] >= 2, f"expected storages packed in one segment, got {sizes}")
        check(all(len(set(v)) == len(v) for v in groups.values()), "two storages of one segment share an offset")
        lines = [f"{cx.args_to_text_full(a)} {n} {float(i * 1000)!r} {float(-(i + 1))!r}"
                 for i, a in enumerate(shares)]
        r = cx.run_tool(["consume-many"], 90, "\n".join(lines) + "\n")
        out = r.stdout.strip().splitlines()
        check(r.returncode == 0 and not [x for x in out if x.startswith("FAIL")], f"consume-many: {out[-3:]}")
        info(f"packed consumer: {out[-1]}")
        torch.cuda.synchronize()
        bad = [i for i, t in enumerate(ts) if not bool((t == -(i + 1)).all())]
        check(not bad, f"packed storages {bad[:5]} do not show the consumer's writes")
        slots = [read_ref_slot(bytes(a[11]), int(a[12])) for a in shares]
        check(all(v == 0 for v in slots), f"ref-counter slots after release: {slots}")

        # 2. A storage that spans segments, behind another block (a non-zero storage offset).
        pad = torch.empty(3 << 20, dtype=torch.float32, device=dev)  # 12 MiB
        n2 = 12 << 20  # 48 MiB: spans at least 3 segments of the 20 MiB large pool
        big = torch.arange(n2, dtype=torch.float32, device=dev).remainder_(1 << 20)
        torch.cuda.synchronize()
        a2 = _es_args(cx, big)
        h2 = cx.args_to_handle(a2)[1]
        s2 = segments_of(h2)
        info(f"spanning: {s2}, storage_offset {h2.storage_offset}, storage_size {h2.storage_size}")
        check(s2 and h2.storage_offset % s2["segment_size"] + h2.storage_size > s2["segment_size"],
              "the 48 MiB storage does not span segments")
        ok = cx.consume(cx.args_to_text_full(a2), 1 << 20, 0.0, 7.0, timeout=120)
        info(f"spanning consumer: {ok}")
        torch.cuda.synchronize()
        check(bool((big == 7.0).all()), "the spanning storage does not show the consumer's writes")
        check(read_ref_slot(bytes(a2[11]), int(a2[12])) == 0, "spanning: slot not 0 after release")
        del pad

        # 2b. The version bridge: this torch's 'e' handle rewritten in the other version (3 -> 2
        # on torch 2.13+, 2 -> 3 before) opens through devshare's parser for that version.
        tb = torch.arange(1000, dtype=torch.float32, device=dev).add_(5000.0)
        torch.cuda.synchronize()
        ab = list(_es_args(cx, tb))
        own, before = ab[7][0], len(ab[7])
        ab[7] = cx.lib.convert(bytes(ab[7]), 2 if own == 3 else 3)
        # The version-2 header is 8 bytes shorter (no handle type and its padding).
        check(ab[7][0] == (2 if own == 3 else 3) and len(ab[7]) == before + (-8 if own == 3 else 8),
              f"bridged handle: {ab[7][:2]!r}, {len(ab[7])} bytes (from {before})")
        ok = cx.consume(cx.args_to_text_full(tuple(ab)), 1000, 5000.0, -5.0, timeout=60)
        info(f"bridge: version {own} -> {ab[7][0]} 'e' handle, consumer: {ok}")
        torch.cuda.synchronize()
        check(bool((tb == -5.0).all()), "bridged handle: the consumer's writes are not seen")
        check(read_ref_slot(bytes(ab[11]), int(ab[12])) == 0, "bridged handle: slot not 0 after release")

        # 3. A segment table too long for the handle struct (over 32 fds): it travels in the text.
        n3 = 176_000_000  # 704 MB: 34+ segments of 20 MiB
        huge = torch.zeros(n3, dtype=torch.float32, device=dev)
        huge[: 1 << 20] = torch.arange(1 << 20, dtype=torch.float32, device=dev)
        torch.cuda.synchronize()
        a3 = _es_args(cx, huge)
        h3 = cx.args_to_handle(a3)[1]
        s3 = segments_of(h3)
        info(f"long table: {s3}, {len(bytes(a3[7]))}-byte 'e' handle")
        check(s3 and not s3["inline"], f"expected a table too long for the struct, got {s3}")
        ok = cx.consume(cx.args_to_text_full(a3), 1 << 20, 0.0, 3.0, timeout=150)
        info(f"long-table consumer: {ok}")
        torch.cuda.synchronize()
        check(float(huge[0]) == 3.0 and float(huge[-1]) == 3.0, "long table: writes not seen")
        check(read_ref_slot(bytes(a3[11]), int(a3[12])) == 0, "long table: slot not 0 after release")
        del huge

        # 4. The package, when present: devshare.share(tensor in an expandable segment).
        try:
            import devshare  # noqa: PLC0415
        except Exception as e:  # noqa: BLE001
            info(f"package part skipped: import devshare failed: {e}")
        else:
            t4 = torch.arange(1 << 16, dtype=torch.float32, device=dev)
            hp = devshare.share(t4)
            check(getattr(hp, "segmented", False), "devshare.share gave a handle that is not segmented")
            cx.consume(hp.to_text(), 1 << 16, 0.0, -9.0)
            torch.cuda.synchronize()
            check(bool((t4 == -9.0).all()), "devshare.share: writes not seen")
            info("package: devshare.share(expandable-segment tensor) -> C consumer: ok")
    finally:
        cx.lib.allow_ptrace(0)
    return "packed, spanning and long-table expandable-segment storages read and written by C consumers; slots 0"


def rebuild_cuda_tensor_opens_a_c_vmm_export_across_segments(cx: Ctx):
    """C VMM producer (cuMemCreate + devshare_export_segments) -> stock rebuild_cuda_tensor of the 'e' tuple."""
    torch, red = cx.torch, cx.reductions
    storage_cls = _storage_class(torch)
    info(f"consumer: torch {torch.__version__} (stock rebuild_cuda_tensor); ptrace_scope "
         f"{ptrace_scope() or 'absent (no Yama)'} (the consumer is the producer's parent: allowed)")
    done = []
    for nseg, where in ((3, "inline"), (40, "external")):
        n, offset, start, write = 1_000_000, (1 << 20) + 4096, 2.0, 5.0  # spans segments 0..2
        prod = cx.producer_vmm(nseg, n, offset, start, 60000)
        try:
            text, f = prod.handle_and_torch()
            seg = next((x for x in prod.seen if x.startswith("SEGMENTS")), "")
            info(f"{nseg} segments: {seg}; TORCH handle {len(f['handle'])} bytes, offset {f['offset']}")
            check(f"table={where}" in seg, f"expected the table {where}: {seg}")
            # gpu_tool writes the format of this torch (DEVSHARE_GPU_TORCH_VERSION).
            v = torch_handle_version(torch.__version__)
            header = 34 if v == 3 else 26
            check(f["handle"][:2] == bytes([v]) + b"e" and len(f["handle"]) == header + 4 * nseg,
                  f"the TORCH handle is not a version-{v} 'e' form of {nseg} fds: {f['handle'][:8].hex()}")
            args = (torch.Tensor, torch.Size([n]), (1,), 0, storage_cls, torch.float32, f["device"],
                    f["handle"], f["size"], f["offset"], False, f["ref_name"], f["slot"], f["event"],
                    f["sync"])
            t = red.rebuild_cuda_tensor(*args)
            want = torch.arange(n, dtype=torch.float32, device=t.device).add_(start)
            check(bool(torch.equal(t, want)), f"values differ: t[:4]={t[:4].tolist()}")
            t.fill_(write)
            torch.cuda.synchronize()
            del t, want
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            rel, after = prod.finish()
            a = after_fields(after)
            info(f"{nseg} segments: producer {rel}; {after}")
            check(a["first"] == write and a["last"] == write, f"producer does not see torch's writes: {after}")
            check(a["pad"] == -1.0, f"torch wrote outside the tensor: {after}")
            done.append(f"{nseg} ({where})")
        finally:
            prod.kill()
    return f"rebuild_cuda_tensor opened devshare's 'e' tuples of {' and '.join(done)} segments; writes seen, RELEASED"


def sibling_consumer_is_refused_under_ptrace_scope_1_unless_allowed(cx: Ctx):
    """Yama ptrace_scope=1: a sibling consumer of a C VMM producer is refused with devshare's message."""
    scope = ptrace_scope()
    if scope != "1":
        raise CaseSkip(f"kernel.yama.ptrace_scope is {scope if scope is not None else 'absent (no Yama)'}, not 1: "
                       f"the sibling-permission failure this case checks only happens under ptrace_scope=1")
    n, start = 4096, 1.0
    # The producer and the consumer are both children of this process: siblings.
    prod = cx.producer_vmm(2, n, 0, start, 5000)
    try:
        text, _ = prod.handle_and_torch()
        r = cx.run_tool(["consume", text, n, repr(start), "2.0"], 60)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        info(f"sibling consumer (rc {r.returncode}): {last[:400]}")
        check(r.returncode != 0 and last.startswith("FAIL"), "the sibling consumer was not refused")
        for words in ("pidfd_getfd", "ptrace_scope is 1", "devshare_allow_ptrace", "PR_SET_PTRACER"):
            check(words in last, f"the message does not name {words!r}: {last}")
        rel = prod.wait_line(("RELEASED", "TIMEOUT"), 30)
        check(rel.startswith("TIMEOUT"), f"the refused consumer returned the reference: {rel}")
    finally:
        prod.kill()
    # The fix the message names: the producer allows its consumers (devshare_allow_ptrace(-1)).
    prod = cx.producer_vmm(2, n, 0, start, 30000, "allow-ptrace")
    try:
        text, _ = prod.handle_and_torch()
        ok = cx.consume(text, n, start, 2.0)
        rel, _ = prod.finish()
        info(f"with devshare_allow_ptrace(-1): consumer {ok}; producer {rel}")
    finally:
        prod.kill()
    return "sibling refused under ptrace_scope=1 with the cause and the fix named; devshare_allow_ptrace fixes it"


def c_consumer_imports_c_vmm_exports_with_inline_and_text_tables(cx: Ctx):
    """C VMM producer -> C consumer (devshare_import_text): inline and long tables, fd and fabric."""
    done = []
    for nseg, opts in ((3, ()), (40, ()), (3, ("fabric",))):
        n, offset, start, write = 1_000_000, (1 << 20) + 4096, 4.0, -6.0
        prod = cx.producer_vmm(nseg, n, offset, start, 30000, "allow-ptrace", *opts)
        try:
            try:
                text, _ = prod.handle_and_torch()
            except CaseFail as e:
                if "fabric" in opts and "cuMemCreate (fabric)" in str(e):
                    info(f"fabric handles are not supported here (no multi-node NVLink / IMEX): {e}")
                    continue
                raise
            seg = next((x for x in prod.seen if x.startswith("SEGMENTS")), "")
            ok = cx.consume(text, n, start, write)
            rel, after = prod.finish()
            a = after_fields(after)
            info(f"{seg}: consumer {ok}; producer {rel}; {after}")
            check(a["first"] == write and a["last"] == write and a["pad"] == -1.0, f"{seg}: {after}")
            done.append(seg.split(" ", 1)[1] if " " in seg else seg)
        finally:
            prod.kill()
    return "C VMM export -> C import: " + "; ".join(done)


def python_package_cuda_api_shares_with_c_and_torch(cx: Ctx):
    """The devshare Python package's CUDA API, if present."""
    try:
        import devshare  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        raise CaseSkip(f"import devshare failed: {e}") from None
    missing = [f for f in ("torch_args", "handle_from_torch", "share", "open") if not hasattr(devshare, f)]
    if missing:
        raise CaseSkip(f"devshare has no {', '.join(missing)} (package CUDA API not there yet)")
    torch, red = cx.torch, cx.reductions
    info(f"devshare package from {pathlib.Path(devshare.__file__).parent}, library {devshare.library_path}")
    n, start = 1 << 16, 21.0

    # 1. C producer -> devshare.open (rebuild_cuda_tensor underneath) -> RELEASED
    prod = cx.producer(n, start, 30000, "event")
    try:
        text, _ = prod.handle_and_torch()
        x = devshare.open(text)
        want = torch.arange(n, dtype=torch.float32, device=x.device).add_(start)
        check(x.is_cuda and bool(torch.equal(x, want)), f"devshare.open: {x.device} {x[:4].tolist()}")
        x.fill_(4.0)
        torch.cuda.synchronize()
        del x, want
        gc.collect()
        rel, after = prod.finish()
        check(after_fields(after)["first"] == 4.0, f"producer does not see the writes: {after}")
        info(f"open(C handle): ok; producer {rel}")
    finally:
        prod.kill()

    # 2. torch_args(handle) -> rebuild_cuda_tensor
    prod = cx.producer(n, start, 30000, "sync")
    try:
        text, _ = prod.handle_and_torch()
        args = devshare.torch_args(devshare.Handle.from_text(text))
        check(len(args) == 15, f"torch_args returned {len(args)} items")
        y = red.rebuild_cuda_tensor(*args)
        check(bool((y[:8] == torch.arange(8, device=y.device).float().add_(start)).all()),
              f"torch_args -> rebuild_cuda_tensor: {y[:4].tolist()}")
        y.fill_(6.0)
        torch.cuda.synchronize()
        del y, args
        gc.collect()
        rel, after = prod.finish()
        check(after_fields(after)["first"] == 6.0, f"producer does not see the writes: {after}")
        info(f"torch_args -> rebuild_cuda_tensor: ok; producer {rel}")
    finally:
        prod.kill()

    # 3. devshare.share(cuda tensor) -> gpu_tool consume
    t = torch.arange(n, dtype=torch.float32, device="cuda").add_(start)
    h = devshare.share(t)
    cx.consume(h.to_text(), n, start, -1.0)
    torch.cuda.synchronize()
    check(bool((t == -1.0).all()), "share(): torch does not see the consumer's writes")
    info("share(cuda tensor) -> C consumer: ok")

    # 4. handle_from_torch(reduce_tensor args) -> gpu_tool consume
    t2 = torch.arange(n, dtype=torch.float32, device="cuda").add_(start)
    h2 = devshare.handle_from_torch(red.reduce_tensor(t2)[1], "cuda")
    cx.consume(h2.to_text(), n, start, -2.0)
    torch.cuda.synchronize()
    check(bool((t2 == -2.0).all()), "handle_from_torch: torch does not see the consumer's writes")
    info("handle_from_torch(reduce_tensor args) -> C consumer: ok")
    return "open, torch_args, share and handle_from_torch work with CUDA tensors"


# --- Pools over a channel: fixed slot addresses, CUDA graphs replayed on them -----------------

#: The pattern gpu_tool produce-pool writes: element j of item i is (i % 4096) + (j % 1024) * 4096.
POOL_ITEM_PERIOD, POOL_ELEMENT_PERIOD = 4096, 1024


def pool_address(tag: str) -> str:
    """A Linux abstract socket name for one producer of this process."""
    return f"@devshare-gpu-suite-{os.getpid()}-{tag}"


def start_pool_producer(tool: str, kind: str, address: str, slots: int, n: int, items: int,
                        timeout_ms: int = 60000) -> tuple["Producer", str]:
    """gpu_tool produce-pool: (the producer, its READY line) once it listens."""
    prod = Producer([tool, "produce-pool", kind, address, str(slots), str(n), str(items), str(timeout_ms)])
    try:
        ready = prod.wait_line("READY", 60)
    except BaseException:
        prod.kill()
        raise
    return prod, ready


def finish_pool_producer(prod: "Producer", items: int) -> str:
    """The producer's DONE line (every slot came back, the consumer detached); FAIL otherwise."""
    done = prod.wait_line("DONE", 60)
    try:
        rc = prod.p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        prod.kill()
        raise CaseFail("gpu_tool produce-pool did not exit after DONE") from None
    check(rc == 0, f"gpu_tool produce-pool exited with {rc}")
    check(f"items={items} " in done, f"producer: {done}")
    return done


class CudaGraphs:
    """CUDA graphs: capture(fn) warms fn up on a side stream, captures it into one
    torch.cuda.CUDAGraph and returns the graph (whose replay() reruns its kernels on the
    addresses seen at capture)."""

    def __init__(self, torch):
        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())

    def capture(self, fn):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def sync(self):
        self.torch.cuda.current_stream().synchronize()


class EagerGraphs:
    """The dry run's stand-in for CudaGraphs (CPU, no GPU): capture(fn) keeps fn, whose tensors
    are the ones seen at capture, and replay() calls it again — on the captured tensors, so on
    the captured addresses, as a CUDA graph would."""

    class Graph:
        def __init__(self, fn):
            self.replay = fn

    def __init__(self, torch):
        self.torch = torch
        self.device = torch.device("cpu")

    def capture(self, fn):
        fn()
        return self.Graph(fn)

    def sync(self):
        pass


def graph_replay_consumer(devshare, graphs, address: str, *, slots: int, n: int, timed: int,
                          timeout: float = 60.0, fault: str = "") -> dict:
    """The consumer of one produce-pool run of 2 x (slots + timed) items, in two phases.

    Phase "graph": one graph per slot, captured on that slot's first item (out = x * 2 + 1 into
    a persistent output tensor); every later item only replays its slot's graph. A slot whose
    address changed would need its graph captured again: that is counted (a recapture) and
    fails the run. Phase "clone": every item is copied into one fixed input tensor, and one
    graph captured on that tensor is replayed. Every output is compared with the reference of
    the item's pattern. Per-item time: from the return of recv to the release after the output
    is ready (the time spent waiting for the producer is not in it), over the last `timed`
    items of each phase. ``fault="stale"`` captures phase 1 on a copy of the slot instead (a
    graph bound to the wrong address), which the output check must catch."""
    torch = graphs.torch
    dev = graphs.device
    per_phase = slots + timed
    j = torch.arange(n, dtype=torch.int64, device=dev)
    base2 = ((j % POOL_ELEMENT_PERIOD) * POOL_ITEM_PERIOD * 2 + 1).to(torch.float32)  # 2*pattern(0)+1
    del j
    conn = devshare.connect(address, timeout=timeout)
    state = {"captures": 0, "recaptures": 0, "slot_ptr": {}, "base": None, "pool": None, "slot_bytes": 4 * n,
             "moves": []}
    times = {"graph": [], "clone": []}
    recv_us = []
    item_no = 0

    def receive():
        t0 = time.perf_counter()
        item = conn.recv(timeout=timeout)
        t1 = time.perf_counter()
        recv_us.append((t1 - t0) * 1e6)
        x = item.tensor
        check(tuple(x.shape) == (n,) and x.dtype == torch.float32 and x.device.type == dev.type,
              f"item {item_no}: tensor {tuple(x.shape)} {x.dtype} on {x.device}, expected ({n},) float32 on {dev}")
        check(item.pool is not None and item.slot is not None and 0 <= item.slot < slots,
              f"item {item_no}: not a slot of the pool (pool {item.pool}, slot {item.slot})")
        if state["pool"] is None:
            state["pool"] = item.pool
        check(item.pool == state["pool"], f"item {item_no}: pool {item.pool}, earlier items {state['pool']}")
        # Fixed addresses: noted here, failed at the end (after the graphs had to cope with it).
        p = x.data_ptr()
        base = p - item.slot * state["slot_bytes"]
        if state["base"] is None:
            state["base"] = base
        if base != state["base"]:
            state["moves"].append(f"item {item_no}: slot {item.slot} at {p:#x} puts the pool at {base:#x}, "
                                  f"earlier items at {state['base']:#x} (one mapping of the allocation expected)")
        first = state["slot_ptr"].setdefault(item.slot, p)
        if first != p:
            state["moves"].append(f"item {item_no}: slot {item.slot} moved from {first:#x} to {p:#x}")
            state["slot_ptr"][item.slot] = p
        return item, x, t1

    def expect(out, what):
        want = base2 + float(2 * (item_no % POOL_ITEM_PERIOD))
        if not bool(torch.equal(out, want)):
            bad = int((out != want).nonzero()[0, 0])
            raise CaseFail(f"{what}: item {item_no} output element {bad} is {float(out[bad])}, expected "
                           f"{float(want[bad])} (2 x the producer's value + 1)")

    try:
        # Phase "graph": one graph per slot, on the slot's own address.
        per_slot = {}  # slot -> (graph, captured input, output, address)
        for k in range(per_phase):
            item, x, t0 = receive()
            entry = per_slot.get(item.slot)
            captured = entry is None or entry[3] != x.data_ptr()
            if captured:
                if entry is not None:
                    state["recaptures"] += 1
                src = x.clone() if fault == "stale" else x
                out = torch.empty_like(x)

                def fn(src=src, out=out):
                    torch.mul(src, 2, out=out)
                    out.add_(1)

                g = graphs.capture(fn)
                state["captures"] += 1
                entry = per_slot[item.slot] = (g, src, out, x.data_ptr())
            entry[0].replay()
            graphs.sync()
            item.release()
            t1 = time.perf_counter()
            if k >= slots and not captured:
                times["graph"].append((t1 - t0) * 1e6)
            expect(entry[2], f"graph of slot {item.slot}")
            del item, x
            item_no += 1
        state["graph_slots"] = len(per_slot)
        # Phase "clone": copy into one fixed input, replay one graph.
        fixed_in = torch.empty(n, dtype=torch.float32, device=dev)
        fixed_out = torch.empty_like(fixed_in)

        def fixed_fn():
            torch.mul(fixed_in, 2, out=fixed_out)
            fixed_out.add_(1)

        g_fixed = None
        for k in range(per_phase):
            item, x, t0 = receive()
            fixed_in.copy_(x)
            if g_fixed is None:
                g_fixed = graphs.capture(fixed_fn)
                state["captures"] += 1
            g_fixed.replay()
            graphs.sync()
            item.release()
            t1 = time.perf_counter()
            if k >= slots:
                times["clone"].append((t1 - t0) * 1e6)
            expect(fixed_out, "the fixed-buffer graph")
            del item, x
            item_no += 1
    finally:
        # Drop the graphs and every tensor over the pool (their imports) before hanging up.
        per_slot = g_fixed = entry = g = src = out = fn = fixed_in = fixed_out = fixed_fn = None  # noqa: F841
        item = x = None  # noqa: F841
        gc.collect()
        graphs.sync()
        conn.close()
    check(state["recaptures"] == 0 and not state["moves"],
          f"{state['recaptures']} recapture(s) after a slot's first item; {len(state['moves'])} address "
          f"change(s): {'; '.join(state['moves'][:3])}")
    check(state["captures"] == state["graph_slots"] + 1,
          f"{state['captures']} captures for {state['graph_slots']} slots + 1 fixed-buffer graph")
    return {"items": item_no, "slots_used": len(state["slot_ptr"]), "captures": state["captures"],
            "recaptures": state["recaptures"], "graph_us": times["graph"], "clone_us": times["clone"],
            "recv_us": recv_us, "base": state["base"]}


def graph_replay_run(tool: str, devshare, graphs, kind: str, *, slots: int, n: int, timed: int,
                     fault: str = "", address: str = "") -> tuple[dict, str]:
    """One producer (gpu_tool produce-pool kind) and the consumer above: (figures, DONE line).
    `address`: where the producer listens (default: an abstract socket of this process)."""
    items = 2 * (slots + timed)
    address = address or pool_address(f"{kind}-{n}{'-' + fault if fault else ''}")
    prod, ready = start_pool_producer(tool, kind, address, slots, n, items)
    try:
        info(f"{kind}, {slots} slots of {4 * n} B: producer {ready}")
        r = graph_replay_consumer(devshare, graphs, address, slots=slots, n=n, timed=timed, fault=fault)
        done = finish_pool_producer(prod, items)
    finally:
        prod.kill()
    return r, done


def graph_replay_report(kind: str, n: int, r: dict) -> float:
    g, c = statistics.median(r["graph_us"]), statistics.median(r["clone_us"])
    ratio = c / max(g, 1e-3)
    info(f"{kind} {mib(4 * n):>10}: per item p50 graph-per-slot {g:8.1f} us, clone+one-graph {c:8.1f} us, "
         f"clone/graph {ratio:5.2f}x (p90 {_p(r['graph_us'], 0.9):.1f} / {_p(r['clone_us'], 0.9):.1f} us; "
         f"{len(r['graph_us'])} items each; {r['slots_used']} slots used, {r['captures']} captures, "
         f"{r['recaptures']} recaptures; recv p50 {statistics.median(r['recv_us']):.1f} us)")
    return ratio


def _import_devshare():
    try:
        import devshare  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        raise CaseFail(f"import devshare failed (run.sh puts the checkout's python/ on PYTHONPATH): "
                       f"{type(e).__name__}: {e}") from None
    if not hasattr(devshare, "connect"):
        raise CaseFail("devshare has no connect (the channel API)")
    return devshare


def c_pool_items_reach_a_c_consumer_at_fixed_slot_addresses(cx: Ctx):
    """C pool producer (cuMemAlloc and VMM exports) -> C consumer over a channel: patterns and fixed slot addresses."""
    done = []
    slots, n, items = 4, 300_000, 40  # 1.2 MB slots: in the VMM export some span 2 MiB segments
    for kind in ("cuda", "vmm"):
        address = pool_address(f"c-{kind}")
        prod, ready = start_pool_producer(cx.tool, kind, address, slots, n, items)
        try:
            r = cx.run_tool(["consume-pool", address, items, 60000], 90)
            last = (r.stdout.strip().splitlines() or [""])[-1]
            check(r.returncode == 0 and last.startswith("OK"), f"{kind}: consume-pool (rc {r.returncode}): {last}")
            fin = finish_pool_producer(prod, items)
            info(f"{kind}: producer {ready}")
            info(f"{kind}: consumer {last}")
            info(f"{kind}: producer {fin}")
            done.append(f"{kind} ({last.split('slots=')[1].count(':')} slots used)")
        finally:
            prod.kill()
    return f"{items} items each, every value and slot address checked: " + ", ".join(done)


def cuda_pool_slots_replay_captured_graphs_without_recapture(cx: Ctx):
    """CUDA graphs captured once per pool slot (devshare.connect / recv), replayed per item; vs clone into one buffer."""
    torch = cx.torch
    devshare = _import_devshare()
    graphs = CudaGraphs(torch)
    info(f"consumer: torch {torch.__version__}, devshare package {pathlib.Path(devshare.__file__).parent}")
    slots, timed = 4, 100
    ratios = []
    for kind in ("cuda", "vmm"):
        for n in (16_384, 4_194_304):  # 64 KiB and 16 MiB slots
            r, done = graph_replay_run(cx.tool, devshare, graphs, kind, slots=slots, n=n, timed=timed)
            ratios.append(f"{kind} {mib(4 * n)} {graph_replay_report(kind, n, r):.2f}x")
            info(f"{kind} {mib(4 * n)}: producer {done}")
    return "0 recaptures; per-item clone/graph-per-slot p50: " + ", ".join(ratios)


def free_tcp_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    import socket  # noqa: PLC0415
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def remote_channel_key() -> None:
    """A fresh channel key (0600) for this case's remote channels, named in the environment
    that the gpu_tool children inherit."""
    key = os.path.join(tempfile.mkdtemp(prefix="devshare-gpu-key-"), "channel.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(os.urandom(32))
    os.environ["DEVSHARE_CHANNEL_KEY_FILE"] = key


def ucx_loads() -> bool:
    """Whether UCX loads here (the remote channels' optional UCX path); says which."""
    ucx = os.environ.get("DEVSHARE_UCX_LIBRARY") or "libucp.so.0"
    try:
        ctypes.CDLL(ucx)
    except OSError as e:
        info(f"UCX ({ucx}) does not load here, its path is not tried: {e}")
        return False
    info(f"UCX: {os.environ.get('DEVSHARE_UCX_LIBRARY') or 'libucp.so.0 from the loader path'}")
    return True


# A plain TCP copy of `items` buffers of `size` bytes from host memory (the remote pools'
# baseline): argv = port, size, items; the child sends, the parent receives.
_TCP_SENDER = r"""
import socket, sys
port, size, items = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
buf = bytearray(b"\x5a" * size)
with socket.create_connection(("127.0.0.1", port)) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(items):
        s.sendall(buf)
"""


def tcp_copy_mb_s(size: int, items: int) -> float:
    """MB/s of a plain loopback TCP copy of `items` x `size` bytes (first byte to last)."""
    import socket  # noqa: PLC0415
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        child = subprocess.Popen([sys.executable, "-c", _TCP_SENDER, str(lst.getsockname()[1]), str(size),
                                  str(items)])
        conn, _ = lst.accept()
    buf = bytearray(size)
    view = memoryview(buf)
    with conn:
        got, total, t0 = 0, size * items, None
        while got < total:
            n = conn.recv_into(view[: min(size, total - got)])
            if n == 0:
                raise CaseFail(f"the TCP sender stopped after {got} of {total} bytes")
            if t0 is None:
                t0 = time.monotonic()
            got += n
        took = time.monotonic() - t0
    child.wait(timeout=60)
    return total / max(took, 1e-9) / 1e6


def remote_cuda_pool_slots_replay_captured_graphs_without_recapture(cx: Ctx):
    """cuda_pool_slots_replay_captured_graphs_without_recapture over a remote channel (tcp://127.0.0.1, items on the authenticated connection): Python consumer, CUDA items in its own memory."""
    devshare = _import_devshare()
    graphs = CudaGraphs(cx.torch)
    remote_channel_key()
    n = 16_384  # 64 KiB slots
    r, done = graph_replay_run(cx.tool, devshare, graphs, "cuda", slots=4, n=n, timed=100,
                               address=f"tcp://127.0.0.1:{free_tcp_port()}")
    ratio = graph_replay_report("remote cuda", n, r)
    info(f"remote cuda {mib(4 * n)}: producer {done}")
    return f"0 recaptures over tcp://; clone/graph-per-slot p50 {ratio:.2f}x"


def remote_cuda_pool_items_arrive_intact_at_fixed_addresses(cx: Ctx):
    """Remote channel (tcp://127.0.0.1) with CUDA pools: cuMemAlloc and VMM exports into the consumer's own device memory, on the stream path (and UCX where it loads); 16 MiB items against a plain TCP copy."""
    remote_channel_key()
    done = []
    # The default path (items on the authenticated connection), then UCX over TCP where it
    # loads. Device memory crosses through pinned host memory at both ends.
    paths = [("stream", None)] + ([("ucx", "tcp")] if ucx_loads() else [])

    def run(label: str, kind: str, slots: int, n: int, counts: tuple[int, int], mode: tuple = ()) -> float:
        """Seconds per item from the consumer's wall time for counts[1] minus counts[0] items
        (mode ("touch",): the consumer checks each item's first and last element only)."""
        took = {}
        for items in counts:
            address = f"tcp://127.0.0.1:{free_tcp_port()}"
            prod, ready = start_pool_producer(cx.tool, kind, address, slots, n, items)
            try:
                t0 = time.monotonic()
                r = cx.run_tool(["consume-pool", address, items, 60000, *mode], 120)
                took[items] = time.monotonic() - t0
                last = (r.stdout.strip().splitlines() or [""])[-1]
                if r.returncode != 0 or not last.startswith("OK"):
                    time.sleep(0.5)  # the producer's own FAIL line says more
                    raise CaseFail(f"{label} {kind}: consume-pool (rc {r.returncode}): {last}; "
                                   f"producer: {prod.seen[-2:]} {''.join(prod.err)[-300:].strip()}")
                fin = finish_pool_producer(prod, items)
            finally:
                prod.kill()
            if items == counts[0]:
                info(f"{label} {kind}: producer {ready}")
                info(f"{label} {kind}: consumer {last}")
                info(f"{label} {kind}: producer {fin}")
        return (took[counts[1]] - took[counts[0]]) / (counts[1] - counts[0])

    for path, tls in paths:
        os.environ["DEVSHARE_REMOTE_DATA"] = path
        if tls:
            os.environ["UCX_TLS"] = tls
        label = path + (f" UCX_TLS={tls}" if tls else "")
        for kind in ("cuda", "vmm"):
            n = 300_000  # 1.2 MB slots: in the VMM export some span 2 MiB segments
            per_item = run(label, kind, 4, n, (40, 240)) * 1e6
            info(f"{label} {kind}: {per_item:.0f} us per {mib(4 * n)} item, "
                 f"{4 * n / max(per_item, 1e-3):.0f} MB/s")
            done.append(f"{label} {kind} {per_item:.0f} us/item")
    # The target: 16 MiB CUDA items on the stream path at >= 0.8x a plain TCP copy from host memory.
    os.environ["DEVSHARE_REMOTE_DATA"] = "stream"
    size = 16 << 20
    # (The consumer touches each item's first and last element, as a plain TCP copy's reader
    # touches nothing: every element of every item was checked above.)
    per_item = run("stream 16 MiB", "cuda", 4, size // 4, (10, 50), ("touch",))
    mb_s = size / max(per_item, 1e-9) / 1e6
    tcp = tcp_copy_mb_s(size, 40)
    info(f"stream cuda 16 MiB: {mb_s:.0f} MB/s; plain TCP copy of the same bytes from host memory "
         f"{tcp:.0f} MB/s: {mb_s / tcp:.2f}x")
    done.append(f"16 MiB cuda on the stream path {mb_s:.0f} MB/s = {mb_s / tcp:.2f}x a plain TCP copy")
    os.environ.pop("DEVSHARE_REMOTE_DATA", None)
    return "every value and slot address checked, in the consumer's own memory: " + ", ".join(done)


# The consumer of torch_cuda_tensors_sent_on_a_channel_are_freed_once_returned (its own process):
# argv = address, count, numel. Prints ITEM <i> <ok> <device> per item (every element checked on the GPU), then DONE.
_SEND_CONSUMER = r"""
import sys
import devshare
import torch
address, count, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = devshare.connect(address, timeout=30)
for i in range(count):
    item = conn.recv(timeout=30)
    t = item.tensor
    ok = t.is_cuda and t.numel() == numel and bool((t == float(i)).all())
    print("ITEM", i, int(ok), t.device, flush=True)
    del t
    item.release()
print("DONE", flush=True)
"""


def a_device_lease_records_its_event_on_torchs_current_stream(cx: Ctx):
    """The stream a device lease's event goes on by default is torch's current stream of the
    tensor's device (read as a raw handle without a Stream object), also inside a side stream."""
    torch = cx.torch
    _import_devshare()
    from devshare import _torch_ipc

    t = torch.zeros(4, device="cuda")
    default = torch.cuda.current_stream(t.device).cuda_stream
    check(_torch_ipc.current_stream(t) == default,
          f"default stream: devshare {_torch_ipc.current_stream(t):#x}, torch {default:#x}")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = _torch_ipc.current_stream(t)
    check(got == side.cuda_stream and got != default,
          f"side stream: devshare {got:#x}, torch {side.cuda_stream:#x} (default {default:#x})")
    check(_torch_ipc.current_stream(t, side) == side.cuda_stream, "an explicit stream is that stream")
    return "the default and a side stream, as torch.cuda.current_stream gives them"


def torch_cuda_tensors_sent_on_a_channel_are_freed_once_returned(cx: Ctx):
    """torch CUDA tensors over a channel (Channel.send: reduce_tensor + adopt) to a Python consumer process; PyTorch's references come back."""
    torch = cx.torch
    devshare = _import_devshare()
    if not hasattr(devshare, "Channel"):
        raise CaseSkip("this devshare package has no Channel")
    count, numel = 12, 1 << 20
    address = pool_address("send")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with devshare.Channel(address) as ch:
        cons = subprocess.Popen([sys.executable, "-c", _SEND_CONSUMER, address, str(count), str(numel)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            peer = ch.wait_peers(1, timeout=30)[0]
            for i in range(count):
                t = torch.full((numel,), float(i), device="cuda")
                ch.send(peer, t)  # an event on the current stream; nothing synchronises
                del t
            held = torch.cuda.memory_allocated() - base
            out, err = cons.communicate(timeout=60)
        finally:
            if cons.poll() is None:
                cons.kill()
                cons.wait()
        lines = out.splitlines()
        items = [ln.split() for ln in lines if ln.startswith("ITEM")]
        check(lines[-1:] == ["DONE"] and len(items) == count,
              f"consumer (rc {cons.returncode}): {lines[-3:]} {err.strip()[-300:]}")
        bad = [it for it in items if it[2] != "1"]
        check(not bad, f"items with wrong values or not on a CUDA device: {bad[:3]}")
        info(f"{count} tensors of {numel} float32 sent; consumer saw them on {items[0][3]}; "
             f"held by the channel while out: {held / 2**20:.0f} MiB")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and torch.cuda.memory_allocated() > base:
            ch.service(0.05)
            ch.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - base
    info(f"memory_allocated after the leases came back: {after / 2**20:.2f} MiB above the start")
    check(after == 0, f"{after} bytes still allocated after every lease came back")
    return f"{count} CUDA tensors leased to a Python consumer, values checked on its GPU; every storage freed"


# The consumer of registered_sync_run: argv = address, tensors per sync, syncs, small tensors.
# Per sync: the batch (a dict) in one recv_batch, each tensor summed in float64 on its device
# (on the consumer's current stream, which waits on the producer's events), then released; then
# one line on stdin before the next. Then the small tensors, twice, each batch read only once
# stdin says "go" (the second one after the producer's send returned).
_REG_CONSUMER = r"""
import hashlib, sys
import devshare
import torch
address, n, syncs, small = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
conn = devshare.connect(address, timeout=30)
if torch.cuda.is_available():
    # A side stream, made current: the default stream's handle is 0, which set_stream takes as
    # "no stream" (wait on the host), and the event wait on a stream would go untested.
    side = torch.cuda.Stream()
    torch.cuda.set_stream(side)
    conn.set_stream(side)
for s in range(syncs):
    batch = conn.recv_batch(n, timeout=60)
    names = hashlib.sha1(",".join(batch).encode()).hexdigest()[:12] if isinstance(batch, dict) else "list"
    tensors = [it.tensor for it in (batch.values() if isinstance(batch, dict) else batch)]
    sums = [repr(float(t.double().sum())) for t in tensors]
    print("SYNC", tensors[0].device.type, names, *sums, flush=True)
    del tensors
    devshare.release_batch(batch)
    del batch
    sys.stdin.readline()
for s in range(2):
    sys.stdin.readline()
    batch = conn.recv_batch(small, timeout=60)
    firsts = torch.stack([it.tensor[0] for it in batch]).cpu()
    ok = bool((firsts == torch.arange(small, dtype=firsts.dtype) + s).all())
    print("SMALL", int(ok), flush=True)
    devshare.release_batch(batch)
    del batch, firsts
print("DONE", flush=True)
"""


def _lines_serving(ch, proc) -> "queue.Queue[str]":
    """A queue of ``proc``'s stdout lines, read by a thread (so that the caller serves ``ch``
    while it waits for one: see :func:`_line_serving`)."""
    lines: "queue.Queue[str]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put("")  # end of output

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _line_serving(ch, lines, proc, prefix: str, timeout: float = 60.0) -> str:
    """The consumer's next line, which must start with ``prefix``; the channel is served while
    waiting (a producer that only waited on a pipe would leave what its socket could not take
    in its send queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ch.service(0)
        try:
            line = lines.get(timeout=0.01)
        except queue.Empty:
            continue
        check(line.startswith(prefix), f"consumer said {line!r} instead of {prefix}... "
                                        f"(rc {proc.poll()}): {proc.stderr.read()[-400:] if proc.poll() is not None else ''}")
        return line
    raise CaseFail(f"no {prefix} line from the consumer within {timeout} s")


def registered_sync_run(torch, devshare, device: str) -> str:
    """A state dict registered once on a channel (views of one storage, a transposed view, bf16
    and float32) synced ten times to a Python consumer process, changed in place between syncs:
    every sum right, the names back as the dict's keys; then 2,500 small registered tensors
    synced twice, the second batch sent before the consumer reads (1,024 leases in its ring, the
    rest over the socket); everything freed after unregister."""
    import hashlib  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, 48, generator=g).to(device)
    sd = {"embed": torch.randn(100, 32, generator=g).to(device), "q": base[:32], "k_t": base[32:].t(),
          "bias": torch.randn(48, generator=g).to(device=device, dtype=torch.bfloat16)}
    for i in range(24):
        sd[f"layers.{i}.weight"] = torch.randn(32, 16, generator=g).to(device)
    n, syncs, small = len(sd), 10, 2500
    names = hashlib.sha1(",".join(sd).encode()).hexdigest()[:12]
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
    address = pool_address(f"register-{device}")
    with devshare.Channel(address) as ch:
        cons = subprocess.Popen([sys.executable, "-c", _REG_CONSUMER, address, str(n), str(syncs), str(small)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = _lines_serving(ch, cons)
            peer = ch.wait_peers(1, timeout=30)[0]
            ch.register(sd)
            retired = False
            for s in range(syncs):
                if s == syncs // 2:
                    # Retirement: the storages unregistered and freed (on a GPU the cache emptied
                    # too), new ones of the same shapes made (on a GPU likely at the same
                    # addresses) and registered: the consumer must see the new values, never
                    # its kept mapping of the old memory.
                    shapes = {k: (t.shape, t.dtype) for k, t in sd.items()}
                    check(ch.unregister(sd) == 0, "the state dict unregistered")
                    check(devshare.wait(list(sd.values()), timeout=30), "leases back before the free")
                    sd.clear()
                    del base
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    g2 = torch.Generator().manual_seed(6)
                    sd = {k: (torch.randn(*sh, generator=g2) * 3 + 7).to(device=device, dtype=dt)
                          for k, (sh, dt) in shapes.items()}
                    base = None
                    ch.register(sd)
                    retired = True
                with torch.no_grad():
                    for t in sd.values():
                        t.add_(1.0)  # in place: the consumer sees it on its next lease
                want = [float(t.double().sum()) for t in sd.values()]
                ch.send_batch(peer, sd)
                got = _line_serving(ch, lines, cons, "SYNC").split()
                check(got[1] == device and got[2] == names,
                      f"sync {s}: the consumer saw {got[1]} tensors named {got[2]} (want {device}, {names})")
                sums = [float(x) for x in got[3:]]
                bad = [(k, a, b) for k, a, b in zip(sd, sums, want) if abs(a - b) > 1e-9 * max(1.0, abs(b))]
                check(len(sums) == n and not bad, f"sync {s}: {len(sums)} sums, wrong: {bad[:3]}")
                check(devshare.wait(sd, timeout=30), f"sync {s}: leases not back within 30 s")
                cons.stdin.write("next\n")
                cons.stdin.flush()
            many = [torch.full((16,), float(i), device=device) for i in range(small)]
            ch.register(many)
            for s in range(2):
                if s == 0:  # the first sync offers each window: read while it is sent
                    cons.stdin.write("go\n")
                    cons.stdin.flush()
                else:
                    with torch.no_grad():
                        for t in many:
                            t.add_(1.0)
                ch.send_batch(peer, many)
                if s == 1:  # sent before the consumer reads any of it
                    cons.stdin.write("go\n")
                    cons.stdin.flush()
                got = _line_serving(ch, lines, cons, "SMALL")
                check(got == "SMALL 1", f"small sync {s}: wrong values")
                check(devshare.wait(many, timeout=60), f"small sync {s}: leases not back within 60 s")
            check(_line_serving(ch, lines, cons, "DONE") == "DONE", "consumer did not finish")
            check(ch.unregister() == 0, "everything unregistered")
            cons.wait(timeout=30)
        finally:
            if cons.poll() is None:
                cons.kill()
                cons.wait()
    check(cons.returncode == 0, f"consumer exited with {cons.returncode}: {cons.stderr.read()[-400:]}")
    t = None  # (the loops' last tensor)
    del sd, many, base
    gc.collect()
    freed = ""
    if device == "cuda":
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and torch.cuda.memory_allocated() > start:
            devshare.collect()
            gc.collect()
            time.sleep(0.05)
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - start
        check(left <= 0, f"{left} bytes still allocated after unregister and the channel's close")
        freed = "; every storage freed after unregister"
    info(f"{n} tensors x {syncs} syncs (new storages from sync {syncs // 2}), then {small} small tensors x 2 on {device}")
    check(retired, "the storages were replaced midway")
    return (f"{syncs} syncs of a registered state dict, sums and names right, also after its storages were freed "
            f"and made again; {small} leases sent unread fit{freed}")


def a_registered_cuda_state_dict_syncs_ten_times_and_thousands_of_unread_leases_fit(cx: Ctx):
    """A registered CUDA state dict synced ten times to a Python consumer (values changed in place, checked on its GPU; midway its storages unregistered, freed with the cache emptied, and made again), then 2,500 registered tensors sent before the consumer reads; all freed after unregister."""
    devshare = _import_devshare()
    if not hasattr(devshare.Channel, "register"):
        raise CaseSkip("this devshare package has no Channel.register")
    return registered_sync_run(cx.torch, devshare, "cuda")


# Each case is named by the behaviour it checks (its function's name); a case's timeout (s), extra
# environment, and whether it needs torch.
CASES = [(fn.__name__, fn, timeout, env, needs_torch) for fn, timeout, env, needs_torch in [
    (c_consumer_reads_and_writes_a_c_export_window, 60, {}, False),
    (c_consumer_of_a_torch_tensor_returns_its_reference_and_the_block_is_freed, 90, {}, True),
    (c_consumer_holds_64_torch_tensors_packed_in_one_block, 90, {}, True),
    (rebuild_cuda_tensor_opens_a_c_export, 60, {}, True),
    (rebuild_cuda_tensor_waits_on_a_c_exports_event, 60, {}, True),
    # Launches must be asynchronous for the stream to be busy at the share.
    (c_consumer_waits_on_the_event_for_a_busy_torch_side_stream, 60, {"CUDA_LAUNCH_BLOCKING": "0"}, True),
    (torch_expandable_segment_handles_read_as_segmented_handles, 60,
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    (python_package_cuda_api_shares_with_c_and_torch, 90, {}, True),
    (c_consumers_read_torch_tensors_in_expandable_segments, 150,
     {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    (rebuild_cuda_tensor_opens_a_c_vmm_export_across_segments, 90, {}, True),
    (cuda_pool_slots_replay_captured_graphs_without_recapture, 120, {}, True),
    (sibling_consumer_is_refused_under_ptrace_scope_1_unless_allowed, 60, {}, False),
    (c_consumer_imports_c_vmm_exports_with_inline_and_text_tables, 90, {}, False),
    (c_pool_items_reach_a_c_consumer_at_fixed_slot_addresses, 60, {}, False),
    (remote_cuda_pool_items_arrive_intact_at_fixed_addresses, 90, {}, False),
    (remote_cuda_pool_slots_replay_captured_graphs_without_recapture, 90, {}, True),
    (a_device_lease_records_its_event_on_torchs_current_stream, 60, {}, True),
    (torch_cuda_tensors_sent_on_a_channel_are_freed_once_returned, 90, {}, True),
    (a_registered_cuda_state_dict_syncs_ten_times_and_thousands_of_unread_leases_fit, 120, {}, True),
    (measure_cold_against_cached_cuda_import, 60, {}, False),
    (measure_handoff_latency_against_torch_multiprocessing_queue, 120, {}, True),
]]
NAME_WIDTH = max(len(c[0]) for c in CASES)


# --- Inside a child ------------------------------------------------------------------------


def child_case(bundle: pathlib.Path, name: str) -> int:
    fn = {c[0]: c[1] for c in CASES}[name]
    try:
        cx = Ctx(bundle)
        msg = fn(cx)
        print(f"RESULT PASS {msg or ''}", flush=True)
    except CaseSkip as e:
        print(f"RESULT SKIP {e}", flush=True)
    except CaseFail as e:
        print(f"RESULT FAIL {e}", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"RESULT FAIL {type(e).__name__}: {str(e)[:500]}", flush=True)
    return 0


def child_preflight(bundle: pathlib.Path) -> int:
    """Prints PREFLIGHT {json}: what is there, and whether torch and devshare can use CUDA."""
    r: dict = {"python": sys.version.split()[0]}
    try:
        lib = Lib(os.environ.get("DEVSHARE_LIBRARY") or str(bundle / "libdevshare.so"))
        r["devshare"] = lib.version()
        r["devshare_cuda"], r["devshare_detail"] = lib.probe_cuda()
    except OSError as e:
        r["devshare_cuda"], r["devshare_detail"] = False, f"cannot load libdevshare: {e}"
    try:
        import torch  # noqa: PLC0415

        r["torch"] = torch.__version__
        r["torch_cuda_build"] = torch.version.cuda
        r["torch_cuda"] = bool(torch.cuda.is_available())
        if r["torch_cuda"]:
            r["device"] = torch.cuda.get_device_name(0)
            r["device_count"] = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            r["device"] += f" (sm_{props.major}{props.minor}, {props.total_memory / (1 << 30):.0f} GiB)"
    except Exception as e:  # noqa: BLE001
        r["torch"] = None
        r["torch_cuda"] = False
        r["torch_error"] = f"{type(e).__name__}: {e}"
    r["driver"] = driver_version()
    print("PREFLIGHT " + json.dumps(r), flush=True)
    return 0


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi) and the CUDA version it supports
    (cuDriverGetVersion), as far as they can be found."""
    parts = []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            parts.append(out.stdout.strip().splitlines()[0].strip())
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        cuda = ctypes.CDLL(os.environ.get("DEVSHARE_CUDA_LIBRARY") or "libcuda.so.1")
        v = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(byref(v)) == 0 and v.value:
            parts.append(f"CUDA {v.value // 1000}.{v.value % 1000 // 10}")
    except (OSError, AttributeError):
        pass
    return ", ".join(parts) or None


# --- The parent ----------------------------------------------------------------------------


class Runner:
    def __init__(self, bundle: pathlib.Path):
        self.bundle = bundle
        self.start = time.monotonic()
        self.counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
        self.rows: list[tuple[str, str, float | None, str]] = []  # case, verdict, seconds, why
        self.env: dict | None = None  # the preflight's answer, for the closing ENV line

    def left(self) -> float:
        return RUN_BUDGET_S - (time.monotonic() - self.start)

    def verdict(self, kind: str, name: str, why: str = "", took: float | None = None,
                detail: str | None = None) -> None:
        self.counts[kind] += 1
        self.rows.append((name, kind, took, why if detail is None else detail))
        if kind == "PASS":
            print(f"PASS {name}" + (f" ({why})" if why else ""), flush=True)
        else:
            print(f"{kind} {name}: {why}", flush=True)

    def spawn(self, argv, timeout: float, env_extra=None, label=""):
        """Run this script as a child; yields (kind, text) for INFO/RESULT/PREFLIGHT lines.
        Returns (lines, rc, stderr_tail, timed_out)."""
        env = dict(os.environ)
        # Every case decides the allocator settings itself: a global expandable_segments:True
        # would turn every torch share into an 'e' handle.
        for k in ALLOC_CONF_VARS:
            env.pop(k, None)
        env.update(env_extra or {})
        errf = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen([sys.executable, "-u", str(pathlib.Path(__file__).resolve())] + argv,
                             stdout=subprocess.PIPE, stderr=errf, text=True, env=env,
                             start_new_session=True)
        lines: queue.Queue = queue.Queue()

        def reader():
            for line in p.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.monotonic() + timeout
        got, timed_out = [], False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            got.append(line)
            if line.startswith("INFO "):
                print(f"    {label}| {line[5:]}", flush=True)
        if timed_out:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the child and everything it started
            except ProcessLookupError:
                pass
        try:
            rc = p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(p.pid, signal.SIGKILL)  # leftovers (a gpu_tool the case did not reap)
        except (ProcessLookupError, PermissionError):
            pass
        errf.seek(0)
        err = errf.read()
        errf.close()
        return got, rc, err, timed_out

    def preflight(self) -> dict | None:
        got, rc, err, timed_out = self.spawn(["--bundle", str(self.bundle), "--child-preflight"],
                                             min(PREFLIGHT_TIMEOUT_S, self.left()))
        for line in got:
            if line.startswith("PREFLIGHT "):
                return json.loads(line[10:])
        why = "timed out" if timed_out else f"exit {rc}"
        self.verdict("FAIL", "preflight", f"the preflight child gave no answer ({why}): {err.strip()[-600:]}")
        return None

    def run_case(self, name, timeout, env_extra) -> None:
        budget = min(timeout, self.left())
        if budget < 10:
            self.verdict("SKIP", name, f"the run's {RUN_BUDGET_S:.0f} s budget is spent")
            return
        t0 = time.monotonic()
        got, rc, err, timed_out = self.spawn(["--bundle", str(self.bundle), "--child-case", name],
                                             budget, env_extra, label=name)
        took = time.monotonic() - t0
        result = next((ln for ln in reversed(got) if ln.startswith("RESULT ")), None)
        tail = "\n".join(err.strip().splitlines()[-15:])
        if timed_out:
            self.verdict("FAIL", name, f"timed out after {budget:.0f} s (killed)", took)
        elif result is None:
            self.verdict("FAIL", name, f"the case process died without a verdict (exit {rc})", took)
        else:
            kind, _, why = result[7:].partition(" ")
            if kind == "PASS":
                self.verdict("PASS", name, f"{why}; {took:.1f} s" if why else f"{took:.1f} s", took, why)
            else:
                self.verdict(kind, name, f"{why} ({took:.1f} s)", took, why)
            if kind != "FAIL":
                return
        if tail:
            print("    " + name + "| stderr (last lines):", flush=True)
            for ln in tail.splitlines():
                print(f"    {name}|   {ln}", flush=True)

    def table(self) -> None:
        """One line per case, as a Markdown table (to paste into a report)."""
        print("== results", flush=True)
        print("| case | result | s | detail |", flush=True)
        print("|---|---|---|---|", flush=True)
        for name, kind, took, why in self.rows:
            detail = why.replace("|", "/")
            detail = detail if len(detail) <= 160 else detail[:157] + "..."
            print(f"| {name} | {kind} | {'-' if took is None else f'{took:.1f}'} | {detail} |", flush=True)

    def env_line(self) -> str:
        """GPU, driver, torch and devshare in one line (from the preflight)."""
        e = self.env or {}
        return (f"ENV: GPU {e.get('device') or '-'}; driver {e.get('driver') or '-'}; torch {e.get('torch') or '-'} "
                f"(CUDA build {e.get('torch_cuda_build') or '-'}); devshare {e.get('devshare') or '-'}; python "
                f"{e.get('python') or '-'}; ptrace_scope {ptrace_scope() or 'absent'}; run "
                f"{time.monotonic() - self.start:.0f} s of the {RUN_BUDGET_S:.0f} s budget")

    def summary(self, table: bool = False) -> int:
        c = self.counts
        if table:
            self.table()
            print(self.env_line(), flush=True)
        print(f"SUMMARY: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped", flush=True)
        return 1 if c["FAIL"] else 0


def check_bundle(bundle: pathlib.Path) -> str | None:
    for f in ("libdevshare.so", "gpu_tool"):
        if not (bundle / f).exists():
            return (f"{bundle / f} is missing: build the bundle with `bash scripts/gpu_bundle.sh` "
                    f"on a machine with Rust and copy build/gpu-bundle here")
    return None


def main_run(bundle: pathlib.Path, only: list[str] | None) -> int:
    r = Runner(bundle)
    print(f"== devshare GPU suite: bundle {bundle}, python {sys.executable}", flush=True)
    selected = [c for c in CASES if not only or c[0] in only]
    problem = check_bundle(bundle)
    if problem:
        r.verdict("FAIL", "setup", problem)
        for c in selected:
            r.verdict("SKIP", c[0], "no bundle")
        return r.summary()
    pf = r.preflight()
    if pf is None:
        for c in selected:
            r.verdict("SKIP", c[0], "preflight failed")
        return r.summary(table=True)
    r.env = pf
    print(f"    preflight| python {pf.get('python')}, torch {pf.get('torch')} (CUDA build "
          f"{pf.get('torch_cuda_build')}), device {pf.get('device', '-')}, devshare "
          f"{pf.get('devshare', '-')}", flush=True)
    print(f"    preflight| driver {pf.get('driver') or '-'}", flush=True)
    print(f"    preflight| devshare cuda backend: {'usable' if pf.get('devshare_cuda') else 'UNUSABLE'}: "
          f"{pf.get('devshare_detail')}", flush=True)
    for k in ALLOC_CONF_VARS:
        if os.environ.get(k):
            print(f"    preflight| note: {k}={os.environ[k]} is not passed to the cases (each case "
                  f"sets the allocator up itself)", flush=True)
    torch_ok, ds_ok = pf.get("torch_cuda"), pf.get("devshare_cuda")
    problems = []
    if not torch_ok:
        if pf.get("torch") is None:
            problems.append(f"PyTorch is not importable by {sys.executable} "
                            f"({pf.get('torch_error')}); set PYTHON=/path/to/python with torch+CUDA")
        else:
            problems.append(f"no CUDA device for PyTorch: torch.cuda.is_available() is False "
                            f"(torch {pf.get('torch')}, CUDA build {pf.get('torch_cuda_build')}, "
                            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    if not ds_ok:
        problems.append(f"devshare's cuda backend is unusable: {pf.get('devshare_detail')}")
    if problems:
        r.verdict("FAIL", "preflight", "; ".join(problems) + ". This suite needs an NVIDIA GPU.")
    else:
        r.verdict("PASS", "preflight")
    for name, _, timeout, env_extra, needs_torch in selected:
        if not ds_ok:
            r.verdict("SKIP", name, "devshare's cuda backend is unusable (see preflight)")
        elif needs_torch and not torch_ok:
            r.verdict("SKIP", name, "needs torch with CUDA (see preflight)")
        else:
            r.run_case(name, timeout, env_extra)
    print(f"    (run took {time.monotonic() - r.start:.0f} s)", flush=True)
    return r.summary(table=True)


def main_dry_run(bundle: pathlib.Path) -> int:
    """No GPU, no torch: bundle, struct mirrors, and the torch-tuple -> handle path."""
    r = Runner(bundle)
    print(f"== devshare GPU suite, dry run: bundle {bundle}", flush=True)
    problem = check_bundle(bundle)
    if problem:
        r.verdict("FAIL", "bundle", problem)
        return r.summary()
    r.verdict("PASS", "bundle")
    tool = str(bundle / "gpu_tool")
    lib = Lib(os.environ.get("DEVSHARE_LIBRARY") or str(bundle / "libdevshare.so"))
    print(f"    library {lib.path}, version {lib.version()}; cuda probe: {lib.probe_cuda()}", flush=True)

    # gpu_tool layout prints the lists of tests/c/abi_fields.h (the one list behind
    # tests/c/layout_dump.c too) as the bundle's gpu_tool was compiled. It is checked with
    # tests/python/abi_check.py, as the normal test run checks layout_dump: it names exactly what
    # the list and this checkout's header name (a bundle built from another header or list fails
    # here), and every mirror of python/devshare/_abi.py matches it (every field's name, order,
    # offset, size and type kind; sizeof and alignment), as do its constants and status codes.
    out = subprocess.run([tool, "layout"], capture_output=True, text=True, timeout=30).stdout
    try:
        ac = _load_abi_check()
        dump = ac.parse_dump(out)
        header = ac.load_header()
        bad = ac.check_dump_complete(header, dump, what="gpu_tool layout")
        bad += ac.check_dump_is_list(ac.load_field_list(), dump, what="gpu_tool layout")
        bad += ac.Checker(header, dump).mirrors_problems(abi.STRUCTS, complete=True)
        bad += ac.constant_problems(abi, dump)
    except (ImportError, OSError, ValueError) as e:
        dump, bad = None, [f"gpu_tool layout could not be checked: {type(e).__name__}: {e}"]
    name = "gpu_tool_layout_matches_the_header_and_the_ctypes_mirrors"
    if bad:
        r.verdict("FAIL", name, "; ".join(bad))
    else:
        r.verdict("PASS", name, f"every field of the {len(dump.structs)} mirrored structs matches gpu_tool layout "
                  f"(and its {len(dump.macros)} macros and {len(dump.statuses)} status codes)")

    # Synthetic PyTorch tuples through devshare_handle_from_torch(_encoded) -> text -> gpu_tool describe
    key = bytes(range(1, 65))
    event = bytes(range(100, 164))
    common = dict(shape=[4, 250], strides=[250, 1], tensor_offset=8, dtype=(2, 32, 1), device=0,
                  storage_size=4096, storage_offset=512, ref_name=b"/torch_4242_77_0", ref_slot=7)
    mib2 = (2 << 20).to_bytes(8, sys.byteorder)

    def cuda_e(pid, n, records, version=2):
        # {int32 pid; 4 padding bytes (garbage, as PyTorch leaves them); u64 segment_size; u64 n}
        return (bytes([version]) + b"e" + pid.to_bytes(4, sys.byteorder, signed=True) + b"\xde\xad\xbe\xef"
                + mib2 + n.to_bytes(8, sys.byteorder) + records)

    def cuda_e3(pid, n, records, handle_type):
        # 2.13+: {int32 pid; 4 pad; u64 segment_size; u64 n; int32 handle_type; 4 pad}, garbage pads
        return (b"\x03e" + pid.to_bytes(4, sys.byteorder, signed=True) + b"\xde\xad\xbe\xef" + mib2
                + n.to_bytes(8, sys.byteorder) + handle_type.to_bytes(4, sys.byteorder) + b"\xca\xfe\xba\xbe"
                + records)

    def fds(k):
        return b"".join((100 + i).to_bytes(4, sys.byteorder) for i in range(k))

    fabric = bytes(range(64)) + bytes(range(64, 128))
    # name, storage handle, event, sync, expected status, what gpu_tool describe must print
    # (key, pid, flags, segments) for an accepted one, or words the error message must hold
    cases = [
        ("c_tuple_version_2_with_an_event_round_trips", b"\x02c" + key, event, True, STATUS_OK, {}),
        ("raw_64_byte_handle_round_trips", key, bytes(64), False, STATUS_OK, {}),
        ("c_tuple_version_3_round_trips", b"\x03c" + key, bytes(64), False, STATUS_OK, {}),
        ("e_tuple_version_2_of_1_fd_round_trips_as_segments", cuda_e(31337, 1, fds(1)), bytes(64), False, STATUS_OK,
         {"key": fds(1).hex(), "pid": "31337", "flags": "4", "segments": "1x2097152/fd/inline",
          "alloc_size": str(2 << 20)}),
        ("e_tuple_version_2_of_3_fds_with_an_event_round_trips_as_segments",
         cuda_e(31337, 3, fds(3)), event, True, STATUS_OK,
         {"key": fds(3).hex(), "pid": "31337", "flags": "5", "segments": "3x2097152/fd/inline"}),
        ("e_tuple_version_2_of_40_fds_carries_its_table_in_the_text",
         cuda_e(31337, 40, fds(40)), bytes(64), False, STATUS_OK,
         {"key": "-", "pid": "31337", "flags": "4", "segments": "40x2097152/fd/external",
          "alloc_size": str(40 * (2 << 20))}),
        ("e_tuple_version_2_of_fabric_handles_round_trips_as_segments",
         cuda_e(31337, 2, fabric), bytes(64), False, STATUS_OK,
         {"key": fabric.hex(), "pid": "31337", "flags": "4", "segments": "2x2097152/fabric/inline"}),
        ("e_tuple_version_1_is_refused_naming_the_version",
         cuda_e(31337, 1, fds(1), version=1), bytes(64), False, STATUS_UNSUPPORTED_VERSION,
         "version 1"),
        ("e_tuple_version_3_of_fds_round_trips_as_segments", cuda_e3(31337, 3, fds(3), 1), bytes(64), False, STATUS_OK,
         {"key": fds(3).hex(), "pid": "31337", "flags": "4", "segments": "3x2097152/fd/inline"}),
        ("e_tuple_version_3_of_handle_type_0_reads_as_fds", cuda_e3(31337, 3, fds(3), 0), bytes(64), False, STATUS_OK,
         {"key": fds(3).hex(), "pid": "31337", "flags": "4", "segments": "3x2097152/fd/inline"}),
        ("e_tuple_version_3_of_fabric_handles_round_trips_as_segments",
         cuda_e3(31337, 2, fabric, 2), bytes(64), False, STATUS_OK,
         {"key": fabric.hex(), "pid": "31337", "flags": "4", "segments": "2x2097152/fabric/inline"}),
        ("e_tuple_version_3_of_40_fds_carries_its_table_in_the_text",
         cuda_e3(31337, 40, fds(40), 1), bytes(64), False, STATUS_OK,
         {"key": "-", "pid": "31337", "flags": "4", "segments": "40x2097152/fd/external"}),
        ("e_tuple_version_3_converted_to_version_2_reads_the_same",
         lib.convert(cuda_e3(31337, 3, fds(3), 1), 2), bytes(64), False, STATUS_OK,
         {"key": fds(3).hex(), "pid": "31337", "flags": "4", "segments": "3x2097152/fd/inline"}),
        ("e_tuple_version_3_of_handle_type_9_is_refused_naming_the_type",
         cuda_e3(31337, 1, fds(1), 9), bytes(64), False, int(abi.Status.INVALID_HANDLE),
         "handle type 9"),
        ("e_tuple_version_3_whose_handle_type_contradicts_its_length_is_refused",
         cuda_e3(31337, 1, fds(1), 2), bytes(64), False, int(abi.Status.BAD_LENGTH),
         "handle type 2"),
        ("e_tuple_version_4_is_refused_naming_the_version",
         cuda_e(31337, 1, fds(1), version=4), bytes(64), False, STATUS_UNSUPPORTED_VERSION,
         "version 4"),
        ("e_tuple_with_pid_0_is_refused",
         cuda_e(0, 1, fds(1)), bytes(64), False, int(abi.Status.INVALID_HANDLE), "pid 0"),
        ("e_tuple_whose_segment_count_contradicts_its_length_is_refused",
         cuda_e(31337, 3, fds(2)), bytes(64), False, int(abi.Status.BAD_LENGTH), "neither 12"),
        ("c_tuple_version_9_is_refused_naming_the_version",
         b"\x09c" + key, bytes(64), False, STATUS_UNSUPPORTED_VERSION, "version 9"),
    ]
    for name, handle, ev, sync, want, expect_more in cases:
        st, text, msg = lib.from_torch_text(handle=handle, event_handle=ev, event_sync=sync, **common)
        if st != want:
            r.verdict("FAIL", name, f"status {st} ({lib.status_name(st)}), expected {want}: {msg}")
            continue
        if st != STATUS_OK:
            if expect_more not in msg:
                r.verdict("FAIL", name, f"the message does not name {expect_more!r}: {msg}")
            else:
                r.verdict("PASS", name, f"{lib.status_name(st)}: {msg[:120]}")
            continue
        # The plain struct path must agree with the encoded one (it drops a long table only).
        st2, h, msg2 = lib.from_torch_fields(handle=handle, event_handle=ev, event_sync=sync, **common)
        if st2 != STATUS_OK:
            r.verdict("FAIL", name, f"devshare_handle_from_torch: {lib.status_name(st2)}: {msg2}")
            continue
        if not expect_more.get("segments", "").endswith("external") and lib.to_text(h) != text:
            r.verdict("FAIL", name, "devshare_handle_to_text differs from the encoded tuple's text")
            continue
        d = subprocess.run([tool, "describe", text], capture_output=True, text=True, timeout=30)
        fields = dict(kv.split("=", 1) for kv in d.stdout.split()[1:] if "=" in kv)
        expect = {"backend": "3", "pid": "4242", "shape": "4,250", "strides": "250,1",
                  "storage_offset": "512", "storage_size": "4096", "tensor_offset": "8",
                  "key": key.hex(), "ref_name": "/torch_4242_77_0", "ref_slot": "7",
                  "flags": "1" if sync else "0", "event": event.hex() if sync else "-"}
        expect.update(expect_more)
        diff = {k: (fields.get(k), v) for k, v in expect.items() if fields.get(k) != v}
        if d.returncode != 0 or diff:
            r.verdict("FAIL", name, f"gpu_tool describe: rc {d.returncode} {d.stdout.strip()[:200]} "
                      f"differs (got, want): {diff}")
        else:
            r.verdict("PASS", name, "from_torch(_encoded) -> text -> gpu_tool describe round trip"
                      + (f" ({expect_more['segments']})" if "segments" in expect_more else ""))

    dry_graph_replay(r, tool)
    dry_registered_sync(r)

    print("    cases a real run would execute (timeout s, extra env, needs torch):", flush=True)
    for name, fn, timeout, env_extra, needs_torch in CASES:
        print(f"      {name:{NAME_WIDTH}} {timeout:4d}  {env_extra or ''}  {'torch' if needs_torch else 'C only'}"
              f"  - {fn.__doc__.strip().splitlines()[0]}", flush=True)
    return r.summary()


def dry_graph_replay(r: "Runner", tool: str) -> None:
    """The consumer logic of cuda_pool_slots_replay_captured_graphs_without_recapture without a
    GPU: gpu_tool produce-pool over a host pool
    (devshare_channel_host_alloc), received with devshare.connect / recv as CPU tensors, with
    EagerGraphs in place of CUDA graphs (replay reruns the captured function on the captured
    tensors). Checks the slot addresses, the recapture count and every output, and that a graph
    bound to the wrong address (a copy of the slot) is caught. Needs torch (CPU is enough) and
    the package; SKIP without them."""
    local = "host_pool_slots_replay_captured_graphs_without_recapture"
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        r.verdict("SKIP", local, f"needs torch (CPU is enough): {e}")
        return
    try:
        devshare = _import_devshare()
    except CaseFail as e:
        r.verdict("FAIL", local, str(e))
        return
    graphs = EagerGraphs(torch)
    for n in (4096, 65536):
        name = f"{local}_{n * 4 // 1024}k"
        got: dict = {}
        try:
            lines = _captured_info(lambda: got.update(run=graph_replay_run(
                tool, devshare, graphs, "host", slots=4, n=n, timed=20)))
        except (CaseFail, devshare.Error, OSError, TimeoutError) as e:
            r.verdict("FAIL", name, f"{type(e).__name__}: {e}")
            continue
        res, done = got["run"]
        lines += _captured_info(lambda: graph_replay_report("host", n, res))
        for ln in lines + [f"producer {done}"]:
            print(f"    {name}| {ln}", flush=True)
        r.verdict("PASS", name, f"{res['items']} items, {res['slots_used']} slots, {res['captures']} captures, "
                  f"{res['recaptures']} recaptures, fixed slot addresses; CPU stand-in graphs, not GPU timings")
    # The same over a remote channel (tcp://, host pool; items on the authenticated connection).
    name = "remote_host_pool_slots_replay_captured_graphs_without_recapture"
    try:
        got = {}
        lines = _captured_info(remote_channel_key)
        lines += _captured_info(lambda: got.update(run=graph_replay_run(
            tool, devshare, graphs, "host", slots=4, n=4096, timed=20,
            address=f"tcp://127.0.0.1:{free_tcp_port()}")))
        res, done = got["run"]
        for ln in lines + [f"producer {done}"]:
            print(f"    {name}| {ln}", flush=True)
        r.verdict("PASS", name, f"{res['items']} items over tcp://, {res['slots_used']} slots, "
                  f"{res['recaptures']} recaptures, fixed slot addresses")
    except (CaseFail, devshare.Error, OSError, TimeoutError) as e:
        r.verdict("FAIL", name, f"{type(e).__name__}: {e}")
    name = "a_graph_replaying_a_copy_of_its_slot_is_caught"
    try:
        _captured_info(lambda: graph_replay_run(tool, devshare, graphs, "host", slots=4, n=4096, timed=20,
                                                fault="stale"))
        r.verdict("FAIL", name, "a graph bound to a copy of the slot replayed without a wrong output")
    except CaseFail as e:
        if "output element" in str(e):
            r.verdict("PASS", name, f"caught: {str(e)[:140]}")
        else:
            r.verdict("FAIL", name, f"failed for another reason: {e}")


def dry_registered_sync(r: "Runner") -> None:
    """The logic of a_registered_cuda_state_dict_syncs_ten_times_and_thousands_of_unread_leases_fit
    without a GPU: the same run over CPU tensors (no device memory to count)."""
    name = "host_registered_state_dict_syncs_ten_times_and_thousands_of_unread_leases_fit"
    try:
        import torch  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        r.verdict("SKIP", name, f"needs torch (CPU is enough): {e}")
        return
    try:
        devshare = _import_devshare()
        got: dict = {}
        lines = _captured_info(lambda: got.update(done=registered_sync_run(torch, devshare, "cpu")))
    except (CaseFail, devshare.Error, OSError, TimeoutError, subprocess.TimeoutExpired) as e:
        r.verdict("FAIL", name, f"{type(e).__name__}: {e}")
        return
    for ln in lines:
        print(f"    {name}| {ln}", flush=True)
    r.verdict("PASS", name, got["done"])


def _captured_info(fn) -> list[str]:
    """The INFO lines fn prints (the dry run shows them indented, as the parent does for cases)."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn()
    return [ln[5:] if ln.startswith("INFO ") else ln for ln in buf.getvalue().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=os.environ.get("DEVSHARE_GPU_BUNDLE", str(ROOT / "build/gpu-bundle")))
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--dry-run", action="store_true", help="check what can be checked without a GPU")
    ap.add_argument("--child-case", help=argparse.SUPPRESS)
    ap.add_argument("--child-preflight", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    bundle = pathlib.Path(a.bundle).resolve()
    if a.child_case:
        return child_case(bundle, a.child_case)
    if a.child_preflight:
        return child_preflight(bundle)
    if a.list:
        for name, fn, timeout, env_extra, needs_torch in CASES:
            print(f"{name:{NAME_WIDTH}} {timeout:4d} s  {fn.__doc__.strip().splitlines()[0]}")
        return 0
    if a.dry_run:
        return main_dry_run(bundle)
    only = None
    if a.only.strip():
        names = [c[0] for c in CASES]
        only = []
        for x in (x.strip() for x in a.only.split(",") if x.strip()):
            hit = [n for n in names if n == x or n.startswith(x + "_")]
            if not hit:
                print(f"unknown case {x!r}; cases: {', '.join(names)}", file=sys.stderr)
                return 2
            only += hit
    return main_run(bundle, only)


if __name__ == "__main__":
    sys.exit(main())
