"""Loading libdevshare.so, its C structs and functions (ctypes), and error translation.

Every call into the library goes through :func:`call`, which turns a negative status into a
:class:`Error` carrying the status and the library's own message (``devshare_last_error``).
"""

from __future__ import annotations

import ctypes
import enum
import os
import pathlib
import threading
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

# --- What this package was written against (include/devshare.h) -------------------------------

#: Library version this package expects: same major; while the major version is 0, the same
#: minor (a 0.x minor release may change the ABI), afterwards a minor at least this high.
EXPECTED_MAJOR = 0
EXPECTED_MINOR = 1

MAX_NDIM = 8
KEY_CAPACITY = 128
REF_NAME_CAPACITY = 64
EVENT_HANDLE_SIZE = 64
HANDLE_RESERVED = 120
HANDLE_SIZE = 616
HANDLE_MAX_ENCODED_SIZE = 493
HANDLE_MAX_TEXT_SIZE = 669
TORCH_HANDLE_CAPACITY = 128

BACKEND_HOST = 1
BACKEND_ACL = 2
BACKEND_CUDA = 3
BACKEND_NAMES = {BACKEND_HOST: "host", BACKEND_ACL: "acl", BACKEND_CUDA: "cuda"}

HANDLE_FLAG_EVENT = 1
HANDLE_FLAG_INFLIGHT = 2

SHARE_INFLIGHT = 1
IMPORT_READ_ONLY = 1
DEVICE_FROM_HANDLE = -1
STORAGE_TO_END = (1 << 64) - 1
CLOSE_FORCE = 1
CLOSE_UNLINK = 2


class Status(enum.IntEnum):
    """``DEVSHARE_STATUS_*`` codes (stable: never renumbered)."""

    OK = 0
    NULL_ARGUMENT = -1
    INVALID_ARGUMENT = -2
    BUFFER_TOO_SMALL = -3
    TRUNCATED = -10
    BAD_MAGIC = -11
    UNSUPPORTED_VERSION = -12
    CHECKSUM_MISMATCH = -13
    BAD_TEXT = -14
    BAD_LENGTH = -15
    INVALID_HANDLE = -20
    STORAGE_OUT_OF_BOUNDS = -21
    TENSOR_OUT_OF_BOUNDS = -22
    BAD_NDIM = -23
    BAD_DTYPE = -24
    BAD_KEY = -25
    BAD_SIZE = -26
    WRONG_HOST = -27
    BACKEND_UNAVAILABLE = -30
    UNSUPPORTED = -31
    NOT_FOUND = -32
    OS = -33
    VENDOR = -34
    TIMEOUT = -35
    BUSY = -36
    ALREADY_RELEASED = -37
    MISMATCH = -38
    INTERNAL = -99


def status_name(status: int) -> str:
    """``"DEVSHARE_STATUS_<NAME>"`` for a status code (``"DEVSHARE_STATUS_<n>"`` if unknown)."""
    try:
        return "DEVSHARE_STATUS_" + Status(status).name
    except ValueError:
        return f"DEVSHARE_STATUS_{status}"


class Error(RuntimeError):
    """A devshare library call failed.

    Attributes: ``status`` (the negative ``DEVSHARE_STATUS_*`` code, an int), ``status_name``
    (``"DEVSHARE_STATUS_..."``), ``message`` (the library's explanation: which function failed
    and why) and ``vendor_error`` (errno or vendor runtime code, 0 when none).
    """

    def __init__(self, status: int, message: str, vendor_error: int = 0):
        self.status = int(status)
        self.status_name = status_name(self.status)
        self.message = message
        self.vendor_error = int(vendor_error)
        super().__init__(f"{message} [{self.status_name}]")

    def __reduce__(self):
        return (type(self), (self.status, self.message, self.vendor_error))


class LibraryNotFoundError(ImportError):
    """No usable libdevshare could be loaded; the message lists every place that was tried."""


