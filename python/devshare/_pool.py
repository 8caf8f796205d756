"""Pools: fixed slots of one allocation, acquired, filled and sent to a channel's consumers.

One job: the producer's side of a pool. :class:`Pool` (made by :meth:`Channel.pool`) hands out
free slots (:meth:`Pool.acquire`, waiting while every slot is out: backpressure); a
:class:`Slot` gives zero-copy views to fill (kept per slot and layout, so that the same layout
costs a ``detach()`` the next time) and is sent to one consumer with a descriptor kept per
layout, or released unsent, or goes back to the pool when it and its views are gone. The
channel a pool is made on is :mod:`devshare._producer`, which imports this module (its
:meth:`~devshare.Channel.pool` makes pools and its close closes them).

Imports :mod:`devshare._lib`, :mod:`devshare._ints`, :mod:`devshare._dtypes`,
:mod:`devshare._args`, :mod:`devshare._views`, :mod:`devshare._registry`,
:mod:`devshare._channel_lib`, :mod:`devshare._ownership` and :mod:`devshare._channel_memory`.
"""

from __future__ import annotations

import os
from ctypes import byref, c_uint32, c_uint64, c_void_p

from . import _dtypes, _ints, _views
from ._args import normalize_shape, type_label
from ._channel_lib import FOREVER, RAW_ACQUIRE, RAW_SEND, call, error, need, peer_id, wait_call
from ._channel_memory import ChannelBuffer, contiguous, layout
from ._lib import MAX_SPIN_US, STORAGE_TO_END, Error, PoolP, Status, lib, registry_lock
from ._ownership import PID, Owned
from ._registry import MAX_ALLOC, buffer_at, host_nbytes, tensor_desc


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


_MAX_DESCS = 64
_MAX_VIEWS = 1024  # Slot views kept by a pool


class Pool(Owned):
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

    def __init__(self, channel, slot_nbytes: int, count: int, memory=None):
        # A Channel (devshare._producer, a layer above: Channel.pool makes pools), known by the
        # name its class gives its objects.
        if not isinstance(channel, Owned) or channel._what != "Channel":
            raise TypeError(f"Pool needs a devshare.Channel, not {type_label(channel)}")
        slot_nbytes = _ints.index("slot_nbytes", slot_nbytes, 1, _ints.N64[1])
        count = _ints.index("count", count, 1, _ints.U32[1])
        total = slot_nbytes * count
        if memory is None:
            if total > MAX_ALLOC:
                raise ValueError(f"{count} slots of {slot_nbytes} bytes are more than the largest "
                                 f"host allocation")
            keeper = ChannelBuffer(total)
        else:
            addr, _, _, _, span = layout(memory)
            with registry_lock:
                keeper = buffer_at(addr, span)
            if keeper is None:
                raise TypeError("a pool's memory must come from devshare.channel_empty() or "
                                "devshare.empty()")
            if total > keeper.export.size:
                raise ValueError(f"{count} slots of {slot_nbytes} bytes do not fit the "
                                 f"{keeper.export.size}-byte allocation")
        ptr = PoolP()
        channel._lib_call(lib.devshare_pool_create, keeper.export.ptr, slot_nbytes, count, byref(ptr))
        pool_id = c_uint32()
        try:
            call(lib.devshare_pool_id, ptr, byref(pool_id))
        except BaseException:
            call(lib.devshare_pool_close, ptr)
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
        self._lib_call(lib.devshare_pool_info, byref(size), byref(count), byref(free))
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
        before it sleeps (0, the default: no spin of its own, only the library's adaptive one, up
        to 50 µs while a consumer is awake on another CPU; at most ``MAX_SPIN_US``, 1 s). For a
        producer with a CPU core of its own; where producer and consumer share a CPU it only
        slows both down."""
        fn = need("devshare_pool_set_spin", "spinning")
        self._lib_call(fn, _ints.index("spin_us", spin_us, 0, MAX_SPIN_US))

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
        ptr = self._ptr if life.open and self._pid == PID[0] else self._enter_refused()
        try:
            if timeout is None:  # one library call, no argument checks (all ctypes objects)
                status = RAW_ACQUIRE(ptr, FOREVER, out[2], out[3])
                if status < 0:
                    raise error(status)
                done = True
            else:
                done = wait_call(lib.devshare_pool_acquire, ptr, timeout, out[2], out[3])
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
        peer = peer_id(peer)
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
        ptr = pool._ptr if life.open and pool._pid == PID[0] else pool._enter_refused()
        try:
            # One library call; every argument is a ctypes object of the C type (no argtypes
            # conversion, nothing to range-check).
            status = RAW_SEND(ptr, self._index_arg, peer_arg, None if desc is None else desc[0])
        finally:
            inside.pop()
            if life.deferred:
                life.leave()
        if status < 0:
            raise error(status)
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
            addr, code_bits_lanes, shape, strides, span = layout(view)
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
            strides = contiguous(shape) if strides is None else tuple(strides)
            if len(strides) != len(shape):
                raise ValueError(f"strides {strides} and shape {shape} differ in length")
            desc = self.pool._desc(code_bits_lanes, shape, strides, offset)
        return desc

    def release(self) -> None:
        """Give the slot back to the pool unsent."""
        self._take("release")
        self.pool._lib_call(lib.devshare_pool_release, self._index_arg)
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


