"""share / open / empty / outstanding / wait / collect."""

from __future__ import annotations

import atexit
import bisect
import builtins
import ctypes
import math
import numbers
import sys
import weakref
from ctypes import byref, c_int64, c_uint64, c_void_p

from . import _dlpack, _dtypes, _ints, _torch_ipc
from ._handle import Handle
from ._lib import (
    BACKEND_ACL,
    BACKEND_CUDA,
    BACKEND_HOST,
    DEVICE_FROM_HANDLE,
    DType,
    IMPORT_READ_ONLY,
    SHARE_INFLIGHT,
    STORAGE_TO_END,
    ExporterP,
    HandleStruct,
    ImportInfo,
    ImportOptions,
    ImportP,
    Status,
    TensorDesc,
    call,
    check_args,
    error_for,
    lib,
    new_struct,
    registry_lock,
)

_HEADER_SIZE = 64  # bytes before the data in a file_system-layout shm object
# The largest host allocation the library makes: header + data must fit an off_t (int64).
_MAX_ALLOC = (1 << 63) - 1 - _HEADER_SIZE
# The longest finite wait devshare_exporter_wait takes (int64 milliseconds).
_MAX_WAIT_MS = (1 << 63) - 1


# --- Exporters owned by this process -------------------------------------------------------------


class _Export:
    """One ``DevshareExporter`` of this process: a devshare allocation or an adopted shm object."""

    __slots__ = ("_ptr", "name", "base", "size", "storage_ref", "waiters", "__weakref__")

    def __init__(self, ptr: ExporterP, name: bytes | None):
        self._ptr = ptr
        self.name = name
        base, size = c_void_p(), c_uint64()
        try:
            call(lib.devshare_exporter_memory, ptr, byref(base), byref(size))
        except BaseException:
            lib.devshare_exporter_close(ptr, 0)
            raise
        self.base = base.value or 0
        self.size = size.value
        self.storage_ref = None  # weakref to the torch storage an adopted export came from
        self.waiters = 0  # threads inside wait(): collect() must not close it under them

    @classmethod
    def alloc(cls, nbytes: int) -> "_Export":
        ptr = ExporterP()
        call(lib.devshare_host_alloc, nbytes, byref(ptr), None)
        # The C API has no accessor for the shm name; the first handle tells it (see share).
        return cls(ptr, None)

    @classmethod
    def adopt(cls, name: bytes, nbytes: int) -> "_Export":
        ptr = ExporterP()
        call(lib.devshare_host_adopt, name, nbytes, byref(ptr), None)
        return cls(ptr, name)

    @property
    def closed(self) -> bool:
        return not self._ptr

    def contains(self, addr: int, nbytes: int = 0) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.size

    def share(self, dtype, shape, strides, storage_offset, storage_size, tensor_offset,
              inflight: bool = True) -> Handle:
        ndim = len(shape)
        shape_arr = _ints.int64_array("shape", shape)
        strides_arr = _ints.int64_array("strides", strides)
        desc = _lib_desc(dtype, ndim, shape_arr, strides_arr, storage_offset, storage_size,
                         tensor_offset, inflight)
        h = new_struct(HandleStruct)
        call(lib.devshare_exporter_share, self._ptr, byref(desc), byref(h))
        if self.name is None:
            self.name = bytes(h.key[: h.key_len])
        return Handle(h)

    def outstanding(self) -> int:
        if self.closed:
            return 0
        n = c_uint64()
        call(lib.devshare_exporter_outstanding, self._ptr, byref(n))
        return n.value

    def wait(self, timeout_ms: int) -> bool:
        if self.closed:
            return True
        check_args(lib.devshare_exporter_wait, (self._ptr, timeout_ms))
        status = lib.devshare_exporter_wait(self._ptr, timeout_ms)
        if status == Status.TIMEOUT:
            return False
        if status < 0:
            raise error_for(status)
        return True

    def close(self) -> None:
        ptr, self._ptr = self._ptr, ExporterP()
        if ptr:
            call(lib.devshare_exporter_close, ptr, 0)


