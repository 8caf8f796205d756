"""The consumer end of a channel: Connection, and the items it receives.

One job: receiving. :func:`connect` makes a :class:`Connection`; :meth:`Connection.recv` takes
the next item from the library and gives it as an :class:`Item` whose tensor (or numpy array)
is a zero-copy view of the producer's memory. A connection keeps a view per pool slot and
layout, so that a pool item seen before costs a ``detach()`` and no new mapping, and a recipe
per host lease's address and layout, so that a lease seen before is not decoded again; the
receive also releases, in the same library call, one import of the connection's grave. How the
library receives depends on its version, chosen once at import: one call with its arguments in
a struct (1.8, :class:`RecvArgsOut`), one call of four arguments (1.7, :class:`RecvItemOut`),
or a receive and a describe (before 1.7, ``Connection._recv_described``); a batch
(:meth:`Connection.recv_batch`) is one library call with a 1.11 library, its items made from
the array the library filled, their names read from it with a 1.15 library. What an item's
lease does when it is released or garbage is :mod:`devshare._leases`.

Imports :mod:`devshare._lib`, :mod:`devshare._dtypes`, :mod:`devshare._ints`,
:mod:`devshare._args`, :mod:`devshare._views`, :mod:`devshare._channel_lib`,
:mod:`devshare._ownership` and :mod:`devshare._leases`.
"""

from __future__ import annotations

import math
import os
import struct
import time
import weakref
from ctypes import byref, c_char, c_int32, c_size_t, c_uint32, c_uint64, c_void_p, cast, sizeof

