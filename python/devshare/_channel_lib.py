"""The library's channel functions: bound once for the loaded version, and how they are called.

One job: everything between the channel classes and the library's channel, pool and connection
functions. At import this module sets their prototypes (:func:`devshare._abi.channel_signatures`
and what 1.2, 1.4, 1.7 and 1.8 added) and looks once at what the loaded library offers. What
differs between library versions is chosen here, then, and not on each call:

- :func:`send_leases`: many leases in one call (1.4), or one call each;
- :func:`describe`: a received import's description in one call (1.4), or three;
- :data:`GIVE_BACK` / :data:`UNMAP_GIVEN_BACK`: an item given back stays mapped until its last
  tensor is gone (1.2), or is unmapped by the give-back itself;
- :data:`RAW_RECV_ITEM` (1.7) and :data:`RAW_RECV_ARGS` (1.8): the receives that report the item
  and release an earlier one in the same call, and :data:`RAW_RECV_BATCH` (1.11) a batch's
  items in one call (None where the library lacks them);
- :func:`need`: a function the library lacks is refused with ``UNSUPPORTED``, naming the version
  that added it.

Calls go through :func:`call` (arguments range-checked, ``CLOSED`` raised as
:class:`ChannelClosed`); blocking calls take seconds through :func:`wait_call` and
:func:`timed`. The per-item calls use the ``RAW_*`` function objects, which skip ctypes'
argument conversion. Also what the functions take: :func:`address_bytes`, :func:`peer_id`.

Imports :mod:`devshare._lib`, :mod:`devshare._ints` and :mod:`devshare._args`.
"""

from __future__ import annotations

import math
import os
import time
from ctypes import POINTER, addressof, byref, c_char_p, c_int32, c_void_p, cast

from . import _ints
from ._args import timeout_ms, type_label
from ._ints import check_args
from ._lib import (
    CHANNEL_MINOR,
    Error,
    ExporterP,
    ImportP,
    Status,
    TensorDesc,
    bind,
    channel_signatures,
    channel_signatures_1_2,
    channel_signatures_1_4,
    channel_signatures_1_7,
    channel_signatures_1_8,
    channel_signatures_1_10,
    channel_signatures_1_11,
    channel_signatures_1_12,
    channel_signatures_1_16,
    error_for,
    lib,
)
from ._lib import version as library_version

# --- Binding --------------------------------------------------------------------------------------


def _bind() -> str | None:
    """Set the channel functions' prototypes; why the library cannot do channels, or None."""
    missing = bind(channel_signatures(ExporterP, ImportP))
    if missing:
        return (f"the loaded libdevshare ({library_version}) has no channel API (it lacks "
                f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): channels need "
                f"libdevshare 1.{CHANNEL_MINOR} or later")
    return None


#: Why the loaded library cannot do channels (it is older than 1.1), or None.
UNAVAILABLE = _bind()

# The functions added after 1.1 that the library has (their prototypes set), and the minor
# version that added each.
_HAVE: set = set()
_ADDED: dict = {}
for _minor, _signatures in ((2, channel_signatures_1_2(ImportP)),
                            (4, channel_signatures_1_4(ExporterP, ImportP)),
                            (7, channel_signatures_1_7(ImportP)),
                            (8, channel_signatures_1_8()),
                            (10, channel_signatures_1_10(ExporterP)),
                            (11, channel_signatures_1_11(ExporterP, ImportP)),
                            (12, channel_signatures_1_12()),
                            (16, channel_signatures_1_16())):
    _names = {name for name, _, _ in _signatures}
    _HAVE |= _names - set(bind(_signatures))
    _ADDED.update(dict.fromkeys(_names, _minor))
del _minor, _signatures, _names


#: Whether the library registers exports with channels (1.10: Channel.register tells consumers
#: to keep mappings).
HAVE_REGISTER = "devshare_channel_register" in _HAVE
#: Whether the library sends and reads lease names (1.11: a dict sent with send_batch comes
#: back as a dict from recv_batch).
HAVE_NAMES = "devshare_channel_send_named" in _HAVE


def require() -> None:
    """Error ``UNSUPPORTED`` when the loaded library has no channels."""
    if UNAVAILABLE:
        raise Error(Status.UNSUPPORTED, UNAVAILABLE)


