"""PyTorch's and torch_npu's device-tensor IPC tuples <-> the library's handle struct.

``torch.multiprocessing.reductions.reduce_tensor(t)`` describes a CUDA tensor (or, with torch_npu
imported, an NPU tensor) as 15 args for ``rebuild_cuda_tensor`` / ``rebuild_npu_tensor``:

    0 tensor class, 1 shape, 2 strides, 3 tensor offset (elements), 4 storage class, 5 dtype,
    6 device, 7 storage handle (bytes; None for an empty storage), 8 storage size (bytes),
    9 storage offset in the allocation (bytes), 10 requires_grad, 11 ref-counter shm name,
    12 ref-counter slot, 13 event handle (64 bytes), 14 event_sync_required

Args 6..14 (without 10) are the storage 8-tuple of ``_share_cuda_()`` / ``_share_npu_()``. The C
library reads and writes the byte forms (``devshare_handle_from_torch`` / ``_to_torch``, and for
expandable segments ``devshare_handle_from_torch_encoded`` / ``devshare_torch_storage_handle``);
this module only moves fields between Python objects and the C structs.

One job: the tuples as the codec of a handle. :func:`struct_from_args` turns a tuple into a
validated ``HandleStruct`` (and the byte encoding, when only that holds the segment table);
:func:`args_of` / :func:`storage_of` write a handle struct out as a tuple. The functions that
take or give a :class:`~devshare.Handle` are in :mod:`devshare._torch_ipc` and on the class.

Versions: each PyTorch writes the storage handle in its own format and reads only versions up to
its own (2.5-2.12 write version 2, 2.13+ version 3, with a different 'e' layout; torch_npu writes
1). What this module writes for a consumer follows ``format`` (a ``TORCH_FORMAT_*`` value or a
torch version string); the default is the format of the torch installed in this process
(:func:`local_torch_format`). :func:`bridge` rewrites another producer's tuple for a consumer of
another version.

Imports :mod:`devshare._lib`, :mod:`devshare._ints`, :mod:`devshare._dtypes` and
:mod:`devshare._handle_struct`.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import sys
from ctypes import POINTER, byref, c_int64, c_size_t, c_uint8, c_uint32, cast

from . import _dtypes
from ._handle_struct import external_table
from ._ints import check_args as _check_args
from ._ints import index as _index
from ._ints import int64_array as _int64_array
from ._lib import (
    BACKEND_ACL,
    BACKEND_CUDA,
    EVENT_HANDLE_SIZE,
    HANDLE_FLAG_EVENT,
    HANDLE_FLAG_SEGMENTED,
    HANDLE_MAX_ENCODED_SIZE,
    MAX_NDIM,
    TORCH_FORMAT_DEFAULT,
    TORCH_FORMAT_MINOR,
    TORCH_FORMAT_V1,
    DType,
    Error,
    HandleStruct,
    Status,
    TorchArgs,
    TorchStorage,
    bind,
    call,
    error_for,
    lib,
    new_struct,
    torch_format_signatures,
)
from ._lib import version as _library_version

# Names accepted for the `backend` argument (devshare calls torch_npu's backend "acl").
_BACKEND_NAMES = {"cuda": BACKEND_CUDA, "npu": BACKEND_ACL, "acl": BACKEND_ACL}
#: How many args reduce_tensor gives for a device tensor.
NARGS = 15
_U64_MAX = (1 << 64) - 1
_I64 = (-(1 << 63), (1 << 63) - 1)
_I32_MAX = (1 << 31) - 1

_storage_class_cache = None


# The format functions (ABI 1.2) the library lacks (the others' prototypes are set).
_FORMATS_MISSING = bind(torch_format_signatures(POINTER(HandleStruct), POINTER(TorchStorage)))
_local_formats: dict[int, int] = {}


def _need_formats(what: str) -> None:
    if _FORMATS_MISSING:
        raise Error(Status.UNSUPPORTED,
                    f"{what} needs libdevshare 1.{TORCH_FORMAT_MINOR} or later; the loaded library "
                    f"({_library_version}) lacks {_FORMATS_MISSING[0]}")


# --- small conversions ----------------------------------------------------------------------------


def backend_id(backend) -> int:
    """The devshare backend of a ``backend`` argument: "cuda" (PyTorch), "npu" or "acl"
    (torch_npu), or the backend's number; ValueError for anything else."""
    if isinstance(backend, str) and backend in _BACKEND_NAMES:
        return _BACKEND_NAMES[backend]
    if backend in (BACKEND_CUDA, BACKEND_ACL) and not isinstance(backend, bool):
        return int(backend)
    raise ValueError(f"backend must be 'cuda' (PyTorch) or 'npu' (torch_npu), not {backend!r}")


