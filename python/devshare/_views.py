"""Between memory and the objects users hold: torch tensors and numpy arrays.

One job: an address range as a zero-copy tensor or array (keeping the range's owner alive as
long as it and every view of it live), an import as a tensor or array through DLPack, and the
other way: whether an object is a tensor or an array, and the bytes an array spans. Nothing
here knows who owns the memory (that is :mod:`devshare._registry`). torch and numpy are
imported only when a tensor or array of theirs is asked for; the type checks look in
``sys.modules``.

Imports :mod:`devshare._dtypes` and :mod:`devshare._dlpack`.
"""

from __future__ import annotations

import ctypes
import sys

from . import _dlpack, _dtypes


def is_torch_tensor(obj) -> bool:
    """Whether obj is a torch tensor (False, without importing torch, when it is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_ndarray(obj) -> bool:
    """Whether obj is a numpy array (False, without importing numpy, when it is not imported)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def array_extent(a) -> tuple[int, int]:
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


def check_like(like: str) -> None:
    """``like`` names a kind of view ("torch" or "numpy") whose package is importable."""
    if like == "torch":
        _dtypes.require_torch()
    elif like == "numpy":
        _dtypes.require_numpy()
    else:
        raise ValueError(f"like must be 'torch' or 'numpy', not {like!r}")


# DLPack (code, bits, lanes) -> the torch / numpy dtype (looked up once each).
_TORCH_DTYPES: dict = {}
_NUMPY_DTYPES: dict = {}


def torch_dtype(dtype):
    """The torch dtype of a DLPack (code, bits, lanes) (cached)."""
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        found = _TORCH_DTYPES[dtype] = _dtypes.to_torch(*dtype)
        return found


def numpy_dtype(dtype):
    """The numpy dtype of a DLPack (code, bits, lanes) (cached)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        found = _NUMPY_DTYPES[dtype] = _dtypes.to_numpy(*dtype)
        return found


def view(addr: int, nbytes: int, keep, dtype, shape, strides=None, like: str = "torch"):
    """A zero-copy tensor/array over ``[addr, addr + nbytes)`` (whose first element is at addr),
    keeping ``keep`` alive as long as it (and every view of it) lives. ``dtype`` is a DLPack
    (code, bits, lanes), ``strides`` in elements (None: C-contiguous). With no element (or no
    byte) to show, a fresh empty tensor/array of that shape.

    Every call makes its own storage (a ctypes array over the memory, holding ``keep``): a
    storage shared between items (or slots) could not keep each one's own owner alive."""
    esize = dtype[1] // 8 * dtype[2]
    numel = 1
    for d in shape:
        numel *= d
    if like == "torch":
        torch = _dtypes.require_torch()
        tdtype = torch_dtype(dtype)
        if numel == 0 or nbytes < esize:
            return torch.empty(shape, dtype=tdtype)  # no memory to share
        raw = (ctypes.c_uint8 * nbytes).from_address(addr)
        raw._devshare_keep = keep  # the ctypes array (and so every tensor over it) keeps it
        count = nbytes // esize
        flat = torch.frombuffer(raw, dtype=tdtype, count=count)
        if len(shape) == 1 and shape[0] == count and (strides is None or strides[0] == 1):
            return flat  # the whole region, as one row: nothing to slice
        if strides is None:
            return flat[:numel].view(shape)
        # (In place: the tensor made here is nobody else's, and an as_strided view of it would
        # cost a view's bookkeeping, about 0.7 us.)
        return flat.as_strided_(shape, strides)
    numpy = _dtypes.require_numpy()
    ndtype = numpy_dtype(dtype)
    if numel == 0 or nbytes == 0:
        return numpy.empty(shape, dtype=ndtype)
    raw = (ctypes.c_uint8 * nbytes).from_address(addr)
    raw._devshare_keep = keep
    bstrides = None if strides is None else tuple(s * esize for s in strides)
    return numpy.ndarray(shape, dtype=ndtype, buffer=raw, strides=bstrides)


def allocation_view(base: int, size: int, keep, nbytes: int, dtype, shape, like: str = "torch"):
    """A C-contiguous tensor/array of ``shape`` and ``dtype`` (a DLPack (code, bits, lanes))
    over the first ``nbytes`` of the allocation ``[base, base + size)``, keeping ``keep`` alive
    as long as it (and every view of it) lives. Its storage is the whole allocation, also when
    it has no elements, so that the allocation is found from any view of it."""
    raw = (ctypes.c_uint8 * size).from_address(base)
    raw._devshare_buffer = keep  # the ctypes array (and so every tensor over it) keeps it alive
    if like == "torch":
        torch = _dtypes.require_torch()
        flat = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes]
        return flat.view(torch_dtype(dtype)).reshape(shape)
    numpy = _dtypes.require_numpy()
    flat = numpy.frombuffer(raw, dtype=numpy.uint8, count=nbytes)
    return flat.view(numpy_dtype(dtype)).reshape(shape)


