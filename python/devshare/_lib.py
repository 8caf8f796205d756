"""Loading libdevshare.so, its functions (ctypes), initialising its structs, and error translation.

The constants, status codes and struct mirrors of include/devshare.h are in :mod:`devshare._abi`
(re-exported here). Every call into the library goes through :func:`call`, which turns a
negative status into a :class:`Error` carrying the status and the library's own message
(``devshare_last_error``). Structs that the library versions by ``struct_size`` are made with
:func:`new_struct`, which runs their C ``devshare_<struct>_init`` function.

Imports :mod:`devshare._abi` and :mod:`devshare._ints`.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
from ctypes import (
    POINTER,
    Structure,
    byref,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

from ._ints import check_args, check_fields
from ._abi import *  # noqa: F401,F403 - re-exported: the package's modules import them from here
from ._abi import (
    BACKEND_ACL,
    BACKEND_CUDA,
    BACKEND_HOST,
    EXPECTED_MAJOR,
    EXPECTED_MINOR,
    INIT_FUNCTIONS,
    BackendInfo,
    HandleStruct,
    ImportInfo,
    ImportOptions,
    Status,
    TensorDesc,
    TorchArgs,
    TorchStorage,
)

BACKEND_NAMES = {BACKEND_HOST: "host", BACKEND_ACL: "acl", BACKEND_CUDA: "cuda"}


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


# --- Opaque types and function signatures -------------------------------------------------------


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
    ("devshare_handle_validate", c_int32, [POINTER(HandleStruct)]),
    ("devshare_handle_encode", c_int32, [POINTER(HandleStruct), c_void_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_handle_decode", c_int32, [c_char_p, c_size_t, POINTER(HandleStruct)]),
    ("devshare_handle_to_text", c_int32, [POINTER(HandleStruct), c_char_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_handle_from_text", c_int32, [c_char_p, POINTER(HandleStruct)]),
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
    # Segmented (expandable-segment) handles, whose segment table may be too long for the struct:
    # the encodings and the PyTorch tuples carry it.
    ("devshare_handle_from_torch_encoded", c_int32, [POINTER(TorchArgs), c_void_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_import_encoded", c_int32, [c_char_p, c_size_t, POINTER(ImportOptions), POINTER(ImportP)]),
    ("devshare_import_text", c_int32, [c_char_p, POINTER(ImportOptions), POINTER(ImportP)]),
    ("devshare_import_torch", c_int32, [POINTER(TorchArgs), POINTER(ImportOptions), POINTER(ImportP)]),
    ("devshare_torch_storage_handle", c_int32,
     [POINTER(HandleStruct), c_char_p, c_size_t, c_void_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_export_segments", c_int32,
     [c_uint16, c_int32, c_void_p, POINTER(c_uint64), c_size_t, c_uint64, c_uint32, POINTER(ExporterP)]),
    ("devshare_exporter_share_encoded", c_int32,
     [ExporterP, POINTER(TensorDesc), c_void_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_exporter_segment_table", c_int32, [ExporterP, c_void_p, c_size_t, POINTER(c_size_t)]),
    ("devshare_allow_ptrace", c_int32, [c_int32]),
    # Initialisers (INIT_FUNCTIONS; use new_struct): struct_size and the defaults.
    ("devshare_handle_init", c_int32, [POINTER(HandleStruct)]),
    ("devshare_tensor_desc_init", c_int32, [POINTER(TensorDesc), c_uint32]),
    ("devshare_import_options_init", c_int32, [POINTER(ImportOptions), c_uint32]),
    ("devshare_import_info_init", c_int32, [POINTER(ImportInfo), c_uint32]),
    ("devshare_backend_info_init", c_int32, [POINTER(BackendInfo), c_uint32]),
    ("devshare_torch_args_init", c_int32, [POINTER(TorchArgs), c_uint32]),
    ("devshare_torch_storage_init", c_int32, [POINTER(TorchStorage), c_uint32]),
]


# --- Finding the library --------------------------------------------------------------------------

LIBRARY_ENV = "DEVSHARE_LIBRARY"
#: The library's soname: its name carries the ABI major version.
_SONAME = f"libdevshare.so.{EXPECTED_MAJOR}"
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
    # The wheel's own library first (devshare/_lib/lib, see _paths): a C/C++ stage built
    # against the wheel's CMake package or pkg-config files links this file's soname, so both
    # sides of a mixed process share one libdevshare.
    out = [("the wheel's library", str(_PACKAGE_DIR / "_lib" / "lib" / _SONAME))]
    for name in ("libdevshare.so", _SONAME):
        out.append(("next to the package", str(_PACKAGE_DIR / name)))
    root = _checkout_root()
    if root is not None:
        for sub in ("build/cargo/release", "target/release"):
            for name in ("libdevshare.so", _SONAME):
                out.append(("source checkout build directory", str(root / sub / name)))
    out.append(("system loader", _SONAME))
    return out


def _version_problem(lib) -> str | None:
    """Why the loaded library's ABI does not fit this package, or None when it does.

    The rule (semantic versioning of the C ABI, as devshare.h states for ``devshare_version``):
    the library's major version must equal :data:`EXPECTED_MAJOR` (another major is another,
    incompatible ABI), and its minor version must be at least :data:`EXPECTED_MINOR` (minor
    releases only add: a newer library still has every function and struct field this package
    uses; an older one may lack some). The patch version does not matter.
    """
    v = int(lib.devshare_version())
    major, minor, patch = v >> 16, (v >> 8) & 0xFF, v & 0xFF
    have = f"{major}.{minor}.{patch}"
    want = f"{EXPECTED_MAJOR}.{EXPECTED_MINOR}"
    if major != EXPECTED_MAJOR:
        return (f"library version {have} has ABI major version {major}, but this package needs "
                f"major version {EXPECTED_MAJOR} (it was written for ABI {want}; another major "
                f"version is an incompatible ABI): use a libdevshare {want} or a later "
                f"{EXPECTED_MAJOR}.x, or a devshare Python package made for ABI {major}.x")
    if minor < EXPECTED_MINOR:
        return (f"library version {have} is older than the ABI {want} this package was written "
                f"for: it may lack functions or struct fields the package uses; use a libdevshare "
                f"{EXPECTED_MAJOR}.{EXPECTED_MINOR} or newer {EXPECTED_MAJOR}.x")
    return None


def _try_load(target: str):
    """(library, None) or (None, reason)."""
    if os.sep in target and not os.path.exists(target):
        return None, "no such file"
    try:
        lib = ctypes.CDLL(target)
    except OSError as e:
        return None, str(e)
    # The version first: a library of another ABI may lack functions, and the version says why.
    try:
        lib.devshare_version.restype = c_uint32
        lib.devshare_version.argtypes = []
    except AttributeError as e:
        return None, f"not a devshare library: {e}"
    problem = _version_problem(lib)
    if problem:
        return None, problem
    try:
        for name, restype, argtypes in _SIGNATURES:
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
    except AttributeError as e:
        return None, f"not a devshare library of ABI {EXPECTED_MAJOR}.{EXPECTED_MINOR}+: {e}"
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


def bind(signatures) -> list[str]:
    """Set the prototypes of the library functions in ``signatures`` ((name, restype, argtypes)
    triples) that the loaded library has; the names it lacks (an older minor version)."""
    missing = []
    for name, restype, argtypes in signatures:
        fn = getattr(lib, name, None)
        if fn is None:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return missing


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
    """Call a status-returning library function; raise :class:`Error` when it fails. Integer
    arguments are range-checked against the C types first (ValueError; ctypes would wrap them)."""
    check_args(fn, args)
    status = fn(*args)
    if status < 0:
        raise error_for(status)
    return status


# The library is thread-safe; this lock only guards this package's own Python-side caches.
registry_lock = threading.RLock()


# --- Structs ----------------------------------------------------------------------------------------


def new_struct(cls, **fields):
    """A new ``cls`` (a mirror from :mod:`devshare._abi`) ready to pass to the library: for a
    versioned struct (one in :data:`INIT_FUNCTIONS`) its C ``devshare_<struct>_init`` function
    sets ``struct_size`` and the defaults; then ``fields`` are set. Use it for inputs and outputs
    alike: the library reads an input's and writes an output's first ``struct_size`` bytes."""
    s = cls()
    init = INIT_FUNCTIONS.get(cls)
    if init is not None:
        fn = getattr(lib, init)
        if len(fn.argtypes) == 2:  # devshare_<struct>_init(T *, uint32_t size): our sizeof
            call(fn, byref(s), ctypes.sizeof(cls))
        else:
            call(fn, byref(s))
    names = {f[0] for f in cls._fields_}
    for k in fields:
        if k not in names:  # ctypes would silently make a Python attribute
            raise TypeError(f"{cls.__name__} has no field {k!r}")
    check_fields(cls, fields)  # ctypes would keep the low bits of an out-of-range int
    for k, v in fields.items():
        setattr(s, k, v)
    return s
