"""Device tensors through PyTorch's own IPC, as handles (CUDA and Ascend NPU).

One job: the :class:`~devshare.Handle` side of PyTorch's and torch_npu's sharing tuples
(:func:`handle_from_torch`, :func:`torch_args`, :func:`storage_tuple`), and sharing and opening
CUDA / NPU tensors with them (:func:`share`, :func:`open`: ``reduce_tensor`` and
``rebuild_cuda_tensor`` / ``rebuild_npu_tensor``), plus the process settings a device consumer
needs (:func:`allow_ptrace`, :func:`local_pid`). The tuples' fields and the storage-handle
formats are :mod:`devshare._torch_tuples`.

Lifetime: each tuple is one reference. ``reduce_tensor`` set a fresh ref-counter slot to 1, and
the producing PyTorch keeps the memory (even after its tensor is freed) until that slot drops to
0; the consumer owes exactly one decrement. A stock consumer (``rebuild_cuda_tensor``, and so
:func:`open`) decrements when its tensor dies.

Imports :mod:`devshare._lib`, :mod:`devshare._ints`, :mod:`devshare._dtypes`,
:mod:`devshare._torch_tuples` and :mod:`devshare._handle`.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from ctypes import POINTER, byref, c_int32, c_uint8, cast

from . import _dtypes, _ints, _torch_tuples
from ._handle import Handle, struct_of
from ._lib import (
    BACKEND_ACL,
    BACKEND_CUDA,
    MAX_NDIM,
    Error,
    TorchArgs,
    call,
    lib,
    new_struct,
)

#: torch device types shared through PyTorch's IPC tuples, and their devshare backends.
DEVICE_BACKENDS = {"cuda": BACKEND_CUDA, "npu": BACKEND_ACL}
_U64_MAX = _ints.U64[1]
_I32_MAX = _ints.I32[1]


def _table(h: Handle) -> bytes | None:
    """A handle's segment table when it travels outside the struct (in the encoding), else None."""
    return None if h.table_inline else h.segment_table


# --- tuple <-> handle -----------------------------------------------------------------------------


def handle_from_torch(args, backend: str | int = "cuda", producer_pid: int = 0) -> Handle:
    """A :class:`Handle` from the 15 args ``reduce_tensor`` made for a CUDA (``backend="cuda"``)
    or NPU (``backend="npu"``) tensor, e.g. received from another process. Needs no GPU or NPU:
    the C library parses and validates the fields (storage handle forms, versions, event, bounds).

    The handle is the tuple's one reference: whoever opens it owes the producer exactly one
    release (:func:`open` does it when its tensor dies). ``producer_pid`` 0 takes the pid from a
    ``/torch_<pid>_...`` ref-counter name. ``requires_grad`` (arg 10) is dropped: handles share
    data, not autograd.

    Expandable segments (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_NPU_ALLOC_CONF``
    ``expandable_segments:True``) give segmented handles: torch_npu's version-1 'e' form and
    PyTorch CUDA's version-2 (2.5-2.12) and version-3 (2.13 and later) 'e' forms (POSIX fds or
    fabric handles: version 3 names the type, version 2 is told apart by length). A
    segment table too long for the handle struct is kept in the handle's byte encoding
    (:meth:`Handle.to_bytes` / :meth:`Handle.to_text` carry it). Raises ValueError for an empty
    storage (storage handle None) and :class:`devshare.Error` naming the problem for forms
    devshare cannot open (CUDA 'e' version 1, whose layout is not known, unknown versions,
    truncated keys) and for malformed ones, each with its own status.
    """
    return Handle(*_torch_tuples.struct_from_args(args, backend, producer_pid))


def torch_args(handle, device: int | None = None, format=None) -> tuple:  # noqa: A002
    """The 15 args a stock consumer passes to ``rebuild_cuda_tensor`` (cuda handles) or torch_npu's
    ``rebuild_npu_tensor`` (acl handles) to open a device handle, e.g. one a C producer made with
    ``devshare_exporter_share``: tensor class ``torch.Tensor``, shape, strides, tensor offset,
    storage class, dtype, then the storage 8-tuple of :func:`storage_tuple` with
    ``requires_grad`` False in between. Byte fields are ``bytes`` and the sync flag a ``bool``,
    as PyTorch checks. ``format`` is the consumer's storage-handle format (see
    :func:`storage_tuple`; default: the torch of this process).

    ``device`` replaces the producer's device index (arg 6) with the receiver's own numbering.
    The tuple carries the handle's one reference: the consumer that rebuilds it decrements the
    ref-counter slot when its tensor dies; pass it to exactly one consumer.
    """
    h = Handle.parse(handle)
    return _torch_tuples.args_of(struct_of(h), _table(h), device, format)