def _int(name: str, value, lo: int = 0, hi: int = _U64_MAX) -> int:
    """value as an int in [lo, hi]; TypeError for bool and non-integers, ValueError when out of
    range (see :mod:`devshare._ints`)."""
    return _index(name, value, lo, hi)


def _bytes(name: str, value) -> bytes:
    """A bytes field (None: empty)."""
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be bytes, not {type(value).__name__}")


def _ints(name: str, values) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, not {type(values).__name__}") from None
    return tuple(_int(f"{name}[{i}]", v, *_I64) for i, v in enumerate(items))


def _buffer(data: bytes):
    """(buffer, pointer, length) of a private copy of data; keep the buffer alive while the
    pointer is in use."""
    buf = (c_uint8 * max(len(data), 1)).from_buffer_copy(data.ljust(1, b"\0"))
    return buf, cast(buf, POINTER(c_uint8)), len(data)


def _unwrap(args) -> tuple:
    """The 15 args, also from the (rebuild_fn, args) pair that reduce_tensor returns."""
    if isinstance(args, tuple) and len(args) == 2 and callable(args[0]) \
            and isinstance(args[1], tuple):
        args = args[1]
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"expected the 15-tuple of reduce_tensor's args, not {type(args).__name__}")
    if len(args) != NARGS:
        raise ValueError(f"expected the {NARGS} args of reduce_tensor (rebuild_cuda_tensor / "
                         f"rebuild_npu_tensor), got {len(args)}")
    return tuple(args)


# --- storage-handle formats and the version bridge ------------------------------------------------


def torch_format(version: str, backend: str | int = "cuda") -> int:
    """The storage-handle format (``TORCH_FORMAT_*``) a consumer running torch ``version`` (cuda:
    ``torch.__version__``; npu: torch_npu's version) reads, and its producer writes: PyTorch
    <= 2.4 ``TORCH_FORMAT_UNVERSIONED``, 2.5-2.12 ``TORCH_FORMAT_V2``, 2.13 and later
    ``TORCH_FORMAT_V3``; every torch_npu ``TORCH_FORMAT_V1``."""
    _need_formats("torch_format")
    if not isinstance(version, str):
        raise TypeError(f"version must be a str such as '2.13.0+cu128', not {type(version).__name__}")
    out = c_uint32()
    call(lib.devshare_torch_format_for_version, backend_id(backend), version.encode(), byref(out))
    return out.value


def _installed_torch_version() -> str | None:
    torch = sys.modules.get("torch")
    v = getattr(torch, "__version__", None)
    if v is not None:
        return str(v)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def local_torch_format(backend: str | int = "cuda") -> int:
    """The format the torch of this process reads (cuda: from ``torch.__version__``, or the
    installed torch's metadata when it is not imported; npu: ``TORCH_FORMAT_V1``), which is the
    default wherever this package writes a storage handle for a consumer. Without torch, or with
    a library older than 1.2, ``TORCH_FORMAT_DEFAULT``."""
    bid = backend_id(backend)
    fmt = _local_formats.get(bid)
    if fmt is None:
        fmt = TORCH_FORMAT_DEFAULT
        if not _FORMATS_MISSING:
            if bid == BACKEND_ACL:
                fmt = TORCH_FORMAT_V1
            else:
                v = _installed_torch_version()
                if v is not None:
                    fmt = torch_format(v, bid)
        _local_formats[bid] = fmt
    return fmt


def _resolve_format(fmt, bid: int) -> int:
    """A ``format`` argument: None (this process's torch), a ``TORCH_FORMAT_*`` int, or a torch
    version string."""
    if fmt is None:
        # (A host handle: the library refuses it by name.)
        return local_torch_format(bid) if bid in (BACKEND_CUDA, BACKEND_ACL) else TORCH_FORMAT_DEFAULT
    if isinstance(fmt, str):
        return torch_format(fmt, bid)
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        raise TypeError(f"format must be None, a TORCH_FORMAT_* int or a torch version str, not "
                        f"{type(fmt).__name__}")
    return fmt


def convert_storage_handle(handle: bytes, to=None, backend: str | int = "cuda") -> bytes:
    """The version bridge for one storage handle (arg 7 of ``reduce_tensor``, item 1 of
    ``_share_cuda_()``): ``handle`` in any form devshare reads, rewritten in the format ``to``
    (a ``TORCH_FORMAT_*`` value or the consumer's torch version; None: this process's torch) as
    that version's producer writes it. Raises :class:`devshare.Error` (UNSUPPORTED) for what the
    target cannot express, e.g. an expandable segment for PyTorch <= 2.4, fabric segments for
    version 2."""
    _need_formats("convert_storage_handle")
    bid = backend_id(backend)
    data = _bytes("storage handle", handle)
    fmt = _resolve_format(to, bid)
    return _write_bytes(lib.devshare_torch_handle_convert, bid, data, len(data), fmt, cap=len(data) + 8)


