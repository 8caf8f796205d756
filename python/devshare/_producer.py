"""The producer end of a channel: Channel, which listens, admits consumers and sends them leases.

One job: :class:`Channel`. It listens on an address, admits consumers (:meth:`~Channel.restrict`,
:meth:`~Channel.trust_announced_pids`), does the channel's pending work when asked
(:meth:`~Channel.service`), and sends tensors as leases (:meth:`~Channel.send`,
:meth:`~Channel.send_batch`): host memory as it is (:mod:`devshare._channel_memory`, or a torch
storage moved into PyTorch's shared memory once), CUDA / NPU storages adopted from PyTorch's
own IPC and held until their leases come back (:mod:`devshare._registry`). Pools on the channel
are :mod:`devshare._pool`; the consumer's end is :mod:`devshare._connection`.

Imports :mod:`devshare._lib`, :mod:`devshare._ints`, :mod:`devshare._dtypes`,
:mod:`devshare._views`, :mod:`devshare._registry`, :mod:`devshare._torch_ipc`,
:mod:`devshare._api`, :mod:`devshare._channel_lib`, :mod:`devshare._ownership`,
:mod:`devshare._channel_memory` and :mod:`devshare._pool`.
"""

from __future__ import annotations

import os
import weakref
from ctypes import byref, c_int32, c_size_t, c_uint32, c_uint64

from . import _dtypes, _ints, _torch_ipc
from ._api import torch_host_export
from ._channel_lib import (
    HAVE_REGISTER,
    address_bytes,
    call,
    need,
    peer_id,
    require,
    send_leases,
    timed,
)
from ._channel_lib import error as channel_error
from ._channel_memory import channel_empty, layout
from ._lib import (
    MAX_NAME_LEN,
    MAX_SPIN_US,
    SHARE_EVENT,
    STORAGE_TO_END,
    ChannelP,
    Error,
    PeerInfo,
    Status,
    lib,
    new_struct,
    registry_lock,
)
from ._ownership import Owned
from ._pool import Pool
from ._registry import (
    Export,
    adopt_device,
    buffer_at,
    collect_except,
    device_adoption,
    registered_tensors,
    sweep_device_adoptions,
    tensor_desc,
)
from ._views import is_torch_tensor

#: devshare_channel_send, called straight on a registered tensor's path (Channel.send).
_SEND = lib.devshare_channel_send

#: PeerInfo.transport's numbers, as peer_info names them.
_TRANSPORTS = {0: "unix", 1: "stream", 2: "ucx"}


class _Registered:
    """A tensor registered on a channel (:meth:`Channel.register`): the tensor (held), what its
    layout was, and its prepared lease (export, desc, keep), whose export stays open."""

    __slots__ = ("tensor", "ptr", "shape", "strides", "prep", "device", "desc_ref", "torch",
                 "__weakref__")

    def __init__(self, t, prep):
        self.tensor = t
        self.torch = is_torch_tensor(t)
        self.ptr, self.shape, self.strides = _layout_of(t)
        self.prep = prep
        self.desc_ref = byref(prep[1])  # (prep keeps the desc alive as long as this)
        registered_tensors[id(t)] = weakref.ref(self)
        self.device = self.torch and t.device.type != "cpu"
        prep[0].registered += 1

    def current(self, t) -> bool:
        """Whether ``t`` is this registered tensor, laid out as it was when registered."""
        if t is not self.tensor:
            return False
        if self.torch:  # (_layout_of's, written out: this is every registered lease's path)
            return t.data_ptr() == self.ptr and t.stride() == self.strides and t.shape == self.shape
        return _layout_of(t) == (self.ptr, self.shape, self.strides)

    def drop(self) -> None:
        ref = registered_tensors.get(id(self.tensor))
        if ref is not None and ref() is self:
            del registered_tensors[id(self.tensor)]
        self.prep[0].registered -= 1
        self.tensor = self.prep = None


