"""The handle API: share, open, empty, outstanding, wait, discard and dlpack_capsule.

One job: the public functions that make handles of tensors and arrays (:func:`share`, over
memory from :func:`empty`, :func:`open` or PyTorch's shared memory), open handles as tensors and
arrays (:func:`open`, :func:`dlpack_capsule`), and follow a producer's references
(:func:`outstanding`, :func:`wait`, :func:`discard`). What memory this process owns is
:mod:`devshare._registry`; turning memory into tensors and arrays, :mod:`devshare._views`;
device tensors, :mod:`devshare._torch_ipc`.

Imports :mod:`devshare._lib`, :mod:`devshare._dtypes`, :mod:`devshare._args`,
:mod:`devshare._dlpack`, :mod:`devshare._views`, :mod:`devshare._handle`,
:mod:`devshare._registry` and :mod:`devshare._torch_ipc`.
"""

from __future__ import annotations

import math
import sys
import time
from ctypes import byref

from . import _dlpack, _dtypes, _torch_ipc
from ._args import normalize_shape, timeout_ms, type_label
from ._handle import Handle, struct_of
from ._lib import (
    BACKEND_ACL,
    BACKEND_CUDA,
    BACKEND_HOST,
    DEVICE_FROM_HANDLE,
    IMPORT_READ_ONLY,
    STORAGE_TO_END,
    ImportInfo,
    ImportOptions,
    ImportP,
    call,
    lib,
    new_struct,
    registry_lock,
)
from ._registry import (
    Export,
    device_adoption,
    HostBuffer,
    add_buffer,
    adopted,
    adopted_export,
    adopted_of_storage,
    buffer_at,
    buffer_named,
    collect_except,
    host_nbytes,
    import_at,
    note_import,
    registered_tensors,
)
from ._views import allocation_view, array_extent, from_import, is_ndarray, is_torch_tensor

# --- share ----------------------------------------------------------------------------------------


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
        raise TypeError(f"inflight must be True or False, not {type_label(inflight)}")
    with registry_lock:
        if is_torch_tensor(obj):
            h, exp = _share_torch(obj, inflight)
        elif is_ndarray(obj):
            h, exp = _share_numpy(obj, inflight)
        else:
            raise TypeError(f"devshare.share() takes a torch tensor (CPU, CUDA or NPU) or a numpy "
                            f"array from devshare.empty()/open(), not {type_label(obj)}")
        collect_except(keep=exp)
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
    exp, storage_offset, nbytes = torch_host_export(t)
    return exp.share(dtype, shape, strides, storage_offset, nbytes, t.storage_offset(),
                     inflight), exp


def torch_host_export(t) -> tuple[Export, int, int]:
    """The export that shares CPU tensor ``t``'s storage, with the storage's byte offset in it
    and its size: a devshare allocation's, the re-export of a devshare import, or PyTorch's
    ``file_system`` shared memory, adopted (a storage in private memory moves there first:
    ``_share_filename_cpu_`` copies it once and the tensor keeps working). Call with
    ``registry_lock`` held."""
    storage = t.untyped_storage()
    addr, nbytes = storage.data_ptr(), storage.nbytes()
    buf = buffer_at(addr, nbytes) if addr else None
    if buf is not None:
        return buf.export, addr - buf.export.base, nbytes
    if not storage.is_shared() and addr:
        found = import_at(addr, nbytes)
        if found is not None:
            # Memory from open(): export the same object again rather than copying it.
            name, size, offset = found
            return adopted_export(name, size), offset, nbytes
    _, name, size = storage._share_filename_cpu_()
    return adopted_export(bytes(name), int(size), storage), 0, int(size)


