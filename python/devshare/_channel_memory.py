"""Host memory for channels, and where a CPU tensor or array lies in memory.

One job: the memory the channel objects hand out and describe. :func:`channel_empty` makes
tensors and arrays over a sealed memfd (``devshare_channel_host_alloc``), owned by a
:class:`ChannelBuffer` that is registered like :func:`devshare.empty`'s buffers (so that
:func:`devshare.outstanding` and a send find it); :func:`layout` tells where a CPU tensor or
numpy array lies (address, dtype, shape, strides, span), for sends and pools.

Imports :mod:`devshare._lib`, :mod:`devshare._dtypes`, :mod:`devshare._args`,
:mod:`devshare._views`, :mod:`devshare._registry` and :mod:`devshare._channel_lib`.
"""

from __future__ import annotations

import os
import weakref
from ctypes import byref

from . import _dtypes, _views
from ._args import normalize_shape, type_label
from ._channel_lib import call, require
from ._lib import Error, ExporterP, lib, registry_lock
from ._registry import Export, add_buffer, host_nbytes
from ._views import array_extent, is_ndarray, is_torch_tensor


class ChannelBuffer:
    """Owner of a ``devshare_channel_host_alloc`` allocation (a sealed memfd). Closed when the
    last tensor/array over it (and the last pool made on it) is gone."""

    __slots__ = ("export", "__weakref__")

    def __init__(self, nbytes: int):
        ptr = ExporterP()
        call(lib.devshare_channel_host_alloc, nbytes, byref(ptr), None)
        self.export = Export(ptr, None)  # closes ptr if it fails
        weakref.finalize(self, _close_export, os.getpid(), self.export)


def _close_export(pid, export) -> None:
    if os.getpid() == pid:
        try:
            export.close()
        except Error:  # noqa: BLE001 - nothing to do about it in a finalizer
            pass


def channel_empty(shape, dtype="float32", like: str = "torch"):
    """Uninitialised (zero-filled) host memory for channels, as a torch tensor or numpy array.

    The memory is a sealed memfd (``devshare_channel_host_alloc``): it has no name anyone could
    open, and reaches another process only over a channel (:meth:`Channel.send`, a pool over it),
    which passes the descriptor itself. :func:`devshare.share` refuses it. The allocation is
    closed when the tensor/array and every view of it are gone; consumers that received it keep
    their mappings until they release them.

    ``shape`` and ``dtype`` as for :func:`devshare.empty`. :func:`devshare.outstanding` and
    :func:`devshare.wait` count the references :meth:`Channel.send` leased out of it.
    Also available as :meth:`Channel.host_empty`.
    """
    require()
    shape = normalize_shape(shape)
    code, bits, lanes = _dtypes.from_any(dtype)
    _views.check_like(like)
    if like == "torch":
        _dtypes.to_torch(code, bits, lanes)
    else:
        _dtypes.to_numpy(code, bits, lanes)
    nbytes = host_nbytes(shape, code, bits, lanes)
    with registry_lock:
        buf = ChannelBuffer(max(nbytes, 1))
        # Registered like devshare.empty()'s buffers: outstanding()/wait() and send() find it.
        add_buffer(buf)
    return _views.view(buf.export.base, nbytes, buf, (code, bits, lanes), shape, like=like)


def contiguous(shape) -> tuple[int, ...]:
    """The element strides of a C-contiguous tensor of ``shape``."""
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def layout(obj):
    """(address of element 0, dtype, shape, element strides, bytes spanned) of a CPU torch
    tensor or numpy array."""
    if is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(f"only CPU tensors can be sent this way, not {obj.device.type} tensors")
        if obj.is_conj() or obj.is_neg():
            raise ValueError("the tensor has a lazy conjugate/negative bit: call resolve_conj() / "
                             "resolve_neg() first")
        shape, strides = tuple(obj.shape), tuple(obj.stride())
        if any(s < 0 for s in strides):
            raise ValueError("tensors with negative strides cannot be sent")
        esize = obj.element_size()
        span = 0 if obj.numel() == 0 else esize * (1 + sum((d - 1) * s for d, s in zip(shape, strides)))
        return obj.data_ptr(), _dtypes.from_any(obj.dtype), shape, strides, span
    if is_ndarray(obj):
        addr, span = array_extent(obj)
        esize = obj.itemsize
        for s in obj.strides:
            if s % esize:
                raise ValueError(f"stride {s} bytes is not a multiple of the element size {esize}")
        return (addr, _dtypes.from_any(obj.dtype), tuple(obj.shape),
                tuple(s // esize for s in obj.strides), span)
    raise TypeError(f"expected a torch tensor or a numpy array, not {type_label(obj)}")
