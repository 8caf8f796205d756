"""Channels: a producer hands tensors to consumer processes over a Unix socket, as leases.

A :class:`Channel` is the producer end: it listens on an address (a filesystem path, or
``"@name"`` for a Linux abstract socket) that consumers :func:`connect` to. Only processes of
this user may connect (:meth:`Channel.restrict` narrows that down to uids or pids), and the
kernel vouches for who they are (``SO_PEERCRED``).

Two ways to hand a tensor over:

- **Leases** (:meth:`Channel.send`): one reference to a tensor in memory from
  :func:`channel_empty` (a sealed memfd that exists only for this process and the consumers it
  was sent to) or :func:`devshare.empty`. :func:`devshare.outstanding` counts it until the
  consumer releases the item or disconnects; :func:`devshare.wait` waits for that.
- **Pools** (:meth:`Channel.pool`): ``count`` slots of ``slot_nbytes`` bytes in one allocation.
  :meth:`Pool.acquire` gives a free slot to fill (blocking while every slot is out:
  backpressure), :meth:`Slot.send` hands it to a consumer, whose :meth:`Item.release` brings it
  back. A consumer maps the pool's allocation once, so every slot keeps one address for the
  pool's life, in the producer and in each consumer.

The consumer (:func:`connect`) gets :class:`Item` objects from :meth:`Connection.recv`: the
item's :attr:`~Item.tensor` is a zero-copy torch tensor (or numpy array) over the producer's
memory, valid until :meth:`Item.release`, which gives the reference or slot back to the
producer at once.

Nothing runs in the background: the library does the channel's work (accepting consumers,
taking their releases, noticing that one died) inside the calls of this module, and inside
:func:`devshare.wait`. A producer that is otherwise idle calls :meth:`Channel.service`, for
example when :meth:`Channel.fileno` becomes readable in a ``select`` / ``poll`` / asyncio loop.

Processes: every object here belongs to the process that made it. A process started with
multiprocessing's ``spawn`` (or any new process) connects by address. A child made by ``fork``
(multiprocessing's default start method on Linux) inherits copies of the parent's channels,
pools, connections and items, but they are the parent's: using one in the child raises
:class:`RuntimeError`, and the child's garbage collection of them does nothing (no release
reaches the parent's producer). Connect again in the child. A child forked after consumers
connected also keeps its copies of their sockets open while it lives, so those consumers see
the producer's death or close only once that child is gone too: start fork workers before
listening, or use ``spawn``.

Threads: the objects may be used from several threads. Closing an object while another thread
is inside one of its calls is refused (:class:`devshare.Error` with status ``BUSY``).

This module is the channel API and nothing else: the memory registry it shares with
:func:`devshare.share` (so that ``outstanding`` / ``wait`` count leases) is
:mod:`devshare._registry`, and tensors over received memory are made by :mod:`devshare._views`.
Imports :mod:`devshare._lib`, :mod:`devshare._ints`, :mod:`devshare._dtypes`,
:mod:`devshare._args`, :mod:`devshare._views`, :mod:`devshare._registry`,
:mod:`devshare._channel_lib` (the library's channel functions, bound once for its version) and
:mod:`devshare._ownership` (objects owned by one process: the fork and thread rules).
"""

from __future__ import annotations

import math
import os
import struct
import time
import weakref
from ctypes import byref, c_int32, c_size_t, c_uint32, c_uint64, c_void_p, cast, sizeof

from . import _dtypes, _ints, _torch_ipc, _views
from ._api import torch_host_export
from ._args import normalize_shape, timeout_ms, type_label
from ._channel_lib import (
    FAST_SECONDS as _FAST_SECONDS,
    FOREVER as _FOREVER,
    GIVE_BACK as _GIVE_BACK,
    I32_MAX as _I32_MAX,
    MS_ARGS as _MS_ARGS,
    RAW_ACQUIRE as _RAW_ACQUIRE,
    RAW_GIVE_BACK as _RAW_GIVE_BACK,  # noqa: F401 - read from here by the benchmarks
    RAW_RECV_ARGS as _RAW_RECV_ARGS,
    RAW_RECV_ITEM as _RAW_RECV_ITEM,
    RAW_RELEASE as _RAW_RELEASE,
    RAW_SEND as _RAW_SEND,
    TIMEOUT as _TIMEOUT,
    UNMAP_GIVEN_BACK as _UNMAP_GIVEN_BACK,
    ChannelClosed,
    address_bytes as _address,
    call as _call,
    describe,
    error as _error,
    need,
    peer_id as _peer_id,
    require as _require,
    send_leases,
    timed as _timed,
    wait_call as _wait_call,
)
from ._lib import (
    BACKEND_HOST,
    ChannelP,
    ConnectionP,
    Error,
    ExporterP,
    HandleStruct,
    ImportInfo,
    ImportP,
    ItemStruct,
    MAX_NDIM,
    MAX_SPIN_US,
    PeerInfo,
    PoolP,
    RecvArgs,
    SHARE_EVENT,
    STORAGE_TO_END,
    Status,
    call,
    lib,
    new_struct,
    registry_lock,
)
from ._ownership import PID as _PID
from ._ownership import Owned as _Owned
from ._ownership import forked as _forked
from ._registry import (
    MAX_ALLOC,
    Export,
    add_buffer,
    adopt_device,
    buffer_at,
    collect_except,
    device_adoption,
    host_nbytes,
    sweep_device_adoptions,
    tensor_desc,
)
from ._views import array_extent, is_ndarray, is_torch_tensor

# --- Binding the channel functions: devshare._channel_lib ----------------------------------------

#: PeerInfo.transport's numbers, as peer_info names them.
_TRANSPORTS = {0: "unix", 1: "stream", 2: "ucx"}


def _set_spin(fn, obj, spin_us) -> None:
    """``fn`` (devshare_pool_set_spin / devshare_connection_set_spin) on ``obj``'s pointer."""
    fn = need(fn, "spinning")
    us = _ints.index("spin_us", spin_us, 0, MAX_SPIN_US)
    ptr = obj._enter()
    try:
        _call(fn, ptr, us)
    finally:
        obj._exit()


def _check_sendable(t) -> None:
    """TypeError, naming what to send instead, for a torch tensor that has no memory of its own
    to lease: a meta tensor, or a sparse (or other non-strided) layout."""
    if t.device.type == "meta":
        raise TypeError("Channel.send: a meta tensor has no memory to share (it only describes a "
                        "shape and dtype); send a tensor on a real device")
    if t.layout is not _strided_layout():
        raise TypeError(f"Channel.send: a {t.layout} tensor cannot be shared as it is (only "
                        f"strided tensors); send t.to_dense(), or its values() and indices() "
                        f"as tensors of their own")


def _strided_layout():
    """``torch.strided`` (torch is imported by then: a tensor was given)."""
    import torch  # noqa: PLC0415

    return torch.strided


def _shape(shape) -> tuple[int, ...]:
    """:func:`devshare._args.normalize_shape`, with a tuple of in-range ints passed through."""
    if type(shape) is tuple:
        for d in shape:
            if type(d) is not int or not 0 <= d <= _N64_MAX:
                break
        else:
            return shape
    return normalize_shape(shape)


_N64_MAX = _ints.N64[1]

# dtype argument (a str or torch.dtype) -> (code, bits, lanes), as _dtypes.from_any gives it.
_DTYPE_ARGS: dict = {}


def _dtype_arg(dtype) -> tuple[int, int, int]:
    if type(dtype) is str or type(dtype).__module__ == "torch":
        try:
            return _DTYPE_ARGS[dtype]
        except (KeyError, TypeError):
            pass
        found = _dtypes.from_any(dtype)
        if len(_DTYPE_ARGS) < 256:
            _DTYPE_ARGS[dtype] = found
        return found
    return _dtypes.from_any(dtype)


# --- Host memory for channels --------------------------------------------------------------------


class _ChannelBuffer:
    """Owner of a ``devshare_channel_host_alloc`` allocation (a sealed memfd). Closed when the
    last tensor/array over it (and the last pool made on it) is gone."""

    __slots__ = ("export", "__weakref__")

    def __init__(self, nbytes: int):
        ptr = ExporterP()
        _call(lib.devshare_channel_host_alloc, nbytes, byref(ptr), None)
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
    _require()
    shape = normalize_shape(shape)
    code, bits, lanes = _dtypes.from_any(dtype)
    _views.check_like(like)
    if like == "torch":
        _dtypes.to_torch(code, bits, lanes)
    else:
        _dtypes.to_numpy(code, bits, lanes)
    nbytes = host_nbytes(shape, code, bits, lanes)
    with registry_lock:
        buf = _ChannelBuffer(max(nbytes, 1))
        # Registered like devshare.empty()'s buffers: outstanding()/wait() and send() find it.
        add_buffer(buf)
    return _views.view(buf.export.base, nbytes, buf, (code, bits, lanes), shape, like=like)