def from_import(imp, like: str = "torch"):
    """An import (an ``ImportP``) as a torch tensor (``torch.from_dlpack`` of a versioned
    capsule) or a numpy array (``numpy.from_dlpack``). The result holds its own reference to the
    import, released when it and every view of it are gone; the caller keeps its own."""
    if like == "torch":
        torch = _dtypes.require_torch()
        cap = _dlpack.capsule(_dlpack.managed_from_import(imp, versioned=True), versioned=True)
        return torch.from_dlpack(cap)
    return _dtypes.require_numpy().from_dlpack(_dlpack.DLPackSource(imp))


def torch_recipe(addr: int, nbytes: int, dtype, shape, strides):
    """What :func:`torch_from` makes torch tensors of ``shape``, ``strides`` (in elements) and
    ``dtype`` (a DLPack (code, bits, lanes)) over ``[addr, addr + nbytes)`` from, worked out
    once, as :func:`view` would each time: (the ctypes array type of the range, its address,
    the torch dtype, the elements to take from the range's start, the shape, and the strides,
    or None when those elements as one row are the tensor), or, with no element to show, None
    and the torch dtype and shape (a fresh empty tensor)."""
    torch = _dtypes.require_torch()
    if not _FROMBUFFER:
        _FROMBUFFER.append(torch.frombuffer)
    tdtype = torch_dtype(dtype)
    esize = dtype[1] // 8 * dtype[2]
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0 or nbytes < esize:
        return None, 0, tdtype, 0, shape, torch
    count = nbytes // esize
    if len(shape) == 1 and strides[0] == 1 and numel <= count:
        # A row of elements from the range's start (a KV block, a flat bucket): the tensor is
        # the first numel elements as they are, with no strided view made over them.
        return ctypes.c_uint8 * nbytes, addr, tdtype, numel, shape, None
    return ctypes.c_uint8 * nbytes, addr, tdtype, count, shape, strides


def torch_from(recipe, keep):
    """A torch tensor of its own (storage and all) from a :func:`torch_recipe`, whose storage
    keeps ``keep`` alive as long as it and every view of it live: a ctypes array over the
    range, made for this tensor, holds it (as :func:`view` does)."""
    array_type, addr, tdtype, count, shape, strides = recipe
    if array_type is None:
        return strides.empty(shape, dtype=tdtype)
    raw = array_type.from_address(addr)
    raw._devshare_keep = keep
    flat = _FROMBUFFER[0](raw, dtype=tdtype, count=count)
    return flat if strides is None else flat.as_strided_(shape, strides)  # (in place, as in view)


def numpy_recipe(addr: int, nbytes: int, keep, dtype, shape, strides=None):
    """What :func:`numpy_from` makes numpy arrays of ``shape`` and ``dtype`` (a DLPack (code,
    bits, lanes)) over ``[addr, addr + nbytes)`` from, checked once: the array type of the
    range, its address, the numpy dtype, the shape, (``numpy.ndarray``, ``keep``) and the
    strides in bytes (None: C-contiguous, also when ``strides``, in elements, say so), or, with
    no element to show, None and what a fresh empty array needs (the numpy module for the
    fifth). ``keep``: kept alive by the recipe."""
    numpy = _dtypes.require_numpy()
    ndtype = numpy_dtype(dtype)
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0 or nbytes == 0:
        return None, 0, ndtype, shape, numpy, None
    esize = dtype[1] // 8 * dtype[2]
    bstrides = None if strides is None else tuple(s * esize for s in strides)
    if bstrides is not None:
        contiguous, step = [], esize
        for d in reversed(shape):
            contiguous.append(step)
            step *= d
        if tuple(reversed(contiguous)) == bstrides:
            bstrides = None  # numpy makes a C-contiguous array faster without strides
    return ctypes.c_uint8 * nbytes, addr, ndtype, shape, (numpy.ndarray, keep), bstrides


def numpy_from(recipe, keep):
    """A numpy array of its own (shape and all) from a :func:`numpy_recipe`, whose memory keeps
    ``keep`` alive as long as it and every numpy view of it live: a ctypes array over the range,
    made for this array, holds it. (Connection.recv makes a pool item's this way itself.)"""
    array_type, addr, ndtype, shape, extra, bstrides = recipe
    if array_type is None:
        return extra.empty(shape, dtype=ndtype)
    raw = array_type.from_address(addr)
    raw._devshare_keep = keep
    return extra[0](shape, ndtype, raw, 0, bstrides)


# torch.frombuffer, looked up once (torch_recipe runs before any torch_from).
_FROMBUFFER: list = []

_USE_COUNT: list = []


def storage_counter():
    """torch's function of a storage's ``_cdata`` that tells how many tensors (and storage
    objects) share it; None when this torch has none."""
    if not _USE_COUNT:
        torch = _dtypes.require_torch()
        _USE_COUNT.append(getattr(torch._C, "_storage_Use_Count", None))
    return _USE_COUNT[0]