def _lib_desc(dtype, ndim, shape_arr, strides_arr, storage_offset, storage_size, tensor_offset,
              inflight=True):
    # devshare_tensor_desc_init sets struct_size (and the defaults: no stream, ...).
    return new_struct(
        TensorDesc,
        dtype=DType(*dtype),
        ndim=ndim,
        shape=ctypes.cast(shape_arr, ctypes.POINTER(c_int64)),
        strides=ctypes.cast(strides_arr, ctypes.POINTER(c_int64)),
        storage_offset=storage_offset,
        storage_size=storage_size,
        tensor_offset=tensor_offset,
        flags=SHARE_INFLIGHT if inflight else 0,
    )


class _HostBuffer:
    """Owner of a devshare_host_alloc allocation behind tensors/arrays made by :func:`empty`.
    Closing happens when the last tensor/array (and view) using the memory is gone."""

    __slots__ = ("export", "__weakref__")

    def __init__(self, nbytes: int):
        self.export = _Export.alloc(nbytes)
        weakref.finalize(self, _Export.close, self.export)


# Live empty() buffers, by data address and (once their first share told it) by shm name (weak:
# a buffer lives as long as its tensors/arrays), and their addresses in order, for finding the buffer around an address in
# O(log n) on every share(). The sorted list may still hold addresses of buffers that are gone;
# lookups drop those.
_buffers: "weakref.WeakValueDictionary[int, _HostBuffer]" = weakref.WeakValueDictionary()
_buffers_by_name: "weakref.WeakValueDictionary[bytes, _HostBuffer]" = weakref.WeakValueDictionary()
_buffer_bases: list[int] = []


def _add_buffer(buf: _HostBuffer) -> None:
    base = buf.export.base
    _buffers[base] = buf
    i = bisect.bisect_left(_buffer_bases, base)
    if i == len(_buffer_bases) or _buffer_bases[i] != base:
        _buffer_bases.insert(i, base)
# Exports of existing shm objects (torch storages, re-shared imports), by shm name; closed by
# collect() once every reference they handed out came back.
_adopted: dict[bytes, _Export] = {}
# Mappings of imports made by open(): (shm name, data address) -> alloc size (a read-only and a
# read-write import of one object are two mappings). An entry may outlive its mapping; it is
# only trusted after checking /proc/self/maps.
_imports: dict[tuple[bytes, int], int] = {}
_IMPORTS_PRUNE_AT = 256


def _buffer_at(addr: int, nbytes: int) -> _HostBuffer | None:
    # Buffers never overlap, so only the one with the nearest address at or below addr can hold
    # [addr, addr + nbytes).
    i = bisect.bisect_right(_buffer_bases, addr) - 1
    while i >= 0:
        buf = _buffers.get(_buffer_bases[i])
        if buf is None:
            del _buffer_bases[i]  # that buffer is gone
            i -= 1
            continue
        return buf if buf.export.contains(addr, nbytes) else None
    return None


def _shm_mappings() -> dict[bytes, list[tuple[int, int, int]]]:
    """shm name -> [(start, end, file offset)] of this process's /dev/shm mappings."""
    out: dict[bytes, list[tuple[int, int, int]]] = {}
    with builtins.open("/proc/self/maps", "rb") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith(b"/dev/shm/"):
                continue
            path = parts[5].rstrip(b"\n")
            if path.endswith(b" (deleted)"):
                continue
            start, end = (int(x, 16) for x in parts[0].split(b"-"))
            out.setdefault(b"/" + path[len(b"/dev/shm/"):], []).append((start, end, int(parts[2], 16)))
    return out


def _live_import(maps, name: bytes, base: int, size: int) -> bool:
    return any(off == 0 and start + _HEADER_SIZE == base and base + size <= end
               for start, end, off in maps.get(name, ()))


def _import_at(addr: int, nbytes: int) -> tuple[bytes, int, int] | None:
    """(shm name, alloc size, byte offset of addr in the data) when [addr, addr+nbytes) lies in
    a live mapping of an object this process imported with open()."""
    candidates = [(name, base, size) for (name, base), size in _imports.items()
                  if base <= addr and addr + nbytes <= base + size]
    if not candidates:
        return None
    maps = _shm_mappings()
    for name, base, size in candidates:
        if _live_import(maps, name, base, size):
            return name, size, addr - base
        del _imports[(name, base)]  # that mapping is gone
    return None


