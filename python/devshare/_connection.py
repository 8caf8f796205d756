"""The consumer end of a channel: Connection, and the items it receives.

One job: receiving. :func:`connect` makes a :class:`Connection`; :meth:`Connection.recv` takes
the next item from the library and gives it as an :class:`Item` whose tensor (or numpy array)
is a zero-copy view of the producer's memory. A connection keeps a view per pool slot and
layout, so that a pool item seen before costs a ``detach()`` and no new mapping; the receive
also releases, in the same library call, one import of the connection's grave. What an item's
lease does when it is released or garbage is :mod:`devshare._leases`.

Imports :mod:`devshare._lib`, :mod:`devshare._ints`, :mod:`devshare._args`,
:mod:`devshare._views`, :mod:`devshare._channel_lib`, :mod:`devshare._ownership` and
:mod:`devshare._leases`.
"""

from __future__ import annotations

import math
import os
import struct
import time
import weakref
from ctypes import byref, c_int32, c_uint32, c_uint64, c_void_p, cast, sizeof

from . import _ints, _views
from ._args import timeout_ms
from ._channel_lib import (
    FAST_SECONDS as _FAST_SECONDS,
    FOREVER as _FOREVER,
    I32_MAX as _I32_MAX,
    MS_ARGS as _MS_ARGS,
    RAW_RECV_ARGS as _RAW_RECV_ARGS,
    RAW_RECV_ITEM as _RAW_RECV_ITEM,
    TIMEOUT as _TIMEOUT,
    ChannelClosed,
    address_bytes as _address,
    call as _call,
    describe,
    error as _error,
    need,
    require as _require,
    timed as _timed,
    wait_call as _wait_call,
)
from ._leases import Anchor, Grave, Lease, PoolLease
from ._lib import (
    BACKEND_HOST,
    MAX_NDIM,
    MAX_SPIN_US,
    ConnectionP,
    Error,
    HandleStruct,
    ImportInfo,
    ImportP,
    ItemStruct,
    RecvArgs,
    Status,
    lib,
    new_struct,
)
from ._ownership import PID, Owned

_MAX_VIEWS = 1024  # item views (and numpy recipes) kept by a connection
_weakref = weakref.ref


def _set_spin(fn, obj, spin_us) -> None:
    """``fn`` (devshare_pool_set_spin / devshare_connection_set_spin) on ``obj``'s pointer."""
    fn = need(fn, "spinning")
    us = _ints.index("spin_us", spin_us, 0, MAX_SPIN_US)
    ptr = obj._enter()
    try:
        _call(fn, ptr, us)
    finally:
        obj._exit()


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

    def __init__(self, lease: Lease, tensor, pool, slot):
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
    lease = Lease(imp)
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
IMPORT_WORD = _IMPORT_AT // 8
assert _IMPORT_AT % 8 == 0 and _ITEM_KEY_END % 8 == 0 and sizeof(ItemStruct) % 8 == 0


def _view_key(out) -> object:
    """The key of a received pool item's kept view (or numpy recipe): its layout_id, or its
    description's bytes (see ``_ITEM_KEY``). (Connection.recv writes it out.)"""
    return out.words[_LAYOUT_WORD] or out.bytes[_ITEM_KEY:_ITEM_KEY_END].tobytes()


class ItemOut:
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
        self.words = self.bytes.cast("Q")  # words[IMPORT_WORD]: the import's address
        self.dead = c_void_p()


_ARGS_TEMPLATE = bytes(new_struct(RecvArgs)) if _RAW_RECV_ARGS is not None else b""
_ARGS_HEAD = RecvArgs.item.offset
assert _ARGS_HEAD == 24 and RecvArgs.release.offset == 16 and RecvArgs.timeout_ms.offset == 4


def _received(out: ItemOut, like: str, conn) -> Item:
    """The :class:`Item` of what ``devshare_connection_recv_item`` wrote into ``out``, for all
    but a pool item whose kept view exists (:meth:`Connection.recv` makes that one)."""
    mv = out.bytes
    imp = ImportP.from_buffer_copy(mv, _IMPORT_AT)
    views = conn._views
    pool, slot, device, backend, read_only, ndim, code, bits, lanes, data, nbytes = \
        _ITEM_HEAD.unpack_from(mv, _ITEM_KEY)
    # The lease keeps the import's address: a pool item's goes to the grave, whose imports
    # the next receive releases by address.
    lease = Lease(out.words[IMPORT_WORD], conn._grave if pool else None)
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
                lease = PoolLease(lease._held.pop(), conn._grave, entry)
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


def _pool_tensor(views: dict, lease, key):
    """(torch tensor, :class:`~devshare._leases.PoolLease`) of a received pool item (whose import moves from
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
    pool_lease = PoolLease(lease._held.pop(), None, entry)
    t = entry[0].detach()
    t._devshare_item = pool_lease
    return t, pool_lease


def _new_pool_view(views: dict, key, data, nbytes, dtype, shape, strides, pool=None, slot=None):
    """The entry :func:`_pool_tensor` keeps for ``key``: (the kept torch tensor over the item's
    memory, its storage, its :class:`~devshare._leases.Anchor`, the pool id, the slot, how many users the
    storage has with nothing but the entry, and what counts them: a function of the storage's
    ``_cdata`` and that, or None where this torch cannot tell), made now and kept in
    ``views``."""
    anchor = Anchor()
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


class Connection(Owned):
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
        # Pool items' imports that are garbage, released by the next receive (see devshare._leases.Grave); the
        # close releases what is left, also the finalizer's.
        self._grave = Grave()
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
            out = ItemOut(self._at)
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
        ptr = self._ptr if life.open and self._pid == PID[0] else self._enter_refused()
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
                lease = PoolLease(out.words[IMPORT_WORD], self._grave, entry)
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
                lease = Lease(out.words[IMPORT_WORD], self._grave)
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