def need(name: str, what: str):
    """The library function ``name`` (one added after 1.1), or Error ``UNSUPPORTED`` saying that
    ``what`` needs the library version that added it."""
    if name not in _HAVE:
        raise Error(Status.UNSUPPORTED, f"{what} needs libdevshare 1.{_ADDED[name]} or later "
                                        f"(loaded: {library_version})")
    return getattr(lib, name)


def _raw(name):
    """The library function ``name`` as a second ctypes function object, without argtypes (None
    when the library lacks it). ctypes converts every argument of a function with argtypes
    through the type's ``from_param``, about 0.1 µs an argument; the per-item calls pass
    ready-made ctypes objects of exactly the C parameter types (or None for NULL), which need
    none of it. The result stays a C int: the status."""
    try:
        return lib[name]
    except AttributeError:
        return None


def _by_address(name):
    """The library function ``name`` (one ``DevshareImport *`` parameter) as a second ctypes
    function object whose parameter is a ``c_void_p``: it takes an import as an ``ImportP`` or
    as its address, an int (which a pool item's lease keeps: reading the address out of the
    received struct costs a tenth of making an ``ImportP`` of it, and converting it here about
    25 ns). None when the library lacks it."""
    fn = _raw(name)
    if fn is not None:
        fn.argtypes = [c_void_p]
    return fn


RAW_ACQUIRE = _raw("devshare_pool_acquire")
RAW_SEND = _raw("devshare_pool_send")
#: Give back and unmap an import that was never given back (the status).
RAW_RELEASE = _by_address("devshare_import_release")
RAW_GIVE_BACK = (_by_address("devshare_import_give_back")
                 if "devshare_import_give_back" in _HAVE else None)
RAW_RECV_ITEM = (_raw("devshare_connection_recv_item")
                 if "devshare_connection_recv_item" in _HAVE else None)
RAW_RECV_ARGS = (_raw("devshare_connection_recv_args")
                 if "devshare_connection_recv_args" in _HAVE else None)
#: Receive a batch into an array of items (1.11), or None.
RAW_RECV_BATCH = (_raw("devshare_connection_recv_batch")
                  if "devshare_connection_recv_batch" in _HAVE else None)


#: Give back many imports (their addresses) in one call (1.12), or None.
GIVE_BACK_MANY = lib.devshare_imports_give_back if "devshare_imports_give_back" in _HAVE else None


def _nothing_to_unmap(imp) -> int:
    """:data:`UNMAP_GIVEN_BACK` of a library before 1.2, whose give-back unmapped already."""
    return 0


if RAW_GIVE_BACK is not None:
    #: Give an item's import back to its producer (the status): from 1.2 it stays mapped, for
    #: the tensors over it, until :data:`UNMAP_GIVEN_BACK`.
    GIVE_BACK = RAW_GIVE_BACK
    #: Unmap an import given back before (the status).
    UNMAP_GIVEN_BACK = RAW_RELEASE
else:  # a library before 1.2 gives back and unmaps in one call: nothing is left to unmap
    GIVE_BACK = RAW_RELEASE
    UNMAP_GIVEN_BACK = _nothing_to_unmap


def _no_int_params(names) -> dict:
    """The functions (of ``names``) none of whose parameters is a C integer, by ``id`` (ctypes
    functions are not hashable; the dict holds them, so no id is reused while it is here).
    Range-checking their arguments (check_args) checks nothing and costs about half a
    microsecond per call, a tenth of an item's trip: :func:`call` skips it for them. (ctypes
    gives the same function object for every ``lib.<name>``: CDLL keeps it as an attribute.)"""
    out = {}
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None and fn.argtypes is not None \
                and all(_ints.ctype_range(t) is None for t in fn.argtypes):
            out[id(fn)] = fn
    return out


_NO_INT_PARAMS = _no_int_params(["devshare_import_pool_slot", "devshare_import_info",
                                 "devshare_import_handle", "devshare_import_release",
                                 "devshare_import_name"])

# --- Calls and errors -----------------------------------------------------------------------------