def _contiguous(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def _layout(obj):
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


# --- Producer ----------------------------------------------------------------------------------------


class Channel(_Owned):
    """The producer end of a channel, listening on ``address``.

    ``address`` is a filesystem path (the socket file is created with mode 0600; an existing
    file there is never replaced: :class:`devshare.Error` ``BUSY``) or ``"@name"`` for a Linux
    abstract socket (no file; gone with the channel). Only processes with this process's
    effective uid may connect until :meth:`restrict` says otherwise.

    Use it as a context manager, or call :meth:`close`: consumers then see
    :class:`ChannelClosed` once they received everything sent before, and what they hold stays
    valid until they release it. Pools made on the channel are closed with it.
    """

    _what = "Channel"

    #: See :func:`channel_empty`.
    host_empty = staticmethod(channel_empty)

    def __init__(self, address):
        _require()
        raw = _address(address)
        ptr = ChannelP()
        _call(lib.devshare_channel_listen, raw, byref(ptr))
        self.address = os.fsdecode(raw)
        # Pools made on this channel (closed before it).
        self._pools: weakref.WeakSet = weakref.WeakSet()
        self._own(ptr, lib.devshare_channel_close)

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<devshare.Channel {self.address!r} {state}>"

    def _closing(self) -> None:
        for pool in list(self._pools):
            pool.close()

    def fileno(self) -> int:
        """A descriptor that becomes readable when :meth:`service` has work (a consumer
        connecting, releasing or hanging up), for ``select`` / ``poll`` / asyncio's
        ``loop.add_reader``. It belongs to the channel: do not close or read it."""
        ptr = self._enter()
        try:
            return _call(lib.devshare_channel_fd, ptr)
        finally:
            self._exit()

    def service(self, timeout=None) -> None:
        """Do the channel's pending work: accept consumers (their credentials checked), take
        releases and returned slots, notice hang-ups (a dead consumer's leases and slots come
        back at once). Waits at most ``timeout`` seconds (None: until something happens; 0: do
        not wait) for something to do. The blocking calls (:meth:`wait_peers`,
        :meth:`Pool.acquire`, :func:`devshare.wait`) do this themselves while they wait."""
        ptr = self._enter()
        try:
            _timed(lambda ms: _call(lib.devshare_channel_service, ptr, ms), timeout)
        finally:
            self._exit()
        sweep_device_adoptions()  # device storages whose leases came back

    def wait_peers(self, n: int = 1, timeout=None) -> list[int]:
        """Serve the channel until at least ``n`` consumers are connected; return the connected
        peers' ids (:meth:`peers`). TimeoutError when ``timeout`` seconds (None: forever) pass
        first."""
        n = _ints.index("n", n, 0, _ints.U64[1])
        ptr = self._enter()
        try:
            done = _timed(lambda ms: _call(lib.devshare_channel_wait_peers, ptr, n, ms), timeout)
        finally:
            self._exit()
        if not done:
            raise TimeoutError(f"fewer than {n} consumer(s) connected within {timeout} s")
        return self.peers()

    def peers(self) -> list[int]:
        """Ids (ints > 0) of the connected consumers, oldest first. As of the last service: call
        :meth:`service` to take in new connections and hang-ups."""
        ptr = self._enter()
        try:
            cap = 16
            while True:
                ids, count = (c_uint64 * cap)(), c_size_t()
                try:
                    _call(lib.devshare_channel_peer_ids, ptr, ids, cap, byref(count))
                except Error as e:
                    if e.status == Status.BUFFER_TOO_SMALL and count.value > cap:
                        cap = count.value + 16  # more may connect before the next call
                        continue
                    raise
                return list(ids[: count.value])
        finally:
            self._exit()

    def peer_info(self, peer: int) -> dict:
        """What is known of a connected consumer, a dict: ``id``; ``pid``, ``uid``, ``gid`` as
        the kernel reported them when it connected; ``tgid``, the pid it announced; ``leases``,
        items leased to it and pools it attached, not yet given back; ``slots``, the pool slots
        it holds now (items sent to it, not given back); ``protocol_errors``, its
        messages the channel refused (giving back what it does not hold, ...); ``transport``, how
        its items travel: ``"unix"`` (shared memory), ``"stream"`` (a remote channel's
        authenticated connection) or ``"ucx"``.
        :class:`devshare.Error` ``NOT_FOUND`` when it is not connected."""
        peer = _peer_id(peer)
        info = new_struct(PeerInfo)
        ptr = self._enter()
        try:
            _call(lib.devshare_channel_peer_info, ptr, peer, byref(info))
        finally:
            self._exit()
        return {"id": info.id, "pid": info.pid, "uid": info.uid, "gid": info.gid,
                "tgid": info.tgid, "leases": info.leases, "slots": info.slots,
                "protocol_errors": info.protocol_errors,
                "transport": _TRANSPORTS.get(info.transport, str(info.transport))}

    def disconnect(self, peer: int) -> None:
        """Disconnect consumer ``peer`` now, as if its process had died: its leases and pool
        slots come back at once and its :meth:`Connection.recv` raises :class:`ChannelClosed`
        once it read what its socket had taken (what still waited for it is dropped). The channel does the same on its own to a consumer
        that stops reading (see the README's limits). :class:`devshare.Error` ``NOT_FOUND``
        when it is not connected."""
        fn = need("devshare_channel_disconnect", "Channel.disconnect")
        peer = _peer_id(peer)
        ptr = self._enter()
        try:
            _call(fn, ptr, peer)
        finally:
            self._exit()

    def trust_announced_pids(self, trust: bool = True) -> None:
        """Whitelist ACL exports sent over this channel for the pid a consumer announced (its
        bare tgid) even where it is not the consumer's pid as the kernel reports it: needed for
        consumers in containers, whose host pid this process cannot check. Off by default: the
        kernel's pid is whitelisted instead, so an admitted consumer cannot get NPU memory
        whitelisted for a process :meth:`restrict` did not admit."""
        fn = need("devshare_channel_trust_announced_pids", "Channel.trust_announced_pids")
        if not isinstance(trust, bool):
            raise TypeError(f"trust must be a bool, not {type(trust).__name__}")
        ptr = self._enter()
        try:
            _call(fn, ptr, 1 if trust else 0)
        finally:
            self._exit()

    def restrict(self, uids=None, pids=None) -> None:
        """Narrow down who may connect from now on (connected consumers stay): ``uids``, an
        iterable of user ids, replaces the allowed set (None or empty: keep it; by default only
        this process's effective uid); ``pids``, when given and not empty, admits only those
        process ids."""
        uid_list = [_ints.index("uid", u, *_ints.U32) for u in (uids or ())]
        pid_list = [_ints.index("pid", p, 1, _ints.I32[1]) for p in (pids or ())]
        uid_arr = (c_uint32 * len(uid_list))(*uid_list) if uid_list else None
        pid_arr = (c_int32 * len(pid_list))(*pid_list) if pid_list else None
        ptr = self._enter()
        try:
            _call(lib.devshare_channel_restrict, ptr, uid_arr, len(uid_list), pid_arr, len(pid_list))
        finally:
            self._exit()

    def send(self, peer: int, obj, *, stream=None) -> None:
        """Send consumer ``peer`` one leased reference to ``obj``; nothing is copied, the
        consumer maps the same memory and gets it as :attr:`Item.tensor`. ``obj`` is:

        - a **CUDA or NPU torch tensor** from PyTorch's or torch_npu's caching allocator
          (plain or expandable segments): shared through PyTorch's own IPC (``reduce_tensor``),
          adopted by devshare (``devshare_exporter_adopt``) and leased. This process keeps the
          tensor's storage alive until the lease comes back (the consumer released the item or
          died), then returns PyTorch's reference and lets the storage go: no
          ``torch.cuda.ipc_collect()``, no warning at exit. Expandable-segment fds travel with
          ``SCM_RIGHTS``: the consumer needs no ``pidfd_getfd`` (no ptrace permission).
          An interprocess event is recorded on ``stream`` (a ``torch.cuda.Stream``, an NPU
          stream or a raw handle; default: the device's current stream) and kept until the
          lease returns; the consumer's receive makes its stream wait on it. Nothing
          synchronises the device.
        - a **CPU torch tensor**: in memory from :func:`channel_empty` / :func:`devshare.empty`
          as is; otherwise its storage moves into PyTorch's ``file_system`` shared memory once
          (one copy, as ``share_memory_()`` does; the tensor keeps working and later sends are
          zero copy) and is leased from there.
        - a **numpy array** in :func:`channel_empty` / :func:`devshare.empty` memory.

        Any strides >= 0, views, offsets. :func:`devshare.outstanding` counts the reference
        until the consumer releases its item or disconnects; :func:`devshare.wait` (``obj``)
        waits for that. Keep writing to the memory only once it came back. Returns are taken
        in this channel's calls (:meth:`service`, sends, :meth:`wait_peers`, ...).

        :class:`devshare.Error` ``NOT_FOUND`` when ``peer`` is not connected."""
        if stream is not None and not (is_torch_tensor(obj) and obj.device.type != "cpu"):
            raise ValueError("stream= applies to CUDA and NPU tensors only")
        self.send_batch(peer, (obj,), stream=stream)

    def send_batch(self, peer: int, tensors, *, stream=None) -> None:
        """Send consumer ``peer`` many tensors in one call (a state dict's values, a list of KV
        blocks), each as its own lease, in order: the consumer receives them as that many
        items, one :meth:`Connection.recv` each, in the order given (pass a dict to send its
        values in its order). Each tensor as in :meth:`send`. They travel in as few messages
        as the message size allows (about 150 tensors per message; one per message to a
        consumer older than 1.4). Tensors of one storage are shared once (one PyTorch reference
        for all of them), and a consumer maps each allocation (a CUDA block or segment) once
        however many tensors lie in it. A tensor that cannot be sent raises before anything
        is sent."""
        peer = _peer_id(peer)
        items = tensors.values() if isinstance(tensors, dict) else tensors
        adopted = False
        with registry_lock:  # (adopted exports stay open from their share to their send)
            try:
                prepared = []
                for t in items:
                    if is_torch_tensor(t):
                        _check_sendable(t)
                    if is_torch_tensor(t) and t.device.type != "cpu":
                        prep, fresh = self._prepare_device(t, stream)
                    else:
                        prep, fresh = self._prepare_host(t)
                    prepared.append(prep)
                    adopted |= fresh
                self._send_prepared(peer, prepared)
            finally:
                if adopted:
                    collect_except(keep=None)

    def _send_prepared(self, peer: int, prepared: list) -> None:
        """Send the (export, TensorDesc, what keeps it valid) of ``prepared`` as leases, in one
        call where the library can (:func:`devshare._channel_lib.send_leases`)."""
        if not prepared:
            return
        ptr = self._enter()
        try:
            send_leases(ptr, peer, prepared)
        finally:
            self._exit()

    def _prepare_host(self, obj):
        """((export, desc, keep), whether a storage was adopted) for a CPU tensor or numpy
        array: devshare memory as is, a torch storage from PyTorch's file_system memory."""
        addr, dtype, shape, strides, span = _layout(obj)
        buf = buffer_at(addr, span)
        if buf is None:
            if not is_torch_tensor(obj):
                raise TypeError("this array's memory cannot be sent over a channel: allocate it "
                                "with devshare.channel_empty(shape, dtype, like='numpy') (or "
                                "devshare.empty), send a torch tensor, or use a pool")
            exp, storage_offset, nbytes = torch_host_export(obj)
            desc, keep = tensor_desc(dtype, shape, strides, storage_offset, nbytes,
                                     obj.storage_offset(), inflight=False)
            return (exp, desc, keep), True
        exp = buf.export
        esize = dtype[1] // 8 * dtype[2]
        offset = addr - exp.base
        # The storage is the whole allocation; the tensor starts at element offset // esize, or,
        # when offset is not a whole number of elements, at its own byte offset.
        if offset % esize == 0:
            desc, keep = tensor_desc(dtype, shape, strides, 0, exp.size, offset // esize,
                                     inflight=False)
        else:
            desc, keep = tensor_desc(dtype, shape, strides, offset, exp.size - offset, 0,
                                     inflight=False)
        return (exp, desc, (keep, buf)), False  # buf: the allocation stays open

    def _prepare_device(self, t, stream):
        """((export, desc, keep), whether a storage was adopted now) for CUDA / NPU tensor
        ``t``: its storage adopted once while leases of it are out."""
        _torch_ipc.DEVICE_BACKENDS[t.device.type]  # noqa: B018 - KeyError names the device type
        raw_stream = _torch_ipc.current_stream(t, stream)
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        dtype = _dtypes.from_any(t.dtype)
        exp = device_adoption(key)
        fresh = exp is None
        if fresh:
            args, backend = _torch_ipc.reduce(t)
            exp = self._adopt(args, backend, storage, key)
        return self._device_desc(exp, dtype, tuple(t.shape), tuple(t.stride()),
                                 t.storage_offset(), raw_stream), fresh

    def _adopt(self, args, backend: int, keep, key) -> Export:
        """Adopt the reference of a PyTorch / torch_npu share tuple made in this process (its
        15 args), holding ``keep`` until its leases are back; the reference goes back at once
        on failure."""
        h = _torch_ipc.handle_of_args(args, backend)
        with registry_lock:
            try:
                return adopt_device(h, keep, key)
            except BaseException:
                _torch_ipc.release(args, backend)
                raise

    @staticmethod
    def _device_desc(exp: Export, dtype, shape, strides, tensor_offset: int, raw_stream: int):
        """(exp, desc, keep) of a tensor inside adopted device export ``exp`` (offsets in its
        storage), with an event recorded on ``raw_stream``."""
        desc, keep = tensor_desc(dtype, shape, strides, 0, STORAGE_TO_END, tensor_offset,
                                 inflight=False)
        desc.flags = SHARE_EVENT
        desc.stream = raw_stream or None
        return exp, desc, keep

    def _lease(self, peer: int, exp: Export, dtype, shape, strides, tensor_offset: int,
               raw_stream: int) -> None:
        """One lease of a tensor inside adopted device export ``exp``."""
        self._send_prepared(peer, [self._device_desc(exp, dtype, shape, strides, tensor_offset,
                                                     raw_stream)])

    def collect(self) -> int:
        """Serve the channel without waiting, then let go of every CUDA / NPU storage whose
        leases all came back (returning PyTorch's reference for it); the number let go.
        :meth:`service` does this too."""
        self.service(0)
        return collect_except(keep=None, force=True)

    def pool(self, slot_nbytes: int, count: int, memory=None) -> "Pool":
        """A :class:`Pool` of ``count`` slots of ``slot_nbytes`` bytes on this channel.

        By default over a fresh :func:`channel_empty` allocation of ``slot_nbytes * count``
        bytes. ``memory``: a tensor/array from :func:`channel_empty` or :func:`devshare.empty`
        instead; the slots then lie back to back from the start of its allocation (which must
        hold them all), and the pool keeps it alive."""
        return Pool(self, slot_nbytes, count, memory)


_MAX_DESCS = 64
_MAX_VIEWS = 1024  # Slot views kept by a pool, Item views kept by a connection


class Pool(_Owned):
    """Fixed slots of one allocation, handed to consumers of a :class:`Channel` (made by
    :meth:`Channel.pool`).

    Attributes: ``channel``, ``slot_nbytes``, ``count``, and ``id`` (> 0), the pool's id on
    its channel, which consumers see as :attr:`Item.pool`.

    :meth:`acquire` a :class:`Slot`, fill it through :meth:`Slot.tensor` / :meth:`Slot.numpy`,
    :meth:`Slot.send` it; the consumer's :meth:`Item.release` brings it back (so does the
    consumer's death). :meth:`acquire` blocks while every slot is out. Each slot has one address
    for the pool's life, here and in every consumer.

    A context manager; :meth:`close` stops handing out slots (the consumers' items stay valid
    until they release them). Views of slots stay readable after the close.
    """

    _what = "Pool"

    def __init__(self, channel: Channel, slot_nbytes: int, count: int, memory=None):
        if not isinstance(channel, Channel):
            raise TypeError(f"Pool needs a devshare.Channel, not {type_label(channel)}")
        slot_nbytes = _ints.index("slot_nbytes", slot_nbytes, 1, _ints.N64[1])
        count = _ints.index("count", count, 1, _ints.U32[1])
        total = slot_nbytes * count
        if memory is None:
            if total > MAX_ALLOC:
                raise ValueError(f"{count} slots of {slot_nbytes} bytes are more than the largest "
                                 f"host allocation")
            keeper = _ChannelBuffer(total)
        else:
            addr, _, _, _, span = _layout(memory)
            with registry_lock:
                keeper = buffer_at(addr, span)
            if keeper is None:
                raise TypeError("a pool's memory must come from devshare.channel_empty() or "
                                "devshare.empty()")
            if total > keeper.export.size:
                raise ValueError(f"{count} slots of {slot_nbytes} bytes do not fit the "
                                 f"{keeper.export.size}-byte allocation")
        ptr = PoolP()
        ch = channel._enter()
        try:
            _call(lib.devshare_pool_create, ch, keeper.export.ptr, slot_nbytes, count, byref(ptr))
        finally:
            channel._exit()
        pool_id = c_uint32()
        try:
            _call(lib.devshare_pool_id, ptr, byref(pool_id))
        except BaseException:
            _call(lib.devshare_pool_close, ptr)
            raise
        #: The pool's id on its channel (> 0): what consumers see as :attr:`Item.pool`.
        self.id = pool_id.value
        self.channel = channel
        self.slot_nbytes = slot_nbytes
        self.count = count
        self._keeper = keeper  # the memory: slot views hold it too
        # Slot.send's descriptors by layout (see _desc), and its last peer as a c_uint64.
        self._descs: dict = {}
        self._last_peer = (0, None)
        # Slot.send's last arguments and their descriptor entry (see Slot._desc_for).
        self._last_send = (None, None, None, None, None)
        # Slot.send's descriptors by its plain arguments (shape, dtype, strides, offset).
        self._sends: dict = {}
        # Slot.tensor / Slot.numpy's views by (slot index, shape, dtype, offset, like): see
        # Slot._view; and each slot's last torch layout (shape, dtype, offset, view) by index.
        self._views: dict = {}
        self._last_views: dict = {}
        # acquire's out-arguments, ready-made (taken by one call at a time: list.pop is atomic).
        self._outs: list = []
        # Each slot's index as the library's uint32 (what Slot.send and Slot.release pass).
        self._index_args: dict = {}
        self._own(ptr, lib.devshare_pool_close)
        channel._pools.add(self)

    def __repr__(self):
        state = "closed" if self.closed else f"{self.free_slots} free"
        return f"<devshare.Pool {self.id}: {self.count} x {self.slot_nbytes} bytes, {state}>"

    def _info(self) -> tuple[int, int, int]:
        size, count, free = c_uint64(), c_uint32(), c_uint32()
        ptr = self._enter()
        try:
            _call(lib.devshare_pool_info, ptr, byref(size), byref(count), byref(free))
        finally:
            self._exit()
        return size.value, count.value, free.value

    def _peer_arg(self, peer: int) -> c_uint64:
        """``peer`` (checked by _peer_id) as a c_uint64, the last one kept (check_args has less
        to do with it)."""
        last = self._last_peer
        if last[0] != peer:
            last = self._last_peer = (peer, c_uint64(peer))
        return last[1]

    def _desc(self, dtype, shape, strides, offset):
        """(byref of a TensorDesc for :meth:`Slot.send`, what it holds). The library only reads
        a descriptor, and a pool's items usually share a few layouts, so the descriptors are
        kept by layout (up to _MAX_DESCS) instead of being made (and initialised by the
        library) for every item. Only layouts of plain ints are kept: anything else goes
        through the checks of :func:`devshare._registry.tensor_desc` every time."""
        if type(offset) is not int or any(type(x) is not int for x in strides):
            desc, keep = tensor_desc(dtype, shape, strides, offset, STORAGE_TO_END, 0, inflight=False)
            return byref(desc), desc, keep
        key = (dtype, shape, strides, offset)
        entry = self._descs.get(key)
        if entry is None:
            desc, keep = tensor_desc(dtype, shape, strides, offset, STORAGE_TO_END, 0, inflight=False)
            entry = (byref(desc), desc, keep)
            if len(self._descs) >= _MAX_DESCS:
                self._descs.clear()
            self._descs[key] = entry
        return entry

    @property
    def free_slots(self) -> int:
        """Slots neither acquired nor out with a consumer (as of the channel's last service)."""
        return self._info()[2]

    def set_spin(self, spin_us: int) -> None:
        """Let :meth:`acquire` poll for a returned slot for up to ``spin_us`` microseconds
        before it sleeps (0, the default: sleep at once; at most ``MAX_SPIN_US``, 1 s). For a
        producer with a CPU core of its own; where producer and consumer share a CPU it only
        slows both down."""
        _set_spin("devshare_pool_set_spin", self, spin_us)

    def acquire(self, timeout=None) -> "Slot":
        """A free :class:`Slot` to fill. While every slot is acquired or out with consumers it
        waits (serving the channel, so returns and hang-ups come in): at most ``timeout``
        seconds (None: forever), then TimeoutError."""
        try:
            out = self._outs.pop()
        except IndexError:
            idx, addr = c_uint32(), c_void_p()
            out = (idx, addr, byref(idx), byref(addr))
        # self._enter() / self._exit(), written out (this is on every item's path).
        life = self._life
        inside = life.inside
        inside.append(None)
        ptr = self._ptr if life.open and self._pid == _PID[0] else self._enter_refused()
        try:
            if timeout is None:  # one library call, no argument checks (all ctypes objects)
                status = _RAW_ACQUIRE(ptr, _FOREVER, out[2], out[3])
                if status < 0:
                    raise _error(status)
                done = True
            else:
                done = _wait_call(lib.devshare_pool_acquire, ptr, timeout, out[2], out[3])
        finally:
            inside.pop()
            if life.deferred:
                life.leave()
        if not done:
            raise TimeoutError(f"no slot of the pool came back within {timeout} s (all {self.count} "
                               f"are out)")
        index, address = out[0].value, out[1].value
        self._outs.append(out)
        return Slot(self, index, address)

    def _index_arg(self, index: int) -> c_uint32:
        arg = self._index_args.get(index)
        if arg is None:
            arg = self._index_args[index] = c_uint32(index)
        return arg


class Slot:
    """An acquired pool slot: ``index``, ``address`` (its first byte in this process, the same
    every time this slot is acquired) and ``nbytes``.

    Fill it through :meth:`tensor` / :meth:`numpy` (zero-copy views), then :meth:`send` it to a
    consumer, or :meth:`release` it unsent. As a context manager it is released at the end of
    the ``with`` block unless it was sent. A slot dropped without either goes back to the pool
    once it and every view of it are gone: the tensors and arrays :meth:`tensor` /
    :meth:`numpy` returned, numpy views of those arrays, and torch views of those tensors
    (slicing, ``view``, ``reshape``, ...; not ``.numpy()``, ``.detach()`` or ``view(dtype)`` of
    a tensor, which share the memory without holding the slot).

    Views are cheap: the pool keeps one torch tensor per slot and layout (shape, dtype,
    offset), made the first time, and :meth:`tensor` returns a new tensor object over it (a
    ``detach()``: the same memory, its own shape and strides, so resizing or reshaping it in
    place never touches what later calls return); :meth:`numpy` makes a new array each time.
    A view is for the time the slot is held: after :meth:`send` or :meth:`release`, one kept
    shows (and writes!) whatever goes into that slot next, the next item sent from it. It
    stays mapped while it lives (the pool's memory is freed only after its last view), so
    using it never faults.
    """

    __slots__ = ("pool", "index", "address", "nbytes", "_state", "_pid", "_index_arg", "__weakref__")

    def __init__(self, pool: Pool, index: int, address: int):
        self.pool = pool
        self.index = index
        # The index as the library's uint32.
        self._index_arg = pool._index_args.get(index) or pool._index_arg(index)
        self.address = address
        self.nbytes = pool.slot_nbytes
        self._pid = pool._pid
        self._state = "acquired"

    def __del__(self):
        # Gone with every view of it (each holds the Slot), neither sent nor released: back to
        # the pool. (Not a weakref.finalize: that costs more than the rest of an acquire.)
        try:
            if self._state == "acquired":
                self._state = "dropped"
                _return_slot(self._pid, self.pool, self.index)
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to do in a finalizer
            pass

    def __repr__(self):
        return f"<devshare.Slot {self.index} of {self.pool!r}, {self._state}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._state == "acquired":
            self.release()

    def _view(self, shape, dtype, offset, like):
        # The pool's views by the plain arguments (a tuple of ints or None, an int offset): a
        # slot has one address for the pool's life, so what was checked and made for a layout
        # once holds every time.
        key = None
        if type(offset) is int:
            if shape is None:
                key = (self.index, None, dtype, offset, like)
            elif type(shape) is tuple:
                for d in shape:
                    if type(d) is not int:
                        break
                else:
                    key = (self.index, shape, dtype, offset, like)
        views = self.pool._views
        made = None
        if key is not None:
            try:
                made = views.get(key)
            except TypeError:  # an unhashable dtype: checked and made every time
                key = None
        if made is None:
            made = self._make_view(shape, dtype, offset, like)
            if key is not None:
                if len(views) >= _MAX_VIEWS:
                    views.clear()
                views[key] = made
        if like == "torch":
            if key is not None:
                # This slot's last torch layout, for tensor()'s look by identity.
                self.pool._last_views[self.index] = (shape, dtype, offset, made)
            # A tensor object of its own over the memory, holding this Slot.
            t = made.detach()
            t._devshare_slot = self
            return t
        return _views.numpy_from(made, self)  # an array of its own, holding this Slot

    def _make_view(self, shape, dtype, offset, like):
        """What :meth:`_view` keeps for a layout: a torch tensor (keeping the pool's memory
        alive), or what numpy arrays over it are made from (:func:`devshare._views.numpy_recipe`)."""
        code_bits_lanes = _dtype_arg(dtype)
        if type(offset) is not int or not 0 <= offset <= self.nbytes:
            offset = _ints.index("offset", offset, 0, self.nbytes)
        esize = code_bits_lanes[1] // 8 * code_bits_lanes[2]
        if shape is None:
            shape = ((self.nbytes - offset) // esize,)
        else:
            shape = _shape(shape)
        need = host_nbytes(shape, *code_bits_lanes)
        if offset + need > self.nbytes:
            raise ValueError(f"shape {shape} of {_dtypes.type_name(*code_bits_lanes)} at offset "
                             f"{offset} needs {need} bytes, beyond the {self.nbytes}-byte slot")
        if like == "torch":
            return _views.view(self.address + offset, self.nbytes - offset, self.pool._keeper,
                               code_bits_lanes, shape, like=like)
        return _views.numpy_recipe(self.address + offset, self.nbytes - offset, self.pool._keeper,
                                   code_bits_lanes, shape)

    def tensor(self, shape=None, dtype="uint8", offset: int = 0):
        """A zero-copy torch tensor over the slot: ``shape`` (None: as many elements as fit)
        of ``dtype``, C-contiguous, starting ``offset`` bytes into the slot."""
        last = self.pool._last_views.get(self.index)
        if last is not None and shape is last[0] and dtype is last[1] and offset is last[2]:
            # The very objects of this slot's last call (a tuple cannot change): its view.
            t = last[3].detach()
            t._devshare_slot = self
            return t
        return self._view(shape, dtype, offset, "torch")

    def numpy(self, shape=None, dtype="uint8", offset: int = 0):
        """Like :meth:`tensor`, as a numpy array."""
        return self._view(shape, dtype, offset, "numpy")

    def _take(self, what: str):
        if self._state != "acquired":
            raise Error(Status.INVALID_ARGUMENT, f"Slot.{what}(): slot {self.index} was already "
                                                 f"{self._state}")

    def send(self, peer: int, shape=None, dtype=None, strides=None, offset: int = 0, *, view=None):
        """Hand the slot to consumer ``peer``; it comes back when the consumer releases the item
        (or disconnects). The consumer's tensor is ``shape`` / ``dtype`` (C-contiguous unless
        ``strides``, in elements) starting ``offset`` bytes into the slot; with neither shape
        nor dtype, the whole slot as uint8 bytes. ``view``: a tensor/array made from this slot
        (:meth:`tensor` / :meth:`numpy`, or a view of one) to describe instead. Do not write to
        the slot after sending it."""
        peer = _peer_id(peer)
        if self._state != "acquired":
            self._take("send")
        pool = self.pool
        last = pool._last_send
        if shape is last[0] and dtype is last[1] and strides is last[2] and offset is last[3] \
                and view is None:
            # The very objects of the last send (a tuple cannot change): its descriptor.
            desc = last[4]
        else:
            desc = self._desc_for(shape, dtype, strides, offset, view)
        last = pool._last_peer
        peer_arg = last[1] if last[0] == peer else pool._peer_arg(peer)
        # pool._enter() / pool._exit(), written out (this is on every item's path).
        life = pool._life
        inside = life.inside
        inside.append(None)
        ptr = pool._ptr if life.open and pool._pid == _PID[0] else pool._enter_refused()
        try:
            # One library call; every argument is a ctypes object of the C type (no argtypes
            # conversion, nothing to range-check).
            status = _RAW_SEND(ptr, self._index_arg, peer_arg, None if desc is None else desc[0])
        finally:
            inside.pop()
            if life.deferred:
                life.leave()
        if status < 0:
            raise _error(status)
        self._state = "sent"

    def _desc_for(self, shape, dtype, strides, offset, view):
        """:meth:`send`'s descriptor entry (None: the whole slot as bytes): by the plain
        arguments (tuples of ints or None, an int offset), as checked and made the first time,
        and remembered as the pool's last send."""
        pool = self.pool
        key = None
        if view is None and type(offset) is int and type(shape) is tuple \
                and (strides is None or type(strides) is tuple):
            for d in shape:
                if type(d) is not int:
                    break
            else:
                if strides is None:
                    key = (shape, dtype, None, offset)
                else:
                    for d in strides:
                        if type(d) is not int:
                            break
                    else:
                        key = (shape, dtype, strides, offset)
        desc = None
        if key is not None:
            try:
                desc = pool._sends.get(key)
            except TypeError:  # an unhashable dtype
                key = None
        if desc is None:
            desc = self._send_desc(shape, dtype, strides, offset, view)
            if key is not None and desc is not None:
                if len(pool._sends) >= _MAX_DESCS:
                    pool._sends.clear()
                pool._sends[key] = desc
        if key is not None:
            pool._last_send = (shape, dtype, strides, offset, desc)
        return desc

    def _send_desc(self, shape, dtype, strides, offset, view):
        """:meth:`send`'s descriptor entry (see :meth:`Pool._desc`), None for the whole slot as
        bytes."""
        if view is not None:
            if shape is not None or dtype is not None or strides is not None or offset:
                raise TypeError("Slot.send(): give either view= or shape/dtype/strides/offset")
            addr, code_bits_lanes, shape, strides, span = _layout(view)
            if not (self.address <= addr and addr + span <= self.address + self.nbytes):
                raise ValueError("Slot.send(view=...): the view does not lie in this slot")
            desc = self.pool._desc(code_bits_lanes, shape, strides, addr - self.address)
        elif shape is None and dtype is None and strides is None and not offset:
            desc = None
        else:
            code_bits_lanes = _dtype_arg("uint8" if dtype is None else dtype)
            if type(offset) is not int or not 0 <= offset <= self.nbytes:
                offset = _ints.index("offset", offset, 0, self.nbytes)
            esize = code_bits_lanes[1] // 8 * code_bits_lanes[2]
            shape = ((self.nbytes - offset) // esize,) if shape is None else _shape(shape)
            strides = _contiguous(shape) if strides is None else tuple(strides)
            if len(strides) != len(shape):
                raise ValueError(f"strides {strides} and shape {shape} differ in length")
            desc = self.pool._desc(code_bits_lanes, shape, strides, offset)
        return desc

    def release(self) -> None:
        """Give the slot back to the pool unsent."""
        self._take("release")
        pool = self.pool
        ptr = pool._enter()
        try:
            _call(lib.devshare_pool_release, ptr, self._index_arg)
        finally:
            pool._exit()
        self._state = "released"


def _return_slot(pid, pool, index) -> None:
    # A slot nobody sent or released, gone with its views: back to the pool, if it is open
    # (entered like any call, so that the pool is not closed under it).
    if os.getpid() != pid:
        return
    ptr = pool._try_enter()
    if ptr is None:
        return  # closed, or its lock is held by this very thread: the pool takes it back later
    try:
        call(lib.devshare_pool_release, ptr, index)
    except Error:  # noqa: BLE001 - nothing to do about it in a finalizer
        pass
    finally:
        pool._exit()


# --- Consumer ----------------------------------------------------------------------------------------


class _Lease:
    """One received import (an ``ImportP``, or its address as an int: a pool item's, see
    :class:`_ItemOut`); given back once (explicitly or when it is garbage). Tensors made
    over it keep it alive (see :func:`devshare._views.view`).

    :meth:`release` gives the item back to the producer at once
    (``devshare_import_give_back``) but keeps the mapping until this object is garbage, that
    is, until the last tensor over it is gone: a tensor used after the release never faults (it
    reads what the producer writes there next). ``_held`` holds the import until the release
    takes it out: ``list.pop`` is atomic, so of two threads releasing at once exactly one gets
    it (the other: ALREADY_RELEASED). Garbage that was never released is released by ``__del__``
    (not a weakref.finalize, which costs more than the rest of a receive), except in a process
    that inherited it through fork."""

    __slots__ = ("_held", "_pid", "_mapped", "_grave", "__weakref__")

    def __init__(self, imp: ImportP, grave=None):
        self._held = [imp]
        self._pid = _PID[0]
        self._mapped = None  # the import, given back, until this object is garbage
        self._grave = grave  # a pool item's: where its import goes once given back and garbage

    @property
    def released(self) -> bool:
        return not self._held

    def release(self) -> None:
        if self._pid != _PID[0]:
            raise _forked("Item", self._pid)
        try:
            imp = self._held.pop()
        except IndexError:
            raise Error(Status.ALREADY_RELEASED, "this item was already released (it is given "
                                                 "back only once)") from None
        # From here on the import is unmapped only when this object is garbage (the last tensor
        # over it gone), also when the give-back fails. (A library before 1.2 unmaps it in the
        # give-back: its UNMAP_GIVEN_BACK does nothing.)
        self._mapped = imp
        status = _GIVE_BACK(imp)
        if status < 0:
            raise _error(status)

    def release_now(self) -> None:
        """Give back and unmap at once (no tensor was made over it)."""
        if self._held:
            status = _RAW_RELEASE(self._held.pop())
            if status < 0:
                raise _error(status)

    def __del__(self):
        try:
            if self._held:
                _release_import(self._pid, self._held.pop())
            elif self._mapped is not None:
                imp, self._mapped = self._mapped, None
                grave = self._grave
                if grave is None or not grave.bury(imp, self._pid):
                    _unmap_import(self._pid, imp)
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to do in a finalizer
            pass


def _release_import(pid, imp) -> None:
    if _PID[0] == pid:
        _RAW_RELEASE(imp)


def _unmap_import(pid, imp) -> None:
    if _PID[0] == pid:
        _UNMAP_GIVEN_BACK(imp)


class _Grave:
    """A connection's pool item imports that were given back and are garbage: the next receive
    releases one (``devshare_connection_recv_item``'s ``release``), in the library call it makes
    anyway, instead of a call of its own. Given back already, such an import only holds the
    pool's mapping (and its own few bytes) meanwhile. Bounded: past ``_MAX_GRAVE`` the import
    is released at once; the connection's close releases what is left (``open`` is cleared
    first, and an import buried after that is taken out by its own burier)."""

    __slots__ = ("imps", "open", "pid")

    def __init__(self):
        self.imps = []
        self.open = True
        self.pid = _PID[0]

    def bury(self, imp, pid) -> bool:
        """Keep ``imp`` for the next receive; False when it must be released now."""
        imps = self.imps
        if not self.open or pid != self.pid or len(imps) >= _MAX_GRAVE:
            return False
        imps.append(imp)
        if not self.open:  # closed meanwhile: release what is there (each pop is one import)
            self.empty()
        return True

    def take(self) -> int:
        """The address of an import to release (0: none)."""
        try:
            return self.imps.pop()
        except IndexError:
            return 0

    def empty(self) -> None:
        imps = self.imps
        while True:
            try:
                imp = imps.pop()
            except IndexError:
                return
            _unmap_import(self.pid, imp)


_MAX_GRAVE = 64
_weakref = weakref.ref


class Item:
    """One tensor received from a channel (:meth:`Connection.recv`).

    :attr:`tensor` is a zero-copy torch tensor (or numpy array, ``like="numpy"``) over the
    producer's memory, valid until :meth:`release`, which gives it back to the producer at once
    (the pool slot becomes free, the lease stops being outstanding). After the release a tensor
    taken from it is stale: it stays mapped while it lives (using it never faults, also after the
    connection closed) but shows whatever the producer writes there next — for a pool slot, the
    next item sent in it. Copy (``.clone()``) what you keep.
    An item that is never released is released when it and every tensor taken from it are
    gone. As a context manager it is released at the end of the ``with`` block.

    A pool item's torch tensor is cheap: the connection keeps one tensor per slot and layout
    (address, dtype, shape, strides), made the first time, and each item of that slot and
    layout gets a new tensor object over it (a ``detach()``: the same memory and data pointer,
    its own shape and strides, so changing them in place never reaches a later item). That
    tensor, and torch views of it (slicing, ``view``, ``reshape``, ...), hold the item; what
    shares the memory without being a view of it (``.numpy()``, ``.detach()``, ``view(dtype)``,
    ``untyped_storage()``) does not hold the item, but does hold the mapping: after the item is
    released (or dropped), it shows the next item sent in that slot, like any tensor kept after
    the release, and never faults. Numpy items (``like="numpy"``) and leases get a view of
    their own each time, which holds the item (a numpy pool item's from what the connection
    kept of its slot and layout the first time).

    ``pool`` and ``slot``: the pool id (> 0) and slot index for a pool item, None for a lease.
    """

    __slots__ = ("_lease", "_tensor", "pool", "slot")

    def __init__(self, lease: _Lease, tensor, pool, slot):
        self._lease = lease
        self._tensor = tensor
        self.pool = pool
        self.slot = slot

    @property
    def tensor(self):
        if not self._lease._held:
            raise Error(Status.ALREADY_RELEASED, "this item was released: its tensor is no longer "
                                                 "valid")
        return self._tensor

    @property
    def released(self) -> bool:
        return self._lease.released

    def release(self) -> None:
        """Give the item back to the producer. :class:`devshare.Error` ``ALREADY_RELEASED``
        when it was already (nothing is sent twice)."""
        self._lease.release()
        self._tensor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._lease.released:
            self.release()

    def __repr__(self):
        what = f"slot {self.slot} of pool {self.pool}" if self.pool is not None else "lease"
        state = "released" if self._lease.released else "held"
        return f"<devshare.Item {what}, {state}>"


# Output structs for every received item, initialised once by their init functions (new_struct)
# and copied per item.
_INFO_TEMPLATE = bytes(new_struct(ImportInfo))
_HANDLE_TEMPLATE = bytes(new_struct(HandleStruct))

# The handle fields an item's tensor needs, read straight from the struct's bytes (one unpack
# instead of a ctypes attribute access per field and element).
_H_DTYPE_NDIM = struct.Struct("=BBH")  # DType: code, bits, lanes
_H_DTYPE_OFF = HandleStruct.dtype.offset
_H_NDIM_OFF = HandleStruct.ndim.offset
_H_SHAPE_OFF = HandleStruct.shape.offset
_H_STRIDES_OFF = HandleStruct.strides.offset
_H_NDIM = struct.Struct("=I")
_H_DIMS = [struct.Struct(f"={n}q") for n in range(MAX_NDIM + 1)]


class _RecvOut:
    """The out-arguments of an item's library calls, made once per connection (taken by one
    receive at a time): the pool and slot, the ImportInfo and the handle, and their byrefs."""

    __slots__ = ("pool", "slot", "info", "handle", "pool_ref", "slot_ref", "info_ref", "handle_ref")

    def __init__(self):
        self.pool, self.slot = c_uint32(), c_uint32()
        self.info = ImportInfo.from_buffer_copy(_INFO_TEMPLATE)
        self.handle = HandleStruct.from_buffer_copy(_HANDLE_TEMPLATE)
        self.pool_ref, self.slot_ref = byref(self.pool), byref(self.slot)
        self.info_ref, self.handle_ref = byref(self.info), byref(self.handle)


def _item(imp: ImportP, like: str, conn=None) -> Item:
    lease = _Lease(imp)
    try:
        outs = None if conn is None else conn._outs
        try:
            out = outs.pop()
        except (AttributeError, IndexError):
            out = _RecvOut()
        pool, slot = describe(imp, out)
        h, info = out.handle, out.info
        dtype = _H_DTYPE_NDIM.unpack_from(h, _H_DTYPE_OFF)
        ndim = _H_NDIM.unpack_from(h, _H_NDIM_OFF)[0]
        if ndim > MAX_NDIM:  # the library never reports more; ctypes would have cut it too
            raise Error(Status.UNTRUSTED, f"item with {ndim} dimensions (at most {MAX_NDIM})")
        dims = _H_DIMS[ndim]
        shape = dims.unpack_from(h, _H_SHAPE_OFF)
        strides = dims.unpack_from(h, _H_STRIDES_OFF)
        backend, data = info.backend, info.data or 0
        end = (info.storage or 0) + info.storage_size
        if outs is not None:
            outs.append(out)  # (only after every call succeeded: a failed one may leave it half-written)
        if backend == BACKEND_HOST:
            nbytes = max(end - data, 0)
            if pool is not None and like == "torch" and conn is not None:
                tensor, lease = _pool_tensor(conn._views, lease, (pool, slot, data, nbytes, dtype,
                                                                  shape, strides))
            else:
                tensor = _views.view(data, nbytes, lease, dtype, shape, strides, like)
        else:
            tensor = _device_tensor(imp, like)
        return Item(lease, tensor, pool, slot)
    except BaseException:
        lease.release_now()
        raise


_ITEM_TEMPLATE = bytes(new_struct(ItemStruct)) if _RAW_RECV_ITEM is not None else b""
# A pool item's kept view is found by the item's layout_id (1.8), or with a library before 1.8
# (which leaves it 0) by the struct's bytes from the pool id to the layout_id, which tell a pool
# item's view apart. (Ints and bytes never compare equal: the two kinds of key never meet.)
_ITEM_KEY = ItemStruct.pool.offset
_ITEM_KEY_END = ItemStruct.layout_id.offset
_LAYOUT_WORD = _ITEM_KEY_END // 8
# pool, slot, device, backend, read_only, ndim, dtype (code, bits, lanes), data, nbytes
_ITEM_HEAD = struct.Struct("=IIiHHIBBHQQ")
_ITEM_SHAPE = ItemStruct.shape.offset
_ITEM_STRIDES = ItemStruct.strides.offset
_IMPORT_AT = ItemStruct.struct_size.size + ItemStruct.reserved.size  # where the import pointer is
_IMPORT_WORD = _IMPORT_AT // 8
assert _IMPORT_AT % 8 == 0 and _ITEM_KEY_END % 8 == 0 and sizeof(ItemStruct) % 8 == 0


def _view_key(out) -> object:
    """The key of a received pool item's kept view (or numpy recipe): its layout_id, or its
    description's bytes (see ``_ITEM_KEY``). (Connection.recv writes it out.)"""
    return out.words[_LAYOUT_WORD] or out.bytes[_ITEM_KEY:_ITEM_KEY_END].tobytes()


class _ItemOut:
    """A receive's out-argument, made once per connection (taken by one receive at a time):
    with a 1.8 library the ``DevshareRecvArgs`` of ``devshare_connection_recv_args`` (``call``;
    ``head`` its first three 64-bit words, the connection's address in [1] and the import to
    release in [2]; ``ms`` its int32s, the timeout in [1]), else the ``DevshareItem`` of
    ``devshare_connection_recv_item``; ``ref`` what the call takes. ``item`` is the item, with a
    byte view and a 64-bit word view of it; ``dead`` a ``c_void_p`` for the import that
    ``devshare_connection_recv_item`` releases."""

    __slots__ = ("call", "head", "ms", "item", "ref", "bytes", "words", "dead")

    def __init__(self, conn: int):
        if _RAW_RECV_ARGS is not None:
            self.call = RecvArgs.from_buffer_copy(_ARGS_TEMPLATE)
            self.call.conn = conn
            head = memoryview(self.call).cast("B")[:_ARGS_HEAD]
            self.head = head.cast("Q")
            self.ms = head.cast("i")
            self.ref = byref(self.call)
            self.item = self.call.item  # (shares the args' memory)
        else:
            self.item = ItemStruct.from_buffer_copy(_ITEM_TEMPLATE)
            self.ref = byref(self.item)
        self.bytes = memoryview(self.item).cast("B")
        self.words = self.bytes.cast("Q")  # words[_IMPORT_WORD]: the import's address
        self.dead = c_void_p()


_ARGS_TEMPLATE = bytes(new_struct(RecvArgs)) if _RAW_RECV_ARGS is not None else b""
_ARGS_HEAD = RecvArgs.item.offset
assert _ARGS_HEAD == 24 and RecvArgs.release.offset == 16 and RecvArgs.timeout_ms.offset == 4


def _received(out: _ItemOut, like: str, conn) -> Item:
    """The :class:`Item` of what ``devshare_connection_recv_item`` wrote into ``out``, for all
    but a pool item whose kept view exists (:meth:`Connection.recv` makes that one)."""
    mv = out.bytes
    imp = ImportP.from_buffer_copy(mv, _IMPORT_AT)
    views = conn._views
    pool, slot, device, backend, read_only, ndim, code, bits, lanes, data, nbytes = \
        _ITEM_HEAD.unpack_from(mv, _ITEM_KEY)
    # The lease keeps the import's address: a pool item's goes to the grave, whose imports
    # the next receive releases by address.
    lease = _Lease(out.words[_IMPORT_WORD], conn._grave if pool else None)
    try:
        if backend == BACKEND_HOST:
            if pool and like == "torch":
                if ndim > MAX_NDIM:
                    raise Error(Status.UNTRUSTED, f"item with {ndim} dimensions (at most {MAX_NDIM})")
                dims = _H_DIMS[ndim]
                # Its view, made now and kept under the item's layout_id (or its description).
                entry = _new_pool_view(views, _view_key(out), data or 0, nbytes,
                                       (code, bits, lanes), dims.unpack_from(mv, _ITEM_SHAPE),
                                       dims.unpack_from(mv, _ITEM_STRIDES), pool, slot)
                lease = _PoolLease(lease._held.pop(), conn._grave, entry)
                tensor = entry[0].detach()
                tensor._devshare_item = lease
                return Item(lease, tensor, pool, slot)
            if ndim > MAX_NDIM:
                raise Error(Status.UNTRUSTED, f"item with {ndim} dimensions (at most {MAX_NDIM})")
            dims = _H_DIMS[ndim]
            shape, strides = dims.unpack_from(mv, _ITEM_SHAPE), dims.unpack_from(mv, _ITEM_STRIDES)
            if pool and like == "numpy":
                # The recipe of its arrays, kept for the next items of this slot and layout.
                recipe = _views.numpy_recipe(data or 0, nbytes, None, (code, bits, lanes), shape, strides)
                views = conn._np_views
                if len(views) >= _MAX_VIEWS:
                    views.clear()
                views[_view_key(out)] = (recipe, pool, slot)
                tensor = _views.numpy_from(recipe, lease)
            else:
                tensor = _views.view(data or 0, nbytes, lease, (code, bits, lanes), shape, strides, like)
        else:
            tensor = _device_tensor(imp, like)
        if pool:
            return Item(lease, tensor, pool, slot)
        return Item(lease, tensor, None, None)
    except BaseException:
        lease.release_now()
        raise


class _Anchor:
    """What the memory of a connection's kept item view holds (see :func:`_pool_tensor`): the
    lease of an item shown through it that is gone while something that is not a view of its
    tensor (``.numpy()``, ``.detach()``, ...) still uses that memory, so that the memory stays
    mapped for it; None when nothing needs that."""

    __slots__ = ("lease",)

    def __init__(self):
        self.lease = None


class _PoolLease(_Lease):
    """The lease of a pool item shown through a kept view: held by the :class:`Item` and by the
    item's tensor (and so by every torch view of that tensor, which keeps its base). When all of
    them are gone: the item goes back (if it was not released), and its import is unmapped
    unless something else still uses the view's memory, in which case the view's
    :class:`_Anchor` keeps it mapped instead (until the next item of that slot and layout, which
    maps the same memory, or the view's end)."""

    __slots__ = ("_entry",)

    def __init__(self, imp, grave, entry):
        self._held = [imp]
        self._pid = _PID[0]
        self._mapped = None
        self._grave = grave
        self._entry = entry

    def __del__(self):
        try:
            entry = self._entry
            count = entry[6]
            if self._pid == _PID[0] and (count is None or count(entry[7]) > entry[5]):
                # More users than the entry's own: the memory is still used. Back to the
                # producer, still mapped: the anchor takes the import (in a lease of its own;
                # this one is going).
                if self._held:
                    self.release()
                keep = _Lease.__new__(_Lease)
                keep._held, keep._pid, keep._grave = [], self._pid, self._grave
                keep._mapped, self._mapped = self._mapped, None
                entry[2].lease = keep
                return
            entry[2].lease = None  # nothing else uses it: the import goes with this lease
            imp = self._mapped
            if imp is not None and not self._held:
                # Released and garbage, the usual end: _Lease.__del__ and _Grave.bury, written
                # out (this is on every item's path).
                self._mapped = None
                grave = self._grave
                if grave is not None and grave.open and grave.pid == self._pid \
                        and len(grave.imps) < _MAX_GRAVE:
                    grave.imps.append(imp)
                    if not grave.open:  # closed meanwhile
                        grave.empty()
                else:
                    _unmap_import(self._pid, imp)
                return
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to do in a finalizer
            pass
        _Lease.__del__(self)


def _pool_tensor(views: dict, lease, key):
    """(torch tensor, :class:`_PoolLease`) of a received pool item (whose import moves from
    ``lease`` to the new lease), through the view the connection
    keeps for ``key`` (pool, slot, data address, bytes to the slot's end, dtype, shape,
    strides), made the first time. The address is in the key: the same address again while
    this item holds the mapping is the same memory (a pool keeps its slots' addresses), so the
    kept tensor (checked when made) fits this item exactly as it did the first one."""
    entry = views.get(key)
    if entry is None:
        pool, slot, data, nbytes, dtype, shape, strides = key
        entry = _new_pool_view(views, key, data, nbytes, dtype, shape, strides)
    else:
        # An item shown before through this view, gone while its memory was still used: that
        # memory is this item's (the same mapping), held by this item from now on.
        entry[2].lease = None
    pool_lease = _PoolLease(lease._held.pop(), None, entry)
    t = entry[0].detach()
    t._devshare_item = pool_lease
    return t, pool_lease


def _new_pool_view(views: dict, key, data, nbytes, dtype, shape, strides, pool=None, slot=None):
    """The entry :func:`_pool_tensor` keeps for ``key``: (the kept torch tensor over the item's
    memory, its storage, its :class:`_Anchor`, the pool id, the slot, how many users the
    storage has with nothing but the entry, and what counts them: a function of the storage's
    ``_cdata`` and that, or None where this torch cannot tell), made now and kept in
    ``views``."""
    anchor = _Anchor()
    base = _views.view(data, nbytes, anchor, dtype, shape, strides, "torch")
    storage = base.untyped_storage()
    # The kept tensor, the storage object, and the tensor the kept one is a view of, if any
    # (-1 where this torch cannot tell: then the memory is always taken to be in use).
    count = _views.storage_counter()
    users = -1 if count is None else count(storage._cdata)
    entry = (base, storage, anchor, pool, slot, users, count, storage._cdata)
    if len(views) >= _MAX_VIEWS:
        views.clear()
    views[key] = entry
    return entry


def _device_tensor(imp, like):
    # Device memory (a pool or lease of a C/C++ producer's CUDA/ACL export): through DLPack,
    # whose tensor holds its own reference to the import, so the item comes back once it is
    # released and that tensor is gone as well.
    if like != "torch":
        raise ValueError("device items open as torch tensors only (like='torch')")
    return _views.from_import(imp, "torch")


class Connection(_Owned):
    """The consumer end of a channel (made by :func:`connect`). A context manager; iterating
    over it yields items (as torch tensors) until the producer is gone (:class:`ChannelClosed`
    ends the loop). ``address``, ``peer_id`` (this consumer's id at the producer) and
    ``producer_pid`` (as the producer reported it) describe it.

    :meth:`close` hangs up: the producer takes back every lease and slot of this connection at
    once, so items still held stay mapped (releasing them later sends nothing) but a pool slot
    among them may be refilled by the producer: release items before closing."""

    _what = "Connection"

    def __init__(self, address, timeout=None, wait=False):
        _require()
        raw = _address(address)
        ptr = ConnectionP()
        timeout_ms(timeout)  # validated before anything is tried
        deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                done = _timed(lambda ms: _call(lib.devshare_channel_connect, raw, ms, byref(ptr)), left)
                break
            except Error as e:
                # wait: nothing listens there yet (a producer still starting): look again.
                if not wait or e.status != Status.NOT_FOUND:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"nothing listened at {os.fsdecode(raw)!r} within {timeout} s "
                                       f"({e.message})") from None
                time.sleep(0.01 if left is None else min(0.01, left))
        if not done:
            raise TimeoutError(f"connecting to channel {os.fsdecode(raw)!r} took longer than "
                               f"{timeout} s")
        self.address = os.fsdecode(raw)
        self._at = cast(ptr, c_void_p).value  # the connection's address, for DevshareRecvArgs
        # Pool items' imports that are garbage, released by the next receive (see _Grave); the
        # close releases what is left, also the finalizer's.
        self._grave = _Grave()
        self._own(ptr, _close_connection, self._grave)
        # Items received and not yet released, for release_all(): a set of weak references to
        # their leases, each removed from the set by its own callback, the set's discard (a C
        # function: no Python frame when an item goes, unlike a WeakSet's). release_all()
        # iterates over a copy, so a removal never meets an iteration.
        self._items: set = set()
        self._items_add = self._items.add
        self._items_gone = self._items.discard
        # Pool items' tensors by slot and layout (see _pool_tensor), numpy arrays' recipes
        # likewise (with the pool id and slot), and recv's out-arguments.
        self._views: dict = {}
        self._np_views: dict = {}
        self._outs: list = []
        peer_id, producer_pid = c_uint64(), c_int32()
        _call(lib.devshare_connection_info, ptr, byref(peer_id), byref(producer_pid))
        #: This consumer's id at the producer (what :meth:`Channel.peers` lists for it).
        self.peer_id = peer_id.value
        #: The producer's process id, as it reported it in the handshake.
        self.producer_pid = producer_pid.value

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<devshare.Connection {self.address!r} {state}>"

    def fileno(self) -> int:
        """A descriptor that becomes readable when an item (or the producer's close) arrives,
        for ``select`` / ``poll`` / asyncio's ``loop.add_reader``. Do not close or read it."""
        ptr = self._enter()
        try:
            return _call(lib.devshare_connection_fd, ptr)
        finally:
            self._exit()

    def set_spin(self, spin_us: int) -> None:
        """Let :meth:`recv` poll for an item for up to ``spin_us`` microseconds before it sleeps
        (0, the default: sleep at once; at most ``MAX_SPIN_US``, 1 s). For a consumer with a CPU
        core of its own; where producer and consumer share a CPU it only slows both down."""
        _set_spin("devshare_connection_set_spin", self, spin_us)

    def set_stream(self, stream) -> None:
        """Read received CUDA / NPU items on ``stream`` (a ``torch.cuda.Stream``, an NPU stream,
        a raw ``CUstream`` / ``aclrtStream`` as an int, or None): each item's event from the
        producer is then waited for by that stream, on the device, and :meth:`recv` returns
        without waiting for the producer's work. None (the default): :meth:`recv` waits on the
        host. Use the stream that will read the items (e.g. ``torch.cuda.current_stream()``)."""
        fn = need("devshare_connection_set_stream", "Connection.set_stream")
        if stream is None:
            raw = 0
        elif isinstance(stream, int) and not isinstance(stream, bool):
            raw = _ints.index("stream", stream, 0, _ints.U64[1])
        else:
            raw = getattr(stream, "cuda_stream", None)
            raw = getattr(stream, "npu_stream", None) if raw is None else raw
            if not isinstance(raw, int):
                raise TypeError(f"stream must be a torch.cuda.Stream, an NPU stream, an int or "
                                f"None, not {type(stream).__name__}")
        ptr = self._enter()
        try:
            _call(fn, ptr, raw or None)
        finally:
            self._exit()

    def recv(self, timeout=None, like: str = "torch") -> Item:
        """The next :class:`Item` (a leased tensor or a pool slot), waiting at most ``timeout``
        seconds (None: forever; 0: only what already arrived): TimeoutError then.
        :class:`ChannelClosed` once the producer closed the channel or exited and everything it
        sent was received. ``like``: "torch" (default) or "numpy" for :attr:`Item.tensor`."""
        if like != "torch" or not _TORCH_SEEN:
            _views.check_like(like)  # raises unless that package imports
            _see_torch(like)
        if _RAW_RECV_ITEM is None:  # a library before 1.7
            return self._recv_describe(timeout, like)
        # One devshare_connection_recv_args (or _item), which also releases one import of the
        # grave.
        outs = self._outs
        try:
            out = outs.pop()
        except IndexError:
            out = _ItemOut(self._at)
        if timeout is None:
            ms = -1
        elif type(timeout) is int and 0 <= timeout <= _FAST_SECONDS:
            ms = timeout * 1000
        else:
            ms = timeout_ms(timeout)
            if ms > _I32_MAX:  # longer than one call waits: calls of the longest wait in turn
                ms = None
        # self._enter() / self._exit(), written out (this is on every item's path).
        life = self._life
        inside = life.inside
        inside.append(None)
        ptr = self._ptr if life.open and self._pid == _PID[0] else self._enter_refused()
        try:
            if ms is None:
                def once(m):
                    status = self._recv_call(ptr, m, out, self._grave.take())
                    if status < 0:
                        raise _error(status)
                done = _timed(once, timeout)
            else:
                dead = self._grave.imps
                if dead:
                    try:
                        dead = dead.pop()
                    except IndexError:  # another thread took the last one
                        dead = 0
                else:
                    dead = 0
                if _RAW_RECV_ARGS is not None:
                    out.head[2] = dead
                    out.ms[1] = ms
                    status = _RAW_RECV_ARGS(out.ref)
                else:
                    status = self._recv_call(ptr, ms, out, dead)
                if status < 0 and status != _TIMEOUT:
                    raise _error(status)
                done = status >= 0
        finally:
            inside.pop()
            if life.deferred:
                life.leave()
        if not done:
            outs.append(out)
            raise TimeoutError(f"nothing arrived on channel {self.address!r} within {timeout} s")
        mv = out.bytes
        if like == "torch":
            # A pool item seen before: its tensor through the view kept for its slot and layout,
            # under its layout_id (or its description: see _LAYOUT_WORD; kept only
            # for host pool items). (_received, written out: this is on every item's path.)
            # (_view_key, written out.)
            entry = self._views.get(out.words[_LAYOUT_WORD] or mv[_ITEM_KEY:_ITEM_KEY_END].tobytes())
            if entry is not None:
                lease = _PoolLease(out.words[_IMPORT_WORD], self._grave, entry)
                outs.append(out)
                # An item shown before through this view, gone while its memory was still
                # used: that memory is this item's (the same mapping), held by it from now on.
                entry[2].lease = None
                tensor = entry[0].detach()
                tensor._devshare_item = lease
                self._items_add(_weakref(lease, self._items_gone))
                return Item(lease, tensor, entry[3], entry[4])
        else:
            # A numpy pool item seen before: an array of its own (holding the item), from the
            # recipe kept for its slot and layout.
            entry = self._np_views.get(out.words[_LAYOUT_WORD] or mv[_ITEM_KEY:_ITEM_KEY_END].tobytes())
            if entry is not None:
                lease = _Lease(out.words[_IMPORT_WORD], self._grave)
                outs.append(out)
                # (_views.numpy_from, written out: this is on every item's path.)
                array_type, addr, ndtype, shape, extra, bstrides = entry[0]
                if array_type is None:
                    array = extra.empty(shape, dtype=ndtype)
                else:
                    raw = array_type.from_address(addr)
                    raw._devshare_keep = lease
                    array = extra[0](shape, ndtype, raw, 0, bstrides)
                self._items_add(_weakref(lease, self._items_gone))
                return Item(lease, array, entry[1], entry[2])
        item = _received(out, like, self)
        outs.append(out)  # (only once read: a failed call may leave it half-written)
        self._items_add(_weakref(item._lease, self._items_gone))
        return item

    def _recv_describe(self, timeout, like) -> Item:
        """:meth:`recv` with ``devshare_connection_recv`` and ``devshare_import_describe`` (a
        library before 1.7)."""
        imp = ImportP()
        ptr = self._enter()
        try:
            if timeout is None:  # one library call, no argument checks (all ctypes objects)
                status = lib.devshare_connection_recv(ptr, _FOREVER, byref(imp))
                if status < 0:
                    raise _error(status)
                done = True
            else:
                done = _wait_call(lib.devshare_connection_recv, ptr, timeout, byref(imp))
        finally:
            self._exit()
        if not done:
            raise TimeoutError(f"nothing arrived on channel {self.address!r} within {timeout} s")
        item = _item(imp, like, self)
        self._items_add(_weakref(item._lease, self._items_gone))
        return item

    def _recv_call(self, ptr, ms: int, out, dead: int) -> int:
        """One receive into ``out`` waiting at most ``ms`` milliseconds (-1: forever) that
        releases the import at address ``dead`` (0: none) on the way, whatever it returns; its
        status. (``recv`` makes a 1.8 library's call itself.)"""
        if _RAW_RECV_ARGS is not None:
            out.head[2] = dead
            out.ms[1] = ms
            return _RAW_RECV_ARGS(out.ref)
        arg = None
        if dead:
            arg = out.dead
            arg.value = dead
        m = _MS_ARGS.get(ms)
        return _RAW_RECV_ITEM(ptr, c_int32(ms) if m is None else m, arg, out.ref)

    def release_all(self) -> int:
        """Release every item received on this connection and not yet released (gone or not):
        each goes back to the producer if it is still there, and its memory is unmapped once
        the last tensor over it is gone (those tensors are stale from now on). What a consumer
        does when :meth:`recv` raised :class:`ChannelClosed` because the producer died, so that
        nothing of that producer stays mapped. Returns how many were released. Callable after
        :meth:`close` too."""
        n = 0
        for ref in list(self._items):
            lease = ref()
            if lease is not None and not lease.released:
                try:
                    lease.release()
                    n += 1
                except Error as e:
                    if e.status != Status.ALREADY_RELEASED:  # another thread was first
                        raise
        return n

    def __iter__(self):
        while True:
            try:
                yield self.recv()
            except ChannelClosed:
                return


# Whether torch imported for a receive (checked once, not on every item).
_TORCH_SEEN = False


def _see_torch(like: str) -> None:
    global _TORCH_SEEN
    if like == "torch":
        _TORCH_SEEN = True


def _close_connection(ptr, grave) -> None:
    """A connection's close (also its finalizer's): the imports of its grave first."""
    grave.open = False
    grave.empty()
    lib.devshare_connection_close(ptr)


def connect(address, timeout=None, *, wait=False) -> Connection:
    """Connect to the :class:`Channel` listening on ``address`` (its path, ``"@name"`` or
    ``"tcp://HOST:PORT"``) and return the :class:`Connection`. The producer must run as this
    user (or root) and admit this process (:meth:`Channel.restrict`). TimeoutError when the
    handshake takes longer than ``timeout`` seconds (None: no limit); :class:`devshare.Error`
    when the producer refuses, and (``NOT_FOUND``) when nothing listens there — unless ``wait``:
    then it looks again every 10 ms until something listens, within ``timeout`` (TimeoutError
    after it), for a consumer started before its producer."""
    return Connection(address, timeout, wait)