def _note_import(name: bytes, base: int, size: int) -> None:
    global _IMPORTS_PRUNE_AT
    if len(_imports) >= _IMPORTS_PRUNE_AT:
        maps = _shm_mappings()
        for (n, b), sz in list(_imports.items()):
            if not _live_import(maps, n, b, sz):
                del _imports[(n, b)]
        _IMPORTS_PRUNE_AT = max(256, 2 * len(_imports))  # many live imports: prune less often
    _imports[(name, base)] = size


def _adopted_export(name: bytes, nbytes: int, storage=None) -> _Export:
    exp = _adopted.get(name)
    if exp is None or exp.closed:
        exp = _Export.adopt(name, nbytes)
        _adopted[name] = exp
    if storage is not None and (exp.storage_ref is None or exp.storage_ref() is None):
        exp.storage_ref = weakref.ref(storage)
    return exp


def collect() -> int:
    """Close this process's exporters of torch storages whose references all came back (like
    ``torch.cuda.ipc_collect``). :func:`share` does this too. Returns how many were closed."""
    return _collect(keep=None)


@atexit.register
def _close_all() -> None:
    """At exit, close every adopted export: its ref-counter name goes away with the last holder
    instead of staying in /dev/shm. Consumers elsewhere keep their mappings."""
    with registry_lock:
        for name, exp in list(_adopted.items()):
            if exp.waiters:
                continue  # a thread still waits on it: leave it to the process exit
            del _adopted[name]
            try:
                exp.close()
            except Exception:  # noqa: BLE001 - nothing useful to do at exit
                pass


def _collect(keep) -> int:
    closed = 0
    with registry_lock:
        for name, exp in list(_adopted.items()):
            if exp is keep or exp.waiters:
                continue
            if exp.closed or exp.outstanding() == 0:
                del _adopted[name]
                exp.close()
                closed += 1
    return closed


# --- share ----------------------------------------------------------------------------------------


def _type_label(obj) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_ndarray(obj) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def share(obj, inflight: bool = True) -> Handle:
    """Share a tensor without copying and return its handle (one reference for one consumer).

    Accepts a torch CPU tensor (its storage moves into, or stays in, PyTorch's ``file_system``
    shared memory, as ``torch.multiprocessing`` would do), or a tensor/array whose memory came
    from :func:`empty` or :func:`open`. Any dtype devshare knows, any strides >= 0, views with
    storage offsets, 0-d and empty tensors. By default the handle carries an in-flight
    reference, so the memory stays alive until the consumer opened it, even if the producer lets
    go first; only a devshare import (:func:`open`, ``devshare_import``, :func:`discard`) can
    take it over.

    ``inflight=False`` makes a handle without one, for a consumer that maps the memory itself
    (stock PyTorch, see :meth:`Handle.mapping_info`): the memory then stays alive only while this
    process's exporter does (a torch storage's, until every reference came back; an
    :func:`empty` buffer's, while the buffer lives), so keep the producer's buffer until the
    consumer returned the reference (:func:`wait`). Device handles never carry one.

    A CUDA tensor, or an NPU tensor (torch_npu, imported when needed), is shared through
    PyTorch's own IPC: ``torch.multiprocessing.reductions.reduce_tensor`` exports its block and
    sets a fresh ref-counter slot to 1, and this process's caching allocator keeps the block
    (also after the tensor is freed) until that slot is back at 0. The handle is that one
    reference and is owed exactly one release: :func:`open` in the consumer (or any stock
    ``rebuild_cuda_tensor`` / ``rebuild_npu_tensor`` given :func:`torch_args`) releases it when
    its tensor dies. A handle nobody opens pins the block until this process exits. Empty
    storages (ValueError) and tensors with more than 8 dimensions cannot be shared. Tensors in
    expandable segments give segmented handles (see :func:`handle_from_torch`); a CUDA consumer
    that is not this process's ancestor needs :func:`allow_ptrace` under Yama ``ptrace_scope`` 1.
    """
    if not isinstance(inflight, bool):
        raise TypeError(f"inflight must be True or False, not {_type_label(inflight)}")
    with registry_lock:
        if _is_torch_tensor(obj):
            h, exp = _share_torch(obj, inflight)
        elif _is_ndarray(obj):
            h, exp = _share_numpy(obj, inflight)
        else:
            raise TypeError(f"devshare.share() takes a torch tensor (CPU, CUDA or NPU) or a numpy "
                            f"array from devshare.empty()/open(), not {_type_label(obj)}")
        _collect(keep=exp)
        return h