class ChannelClosed(Error):
    """The other end of the channel is gone, or the channel was closed (status ``CLOSED``).

    :meth:`Connection.recv` raises it once the producer closed the channel or exited and every
    item it sent before was received. Items received earlier stay valid until released.
    """


def call(fn, *args) -> int:
    """:func:`devshare._lib.call` (arguments range-checked, Error on failure), with status
    ``CLOSED`` raised as :class:`ChannelClosed`."""
    if id(fn) not in _NO_INT_PARAMS:
        check_args(fn, args)  # what _lib.call() does, in this frame (this is on every item's path)
    status = fn(*args)
    if status < 0:
        raise error(status)
    return status


def error(status: int) -> Error:
    """The exception for a negative status: :class:`ChannelClosed` for ``CLOSED``."""
    e = error_for(status)
    if e.status == Status.CLOSED:
        return ChannelClosed(e.status, e.message, e.vendor_error)
    return e


# --- Waits ----------------------------------------------------------------------------------------

_ceil = math.ceil
I32_MAX = (1 << 31) - 1
TIMEOUT = int(Status.TIMEOUT)
# Whole seconds that are fewer than I32_MAX milliseconds: one library call waits that long.
FAST_SECONDS = I32_MAX // 1000
MS_ARGS = {-1: c_int32(-1), 0: c_int32(0)}  # read-only: passed by value
FOREVER = MS_ARGS[-1]


def wait_ms(timeout) -> int | None:
    """A timeout in seconds (None or math.inf: forever; validated like :func:`devshare.wait`'s)
    as the milliseconds one blocking library call takes (-1: forever), or None when it is longer
    than one call waits (about 24.8 days: use :func:`timed`)."""
    if timeout is None:
        return -1
    if type(timeout) is int and 0 <= timeout <= FAST_SECONDS:
        return timeout * 1000
    if type(timeout) is float and 0.0 <= timeout <= FAST_SECONDS:  # (NaN fails both)
        return _ceil(timeout * 1000)  # what timeout_ms makes of it, as recv_batch's waits are
    ms = timeout_ms(timeout)
    return None if ms > I32_MAX else ms


def wait_call(fn, ptr, timeout, *outs) -> bool:
    """``fn(ptr, ms, *outs)``, a blocking library call, for a timeout in seconds (as
    :func:`timed`): False when it timed out. The common timeouts (None, whole seconds) take one
    call with no closure; TIMEOUT is not turned into an exception on the way."""
    ms = wait_ms(timeout)
    if ms is None:
        return timed(lambda m: call(fn, ptr, m, *outs), timeout)
    # The usual waits as ready-made c_int32s (check_args has less to do with them).
    args = (ptr, MS_ARGS.get(ms, ms), *outs)
    check_args(fn, args)  # as call() does
    status = fn(*args)
    if status < 0:
        if status == TIMEOUT:
            return False
        raise error(status)
    return True


def timed(fn, timeout) -> bool:
    """Run ``fn(ms)`` (a blocking library call through :func:`call`) for a timeout in seconds
    (None or math.inf: forever; validated like :func:`devshare.wait`'s): False when it timed
    out. The library takes int32 milliseconds (about 24.8 days): longer finite waits are made of
    several calls."""
    ms = timeout_ms(timeout)
    deadline = None if ms <= I32_MAX else time.monotonic() + ms / 1000
    while True:
        if deadline is not None:
            ms = min(I32_MAX, max(0, math.ceil((deadline - time.monotonic()) * 1000)))
        try:
            fn(ms)
            return True
        except Error as e:
            if e.status != Status.TIMEOUT:
                raise
            if deadline is None or ms < I32_MAX:
                return False


# --- What differs between library versions (chosen once, above all for the loaded library) --------


def _send_each(ptr, peer: int, prepared: list, names=None) -> None:
    for exp, desc, _ in prepared:
        call(lib.devshare_channel_send, ptr, peer, exp.ptr, byref(desc))


_DESC_PP = POINTER(POINTER(TensorDesc))