def storage_tuple(h: Handle, format=None) -> tuple:  # noqa: A002
    """The storage 8-tuple ``(device, handle, storage_size, storage_offset, ref_name, ref_slot,
    event_handle, event_sync_required)`` of ``_share_cuda_()`` / ``_share_npu_()`` for a device
    handle (no torch needed), with the storage handle in ``format``: a ``TORCH_FORMAT_*`` value
    or the consumer's torch version string; None (default) the torch of this process
    (:func:`local_torch_format`). cuda: the raw 64-byte IPC handle (every PyTorch reads it), and
    for segmented handles the 'e' form of the format (version 2 for PyTorch 2.5-2.12, 3 for 2.13
    and later); acl: torch_npu's version-1 'c' or 'e' form."""
    return _torch_tuples.storage_of(struct_of(h), _table(h), format)


# --- torch_npu, found lazily ----------------------------------------------------------------------


def _import_torch_npu():
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise ImportError(f"NPU tensors need torch_npu, and import torch_npu failed: {e}") from e


def _rebuild_function(backend: int):
    """rebuild_cuda_tensor or torch_npu's rebuild_npu_tensor, looked up at call time."""
    if backend == BACKEND_CUDA:
        _dtypes.require_torch()
        reductions = importlib.import_module("torch.multiprocessing.reductions")
        return reductions.rebuild_cuda_tensor
    try:
        reductions = importlib.import_module("torch_npu.multiprocessing.reductions")
    except ImportError as e:
        raise ImportError(f"opening acl handles needs torch_npu "
                          f"(torch_npu.multiprocessing.reductions.rebuild_npu_tensor), and "
                          f"importing it failed: {e}") from e
    fn = getattr(reductions, "rebuild_npu_tensor", None)
    if fn is None:
        raise ImportError("this torch_npu has no torch_npu.multiprocessing.reductions."
                          "rebuild_npu_tensor (a torch_npu with NPU IPC support is needed)")
    return fn


def _release(args: tuple, backend: int) -> None:
    """Return a tuple's reference (decrement its ref-counter slot once) with
    ``devshare_torch_discard``, without opening the storage: what PyTorch's consumers do for a
    storage they already hold. Best effort: a producer that is gone, or a malformed name, is
    ignored (the caller's error matters more)."""
    del backend  # the ref-counter protocol is the same for cuda and npu
    name, slot = args[11], args[12]
    if not isinstance(name, (bytes, bytearray)) or not name or isinstance(slot, bool) \
            or not isinstance(slot, int) or not 0 <= slot <= _U64_MAX:
        return
    buf = ctypes.create_string_buffer(bytes(name), len(name))
    try:
        targs = new_struct(TorchArgs, ref_name=cast(buf, POINTER(c_uint8)), ref_name_len=len(name),
                           ref_slot=slot)
    except Error:
        return
    lib.devshare_torch_discard(byref(targs))


def allow_ptrace(pid: int) -> None:
    """Let process ``pid`` take this process's file descriptors with ``pidfd_getfd`` under Yama
    ``ptrace_scope`` 1 (``prctl(PR_SET_PTRACER, pid)``; -1: any process, 0: nobody again).

    A CUDA tensor in an expandable segment is shared as the producer's POSIX fd numbers, which
    the consumer takes with ``pidfd_getfd``; with ``ptrace_scope`` 1 (Ubuntu's default) only an
    ancestor of the producer may do that, so a sibling or unrelated consumer (and a child
    consumer too) fails with a permission error until the producer calls this. PyTorch never
    does; devshare never does it on its own. Process-wide, one pid at a time (the last call
    wins); a no-op without Yama."""
    call(lib.devshare_allow_ptrace, _ints.index("pid", pid, -1, _I32_MAX))


def local_pid(backend="npu", device: int = 0) -> int:
    """The pid a producer must allow (``devshare_exporter_allow_pid``) for this process to import
    its ``backend`` memory on ``device``: on Ascend the bare tgid (``aclrtDeviceGetBareTgid``,
    which differs from ``os.getpid()`` in containers), elsewhere ``os.getpid()``. Send it to a C
    producer that exports NPU memory with pid validation before opening its handles here."""
    out = c_int32()
    call(lib.devshare_local_pid, _torch_tuples.backend_id(backend),
         _ints.index("device", device, 0, _I32_MAX), byref(out))
    return out.value


# --- share / open -----------------------------------------------------------------------------------