def bridge(args, to=None, backend: str | int = "cuda"):
    """A PyTorch / torch_npu sharing tuple with its storage handle rewritten for a consumer of
    another torch version (:func:`convert_storage_handle`); everything else is unchanged, so the
    consumer's stock ``rebuild_cuda_tensor`` / ``_new_shared_cuda`` opens it and returns the
    reference as usual. ``args`` is the 15-tuple of ``reduce_tensor``, its ``(rebuild, args)``
    pair, or the 8-tuple of ``_share_cuda_()``; the same shape comes back. ``to`` None is this
    process's torch: call it on the consumer side before rebuilding. An empty storage (handle
    None) is returned as it is."""
    pair = None
    if isinstance(args, tuple) and len(args) == 2 and callable(args[0]) and isinstance(args[1], tuple):
        pair, args = args[0], args[1]
    if not isinstance(args, (tuple, list)) or len(args) not in (8, NARGS):
        raise ValueError("expected the 15 args of reduce_tensor, its (rebuild, args) pair or the "
                         "8-tuple of _share_cuda_() / _share_npu_()")
    i = 7 if len(args) == NARGS else 1
    out = tuple(args)
    if out[i] is not None:
        out = out[:i] + (convert_storage_handle(out[i], to, backend),) + out[i + 1:]
    return out if pair is None else (pair, out)


# --- tuple -> handle struct -----------------------------------------------------------------------


def struct_from_args(args, backend: str | int = "cuda", producer_pid: int = 0):
    """(HandleStruct, byte encoding or None) of the 15 args ``reduce_tensor`` made for a CUDA
    or NPU tensor (the tuple, or the ``(rebuild_fn, args)`` pair), validated by the library:
    what :func:`devshare.handle_from_torch` documents, without the :class:`~devshare.Handle`.
    The encoding is there only for a segmented handle whose segment table is too long for the
    struct (it carries the table)."""
    a = _unwrap(args)
    bid = backend_id(backend)
    if a[7] is None:
        raise ValueError("the tensor has an empty storage (storage handle None): there is no "
                         "device memory to share")
    shape = _ints("shape (arg 1)", a[1])
    strides = _ints("strides (arg 2)", a[2])
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise ValueError(f"{ndim} dimensions is above devshare's maximum of {MAX_NDIM}")
    if len(strides) != ndim:
        raise ValueError(f"{len(strides)} strides (arg 2) for {ndim} dimensions (arg 1)")
    shape_arr = _int64_array("shape (arg 1)", shape)
    strides_arr = _int64_array("strides (arg 2)", strides)
    # Keep every buffer referenced until the call returns.
    handle_buf, handle_p, handle_len = _buffer(_bytes("storage handle (arg 7)", a[7]))
    ref_buf, ref_p, ref_len = _buffer(_bytes("ref-counter name (arg 11)", a[11]))
    event_buf, event_p, event_len = _buffer(_bytes("event handle (arg 13)", a[13]))
    targs = new_struct(  # devshare_torch_args_init sets struct_size
        TorchArgs,
        backend=bid,
        dtype=DType(*_dtypes.from_any(a[5])),
        ndim=ndim,
        shape=cast(shape_arr, POINTER(c_int64)),
        strides=cast(strides_arr, POINTER(c_int64)),
        tensor_offset=_int("tensor offset (arg 3)", a[3], *_I64),
        device=_int("device (arg 6)", a[6], 0, _I32_MAX),
        producer_pid=_int("producer_pid", producer_pid, 0, _I32_MAX),
        handle=handle_p,
        handle_len=handle_len,
        storage_size=_int("storage size (arg 8)", a[8]),
        storage_offset=_int("storage offset (arg 9)", a[9]),
        ref_name=ref_p,
        ref_name_len=ref_len,
        ref_slot=_int("ref-counter slot (arg 12)", 0 if a[12] is None else a[12]),
        event_handle=event_p,
        event_handle_len=event_len,
        event_sync_required=1 if a[14] else 0,
    )
    h = new_struct(HandleStruct)
    call(lib.devshare_handle_from_torch, byref(targs), byref(h))
    encoded = None
    if external_table(h):
        # An expandable segment whose table is too long for the struct: keep the encoding
        # that carries it (the same tuple, parsed again, written out with its table).
        encoded = _write_bytes(lib.devshare_handle_from_torch_encoded, byref(targs))
    del handle_buf, ref_buf, event_buf  # (alive until here: targs points into them)
    return h, encoded