from . import _dtypes, _ints, _views
from ._args import timeout_ms
from ._channel_lib import (
    FOREVER,
    GIVE_BACK_MANY,
    HAVE_NAMES,
    RAW_RECV_ARGS,
    RAW_RECV_BATCH,
    RAW_RECV_ITEM,
    RAW_RELEASE,
    TIMEOUT,
    ChannelClosed,
    address_bytes,
    call,
    describe,
    error,
    lease_name,
    need,
    require,
    timed,
    wait_call,
    wait_ms,
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
from ._ownership import PID, Owned, forked

_MAX_VIEWS = 1024  # item views (and numpy recipes) kept by a connection
_CU_STREAM_LEGACY = 0x1  # cuda.h: the legacy default stream, which a handle of 0 also names
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
    :attr:`name`: the name the producer gave a lease (a dict's key in
    :meth:`Channel.send_batch`), or None.
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

    @property
    def name(self):
        """The name the producer sent with this lease (the key of a dict given to
        :meth:`Channel.send_batch`), or None: none was sent, a pool item, or a library before
        1.11. Read while the item lives (released or not)."""
        if self.pool is not None:
            return None
        lease = self._lease
        held = lease._held
        imp = held[0] if held else lease._mapped
        return lease_name(imp)

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


# --- What the library wrote: an item's description ------------------------------------------------

# The handle fields an item's tensor needs, read straight from the struct's bytes (one unpack
# instead of a ctypes attribute access per field and element).
_H_DTYPE = struct.Struct("=BBH")  # DType: code, bits, lanes
_H_DTYPE_OFF = HandleStruct.dtype.offset
_H_NDIM_OFF = HandleStruct.ndim.offset
_H_SHAPE_OFF = HandleStruct.shape.offset
_H_STRIDES_OFF = HandleStruct.strides.offset
_H_NDIM = struct.Struct("=I")
_H_DIMS = [struct.Struct(f"={n}q") for n in range(MAX_NDIM + 1)]

# A received item (DevshareItem). A pool item's kept view is found by the item's layout_id
# (1.8), or with a library before 1.8 (which leaves it 0) by the struct's bytes from the pool id
# to the layout_id, which tell a pool item's view apart. (Ints and bytes never compare equal:
# the two kinds of key never meet.)
_ITEM_KEY = ItemStruct.pool.offset
_ITEM_KEY_END = ItemStruct.layout_id.offset
_LAYOUT_WORD = _ITEM_KEY_END // 8
# pool, slot, device, backend, read_only, ndim, dtype (code, bits, lanes), data, nbytes
_ITEM_HEAD = struct.Struct("=IIiHHIBBHQQ")
_ITEM_SHAPE = ItemStruct.shape.offset
_ITEM_STRIDES = ItemStruct.strides.offset
_IMPORT_AT = ItemStruct.struct_size.size + ItemStruct.reserved.size  # where the import pointer is
#: The 64-bit word of a received item that holds its import's address.
IMPORT_WORD = _IMPORT_AT // 8
# A batch's items lie _ITEM_SIZE bytes apart (devshare_connection_recv_batch's stride); an item
# whose struct_size on return reaches _ITEM_NAMED has its name (1.15): the pointer in word
# _NAME_WORD, its length in the next.
_ITEM_SIZE = sizeof(ItemStruct)
_NAME_WORD = ItemStruct.name.offset // 8
_ITEM_NAMED = ItemStruct.name_len.offset + 8
assert _IMPORT_AT % 8 == 0 and _ITEM_KEY_END % 8 == 0 and _ITEM_SIZE % 8 == 0 and _ITEM_NAMED == _ITEM_SIZE

# Output structs for every received item, initialised once by their init functions (new_struct)
# and copied per receive's out-argument.
_INFO_TEMPLATE = bytes(new_struct(ImportInfo))
_HANDLE_TEMPLATE = bytes(new_struct(HandleStruct))
_ITEM_TEMPLATE = bytes(new_struct(ItemStruct)) if RAW_RECV_ITEM is not None else b""
_ARGS_TEMPLATE = bytes(new_struct(RecvArgs)) if RAW_RECV_ARGS is not None else b""
_ARGS_HEAD = RecvArgs.item.offset
assert _ARGS_HEAD == 24 and RecvArgs.release.offset == 16 and RecvArgs.timeout_ms.offset == 4


class RecvArgsOut:
    """A receive's out-argument with a 1.8 library, made once per connection (taken by one
    receive at a time): the ``DevshareRecvArgs`` (``args``) of
    ``devshare_connection_recv_args``, whose ``item`` is the item; ``ref`` is what that call
    takes. :meth:`Connection.recv` fills it in and calls ``fn(*fn_args)``: ``head`` is the
    struct's first three 64-bit words (the connection's address in [1], the import to release
    in [2]), ``ms`` its int32s (the timeout in [1]). ``bytes`` and ``words`` are a byte and a
    64-bit word view of the item (``words[IMPORT_WORD]``: the import's address)."""

    __slots__ = ("args", "item", "ref", "head", "ms", "bytes", "words", "fn", "fn_args")

    def __init__(self, conn: int):
        self.args = RecvArgs.from_buffer_copy(_ARGS_TEMPLATE)
        self.args.conn = conn
        head = memoryview(self.args).cast("B")[:_ARGS_HEAD]
        self.head = head.cast("Q")
        self.ms = head.cast("i")
        self.ref = byref(self.args)
        self.item = self.args.item  # (shares the args' memory)
        self.bytes = memoryview(self.item).cast("B")
        self.words = self.bytes.cast("Q")
        self.fn = RAW_RECV_ARGS
        self.fn_args = (self.ref,)


class RecvItemOut:
    """A receive's out-argument with a 1.7 library, as :class:`RecvArgsOut` (the same
    attributes): the ``DevshareItem`` of ``devshare_connection_recv_item`` (``item``). That
    call's other arguments (the connection, the timeout and the import to release) are ctypes
    objects over three 64-bit words (``args``) laid out like the head of ``DevshareRecvArgs``,
    so that :meth:`Connection.recv` fills either kind in the same way."""

    __slots__ = ("args", "item", "ref", "head", "ms", "bytes", "words", "fn", "fn_args")

    def __init__(self, conn: int):
        self.item = ItemStruct.from_buffer_copy(_ITEM_TEMPLATE)
        self.ref = byref(self.item)
        self.args = (c_uint64 * 3)()
        head = memoryview(self.args).cast("B")
        self.head = head.cast("Q")
        self.ms = head.cast("i")
        self.bytes = memoryview(self.item).cast("B")
        self.words = self.bytes.cast("Q")
        self.fn = RAW_RECV_ITEM
        self.fn_args = (c_void_p(conn), c_int32.from_buffer(self.args, RecvArgs.timeout_ms.offset),
                        c_void_p.from_buffer(self.args, RecvArgs.release.offset), self.ref)


#: The out-argument class of :meth:`Connection.recv`, chosen for the loaded library (None
#: before 1.7: ``Connection._recv_described`` receives then).
ItemOut = (RecvArgsOut if RAW_RECV_ARGS is not None
           else RecvItemOut if RAW_RECV_ITEM is not None else None)


class _RecvOut:
    """The out-arguments of a receive with a library before 1.7 (see
    :func:`devshare._channel_lib.describe`), made once per connection (taken by one receive at a
    time): the pool and slot, the ImportInfo and the handle, and their byrefs."""

    __slots__ = ("pool", "slot", "info", "handle", "pool_ref", "slot_ref", "info_ref", "handle_ref")

    def __init__(self):
        self.pool, self.slot = c_uint32(), c_uint32()
        self.info = ImportInfo.from_buffer_copy(_INFO_TEMPLATE)
        self.handle = HandleStruct.from_buffer_copy(_HANDLE_TEMPLATE)
        self.pool_ref, self.slot_ref = byref(self.pool), byref(self.slot)
        self.info_ref, self.handle_ref = byref(self.info), byref(self.handle)


# --- Items of what the library wrote --------------------------------------------------------------


def new_pool_view(views: dict, key, data, nbytes, dtype, shape, strides, pool, slot):
    """The entry a connection keeps in ``views`` under ``key`` for a pool slot and layout,
    made now: (the kept torch tensor over the item's memory, its storage, its
    :class:`~devshare._leases.Anchor`, the pool id, the slot, how many users the storage has
    with nothing but the entry, and what counts them: a function of the storage's ``_cdata``
    and that, or None where this torch cannot tell). The address is in what the key stands
    for: the same address again while an item holds the mapping is the same memory (a pool
    keeps its slots' addresses), so the kept tensor (checked when made) fits every later item
    of that key exactly as it did the first one."""
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


def _new_item(conn, like, lease, imp, key, pool, slot, backend, data, nbytes, dtype, ndim, buf,
              shape_at, strides_at) -> Item:
    """The :class:`Item` of a received import, its lease ``lease`` (released at once if this
    fails). ``imp``: the import as an ``ImportP`` (needed for device items only); ``key``: what
    ``conn`` keeps a pool item's view under (None: the item's description, for a library before
    1.7); ``pool``, ``slot``: a pool item's (0 or None: a lease); the shape and strides are
    ``ndim`` int64s at ``shape_at`` / ``strides_at`` in ``buf``."""
    try:
        if backend != BACKEND_HOST:
            # Device memory (a pool or lease of a C/C++ producer's CUDA/ACL export): through
            # DLPack, whose tensor holds its own reference to the import, so the item comes back
            # once it is released and that tensor is gone as well.
            if like != "torch":
                raise ValueError("device items open as torch tensors only (like='torch')")
            tensor = _views.from_import(imp, "torch")
        else:
            if ndim > MAX_NDIM:  # the library never reports more; ctypes would have cut it too
                raise Error(Status.UNTRUSTED, f"item with {ndim} dimensions (at most {MAX_NDIM})")
            dims = _H_DIMS[ndim]
            shape, strides = dims.unpack_from(buf, shape_at), dims.unpack_from(buf, strides_at)
            if not pool:
                if like == "torch" and key is not None:
                    # A lease: its tensor from the recipe kept for its address and layout (made
                    # now, for the next leases of them), with a storage of its own that holds it.
                    recipe = _views.torch_recipe(data, nbytes, dtype, shape, strides)
                    lease_views = conn._lease_views
                    if len(lease_views) >= _MAX_VIEWS:
                        lease_views.clear()
                    lease_views[key] = recipe
                    tensor = _views.torch_from(recipe, lease)
                else:
                    tensor = _views.view(data, nbytes, lease, dtype, shape, strides, like)
            elif like == "torch":
                # Through the view kept for its slot and layout, made the first time.
                if key is None:
                    key = (pool, slot, data, nbytes, dtype, shape, strides)
                views = conn._views
                entry = views.get(key)
                if entry is None:
                    entry = new_pool_view(views, key, data, nbytes, dtype, shape, strides, pool,
                                          slot)
                # As Connection.recv does for a pool item seen before (it writes this out).
                entry[2].lease = None
                lease = PoolLease(lease._held.pop(), lease._grave, entry)
                tensor = entry[0].detach()
                tensor._devshare_item = lease
            else:
                # The recipe of its arrays, kept for the next items of this slot and layout.
                recipe = _views.numpy_recipe(data, nbytes, None, dtype, shape, strides)
                if key is not None:
                    np_views = conn._np_views
                    if len(np_views) >= _MAX_VIEWS:
                        np_views.clear()
                    np_views[key] = (recipe, pool, slot)
                tensor = _views.numpy_from(recipe, lease)
        if pool:
            return Item(lease, tensor, pool, slot)
        return Item(lease, tensor, None, None)
    except BaseException:
        lease.release_now()
        raise


def _received(mv, words, at: int, like: str, conn, key) -> Item:
    """The :class:`Item` of the item that ``devshare_connection_recv_args`` / ``_recv_item`` /
    ``_recv_batch`` wrote at byte ``at`` of ``mv`` (``words``: the same memory as 64-bit words),
    for all but an item whose kept view or recipe exists (:meth:`Connection._item_at` makes
    that one); ``key``, its view's key."""
    pool, slot, device, backend, read_only, ndim, code, bits, lanes, data, nbytes = \
        _ITEM_HEAD.unpack_from(mv, at + _ITEM_KEY)
    # The lease keeps the import's address: a pool item's goes to the grave, whose imports
    # the next receive releases by address.
    lease = Lease(words[(at >> 3) + IMPORT_WORD], conn._grave if pool else None)
    imp = ImportP.from_buffer_copy(mv, at + _IMPORT_AT) if backend != BACKEND_HOST else None
    return _new_item(conn, like, lease, imp, key, pool, slot, backend, data or 0, nbytes,
                     (code, bits, lanes), ndim, mv, at + _ITEM_SHAPE, at + _ITEM_STRIDES)


def _described(imp: ImportP, like: str, conn) -> Item:
    """The :class:`Item` of import ``imp`` from ``devshare_connection_recv`` (a library before
    1.7), described by :func:`devshare._channel_lib.describe`."""
    lease = Lease(imp)
    outs = conn._outs
    try:
        try:
            out = outs.pop()
        except IndexError:
            out = _RecvOut()
        pool, slot = describe(imp, out)
    except BaseException:
        lease.release_now()
        raise
    h, info = out.handle, out.info
    data = info.data or 0
    end = (info.storage or 0) + info.storage_size
    item = _new_item(conn, like, lease, imp, None, pool, slot, info.backend, data,
                     max(end - data, 0), _H_DTYPE.unpack_from(h, _H_DTYPE_OFF),
                     _H_NDIM.unpack_from(h, _H_NDIM_OFF)[0], h, _H_SHAPE_OFF, _H_STRIDES_OFF)
    outs.append(out)  # (only once read: a failed call may leave it half-written)
    return item


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
        require()
        raw = address_bytes(address)
        ptr = ConnectionP()
        timeout_ms(timeout)  # validated before anything is tried
        deadline = None if timeout is None or math.isinf(timeout) else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                done = timed(lambda ms: call(lib.devshare_channel_connect, raw, ms, byref(ptr)), left)
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
        self._at = cast(ptr, c_void_p).value  # the connection's address, for the receives (ItemOut)
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
        # Pool items' tensors by slot and layout (see new_pool_view), numpy arrays' recipes
        # likewise (with the pool id and slot), and recv's out-arguments.
        self._views: dict = {}
        self._np_views: dict = {}
        # Host leases' tensor recipes by address and layout (see _views.torch_recipe): each
        # lease still gets a storage of its own, which holds it; only the decoding is kept.
        self._lease_views: dict = {}
        self._outs: list = []
        peer_id, producer_pid = c_uint64(), c_int32()
        call(lib.devshare_connection_info, ptr, byref(peer_id), byref(producer_pid))
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
        return self._lib_call(lib.devshare_connection_fd)

    def set_spin(self, spin_us: int) -> None:
        """Let :meth:`recv` poll for an item for up to ``spin_us`` microseconds before it sleeps
        (0, the default: no spin of its own, only the library's adaptive one, up to 50 µs while
        the producer is awake on another CPU; at most ``MAX_SPIN_US``, 1 s). For a consumer with
        a CPU core of its own; where producer and consumer share a CPU it only slows both down."""
        fn = need("devshare_connection_set_spin", "spinning")
        self._lib_call(fn, _ints.index("spin_us", spin_us, 0, MAX_SPIN_US))

    def set_stream(self, stream) -> None:
        """Read received CUDA / NPU items on ``stream`` (a ``torch.cuda.Stream``, an NPU stream,
        a raw ``CUstream`` / ``aclrtStream`` as an int, or None): each item's event from the
        producer is then waited for by that stream, on the device, and :meth:`recv` returns
        without waiting for the producer's work. None (the default): :meth:`recv` waits on the
        host. Use the stream that will read the items (e.g. ``torch.cuda.current_stream()``).
        A CUDA stream object whose handle is 0 (PyTorch's default stream, the legacy one) is
        passed as ``CU_STREAM_LEGACY``, which names the same stream: a raw 0 would mean "no
        stream" (wait on the host)."""
        fn = need("devshare_connection_set_stream", "Connection.set_stream")
        if stream is None:
            raw = 0
        elif isinstance(stream, int) and not isinstance(stream, bool):
            raw = _ints.index("stream", stream, 0, _ints.U64[1])
        else:
            raw = getattr(stream, "cuda_stream", None)
            if raw == 0 and isinstance(raw, int):
                raw = _CU_STREAM_LEGACY
            raw = getattr(stream, "npu_stream", None) if raw is None else raw
            if not isinstance(raw, int):
                raise TypeError(f"stream must be a torch.cuda.Stream, an NPU stream, an int or "
                                f"None, not {type(stream).__name__}")
        self._lib_call(fn, raw or None)

    def recv(self, timeout=None, like: str = "torch") -> Item:
        """The next :class:`Item` (a leased tensor or a pool slot), waiting at most ``timeout``
        seconds (None: forever; 0: only what already arrived): TimeoutError then.
        :class:`ChannelClosed` once the producer closed the channel or exited and everything it
        sent was received. ``like``: "torch" (default) or "numpy" for :attr:`Item.tensor`."""
        if like != "torch" or not _TORCH_SEEN:
            _see(like)  # raises unless that package imports
        # One library call (see ItemOut), which also releases one import of the grave.
        outs = self._outs
        try:
            out = outs.pop()
        except IndexError:
            out = ItemOut(self._at)
        ms = -1 if timeout is None else wait_ms(timeout)
        # self._enter() / self._exit(), written out (this is on every item's path, where two
        # calls cost more than what they do). The connection's pointer is in out.
        life = self._life
        inside = life.inside
        inside.append(None)
        if not life.open or self._pid != PID[0]:
            self._enter_refused()
        try:
            if ms is not None:
                # self._grave.take(), written out (as above).
                dead = self._grave.imps
                if dead:
                    try:
                        dead = dead.pop()
                    except IndexError:  # another thread took the last one
                        dead = 0
                else:
                    dead = 0
                out.head[2] = dead
                out.ms[1] = ms
                status = out.fn(*out.fn_args)
                if status < 0 and status != TIMEOUT:
                    raise error(status)
                done = status >= 0
            else:  # longer than one call waits: calls of the longest wait in turn
                def once(m):
                    out.head[2] = self._grave.take()
                    out.ms[1] = m
                    status = out.fn(*out.fn_args)
                    if status < 0:
                        raise error(status)
                done = timed(once, timeout)
        finally:
            inside.pop()
            if life.deferred:
                life.leave()
        if not done:
            outs.append(out)
            raise TimeoutError(f"nothing arrived on channel {self.address!r} within {timeout} s")
        item = self._item_at(out.bytes, out.words, 0, like)
        outs.append(out)  # (only once read: a failed call may leave it half-written)
        return item

    def _item_at(self, mv, words, at: int, like: str) -> Item:
        """The :class:`Item` of the received item the library wrote at byte ``at`` of ``mv`` (a
        byte view of one ``DevshareItem``, or of an array of them; ``words``: the same memory
        as 64-bit words), recorded for :meth:`release_all`. What :meth:`recv` and
        :meth:`recv_batch` make of each item."""
        w = at >> 3
        # The key of the view (or numpy recipe) kept for a pool item's slot and layout: its
        # layout_id, or its description (see _LAYOUT_WORD).
        key = words[w + _LAYOUT_WORD] or mv[at + _ITEM_KEY:at + _ITEM_KEY_END].tobytes()
        if like == "torch":
            entry = self._views.get(key)
            if entry is not None:
                # A pool item seen before: its tensor through the view kept for its slot and
                # layout. (_new_item's, written out: this is every pool item's path.)
                lease = PoolLease(words[w + IMPORT_WORD], self._grave, entry)
                # An item shown before through this view, gone while its memory was still
                # used: that memory is this item's (the same mapping), held by it from now on.
                entry[2].lease = None
                tensor = entry[0].detach()
                tensor._devshare_item = lease
                self._items_add(_weakref(lease, self._items_gone))
                return Item(lease, tensor, entry[3], entry[4])
            recipe = self._lease_views.get(key)
            if recipe is not None:
                # A host lease at an address and layout seen before: a tensor of its own
                # (holding the lease) from the recipe kept for them. (_views.torch_from,
                # written out: this is every repeated lease's path.)
                lease = Lease(words[w + IMPORT_WORD])
                array_type, addr, tdtype, count, shape, strides = recipe
                if array_type is None:
                    tensor = strides.empty(shape, dtype=tdtype)
                else:
                    raw = array_type.from_address(addr)
                    raw._devshare_keep = lease
                    tensor = _FROMBUFFER(raw, dtype=tdtype, count=count)
                    if strides is not None:
                        tensor.as_strided_(shape, strides)  # (in place, as _views.view)
                self._items_add(_weakref(lease, self._items_gone))
                return Item(lease, tensor, None, None)
        else:
            # A numpy pool item seen before: an array of its own (holding the item), from the
            # recipe kept for its slot and layout.
            entry = self._np_views.get(key)
            if entry is not None:
                lease = Lease(words[w + IMPORT_WORD], self._grave)
                # (_views.numpy_from, written out: as above.)
                array_type, addr, ndtype, shape, extra, bstrides = entry[0]
                if array_type is None:
                    array = extra.empty(shape, dtype=ndtype)
                else:
                    raw = array_type.from_address(addr)
                    raw._devshare_keep = lease
                    array = extra[0](shape, ndtype, raw, 0, bstrides)
                self._items_add(_weakref(lease, self._items_gone))
                return Item(lease, array, entry[1], entry[2])
        item = _received(mv, words, at, like, self, key)
        self._items_add(_weakref(item._lease, self._items_gone))
        return item

    def _recv_described(self, timeout=None, like: str = "torch") -> Item:
        """:meth:`recv` with ``devshare_connection_recv`` and
        :func:`devshare._channel_lib.describe` (a library before 1.7)."""
        if like != "torch" or not _TORCH_SEEN:
            _see(like)  # raises unless that package imports
        imp = ImportP()
        ptr = self._enter()
        try:
            if timeout is None:  # one library call, no argument checks (all ctypes objects)
                status = lib.devshare_connection_recv(ptr, FOREVER, byref(imp))
                if status < 0:
                    raise error(status)
                done = True
            else:
                done = wait_call(lib.devshare_connection_recv, ptr, timeout, byref(imp))
        finally:
            self._exit()
        if not done:
            raise TimeoutError(f"nothing arrived on channel {self.address!r} within {timeout} s")
        item = _described(imp, like, self)
        self._items_add(_weakref(item._lease, self._items_gone))
        return item

    if RAW_RECV_ITEM is None:  # a library before 1.7 (chosen once, for the loaded library)
        recv = _recv_described  # noqa: F811

    def recv_batch(self, n: int, timeout=None, like: str = "torch"):
        """The next ``n`` items, in the order they were sent (a producer's :meth:`Channel.send_batch`
        of ``n`` tensors): a list of :class:`Item`, or, when every item carries a name and no
        two the same (the producer sent a dict), a dict of name -> :class:`Item` in that order.
        ``timeout`` (seconds; ``None``: no limit) bounds the whole batch:
        :class:`TimeoutError` when it runs out first, and the items received before it are
        released (none is lost: each went back to the producer).
        Release the batch with :func:`release_batch` (a list or a dict; or each item, or
        :meth:`release_all`). With a 1.11 library the batch is one library call, and with a
        1.15 one the names come with it (no call per item)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"recv_batch: n must be an int >= 0, not {n!r}")
        ms = wait_ms(timeout)
        if RAW_RECV_BATCH is None or ms is None or n == 0:
            return self._recv_each(n, timeout, like)
        if like != "torch" or not _TORCH_SEEN:
            _see(like)  # raises unless that package imports
        # The items as the library writes them, in one array initialised from the template
        # (made per call: a batch's items are read before it returns).
        buf = bytearray(_ITEM_TEMPLATE * n)
        mv = memoryview(buf)
        words = mv.cast("Q")
        items, names = [], []
        # Items whose import an Item (or its lease, which releases it if the item fails) took:
        # the first `taken`. The others the library handed out are released here when anything
        # (a KeyboardInterrupt included) stops this call between its return and their items.
        taken = 0
        try:
            ptr = self._enter()
            try:
                status = RAW_RECV_BATCH(ptr, c_int32(ms), (c_char * len(buf)).from_buffer(buf),
                                        c_size_t(n))
            finally:
                self._exit()
            if status < 0:
                # The library released what it had received (each went back to the producer)
                # and left every import NULL.
                if status == TIMEOUT:
                    raise TimeoutError(f"{n} items did not arrive on channel {self.address!r} "
                                       f"within {timeout} s")
                raise error(status)
            # The names as the library wrote them (1.15), or asked for per lease (1.11).
            in_items = (words[0] & 0xFFFFFFFF) >= _ITEM_NAMED
            for at in range(0, n * _ITEM_SIZE, _ITEM_SIZE):
                taken += 1
                item = self._item_at(mv, words, at, like)
                items.append(item)
                if item.pool is None and HAVE_NAMES:
                    w = at >> 3
                    if not in_items:
                        names.append(lease_name(words[w + IMPORT_WORD]))
                    elif words[w + _NAME_WORD]:
                        # (An array over the name's bytes: half of what ctypes.string_at costs.)
                        text = (c_char * words[w + _NAME_WORD + 1]).from_address(words[w + _NAME_WORD])
                        names.append(text.raw.decode("utf-8"))
                    else:
                        names.append(None)
        except BaseException:
            release_batch(items)
            # The imports received and never made into items (the library's NULL for none).
            for rest in range(taken * _ITEM_SIZE, n * _ITEM_SIZE, _ITEM_SIZE):
                imp = words[(rest >> 3) + IMPORT_WORD]
                if imp:
                    RAW_RELEASE(imp)
            raise
        return _by_name(items, names)

    def _recv_each(self, n: int, timeout, like: str):
        """:meth:`recv_batch` one :meth:`recv` at a time (a library before 1.11, or a timeout
        longer than one library call waits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        items = []
        try:
            for _ in range(n):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                items.append(self.recv(left, like))
        except BaseException:
            release_batch(items)
            raise
        names = [it.name for it in items] if HAVE_NAMES and items and items[0].pool is None else []
        return _by_name(items, names)

    def release_all(self) -> int:
        """Release every item received on this connection and not yet released (gone or not):
        each goes back to the producer if it is still there, and its memory is unmapped once
        the last tensor over it is gone (those tensors are stale from now on). What a consumer
        does when :meth:`recv` raised :class:`ChannelClosed` because the producer died, so that
        nothing of that producer stays mapped. Returns how many were released. Callable after
        :meth:`close` too. With a 1.12 library the leases go back in one message, as
        :func:`release_batch` sends them."""
        leases = [lease for lease in (ref() for ref in list(self._items)) if lease is not None]
        return _give_back_many(leases)

    def __iter__(self):
        while True:
            try:
                yield self.recv()
            except ChannelClosed:
                return


# Whether torch imported for a receive (checked once, not on every item).
_TORCH_SEEN = False


# torch.frombuffer, once torch imported for a receive.
_FROMBUFFER = None


def _see(like: str) -> None:
    """Check ``like`` (its package imports), once for torch."""
    global _TORCH_SEEN, _FROMBUFFER
    _views.check_like(like)
    if like == "torch":
        _FROMBUFFER = _dtypes.require_torch().frombuffer
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


def release_batch(items) -> int:
    """Release every :class:`Item` of ``items`` (a list from :meth:`Connection.recv_batch`, or
    any iterable of items; a dict's values) that is not released yet: one call for a batch,
    and with a 1.12 library one library call, whose leases of a connection go back to its
    producer in one message (so a batch of any size fits the producer's socket while it is
    not reading; one message per lease filled it at a few hundred, and the rest waited for
    this consumer's next call). Returns how many were released."""
    if isinstance(items, dict):
        items = items.values()
    items = list(items)
    n = _give_back_many([it._lease for it in items])
    for it in items:
        if it._lease.released:
            it._tensor = None
    return n


def _by_name(items: list, names: list):
    """``items`` as a dict of name -> item when ``names`` (one per item) are all names and no
    two the same (a producer's dict); else the list."""
    if not items or len(names) != len(items):
        return items
    named = dict(zip(names, items))
    if len(named) != len(items) or None in named:
        return items
    return named


def _give_back_many(leases) -> int:
    """Release every lease of ``leases`` (:class:`Lease` objects) that is not released yet, in
    one library call where the library has it (a connection's leases then go back to its
    producer in one message), else one at a time. A process that inherited any of them
    through fork raises before anything is released. Returns how many were released."""
    pid = PID[0]
    for lease in leases:
        if lease._held and lease._pid != pid:
            raise forked("Item", lease._pid)
    if GIVE_BACK_MANY is None:
        n = 0
        for lease in leases:
            try:
                lease.release()
                n += 1
            except Error as e:
                if e.status != Status.ALREADY_RELEASED:  # (released meanwhile: not counted)
                    raise
        return n
    addresses = []
    for lease in leases:
        try:
            imp = lease._held.pop()
        except IndexError:  # released already, or by another thread meanwhile
            continue
        # As Lease.release: mapped until the lease is garbage, also if the give-back fails.
        lease._mapped = imp
        addresses.append(imp if type(imp) is int else cast(imp, c_void_p).value)
    n = len(addresses)
    if n:
        status = GIVE_BACK_MANY((c_void_p * n)(*addresses), n)
        if status < 0:
            raise error(status)
    return n