def _share_torch(t, inflight=True):
    torch = sys.modules["torch"]
    kind = t.device.type
    if kind != "cpu" and kind not in _torch_ipc.DEVICE_BACKENDS:
        raise ValueError(f"only CPU, CUDA and NPU tensors can be shared, not {kind} tensors")
    if t.is_nested or t.layout != torch.strided:
        raise ValueError(f"only strided (dense) tensors can be shared, not layout {t.layout}")
    if t.is_quantized:
        raise ValueError("quantized tensors cannot be shared")
    if t.is_conj() or t.is_neg():
        raise ValueError("the tensor has a lazy conjugate/negative bit: call resolve_conj() / "
                         "resolve_neg() first (sharing its memory would show unconjugated values)")
    if kind != "cpu":
        return _torch_ipc.share(t), None
    dtype = _dtypes.from_any(t.dtype)
    shape, strides = tuple(t.shape), tuple(t.stride())
    storage = t.untyped_storage()
    addr, nbytes = storage.data_ptr(), storage.nbytes()

    buf = _buffer_at(addr, nbytes) if addr else None
    if buf is not None:
        exp = buf.export
        return exp.share(dtype, shape, strides, addr - exp.base, nbytes, t.storage_offset(),
                         inflight), exp
    if not storage.is_shared() and addr:
        found = _import_at(addr, nbytes)
        if found is not None:
            # Memory from open(): export the same object again rather than copying it.
            name, size, offset = found
            exp = _adopted_export(name, size)
            return exp.share(dtype, shape, strides, offset, nbytes, t.storage_offset(),
                             inflight), exp
    _, name, size = storage._share_filename_cpu_()
    exp = _adopted_export(bytes(name), int(size), storage)
    return exp.share(dtype, shape, strides, 0, int(size), t.storage_offset(), inflight), exp


def _array_extent(a) -> tuple[int, int]:
    """(first byte address, bytes spanned) of a numpy array; ValueError for negative strides."""
    addr = a.__array_interface__["data"][0]
    if a.size == 0:
        return addr, 0
    last = 0
    for dim, stride in zip(a.shape, a.strides):
        if stride < 0:
            raise ValueError("arrays with negative strides cannot be shared (devshare strides are "
                             ">= 0): share a copy or the un-flipped array")
        last += (dim - 1) * stride
    return addr, last + a.itemsize