def _share_numpy(a, inflight=True):
    dtype = _dtypes.from_any(a.dtype)
    itemsize = a.itemsize
    for s in a.strides:
        if s < 0:
            array_extent(a)  # raises the negative-stride error
        if s % itemsize:
            raise ValueError(f"stride {s} bytes is not a multiple of the element size {itemsize}")
    strides = tuple(s // itemsize for s in a.strides)
    shape = tuple(a.shape)
    addr, span = array_extent(a)
    buf = buffer_at(addr, span)
    if buf is not None:
        exp = buf.export
        offset = addr - exp.base
    else:
        found = import_at(addr, span)
        if found is None:
            raise TypeError("this numpy array's memory is not shareable: allocate it with "
                            "devshare.empty(shape, dtype, like='numpy') (or share a torch tensor)")
        name, size, offset = found
        exp = adopted_export(name, size)
    if offset % itemsize == 0:
        return exp.share(dtype, shape, strides, 0, STORAGE_TO_END, offset // itemsize, inflight), exp
    return exp.share(dtype, shape, strides, offset, STORAGE_TO_END, 0, inflight), exp


# --- producer side: outstanding / wait ------------------------------------------------------------


def _export_of(obj) -> tuple[Export | None, object]:
    """The exporter of this process that shares obj (a Handle, torch tensor or numpy array), and
    the object that keeps it open (hold it while using the exporter)."""
    if isinstance(obj, (str, bytes, bytearray, memoryview)):
        obj = Handle.parse(obj)
    if isinstance(obj, Handle):
        buf = buffer_named(obj.key)
        if buf is not None:
            return buf.export, buf
        return adopted(obj.key), None
    if is_torch_tensor(obj):
        storage = obj.untyped_storage()
        addr, nbytes = storage.data_ptr(), storage.nbytes()
        if obj.device.type != "cpu":  # leased over a channel (Channel.send), if at all
            return device_adoption((obj.device.type, obj.device.index, addr)), None
        buf = buffer_at(addr, nbytes) if addr else None
        if buf is not None:
            return buf.export, buf
        exp = adopted_of_storage(storage)
        if exp is not None:
            return exp, None
        found = import_at(addr, nbytes) if addr else None
        return (adopted(found[0]) if found else None), None
    if is_ndarray(obj):
        addr, span = array_extent(obj)
        buf = buffer_at(addr, span)
        if buf is not None:
            return buf.export, buf
        found = import_at(addr, span)
        return (adopted(found[0]) if found else None), None
    raise TypeError(f"expected a devshare.Handle, a torch tensor or a numpy array, not "
                    f"{type_label(obj)}")


def outstanding(obj) -> int:
    """References this process handed out for obj's memory (a tensor, array or Handle) that
    their consumers have not released yet. 0 when nothing is outstanding or it was never shared
    (a handle counts for its whole allocation)."""
    with registry_lock:
        exp, _ = _export_of(obj)
        return exp.outstanding() if exp is not None else 0


def wait(obj, timeout=None) -> bool:
    """Wait until every reference handed out for obj's memory came back. True when they did,
    False when ``timeout`` seconds passed first (an int or float >= 0; None or ``math.inf``:
    wait forever). ``obj``: a tensor, array or handle, or a dict, list or tuple of them (a
    state dict sent with :meth:`Channel.send_batch`): then every one's, within the one
    ``timeout``, each storage once. While it waits it serves the channels they were leased
    through, and before it sleeps it may poll their rings briefly (``Channel.set_spin``, or
    up to 50 µs while a consumer is awake on another CPU) or yield the CPU once to a consumer
    awake on this one. TypeError for a bool or non-number timeout, ValueError for NaN,
    negative or finite timeouts beyond int64 milliseconds."""
    ms = timeout_ms(timeout)
    if isinstance(obj, (dict, list, tuple)):
        return _wait_all(obj.values() if isinstance(obj, dict) else obj, ms)
    with registry_lock:
        exp, owner = _waited_export(obj)
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


def _waited_export(obj):
    """The export whose references :func:`wait` waits for, and what keeps it open (see
    :func:`_export_of`); with the registry lock held."""
    r = registered_tensors.get(id(obj))
    r = r() if r is not None else None
    if r is not None and r.current(obj):  # a registered tensor: its registration's export
        return r.prep[0], None
    return _export_of(obj)  # owner: keeps an empty() allocation open meanwhile


def _wait_all(objs, ms: int) -> bool:
    """:func:`wait` of many: each export once, in turn, within ``ms`` (-1: no limit) in all."""
    exps: dict = {}
    owners = []
    with registry_lock:
        try:
            for obj in objs:
                exp, owner = _waited_export(obj)
                if owner is not None:
                    owners.append(owner)
                if exp is not None and not exp.closed and id(exp) not in exps:
                    exps[id(exp)] = exp
                    exp.waiters += 1
        except BaseException:  # (an object that is not a tensor): no export stays waited on
            for exp in exps.values():
                exp.waiters -= 1
            raise
    try:
        deadline = None if ms < 0 else time.monotonic() + ms / 1000
        for exp in exps.values():
            left = -1 if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not exp.wait(left):
                return False
        return True
    finally:
        with registry_lock:
            for exp in exps.values():
                exp.waiters -= 1
        del owners


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
    call(lib.devshare_handle_discard, byref(struct_of(h)))


# --- consumer side: open --------------------------------------------------------------------------


def _import(h: Handle, read_only: bool) -> ImportP:
    opts = new_struct(ImportOptions)  # devshare_import_options_init: struct_size, defaults
    if read_only:
        opts.flags |= IMPORT_READ_ONLY
    opts.device = DEVICE_FROM_HANDLE
    imp = ImportP()
    if h.table_inline:
        call(lib.devshare_import, byref(struct_of(h)), byref(opts), byref(imp))
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
            note_import(h.key, info.base or 0, info.alloc_size)
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
        _dtypes.require_torch()
        _dtypes.to_torch(*h.dtype)
        if read_only:
            raise ValueError("PyTorch has no read-only tensors (a write would crash the process): "
                             "open with like='numpy' for a read-only view")
    elif like == "numpy":
        _dtypes.require_numpy()
        _dtypes.to_numpy(*h.dtype)
    else:
        raise ValueError(f"like must be 'torch' or 'numpy', not {like!r}")
    if h.backend_id != BACKEND_HOST:
        raise ValueError(f"{h.backend} handles cannot be opened by this package")

    imp = _import_noted(h, read_only)
    try:
        return from_import(imp, like)
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
    shape = normalize_shape(shape)
    code, bits, lanes = _dtypes.from_any(dtype)
    if like == "torch":
        _dtypes.require_torch()
        _dtypes.to_torch(code, bits, lanes)
    elif like == "numpy":
        _dtypes.require_numpy()
        _dtypes.to_numpy(code, bits, lanes)
    else:
        raise ValueError(f"like must be 'torch' or 'numpy', not {like!r}")
    nbytes = host_nbytes(shape, code, bits, lanes)
    with registry_lock:
        buf = HostBuffer(max(nbytes, 1))
        add_buffer(buf)
    # The view (and so every tensor/array over the allocation) keeps the buffer alive.
    return allocation_view(buf.export.base, buf.export.size, buf, nbytes, (code, bits, lanes),
                           shape, like)