# --- C structs ------------------------------------------------------------------------------------


class DType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class TensorDesc(Structure):
    _fields_ = [
        ("dtype", DType),
        ("ndim", c_uint32),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("storage_offset", c_uint64),
        ("storage_size", c_uint64),
        ("tensor_offset", c_int64),
        ("flags", c_uint32),
        ("reserved", c_uint32),
    ]


class HandleStruct(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("layout_version", c_uint16),
        ("backend", c_uint16),
        ("flags", c_uint32),
        ("device_index", c_int32),
        ("device_uuid", c_uint8 * 16),
        ("host_id", c_uint8 * 16),
        ("producer_pid", c_int32),
        ("ndim", c_uint32),
        ("alloc_size", c_uint64),
        ("storage_offset", c_uint64),
        ("storage_size", c_uint64),
        ("tensor_offset", c_int64),
        ("dtype", DType),
        ("key_len", c_uint32),
        ("shape", c_int64 * MAX_NDIM),
        ("strides", c_int64 * MAX_NDIM),
        ("key", c_uint8 * KEY_CAPACITY),
        ("ref_slot", c_uint64),
        ("ref_name_len", c_uint32),
        ("reserved0", c_uint32),
        ("ref_name", c_uint8 * REF_NAME_CAPACITY),
        ("event_handle", c_uint8 * EVENT_HANDLE_SIZE),
        ("reserved", c_uint8 * HANDLE_RESERVED),
    ]


class ImportOptions(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("flags", c_uint32),
        ("device", c_int32),
        ("reserved", c_uint32),
        ("stream", c_void_p),
    ]


class ImportInfo(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("storage", c_void_p),
        ("base", c_void_p),
        ("alloc_size", c_uint64),
        ("storage_size", c_uint64),
        ("numel", c_uint64),
        ("element_size", c_uint64),
        ("backend", c_uint16),
        ("read_only", c_uint16),
        ("device", c_int32),
    ]


class BackendInfo(Structure):
    _fields_ = [
        ("backend", c_uint16),
        ("usable", c_uint16),
        ("reserved", c_uint32),
        ("name", c_char * 16),
        ("detail", c_char * 512),
    ]