def _share_numpy(a, inflight=True):
    dtype = _dtypes.from_any(a.dtype)
    itemsize = a.itemsize
    for s in a.strides:
        if s < 0:
            _array_extent(a)  # raises the negative-stride error
        if s % itemsize:
            raise ValueError(f"stride {s} bytes is not a multiple of the element size {itemsize}")
    strides = tuple(s // itemsize for s in a.strides)
    shape = tuple(a.shape)
    addr, span = _array_extent(a)
    buf = _buffer_at(addr, span)
    if buf is not None:
        exp = buf.export
        offset = addr - exp.base
    else:
        found = _import_at(addr, span)
        if found is None:
            raise TypeError("this numpy array's memory is not shareable: allocate it with "
                            "devshare.empty(shape, dtype, like='numpy') (or share a torch tensor)")
        name, size, offset = found
        exp = _adopted_export(name, size)
    if offset % itemsize == 0:
        return exp.share(dtype, shape, strides, 0, STORAGE_TO_END, offset // itemsize, inflight), exp
    return exp.share(dtype, shape, strides, offset, STORAGE_TO_END, 0, inflight), exp


# --- producer side: outstanding / wait ------------------------------------------------------------


def _export_of(obj) -> tuple[_Export | None, object]:
    """The exporter of this process that shares obj (a Handle, torch tensor or numpy array), and
    the object that keeps it open (hold it while using the exporter)."""
    if isinstance(obj, (str, bytes, bytearray, memoryview)):
        obj = Handle.parse(obj)
    if isinstance(obj, Handle):
        buf = _buffers_by_name.get(obj.key)
        if buf is None:
            buf = next((b for b in list(_buffers.values()) if b.export.name == obj.key), None)
            if buf is not None:
                _buffers_by_name[obj.key] = buf
        if buf is not None:
            return buf.export, buf
        return _adopted.get(obj.key), None
    if _is_torch_tensor(obj):
        storage = obj.untyped_storage()
        addr, nbytes = storage.data_ptr(), storage.nbytes()
        buf = _buffer_at(addr, nbytes) if addr else None
        if buf is not None:
            return buf.export, buf
        for exp in _adopted.values():
            if exp.storage_ref is not None and exp.storage_ref() is storage:
                return exp, None
        found = _import_at(addr, nbytes) if addr else None
        return (_adopted.get(found[0]) if found else None), None
    if _is_ndarray(obj):
        addr, span = _array_extent(obj)
        buf = _buffer_at(addr, span)
        if buf is not None:
            return buf.export, buf
        found = _import_at(addr, span)
        return (_adopted.get(found[0]) if found else None), None
    raise TypeError(f"expected a devshare.Handle, a torch tensor or a numpy array, not "
                    f"{_type_label(obj)}")


def outstanding(obj) -> int:
    """References this process handed out for obj's memory (a tensor, array or Handle) that
    their consumers have not released yet. 0 when nothing is outstanding or it was never shared
    (a handle counts for its whole allocation)."""
    with registry_lock:
        exp, _ = _export_of(obj)
        return exp.outstanding() if exp is not None else 0


def _timeout_ms(timeout) -> int:
    """A timeout in seconds (int or float; None or math.inf: forever) as devshare_exporter_wait's
    int64 milliseconds (-1: forever), rounded up. TypeError for bool and non-numbers, ValueError
    for NaN, negative values and finite values beyond int64 milliseconds (about 292 million
    years: ctypes would wrap them into a short wait)."""
    if timeout is None:
        return -1
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds (int or float) or None, not "
                        f"{_type_label(timeout)}")
    if isinstance(timeout, numbers.Integral):
        ms = int(timeout) * 1000  # exact for every int
    else:
        t = float(timeout)
        if math.isnan(t):
            raise ValueError("timeout must be a number of seconds, not NaN")
        if t == math.inf:
            return -1
        ms = math.ceil(t * 1000) if t >= 0 else -1
    if ms < 0:
        raise ValueError(f"timeout must be >= 0 seconds (or None to wait forever), not {timeout!r}")
    if ms > _MAX_WAIT_MS:
        raise ValueError(f"timeout {timeout!r} s is beyond the longest finite wait "
                         f"({_MAX_WAIT_MS // 1000} s); use None (or math.inf) to wait forever")
    return ms


def wait(obj, timeout=None) -> bool:
    """Wait until every reference handed out for obj's memory came back. True when they did,
    False when ``timeout`` seconds passed first (an int or float >= 0; None or ``math.inf``:
    wait forever). TypeError for a bool or non-number timeout, ValueError for NaN, negative or
    finite timeouts beyond int64 milliseconds."""
    ms = _timeout_ms(timeout)
    with registry_lock:
        exp, owner = _export_of(obj)  # owner: keeps an empty() allocation open meanwhile
        if exp is None or exp.closed:
            return True
        exp.waiters += 1
    try:
        # ctypes drops the GIL during the call, so other threads (and releasing consumers in
        # this process) keep running.
        return exp.wait(ms)
    finally:
        with registry_lock:
            exp.waiters -= 1
        del owner


def discard(handle) -> None:
    """Return a handle's reference without opening it (``devshare_handle_discard``): for a
    consumer that received a handle it will not use, or for a producer giving back the
    reference of a handle whose consumer cannot (a stock PyTorch consumer that mapped the
    memory itself, see :meth:`Handle.mapping_info`; do it once that consumer is done). A handle
    with an in-flight reference is imported and released at once (the in-flight count is taken
    over). :class:`devshare.Error` with ``ALREADY_RELEASED`` when the reference was already
    returned, ``BUSY`` while an import in this process holds it (releasing that import returns
    it). A handle without a ref-counter has nothing to return."""
    h = Handle.parse(handle)
    call(lib.devshare_handle_discard, byref(h._h))


# --- consumer side: open --------------------------------------------------------------------------


def _import(h: Handle, read_only: bool) -> ImportP:
    opts = new_struct(ImportOptions)  # devshare_import_options_init: struct_size, defaults
    if read_only:
        opts.flags |= IMPORT_READ_ONLY
    opts.device = DEVICE_FROM_HANDLE
    imp = ImportP()
    if h.table_inline:
        call(lib.devshare_import, byref(h._h), byref(opts), byref(imp))
    else:
        # A segmented handle whose segment table travels in its encoding only.
        enc = h.to_bytes()
        call(lib.devshare_import_encoded, enc, len(enc), byref(opts), byref(imp))
    return imp


def _import_noted(h: Handle, read_only: bool) -> ImportP:
    """Import h and note its mapping, so that share() of the result re-shares the same object."""
    imp = _import(h, read_only)
    if h.backend_id != BACKEND_HOST:
        return imp  # only host imports can be re-shared (their key is a shm name)
    try:
        info = new_struct(ImportInfo)
        call(lib.devshare_import_info, imp, byref(info))
        with registry_lock:
            _note_import(h.key, info.base or 0, info.alloc_size)
    except BaseException:
        lib.devshare_import_release(imp)
        raise
    return imp


def open(handle, like: str = "torch", read_only: bool = False):  # noqa: A001 - the API's name
    """Open a handle (Handle, bytes or text) without copying.

    Returns a torch tensor (``like="torch"``) or a numpy array (``like="numpy"``) with the
    handle's dtype, shape, strides and offset over the shared memory. The import is released,
    and the producer sees the reference come back, when the returned object and every view of it
    are gone. ``read_only=True`` maps the memory without write permission: numpy arrays come
    back non-writeable; PyTorch has no read-only tensors, so it is refused with like="torch".

    A cuda or acl handle opens as a torch tensor on its device through PyTorch's own consumer:
    ``rebuild_cuda_tensor(*torch_args(handle))`` (torch.multiprocessing.reductions), or torch_npu's
    ``rebuild_npu_tensor`` for acl (ImportError naming torch_npu without it). PyTorch then opens
    the IPC handle (waiting on its event, if any) and decrements the handle's ref-counter slot
    when the tensor dies, which the producer sees. ``like="numpy"`` and ``read_only=True`` are
    refused for device handles.
    """
    h = Handle.parse(handle)
    if h.backend_id in (BACKEND_ACL, BACKEND_CUDA):
        return _torch_ipc.open(h, like, read_only)
    if like == "torch":
        torch = _dtypes.require_torch()
        _dtypes.to_torch(*h.dtype)
        if read_only:
            raise ValueError("PyTorch has no read-only tensors (a write would crash the process): "
                             "open with like='numpy' for a read-only view")
    elif like == "numpy":
        numpy = _dtypes.require_numpy()
        _dtypes.to_numpy(*h.dtype)
    else:
        raise ValueError(f"like must be 'torch' or 'numpy', not {like!r}")
    if h.backend_id != BACKEND_HOST:
        raise ValueError(f"{h.backend} handles cannot be opened by this package")

    imp = _import_noted(h, read_only)
    try:
        if like == "torch":
            cap = _dlpack.capsule(_dlpack.managed_from_import(imp, versioned=True), versioned=True)
            return torch.from_dlpack(cap)
        return numpy.from_dlpack(_dlpack.DLPackSource(imp))
    finally:
        # The DLPack tensor holds its own reference to the import.
        lib.devshare_import_release(imp)


def dlpack_capsule(handle, versioned: bool = True, read_only: bool = False):
    """Import a handle and return it as a DLPack PyCapsule (``"dltensor_versioned"``, or the
    legacy ``"dltensor"``) for any DLPack consumer. The import is released when the consumer
    calls the deleter, or when the capsule is destroyed unconsumed."""
    h = Handle.parse(handle)
    imp = _import_noted(h, read_only)
    try:
        return _dlpack.capsule(_dlpack.managed_from_import(imp, versioned), versioned)
    finally:
        lib.devshare_import_release(imp)


# --- empty ----------------------------------------------------------------------------------------


def _normalize_shape(shape) -> tuple[int, ...]:
    """shape as a tuple of ints in [0, INT64_MAX]: an int (or integer-like: ``operator.index``)
    or an iterable of them (tuple, list, ``torch.Size``, ...). TypeError for str/bytes (their
    characters are not dimensions), floats, bools and other non-integers; ValueError for
    negative or oversized dimensions."""
    if isinstance(shape, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"shape must be an int or a sequence of ints, not {_type_label(shape)}")
    if isinstance(shape, bool):
        raise TypeError("shape must be an int or a sequence of ints, not bool")
    try:
        return (_ints.index("shape", shape, *_ints.N64),)
    except TypeError:
        pass
    except ValueError:
        raise ValueError(f"negative or oversized dimension in shape {shape!r} (each must be in "
                         f"[0, {_ints.N64[1]}])") from None
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {_type_label(shape)}") from None
    out = []
    for i, d in enumerate(dims):
        try:
            out.append(_ints.index(f"shape[{i}]", d, *_ints.N64))
        except TypeError:
            raise TypeError(f"shape[{i}] must be an int, not {_type_label(d)} (shape {shape!r})") from None
        except ValueError:
            raise ValueError(f"negative or oversized dimension {d} in shape {shape!r} (each must be "
                             f"in [0, {_ints.N64[1]}])") from None
    return tuple(out)


def empty(shape, dtype="float32", like: str = "torch"):
    """Uninitialised (zero-filled) shareable host memory as a torch tensor or numpy array.

    The memory is a devshare allocation: :func:`share` hands out handles for it (or any view of
    it) without copying, and the allocation is closed when the tensor/array and all its views
    are gone.

    ``shape`` is an int or a sequence of ints (``torch.Size``, numpy integers are fine):
    TypeError for str, bytes, floats, bools and other types; ValueError for a negative
    dimension or a size beyond what one allocation can hold (checked exactly, before anything
    reaches the library); :class:`devshare.Error` when ``/dev/shm`` has no room for it.
    """
    shape = _normalize_shape(shape)
    code, bits, lanes = _dtypes.from_any(dtype)
    if like == "torch":
        torch = _dtypes.require_torch()
        tdtype = _dtypes.to_torch(code, bits, lanes)
    elif like == "numpy":
        numpy = _dtypes.require_numpy()
        ndtype = _dtypes.to_numpy(code, bits, lanes)
    else:
        raise ValueError(f"like must be 'torch' or 'numpy', not {like!r}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * (bits // 8) * lanes
    if nbytes > _MAX_ALLOC:
        raise ValueError(f"shape {shape} of {_dtypes.type_name(code, bits, lanes)} needs {nbytes} "
                         f"bytes, more than the largest host allocation ({_MAX_ALLOC} bytes)")
    with registry_lock:
        buf = _HostBuffer(max(nbytes, 1))
        _add_buffer(buf)
    raw = (ctypes.c_uint8 * buf.export.size).from_address(buf.export.base)
    raw._devshare_buffer = buf  # the ctypes array (and so every tensor over it) keeps it alive
    if like == "torch":
        flat = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes]
        return flat.view(tdtype).reshape(shape)
    flat = numpy.frombuffer(raw, dtype=numpy.uint8, count=nbytes)
    return flat.view(ndtype).reshape(shape)
