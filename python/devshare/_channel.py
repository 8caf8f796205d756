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

This module is the channel API's one import point and nothing else: its names are made by the
channel modules, each with one job, in layers (tests/python/test_module_graph.py checks them):

- :mod:`devshare._channel_lib`: the library's channel functions, bound once for its version;
- :mod:`devshare._ownership`: objects owned by one process (fork and thread rules);
- :mod:`devshare._channel_memory`: :func:`channel_empty`'s memory, the layout of what is sent;
- :mod:`devshare._leases`: a received item's import, given back once, unmapped when garbage;
- :mod:`devshare._pool`: :class:`Pool` and :class:`Slot`;
- :mod:`devshare._connection`: :class:`Connection`, :class:`Item`, :func:`connect`;
- :mod:`devshare._producer`: :class:`Channel`.

The memory registry they share with :func:`devshare.share` (so that ``outstanding`` / ``wait``
count leases) is :mod:`devshare._registry`, and tensors over received memory are made by
:mod:`devshare._views`. Imports :mod:`devshare._lib` and the channel modules above.
"""

from __future__ import annotations

from ._channel_lib import ChannelClosed
from ._channel_memory import channel_empty
from ._connection import Connection, Item, connect, release_batch
from ._pool import Pool, Slot
from ._producer import Channel

# Internals that the tests and the benchmarks' bare-call floor (bench/user_pays.py) read from
# here, where they lived before the channel modules were split out of this one.
from ._channel_lib import FOREVER as _FOREVER  # noqa: F401
from ._channel_lib import RAW_ACQUIRE as _RAW_ACQUIRE  # noqa: F401
from ._channel_lib import RAW_GIVE_BACK as _RAW_GIVE_BACK  # noqa: F401
from ._channel_lib import RAW_RECV_ARGS as _RAW_RECV_ARGS  # noqa: F401
from ._channel_lib import RAW_RECV_ITEM as _RAW_RECV_ITEM  # noqa: F401
from ._channel_lib import RAW_SEND as _RAW_SEND  # noqa: F401
from ._channel_lib import error as _error  # noqa: F401
from ._connection import IMPORT_WORD as _IMPORT_WORD  # noqa: F401
from ._connection import ItemOut as _ItemOut  # noqa: F401
from ._lib import Status, lib  # noqa: F401
from ._ownership import Owned as _Owned  # noqa: F401

__all__ = ["Channel", "ChannelClosed", "Connection", "Item", "Pool", "Slot", "channel_empty",
           "connect", "release_batch"]