def _forget_registrations(registered: dict, reg_exports: dict, pid: int | None = None) -> None:
    """Drop a closing (or garbage) channel's registrations. Closing the channel ends every
    connection: consumers let kept mappings go by themselves, so the library is not asked (nor
    may it be, inside close). ``pid``: the channel's process; another (a fork) does nothing."""
    if not registered or (pid is not None and pid != os.getpid()):
        return
    with registry_lock:
        for r in registered.values():
            r.drop()
        registered.clear()
        reg_exports.clear()
        collect_except(keep=None)


def _layout_of(t):
    """What a registered tensor's prepared lease depends on: its data address (storage and
    offset), shape and strides."""
    if is_torch_tensor(t):
        return t.data_ptr(), t.shape, t.stride()
    return t.__array_interface__["data"][0], t.shape, t.strides


def _tensors_of(tensors) -> list:
    """The tensors of ``tensors``: one tensor or array, a dict's values, or an iterable."""
    if is_torch_tensor(tensors) or hasattr(tensors, "__array_interface__"):
        return [tensors]
    if isinstance(tensors, dict):
        return list(tensors.values())
    return list(tensors)


def _registered_stream(streams: dict, t, stream):
    """The raw stream handle a registered device tensor's lease records its event on, looked
    up once per device per batch."""
    key = (t.device.type, t.device.index)
    raw = streams.get(key)
    if raw is None:
        raw = streams[key] = _torch_ipc.current_stream(t, stream) or None
    return raw


#: Names checked and encoded before (str -> UTF-8 bytes), so that a state dict sent again
#: costs a lookup per key; bounded (cleared past _MAX_NAMES).
_NAMES: dict = {}
_MAX_NAMES = 1 << 16


def _names_of(d: dict) -> list:
    """A dict's keys as lease names (UTF-8 bytes), checked before anything is sent."""
    known = _NAMES.get
    names = []
    for key in d:
        b = known(key) if type(key) is str else None
        if b is None:
            b = _name_of(key)
        names.append(b)
    return names


def _name_of(key) -> bytes:
    """One key as a lease name (see :func:`_names_of`), checked, and kept when it is a str."""
    if not isinstance(key, str):
        raise TypeError(f"send_batch: a dict's keys travel as names and must be str, not {type(key).__name__}")
    b = key.encode("utf-8")
    if len(b) > MAX_NAME_LEN or b"\0" in b:
        shown = repr(key) if len(key) <= 40 else repr(key[:40]) + "..."
        raise ValueError(f"send_batch: the name {shown} is longer than {MAX_NAME_LEN} bytes of UTF-8 "
                         f"or holds a NUL")
    if type(key) is str:  # (a str subclass may hash and compare as it likes: not kept)
        if len(_NAMES) >= _MAX_NAMES:
            _NAMES.clear()
        _NAMES[key] = b
    return b


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