def _write_bytes(fn, *args, cap: int = HANDLE_MAX_ENCODED_SIZE) -> bytes:
    """Call ``fn(*args, buf, cap, &len)`` (a function that writes bytes and reports their length,
    BUFFER_TOO_SMALL when they do not fit) and return the bytes."""
    n = c_size_t()
    for _ in range(2):
        buf = ctypes.create_string_buffer(max(cap, 1))
        call_args = (*args, buf, len(buf), byref(n))
        _check_args(fn, call_args)
        status = fn(*call_args)
        if status != Status.BUFFER_TOO_SMALL:
            break
        cap = n.value
    if status < 0:
        raise error_for(status)
    return buf.raw[: n.value]


# --- handle struct -> tuple -----------------------------------------------------------------------


def _storage_class(torch):
    """The storage class reduce_tensor passes as arg 4: ``type(tensor._typed_storage())``
    (``torch.storage.TypedStorage`` in PyTorch 2.x)."""
    global _storage_class_cache
    if _storage_class_cache is None:
        _storage_class_cache = type(torch.empty(0)._typed_storage())
    return _storage_class_cache


def args_of(h: HandleStruct, table: bytes | None, device: int | None = None,
            format=None) -> tuple:  # noqa: A002
    """The 15 args of :func:`devshare.torch_args` for the validated handle struct ``h`` (with
    ``table``, its segment table when it is not inline, else None): tensor class
    ``torch.Tensor``, shape, strides, tensor offset, storage class, dtype, then the storage
    8-tuple of :func:`storage_of` with ``requires_grad`` False in between. ``device`` replaces
    the producer's device index (arg 6); ``format`` as for :func:`storage_of`."""
    torch = _dtypes.require_torch()
    dtype = _dtypes.to_torch(int(h.dtype.code), int(h.dtype.bits), int(h.dtype.lanes))
    storage = storage_of(h, table, format)
    if device is not None:
        storage = (_int("device", device, 0, _I32_MAX),) + storage[1:]
    return (
        torch.Tensor,
        torch.Size(tuple(int(x) for x in h.shape[: h.ndim])),
        tuple(int(x) for x in h.strides[: h.ndim]),
        int(h.tensor_offset),
        _storage_class(torch),
        dtype,
        *storage[:4],
        False,
        *storage[4:],
    )


def storage_of(h: HandleStruct, table: bytes | None, format=None) -> tuple:  # noqa: A002
    """The storage 8-tuple of :func:`devshare.storage_tuple` for the validated device handle
    struct ``h`` (``table``: its segment table when it is not inline, else None), with the
    storage handle in ``format`` (a ``TORCH_FORMAT_*`` value or the consumer's torch version
    string; None: the torch of this process). No torch needed."""
    fmt = _resolve_format(format, int(h.backend))
    if _FORMATS_MISSING and fmt != TORCH_FORMAT_DEFAULT:
        _need_formats(f"storage-handle format {fmt}")
    if not h.flags & HANDLE_FLAG_SEGMENTED:
        s = new_struct(TorchStorage)  # devshare_torch_storage_init: the size the library may fill
        if _FORMATS_MISSING:
            call(lib.devshare_handle_to_torch, byref(h), byref(s))
        else:
            call(lib.devshare_handle_to_torch_as, byref(h), fmt, byref(s))
        return (int(s.device), bytes(s.handle[: s.handle_len]), int(s.storage_size),
                int(s.storage_offset), bytes(s.ref_name[: s.ref_name_len]), int(s.ref_slot),
                bytes(s.event_handle), bool(s.event_sync_required))
    # The 'e' bytes are longer than DevshareTorchStorage holds, and a table that is not inline
    # must be passed: devshare_torch_storage_handle_as (which validates the handle) writes them.
    n = 0 if table is None else len(table)
    if _FORMATS_MISSING:
        storage_handle = _write_bytes(lib.devshare_torch_storage_handle, byref(h), table, n, cap=256)
    else:
        storage_handle = _write_bytes(lib.devshare_torch_storage_handle_as, byref(h), table, n, fmt,
                                      cap=256)
    event = bool(h.flags & HANDLE_FLAG_EVENT)
    return (int(h.device_index), storage_handle, int(h.storage_size), int(h.storage_offset),
            bytes(h.ref_name[: h.ref_name_len]), int(h.ref_slot),
            bytes(h.event_handle) if event else bytes(EVENT_HANDLE_SIZE), event)