def reduce(t) -> tuple[tuple, int]:
    """PyTorch's own share of CUDA or NPU tensor ``t`` (``reduce_tensor``): its 15 args, one
    fresh reference, and the devshare backend id. Checks what devshare cannot carry first
    (more than 8 dimensions, an unknown dtype), before a reference is taken."""
    kind = t.device.type
    backend = DEVICE_BACKENDS[kind]
    if t.dim() > MAX_NDIM:
        raise ValueError(f"{t.dim()} dimensions is above devshare's maximum of {MAX_NDIM}")
    _dtypes.from_any(t.dtype)  # an unsupported dtype fails before a reference is taken
    if kind == "npu":
        _import_torch_npu()  # torch_npu patches reduce_tensor for NPU tensors
    reductions = importlib.import_module("torch.multiprocessing.reductions")
    if t.requires_grad:
        t = t.detach()  # same storage; handles share data, not autograd
    rebuild, args = reductions.reduce_tensor(t)
    if not isinstance(args, tuple) or len(args) != _torch_tuples.NARGS:
        raise ValueError(f"reduce_tensor shared this {kind} tensor with "
                         f"{getattr(rebuild, '__name__', rebuild)}, not as a device tensor "
                         f"(is torch_npu imported for NPU tensors?)")
    return args, backend


def handle_of_args(args, backend: int) -> Handle:
    """:func:`handle_from_torch` for a tuple this process's torch just made; on failure the
    tuple's reference is returned before raising."""
    try:
        return handle_from_torch(args, backend, producer_pid=os.getpid())
    except BaseException:
        _release(args, backend)
        raise


def release(args, backend: int) -> None:
    """Return the reference a tuple carries without opening it (see :func:`_release`)."""
    _release(args, backend)


# torch._C._cuda_getCurrentRawStream (the current CUDA stream of a device index as its raw
# handle, what torch.cuda.current_stream(device).cuda_stream reads), or None where torch lacks
# it; looked up once.
_RAW_STREAM: list = []


def _raw_current_stream():
    if not _RAW_STREAM:
        _RAW_STREAM.append(getattr(importlib.import_module("torch")._C, "_cuda_getCurrentRawStream", None))
    return _RAW_STREAM[0]


def current_stream(t, stream=None) -> int:
    """The stream handle (``cudaStream_t`` / ``aclrtStream``, as an int) that devshare records
    a share's event on: ``stream`` (a ``torch.cuda.Stream`` / ``torch_npu`` stream, or a raw
    handle as an int), by default the current stream of ``t``'s device."""
    if stream is None:
        device = t.device
        if device.type == "npu":
            stream = _import_torch_npu().npu.current_stream(device)
        else:
            raw = _raw_current_stream()
            if raw is not None:
                # torch.cuda.current_stream(device).cuda_stream without the Stream object
                # (this is every device lease's path).
                return raw(device.index)
            stream = importlib.import_module("torch").cuda.current_stream(device)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _ints.index("stream", stream, 0, _U64_MAX)
    for attr in ("cuda_stream", "npu_stream"):
        raw = getattr(stream, attr, None)
        if isinstance(raw, int):
            return raw
    raise TypeError(f"stream must be a torch.cuda.Stream, an NPU stream or a raw stream handle "
                    f"(int), not {type(stream).__name__}")


def share(t) -> Handle:
    """Share a CUDA or NPU tensor through PyTorch's own IPC (``reduce_tensor``): the handle holds
    the tuple's fields, the producer's pid and the tuple's one reference, which the consumer owes
    back exactly once. Until then this process's caching allocator keeps the block (also after
    ``t`` is freed), as with ``torch.multiprocessing``. Conversion errors return the reference
    before raising.
    """
    args, backend = reduce(t)
    return handle_of_args(args, backend)


def open(h: Handle, like: str = "torch", read_only: bool = False):  # noqa: A001
    """Open a cuda or acl handle as a torch tensor with PyTorch's own consumer
    (``rebuild_cuda_tensor``, or torch_npu's ``rebuild_npu_tensor``), which opens the IPC handle,
    waits on the event if there is one, and decrements the ref-counter slot when the tensor dies.
    """
    if like != "torch":
        raise ValueError(f"{h.backend} handles open as torch tensors only (like='torch'), not "
                         f"like={like!r}: the memory is on a device")
    if read_only:
        raise ValueError(f"read_only=True is not available for {h.backend} handles (PyTorch has "
                         f"no read-only device tensors)")
    backend = h.backend_id
    rebuild = _rebuild_function(backend)
    args = torch_args(h)  # in the format of this process's torch
    return rebuild(*args)