class Channel(Owned):
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
        require()
        raw = address_bytes(address)
        ptr = ChannelP()
        call(lib.devshare_channel_listen, raw, byref(ptr))
        self.address = os.fsdecode(raw)
        # Pools made on this channel (closed before it).
        self._pools: weakref.WeakSet = weakref.WeakSet()
        # Registered tensors (register): id(tensor) -> _Registered; and the exports registered
        # with the library's channel for them: id(export) -> [export, how many tensors].
        self._registered: dict[int, _Registered] = {}
        self._reg_exports: dict[int, list] = {}
        self._own(ptr, lib.devshare_channel_close)
        # A channel that is garbage without close() lets its registrations go as close does
        # (their exports close once their leases are back).
        # (Not in a process that inherited it through fork: its registrations are the parent's.)
        weakref.finalize(self, _forget_registrations, self._registered, self._reg_exports, self._pid)

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<devshare.Channel {self.address!r} {state}>"

    def _closing(self) -> None:
        _forget_registrations(self._registered, self._reg_exports)
        for pool in list(self._pools):
            pool.close()

    def fileno(self) -> int:
        """A descriptor that becomes readable when :meth:`service` has work (a consumer
        connecting, releasing or hanging up), for ``select`` / ``poll`` / asyncio's
        ``loop.add_reader``. It belongs to the channel: do not close or read it."""
        return self._lib_call(lib.devshare_channel_fd)

    def service(self, timeout=None) -> None:
        """Do the channel's pending work: accept consumers (their credentials checked), take
        releases and returned slots, notice hang-ups (a dead consumer's leases and slots come
        back at once). Waits at most ``timeout`` seconds (None: until something happens; 0: do
        not wait) for something to do. The blocking calls (:meth:`wait_peers`,
        :meth:`Pool.acquire`, :func:`devshare.wait`) do this themselves while they wait."""
        ptr = self._enter()
        try:
            timed(lambda ms: call(lib.devshare_channel_service, ptr, ms), timeout)
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
            done = timed(lambda ms: call(lib.devshare_channel_wait_peers, ptr, n, ms), timeout)
        finally:
            self._exit()
        if not done:
            raise TimeoutError(f"fewer than {n} consumer(s) connected within {timeout} s")
        return self.peers()

    def set_spin(self, spin_us: int) -> None:
        """Let :func:`devshare.wait` on what was sent over this channel poll for the consumers'
        releases for up to ``spin_us`` microseconds before it sleeps (0, the default: sleep at
        once; at most ``MAX_SPIN_US``, 1 s). For a producer with a CPU to spare: a release comes
        back within a microsecond or so of the consumer's call instead of after a wake-up (tens
        of microseconds across CPUs); the waiting thread burns its CPU meanwhile. A remote
        (``tcp://``) channel: :class:`devshare.Error` ``UNSUPPORTED``."""
        fn = need("devshare_channel_set_spin", "Channel.set_spin")
        self._lib_call(fn, _ints.index("spin_us", spin_us, 0, MAX_SPIN_US))

    def peers(self) -> list[int]:
        """Ids (ints > 0) of the connected consumers, oldest first. As of the last service: call
        :meth:`service` to take in new connections and hang-ups."""
        ptr = self._enter()
        try:
            cap = 16
            while True:
                ids, count = (c_uint64 * cap)(), c_size_t()
                try:
                    call(lib.devshare_channel_peer_ids, ptr, ids, cap, byref(count))
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
        peer = peer_id(peer)
        info = new_struct(PeerInfo)
        self._lib_call(lib.devshare_channel_peer_info, peer, byref(info))
        return {"id": info.id, "pid": info.pid, "uid": info.uid, "gid": info.gid,
                "tgid": info.tgid, "leases": info.leases, "slots": info.slots,
                "protocol_errors": info.protocol_errors,
                "transport": _TRANSPORTS.get(info.transport, str(info.transport))}

    def disconnect(self, peer: int) -> None:
        """Disconnect consumer ``peer`` now, as if its process had died: its leases and pool
        slots come back at once and its :meth:`Connection.recv` raises :class:`ChannelClosed`
        once it read what its socket had taken (what still waited for it is dropped). The channel does the same on its own to a consumer
        that stops reading (see docs/channels.md, the limits). :class:`devshare.Error` ``NOT_FOUND``
        when it is not connected."""
        fn = need("devshare_channel_disconnect", "Channel.disconnect")
        self._lib_call(fn, peer_id(peer))

    def trust_announced_pids(self, trust: bool = True) -> None:
        """Whitelist ACL exports sent over this channel for the pid a consumer announced (its
        bare tgid) even where it is not the consumer's pid as the kernel reports it: needed for
        consumers in containers, whose host pid this process cannot check. Off by default: the
        kernel's pid is whitelisted instead, so an admitted consumer cannot get NPU memory
        whitelisted for a process :meth:`restrict` did not admit."""
        fn = need("devshare_channel_trust_announced_pids", "Channel.trust_announced_pids")
        if not isinstance(trust, bool):
            raise TypeError(f"trust must be a bool, not {type(trust).__name__}")
        self._lib_call(fn, 1 if trust else 0)

    def restrict(self, uids=None, pids=None) -> None:
        """Narrow down who may connect from now on (connected consumers stay): ``uids``, an
        iterable of user ids, replaces the allowed set (None or empty: keep it; by default only
        this process's effective uid); ``pids``, when given and not empty, admits only those
        process ids."""
        uid_list = [_ints.index("uid", u, *_ints.U32) for u in (uids or ())]
        pid_list = [_ints.index("pid", p, 1, _ints.I32[1]) for p in (pids or ())]
        uid_arr = (c_uint32 * len(uid_list))(*uid_list) if uid_list else None
        pid_arr = (c_int32 * len(pid_list))(*pid_list) if pid_list else None
        self._lib_call(lib.devshare_channel_restrict, uid_arr, len(uid_list), pid_arr, len(pid_list))

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
        peer = peer_id(peer)
        registered = self._registered
        if registered:
            # A registered tensor as it was registered: its one lease message, with nothing
            # of send_batch's general path (this is every repeated lease's path: a KV block).
            r = registered.get(id(obj))
            if r is not None and (stream is None or r.device) and r.current(obj):
                with registry_lock:  # (as send_batch: r's export stays open until it is sent)
                    prep = r.prep
                    if prep is not None:
                        exp, desc, _ = prep
                        if r.device:
                            desc.stream = _registered_stream({}, obj, stream)
                        ptr = self._enter()
                        try:
                            status = _SEND(ptr, peer, exp.ptr, r.desc_ref)
                        finally:
                            self._exit()
                        if status < 0:
                            raise channel_error(status)
                        return
        if stream is not None and not (is_torch_tensor(obj) and obj.device.type != "cpu"):
            raise ValueError("stream= applies to CUDA and NPU tensors only")
        self.send_batch(peer, (obj,), stream=stream)

    def send_batch(self, peer: int, tensors, *, stream=None) -> None:
        """Send consumer ``peer`` many tensors in one call (a state dict's values, a list of KV
        blocks), each as its own lease, in order: the consumer receives them as that many
        items, one :meth:`Connection.recv` each (or :meth:`Connection.recv_batch`), in the
        order given (pass a dict to send its values in its order). Each tensor as in
        :meth:`send`. They travel in as few messages as the message size allows (about 150
        tensors per message; one per message to a consumer older than 1.4). Tensors of one
        storage are shared once (one PyTorch reference for all of them), and a consumer maps
        each allocation (a CUDA block or segment) once however many tensors lie in it.
        Registered tensors (:meth:`register`) cost only their lease. A tensor that cannot be
        sent raises before anything is sent.

        A dict's keys travel with its tensors as their names (:attr:`Item.name`; strings of at
        most 1024 bytes of UTF-8 without NUL, 1.11 libraries at both ends), and
        :meth:`Connection.recv_batch` gives the batch back as a dict."""
        peer = peer_id(peer)
        names = _names_of(tensors) if isinstance(tensors, dict) else None
        items = tensors.values() if isinstance(tensors, dict) else tensors
        adopted = False
        registered = self._registered
        streams: dict = {}
        with registry_lock:  # (adopted exports stay open from their share to their send)
            try:
                prepared = []
                for t in items:
                    r = registered.get(id(t)) if registered else None
                    if r is not None and r.current(t):
                        if r.device:
                            r.prep[1].stream = _registered_stream(streams, t, stream)
                        prepared.append(r.prep)
                        continue
                    prep, fresh = self._prepare(t, stream)
                    prepared.append(prep)
                    adopted |= fresh
                self._send_prepared(peer, prepared, names)
            finally:
                if adopted:
                    collect_except(keep=None)

    def _prepare(self, t, stream):
        """(export, desc, keep) of one tensor to send, and whether a storage was adopted now."""
        if is_torch_tensor(t):
            _check_sendable(t)
            if t.device.type != "cpu":
                return self._prepare_device(t, stream)
        elif stream is not None:
            raise ValueError("stream= applies to CUDA and NPU tensors only")
        return self._prepare_host(t)

    def register(self, tensors) -> int:
        """Share these tensors' storages with this channel once (a state dict, a model's
        parameters, a KV cache and its block views): every later :meth:`send` /
        :meth:`send_batch` of any of them, to any consumer, costs one lease message, with
        nothing re-shared, re-adopted or re-described. ``tensors``: a tensor, or an iterable or
        dict of tensors (CPU or CUDA / NPU, as :meth:`send` takes them). Returns how many are
        registered on this channel now.

        What it holds: each registered tensor (so its storage lives, as a strong reference in
        this channel) and its storage's export (a CPU storage's ``file_system`` shared memory;
        a CUDA / NPU storage's adoption of PyTorch's own share, with PyTorch's reference) until
        :meth:`unregister` or :meth:`close`. So ``torch.cuda.empty_cache()`` does not give a
        registered storage's memory back, and an expandable segment keeps the registered
        storage's range mapped however it grows or shrinks elsewhere. Registration adds no
        device memory: the storage is shared where it is.

        In-place changes (``copy_``, an optimiser step) are what the consumer sees on its
        next lease: the memory is shared, not copied. A registered tensor whose storage, offset,
        shape or strides changed since (``t.data = ...``, ``set_``, ``resize_``) is prepared
        afresh when sent (and kept registered in its new form). Leases are counted as for any
        send: :func:`devshare.wait` waits for them, and a consumer that dies returns them."""
        items = _tensors_of(tensors)
        with registry_lock:
            try:
                for t in items:
                    old = self._registered.get(id(t))
                    if old is not None and old.current(t):
                        continue
                    prep, _ = self._prepare(t, None)
                    self._hold_export(prep[0])
                    if old is not None:
                        self._drop(old)
                    self._registered[id(t)] = _Registered(t, prep)
            finally:
                collect_except(keep=None)
        return len(self._registered)

    def unregister(self, tensors=None) -> int:
        """Undo :meth:`register` for ``tensors`` (a tensor, iterable or dict; ``None``: every
        registered tensor): their leases out stay valid and are counted as before; once those
        are back, the storages' exports close (PyTorch's reference goes back) as after any
        send. Returns how many stay registered."""
        with registry_lock:
            if tensors is None:
                gone = list(self._registered.values())
                self._registered.clear()
            else:
                gone = [r for r in (self._registered.pop(id(t), None) for t in _tensors_of(tensors))
                        if r is not None]
            for r in gone:
                self._drop(r)
            collect_except(keep=None)
        return len(self._registered)

    def _hold_export(self, exp) -> None:
        """One more registered tensor in ``exp``; its first registers it with the library's
        channel (1.10: consumers keep its allocation mapped between leases)."""
        held = self._reg_exports.get(id(exp))
        if held is not None:
            held[1] += 1
            return
        if HAVE_REGISTER:
            self._lib_call(lib.devshare_channel_register, exp.ptr)
        self._reg_exports[id(exp)] = [exp, 1]

    def _drop(self, r: _Registered) -> None:
        """Unregister ``r``; the last registered tensor of an export unregisters the export
        with the library's channel (its consumers let their mappings of it go)."""
        exp = r.prep[0]
        held = self._reg_exports.get(id(exp))
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                del self._reg_exports[id(exp)]
                if HAVE_REGISTER and not self.closed and not exp.closed:
                    self._lib_call(lib.devshare_channel_unregister, exp.ptr)
        r.drop()

    def _send_prepared(self, peer: int, prepared: list, names=None) -> None:
        """Send the (export, TensorDesc, what keeps it valid) of ``prepared`` as leases, in one
        call where the library can (:func:`devshare._channel_lib.send_leases`), with ``names``
        (None, or UTF-8 bytes per lease)."""
        if not prepared:
            return
        ptr = self._enter()
        try:
            send_leases(ptr, peer, prepared, names)
        finally:
            self._exit()

    def _prepare_host(self, obj):
        """((export, desc, keep), whether a storage was adopted) for a CPU tensor or numpy
        array: devshare memory as is, a torch storage from PyTorch's file_system memory."""
        addr, dtype, shape, strides, span = layout(obj)
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