def _send_batch(ptr, peer: int, prepared: list, names=None) -> None:
    if len(prepared) == 1 and not (names and HAVE_NAMES):
        _send_each(ptr, peer, prepared)
        return
    n = len(prepared)
    exps = (ExporterP * n)(*(exp.ptr for exp, _, _ in prepared))
    # The descriptions' addresses as one array (a pointer object per description cost four
    # times as much: 0.8 us a lease).
    descs = cast((c_void_p * n)(*(addressof(desc) for _, desc, _ in prepared)), _DESC_PP)
    if names and HAVE_NAMES:
        texts = (c_char_p * n)(*names)
        call(lib.devshare_channel_send_named, ptr, peer, exps, descs, texts, n)
    else:
        call(lib.devshare_channel_send_batch, ptr, peer, exps, descs, n)


#: ``send_leases(channel_ptr, peer, prepared, names=None)``: send the (export, TensorDesc, what
#: keeps it valid) triples of ``prepared`` to ``peer`` as leases, in order: a batch in one call
#: (1.4), or (a library before 1.4, or a single lease) one call each. ``names``: None, or one
#: UTF-8 ``bytes`` (or None) per lease, sent where the library has names (1.11).
send_leases = _send_batch if "devshare_channel_send_batch" in _HAVE else _send_each


def lease_name(imp):
    """The name a received lease carries (``devshare_import_name``), or None: none, or a
    library before 1.11. ``imp``: an ``ImportP`` or its address."""
    if not HAVE_NAMES or imp is None:
        return None
    text = c_char_p()
    if not isinstance(imp, ImportP):
        imp = cast(c_void_p(imp), ImportP)
    call(lib.devshare_import_name, imp, byref(text), None)
    return None if text.value is None else text.value.decode("utf-8")

_INVALID_ARGUMENT = int(Status.INVALID_ARGUMENT)


def _describe_in_one(imp, out):
    status = lib.devshare_import_describe(imp, out.info_ref, out.handle_ref, out.pool_ref,
                                          out.slot_ref)
    if status < 0:
        raise error(status)
    pool = out.pool.value
    if pool == 0:
        return None, None  # a lease, not a pool item
    return pool, out.slot.value


def _describe_in_three(imp, out):
    # Not call(): for a lease, INVALID_ARGUMENT is the answer, not an error to describe.
    status = lib.devshare_import_pool_slot(imp, out.pool_ref, out.slot_ref)
    if status >= 0:
        pool, slot = out.pool.value, out.slot.value
    elif status == _INVALID_ARGUMENT:
        pool = slot = None  # a lease, not a pool item
    else:
        raise error(status)
    status = lib.devshare_import_info(imp, out.info_ref)
    if status < 0:
        raise error(status)
    status = lib.devshare_import_handle(imp, out.handle_ref)
    if status < 0:
        raise error(status)
    return pool, slot


#: ``describe(imp, out)``: write received import ``imp``'s ImportInfo and handle into ``out``
#: (``info_ref``, ``handle_ref``, and ``pool`` / ``slot`` with their ``pool_ref`` /
#: ``slot_ref``: every argument a ctypes object, nothing to range-check); (pool id, slot) for a
#: pool item, (None, None) for a lease. One call (1.4), or three.
describe = _describe_in_one if "devshare_import_describe" in _HAVE else _describe_in_three

# --- Arguments ------------------------------------------------------------------------------------


def address_bytes(address) -> bytes:
    """A channel address (a path as str, bytes or os.PathLike, or ``"@name"``) as the bytes the
    library takes; TypeError / ValueError for anything else."""
    if isinstance(address, bytes):
        raw = address
    elif isinstance(address, str) or hasattr(address, "__fspath__"):
        raw = os.fsencode(address)
    else:
        raise TypeError(f"a channel address is a path (str, bytes or os.PathLike) or '@name', not "
                        f"{type_label(address)}")
    if not raw or raw == b"@":
        raise ValueError("a channel address needs a path or a name after '@'")
    if b"\0" in raw:
        raise ValueError(f"a channel address cannot contain NUL characters: {address!r}")
    return raw


_U64_MAX = _ints.U64[1]


def peer_id(peer) -> int:
    """A consumer's id (an int from 1 to 2**64 - 1), checked."""
    if type(peer) is int and 0 < peer <= _U64_MAX:
        return peer
    return _ints.index("peer", peer, 1, _U64_MAX)