class TorchArgs(Structure):
    """``DevshareTorchArgs``: the fields of one ``reduce_tensor`` 15-tuple (arg numbers in the
    comments), for ``devshare_handle_from_torch``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("backend", c_uint16),
        ("reserved0", c_uint16),
        ("dtype", DType),  # arg 5
        ("ndim", c_uint32),
        ("shape", POINTER(c_int64)),  # arg 1
        ("strides", POINTER(c_int64)),  # arg 2 (NULL: C-contiguous)
        ("tensor_offset", c_int64),  # arg 3, elements
        ("device", c_int32),  # arg 6
        ("producer_pid", c_int32),  # 0: read from a /torch_<pid>_... ref-counter name
        ("handle", POINTER(c_uint8)),  # arg 7
        ("handle_len", c_size_t),
        ("storage_size", c_uint64),  # arg 8, bytes
        ("storage_offset", c_uint64),  # arg 9, bytes
        ("ref_name", POINTER(c_uint8)),  # arg 11
        ("ref_name_len", c_size_t),
        ("ref_slot", c_uint64),  # arg 12
        ("event_handle", POINTER(c_uint8)),  # arg 13
        ("event_handle_len", c_size_t),
        ("event_sync_required", c_uint32),  # arg 14
        ("reserved1", c_uint32),
    ]


class TorchStorage(Structure):
    """``DevshareTorchStorage``: the storage 8-tuple of ``_share_cuda_()`` / ``_share_npu_()``,
    from ``devshare_handle_to_torch``."""

    _fields_ = [
        ("device", c_int32),
        ("handle_len", c_uint32),
        ("handle", c_uint8 * TORCH_HANDLE_CAPACITY),
        ("storage_size", c_uint64),
        ("storage_offset", c_uint64),
        ("ref_name_len", c_uint32),
        ("reserved0", c_uint32),
        ("ref_name", c_uint8 * REF_NAME_CAPACITY),
        ("ref_slot", c_uint64),
        ("event_handle", c_uint8 * EVENT_HANDLE_SIZE),
        ("event_sync_required", c_uint32),
        ("reserved1", c_uint32),
    ]


# Layout guards: sizes from include/devshare.h (checked with sizeof/offsetof in C).
for _struct, _size in ((HandleStruct, HANDLE_SIZE), (TorchArgs, 128), (TorchStorage, 304)):
    if ctypes.sizeof(_struct) != _size:  # pragma: no cover - layout guard
        raise ImportError(f"{_struct.__name__} mirror is {ctypes.sizeof(_struct)} bytes, not {_size}")
del _struct, _size


class Exporter(Structure):
    """Opaque ``DevshareExporter``."""


class Import(Structure):
    """Opaque ``DevshareImport``."""


ExporterP = POINTER(Exporter)
ImportP = POINTER(Import)

# (name, restype, argtypes); int32 results are statuses.
_SIGNATURES = [
    ("devshare_status_str", c_char_p, [c_int32]),
    ("devshare_last_error", c_size_t, [c_char_p, c_size_t]),
    ("devshare_last_vendor_error", c_int64, []),
    ("devshare_version", c_uint32, []),
    ("devshare_host_alloc", c_int32, [c_uint64, POINTER(ExporterP), POINTER(c_void_p)]),
    ("devshare_host_adopt", c_int32, [c_char_p, c_uint64, POINTER(ExporterP), POINTER(c_void_p)]),
    ("devshare_exporter_memory", c_int32, [ExporterP, POINTER(c_void_p), POINTER(c_uint64)]),
    ("devshare_exporter_share", c_int32, [ExporterP, POINTER(TensorDesc), POINTER(HandleStruct)]),
    ("devshare_exporter_outstanding", c_int32, [ExporterP, POINTER(c_uint64)]),
    ("devshare_exporter_wait", c_int32, [ExporterP, c_int64]),
    ("devshare_exporter_close", c_int32, [ExporterP, c_uint32]),
    ("devshare_handle_init", c_int32, [POINTER(HandleStruct)]),
    ("devshare_handle_validate", c_int32, [POINTER(HandleStruct)]),
    ("devshare_handle_encode", c_int32, [POINTER(HandleStruct), c_void_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_handle_decode", c_int32, [c_char_p, c_size_t, POINTER(HandleStruct)]),
    ("devshare_handle_to_text", c_int32, [POINTER(HandleStruct), c_char_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_handle_from_text", c_int32, [c_char_p, POINTER(HandleStruct)]),
    ("devshare_import_options_init", c_int32, [POINTER(ImportOptions)]),
    ("devshare_import", c_int32, [POINTER(HandleStruct), POINTER(ImportOptions), POINTER(ImportP)]),
    ("devshare_import_info", c_int32, [ImportP, POINTER(ImportInfo)]),
    ("devshare_import_handle", c_int32, [ImportP, POINTER(HandleStruct)]),
    ("devshare_import_release", c_int32, [ImportP]),
    ("devshare_import_to_dlpack_versioned", c_int32, [ImportP, POINTER(c_void_p)]),
    ("devshare_import_to_dlpack", c_int32, [ImportP, POINTER(c_void_p)]),
    ("devshare_probe", c_int32, [c_uint16, POINTER(BackendInfo)]),
    ("devshare_handle_from_torch", c_int32, [POINTER(TorchArgs), POINTER(HandleStruct)]),
    ("devshare_handle_to_torch", c_int32, [POINTER(HandleStruct), POINTER(TorchStorage)]),
    ("devshare_torch_discard", c_int32, [POINTER(TorchArgs)]),
    ("devshare_local_pid", c_int32, [c_uint16, c_int32, POINTER(c_int32)]),
    ("devshare_handle_discard", c_int32, [POINTER(HandleStruct)]),
]


# --- Finding the library --------------------------------------------------------------------------

LIBRARY_ENV = "DEVSHARE_LIBRARY"
_SONAME = "libdevshare.so.0"
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def _checkout_root() -> pathlib.Path | None:
    """The source checkout this package is imported from (``<root>/python/devshare``), if any."""
    root = _PACKAGE_DIR.parent.parent
    if _PACKAGE_DIR.parent.name == "python" and (root / "Cargo.toml").is_file() \
            and (root / "include" / "devshare.h").is_file():
        return root
    return None


def _candidates() -> list[tuple[str, str]]:
    """(description, what to pass to dlopen), in search order."""
    out = []
    for name in ("libdevshare.so", _SONAME):
        out.append(("next to the package", str(_PACKAGE_DIR / name)))
    root = _checkout_root()
    if root is not None:
        for sub in ("build/cargo/release", "target/release"):
            out.append(("source checkout build directory", str(root / sub / "libdevshare.so")))
    out.append(("system loader", _SONAME))
    return out


def _version_problem(lib) -> str | None:
    v = int(lib.devshare_version())
    major, minor, patch = v >> 16, (v >> 8) & 0xFF, v & 0xFF
    ok = major == EXPECTED_MAJOR and (minor == EXPECTED_MINOR if major == 0 else minor >= EXPECTED_MINOR)
    if ok:
        return None
    want = f"{EXPECTED_MAJOR}.{EXPECTED_MINOR}" + ("" if EXPECTED_MAJOR == 0 else "+")
    return f"library version {major}.{minor}.{patch} does not match the {want} this package expects"


def _try_load(target: str):
    """(library, None) or (None, reason)."""
    if os.sep in target and not os.path.exists(target):
        return None, "no such file"
    try:
        lib = ctypes.CDLL(target)
    except OSError as e:
        return None, str(e)
    try:
        for name, restype, argtypes in _SIGNATURES:
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
    except AttributeError as e:
        return None, f"not a devshare library: {e}"
    problem = _version_problem(lib)
    if problem:
        return None, problem
    return lib, None


def _load():
    tried = []
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        lib, why = _try_load(explicit)
        if lib is not None:
            return lib, explicit
        raise LibraryNotFoundError(
            f"could not load libdevshare from {LIBRARY_ENV}={explicit}: {why} (other places are "
            f"not tried while {LIBRARY_ENV} is set)")
    tried.append(f"{LIBRARY_ENV}: not set")
    for what, target in _candidates():
        lib, why = _try_load(target)
        if lib is not None:
            return lib, target
        tried.append(f"{what}: {target}: {why}")
    raise LibraryNotFoundError(
        "could not load libdevshare; looked in:\n  " + "\n  ".join(tried)
        + f"\nBuild it (cargo build --release) or set {LIBRARY_ENV} to the full path of libdevshare.so.")


lib, library_path = _load()

_version = int(lib.devshare_version())
version = f"{_version >> 16}.{(_version >> 8) & 0xFF}.{_version & 0xFF}"


# --- Calls and errors ---------------------------------------------------------------------------


def last_error() -> str:
    """The calling thread's last error message from the library."""
    n = lib.devshare_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.devshare_last_error(buf, n + 1)
    return buf.value.decode("utf-8", "replace")


def error_for(status: int) -> Error:
    # The message and vendor code are per thread, and ctypes runs the call on this thread.
    return Error(status, last_error(), lib.devshare_last_vendor_error())


def call(fn, *args) -> int:
    """Call a status-returning library function; raise :class:`Error` when it fails."""
    status = fn(*args)
    if status < 0:
        raise error_for(status)
    return status


# The library is thread-safe; this lock only guards this package's own Python-side caches.
registry_lock = threading.RLock()
