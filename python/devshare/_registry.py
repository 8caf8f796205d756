"""The memory registry: the exporters this process owns and the host imports it made.

One job: remember which memory this process can hand out, so that a share finds the allocation
behind any address and :func:`devshare.outstanding` / :func:`devshare.wait` find its exporter:

- :class:`Export`: one ``DevshareExporter`` (a devshare host allocation, an adopted shm object,
  or a channel's memfd);
- allocations (:class:`HostBuffer` and the channels' buffers), by address and, once their first
  share told it, by shm name: :func:`add_buffer`, :func:`buffer_at`, :func:`buffer_named`;
- exports of existing shm objects (torch storages, re-shared imports), by shm name:
  :func:`adopted_export`, :func:`adopted`, :func:`adopted_of_storage`; closed by
  :func:`collect` once every reference they handed out came back, and at exit;
- adopted device exports (PyTorch's / torch_npu's share of a CUDA / NPU storage, leased over
  channels): :func:`adopt_device`, :func:`device_adoption`; each holds what the caller gave it
  to keep (the storage) until every lease came back, then :func:`collect` closes it (which
  returns PyTorch's reference) and lets the storage go;
- host imports made by :func:`devshare.open`: :func:`note_import`, :func:`import_at` (trusted
  only after checking ``/proc/self/maps``).

Callers hold :data:`devshare._lib.registry_lock` around every lookup and change (the functions
here take it only where they are entry points: :func:`collect`, :func:`close_all`). Nothing here
knows torch or numpy: callers pass addresses.

Imports :mod:`devshare._lib`, :mod:`devshare._ints` and :mod:`devshare._handle` (an export's
share is a :class:`~devshare.Handle`).
"""

from __future__ import annotations

import atexit
import bisect
import builtins
import ctypes
import weakref
from ctypes import byref, c_int64, c_uint64, c_void_p

from . import _dtypes, _ints
from ._handle import Handle, struct_of
from ._lib import (
    ADOPT_MINOR,
    SHARE_INFLIGHT,
    DType,
    Error,
    ExporterP,
    HandleStruct,
    Status,
    TensorDesc,
    adopt_signatures,
    bind,
    call,
    check_args,
    error_for,
    lib,
    new_struct,
    registry_lock,
)
from ._lib import version as library_version

#: Bytes before the data in a file_system-layout shm object.
HEADER_SIZE = 64
_I64_MAX = (1 << 63) - 1
_TIMEOUT = int(Status.TIMEOUT)
_EXPORTER_WAIT = lib.devshare_exporter_wait
#: The largest host allocation the library makes: header + data must fit an off_t (int64).
MAX_ALLOC = (1 << 63) - 1 - HEADER_SIZE


def host_nbytes(shape, code, bits, lanes) -> int:
    """Bytes of a host tensor of ``shape`` and this dtype; ValueError past :data:`MAX_ALLOC`."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * (bits // 8) * lanes
    if nbytes > MAX_ALLOC:
        raise ValueError(f"shape {shape} of {_dtypes.type_name(code, bits, lanes)} needs {nbytes} "
                         f"bytes, more than the largest host allocation ({MAX_ALLOC} bytes)")
    return nbytes


# --- Exporters ------------------------------------------------------------------------------------


def tensor_desc(dtype, shape, strides, storage_offset, storage_size, tensor_offset,
                inflight: bool = True):
    """A ``TensorDesc`` (made by devshare_tensor_desc_init: struct_size and the defaults, no
    stream) for a share of ``dtype`` (DLPack (code, bits, lanes)), ``shape`` and ``strides``
    (elements, each checked into int64), with an in-flight reference unless ``inflight`` is
    False. Returns (desc, the arrays it points into: keep them while the desc is in use)."""
    shape_arr = _ints.int64_array("shape", shape)
    strides_arr = _ints.int64_array("strides", strides)
    desc = new_struct(
        TensorDesc,
        dtype=DType(*dtype),
        ndim=len(shape),
        shape=ctypes.cast(shape_arr, ctypes.POINTER(c_int64)),
        strides=ctypes.cast(strides_arr, ctypes.POINTER(c_int64)),
        storage_offset=storage_offset,
        storage_size=storage_size,
        tensor_offset=tensor_offset,
        flags=SHARE_INFLIGHT if inflight else 0,
    )
    return desc, (shape_arr, strides_arr)


class Export:
    """One ``DevshareExporter`` of this process: a devshare allocation or an adopted shm object.

    ``ptr`` is the library's exporter (NULL once closed), ``base`` and ``size`` its memory,
    ``name`` its shm name (None until a share tells it), ``storage_ref`` a weakref to the torch
    storage an adopted export came from, ``waiters`` the threads inside :func:`devshare.wait`
    on it and ``registered`` the channel registrations that hold it (:func:`collect` must not
    close it under either)."""

    __slots__ = ("ptr", "name", "base", "size", "storage_ref", "waiters", "keep", "key", "registered",
                 "__weakref__")

    def __init__(self, ptr: ExporterP, name: bytes | None):
        self.ptr = ptr
        self.name = name
        base, size = c_void_p(), c_uint64()
        try:
            call(lib.devshare_exporter_memory, ptr, byref(base), byref(size))
        except BaseException:
            lib.devshare_exporter_close(ptr, 0)
            raise
        self.base = base.value or 0
        self.size = size.value
        self.storage_ref = None
        self.waiters = 0
        self.registered = 0  # channel registrations holding it open (Channel.register)
        self.keep = None  # adopted device exports: the storage, held until closed
        self.key = None  # adopted device exports: the caller's key for the storage

    @classmethod
    def alloc(cls, nbytes: int) -> Export:
        ptr = ExporterP()
        call(lib.devshare_host_alloc, nbytes, byref(ptr), None)
        # The C API has no accessor for the shm name; the first handle tells it (see share).
        return cls(ptr, None)

    @classmethod
    def adopt(cls, name: bytes, nbytes: int) -> Export:
        ptr = ExporterP()
        call(lib.devshare_host_adopt, name, nbytes, byref(ptr), None)
        return cls(ptr, name)

    @property
    def closed(self) -> bool:
        return not self.ptr

    def contains(self, addr: int, nbytes: int = 0) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.size

    def share(self, dtype, shape, strides, storage_offset, storage_size, tensor_offset,
              inflight: bool = True) -> Handle:
        desc, keep = tensor_desc(dtype, shape, strides, storage_offset, storage_size,
                                 tensor_offset, inflight)
        h = new_struct(HandleStruct)
        call(lib.devshare_exporter_share, self.ptr, byref(desc), byref(h))
        del keep  # (alive until here: desc points into them)
        if self.name is None:
            self.name = bytes(h.key[: h.key_len])
        return Handle(h)

    def outstanding(self) -> int:
        if self.closed:
            return 0
        n = c_uint64()
        call(lib.devshare_exporter_outstanding, self.ptr, byref(n))
        return n.value

    def wait(self, timeout_ms: int) -> bool:
        if self.closed:
            return True
        if not (type(timeout_ms) is int and -1 <= timeout_ms <= _I64_MAX):  # (the usual, at once)
            check_args(lib.devshare_exporter_wait, (self.ptr, timeout_ms))
        status = _EXPORTER_WAIT(self.ptr, timeout_ms)
        if status < 0:
            if status == _TIMEOUT:
                return False
            raise error_for(status)
        return True

    def close(self) -> None:
        ptr, self.ptr = self.ptr, ExporterP()
        if ptr:
            call(lib.devshare_exporter_close, ptr, 0)


# --- Allocations: empty()'s and the channels' buffers --------------------------------------------


class HostBuffer:
    """Owner of a devshare_host_alloc allocation behind tensors/arrays made by
    :func:`devshare.empty`. Closing happens when the last tensor/array (and view) using the
    memory is gone."""

    __slots__ = ("export", "__weakref__")

    def __init__(self, nbytes: int):
        self.export = Export.alloc(nbytes)
        weakref.finalize(self, Export.close, self.export)


#: Tensors registered on a channel (``Channel.register``), for :func:`devshare.wait`'s quick
#: look-up: id(tensor) -> the newest registration of it (a ``_Registered``, on any channel),
#: whose export is the one :func:`devshare.wait` would find for it while the tensor's layout
#: is the registered one, as a weak reference (a channel dropped without ``close`` lets its
#: registered tensors go, as before). A registration removes its own entry when dropped (a
#: channel's close or its finalizer drops all of its). Under registry_lock.
registered_tensors: dict = {}


# Live buffers (objects with an ``export``), by data address and (once their first share told
# it) by shm name (weak: a buffer lives as long as its tensors/arrays), and their addresses in
# order, for finding the buffer around an address in O(log n) on every share. The sorted list
# may still hold addresses of buffers that are gone; lookups drop those.
_buffers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_buffers_by_name: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_buffer_bases: list[int] = []


def add_buffer(buf) -> None:
    """Register a live buffer (an object with an :class:`Export` as ``export``, weakly held)."""
    base = buf.export.base
    _buffers[base] = buf
    i = bisect.bisect_left(_buffer_bases, base)
    if i == len(_buffer_bases) or _buffer_bases[i] != base:
        _buffer_bases.insert(i, base)


def buffer_at(addr: int, nbytes: int):
    """The live buffer that holds ``[addr, addr + nbytes)``, or None."""
    # Buffers never overlap, so only the one with the nearest address at or below addr can hold
    # [addr, addr + nbytes).
    i = bisect.bisect_right(_buffer_bases, addr) - 1
    while i >= 0:
        buf = _buffers.get(_buffer_bases[i])
        if buf is None:
            del _buffer_bases[i]  # that buffer is gone
            i -= 1
            continue
        return buf if buf.export.contains(addr, nbytes) else None
    return None


def buffer_named(name: bytes):
    """The live buffer whose export has shm name ``name`` (a handle's key), or None."""
    buf = _buffers_by_name.get(name)
    if buf is None:
        buf = next((b for b in list(_buffers.values()) if b.export.name == name), None)
        if buf is not None:
            _buffers_by_name[name] = buf
    return buf


# --- Imports made by open() -----------------------------------------------------------------------

# Mappings of imports made by open(): (shm name, data address) -> alloc size (a read-only and a
# read-write import of one object are two mappings). An entry may outlive its mapping; it is
# only trusted after checking /proc/self/maps.
_imports: dict[tuple[bytes, int], int] = {}
_IMPORTS_PRUNE_AT = 256


def shm_mappings() -> dict[bytes, list[tuple[int, int, int]]]:
    """shm name -> [(start, end, file offset)] of this process's /dev/shm mappings."""
    out: dict[bytes, list[tuple[int, int, int]]] = {}
    with builtins.open("/proc/self/maps", "rb") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith(b"/dev/shm/"):
                continue
            path = parts[5].rstrip(b"\n")
            if path.endswith(b" (deleted)"):
                continue
            start, end = (int(x, 16) for x in parts[0].split(b"-"))
            out.setdefault(b"/" + path[len(b"/dev/shm/"):], []).append((start, end, int(parts[2], 16)))
    return out


def _live_import(maps, name: bytes, base: int, size: int) -> bool:
    return any(off == 0 and start + HEADER_SIZE == base and base + size <= end
               for start, end, off in maps.get(name, ()))


def import_at(addr: int, nbytes: int) -> tuple[bytes, int, int] | None:
    """(shm name, alloc size, byte offset of addr in the data) when [addr, addr+nbytes) lies in
    a live mapping of an object this process imported with open()."""
    candidates = [(name, base, size) for (name, base), size in _imports.items()
                  if base <= addr and addr + nbytes <= base + size]
    if not candidates:
        return None
    maps = shm_mappings()
    for name, base, size in candidates:
        if _live_import(maps, name, base, size):
            return name, size, addr - base
        del _imports[(name, base)]  # that mapping is gone
    return None


def note_import(name: bytes, base: int, size: int) -> None:
    """Remember a host import's mapping (shm name, data address, alloc size), so that a share
    of memory in it exports the same object again."""
    global _IMPORTS_PRUNE_AT
    if len(_imports) >= _IMPORTS_PRUNE_AT:
        maps = shm_mappings()
        for (n, b), sz in list(_imports.items()):
            if not _live_import(maps, n, b, sz):
                del _imports[(n, b)]
        _IMPORTS_PRUNE_AT = max(256, 2 * len(_imports))  # many live imports: prune less often
    _imports[(name, base)] = size


# --- Adopted exports ------------------------------------------------------------------------------

# Exports of existing shm objects (torch storages, re-shared imports), by shm name; closed by
# collect() once every reference they handed out came back.
_adopted: dict[bytes, Export] = {}


def adopted_export(name: bytes, nbytes: int, storage=None) -> Export:
    """The export of shm object ``name`` (``nbytes`` of data), adopted now unless this process
    has an open one; ``storage``: the torch storage it is for (remembered weakly)."""
    exp = _adopted.get(name)
    if exp is None or exp.closed:
        exp = Export.adopt(name, nbytes)
        _adopted[name] = exp
    if storage is not None and (exp.storage_ref is None or exp.storage_ref() is None):
        exp.storage_ref = weakref.ref(storage)
    return exp


def adopted(name: bytes) -> Export | None:
    """The adopted export of shm object ``name``, or None."""
    return _adopted.get(name)


def adopted_of_storage(storage) -> Export | None:
    """The adopted export made for the torch storage ``storage``, or None."""
    for exp in _adopted.values():
        if exp.storage_ref is not None and exp.storage_ref() is storage:
            return exp
    return None


def collect() -> int:
    """Close this process's exporters of torch storages whose references all came back (like
    ``torch.cuda.ipc_collect``), and let go of CUDA / NPU storages whose channel leases all came
    back. :func:`share` and the channel calls do this too. Returns how many were closed."""
    return collect_except(keep=None, force=True)


def collect_except(keep, force: bool = False) -> int:
    """:func:`collect`, leaving ``keep`` (an export just shared) open. Adopted device exports
    are looked at only when ``force`` or when many were added since the last look (so that a
    loop of sends costs O(1) each, amortised)."""
    closed = 0
    with registry_lock:
        closed += _sweep_devices(keep, force)
        for name, exp in list(_adopted.items()):
            if exp is keep or exp.waiters or exp.registered:
                continue
            if exp.closed or exp.outstanding() == 0:
                del _adopted[name]
                exp.close()
                closed += 1
    return closed


# Adopted device exports, oldest first; and how many there were after the last full sweep
# (collect_except sweeps them only once that many more were added, or when forced).
_device_adopted: list[Export] = []
_device_swept = [0]


def _bind_adopt() -> str | None:
    missing = bind(adopt_signatures(ctypes.POINTER(HandleStruct), ExporterP))
    return (f"leasing PyTorch's own CUDA / NPU tensors needs libdevshare 1.{ADOPT_MINOR} or later "
            f"(devshare_exporter_adopt); the loaded library is {library_version}") if missing else None


_ADOPT_UNAVAILABLE = _bind_adopt()


def adopt_device(h: Handle, keep, key) -> Export:
    """Adopt the reference device handle ``h`` carries (PyTorch's / torch_npu's share of a
    storage in this process: ``devshare_exporter_adopt``) as an :class:`Export`, which holds
    ``keep`` (the storage) until it is closed; ``key`` finds it again (:func:`device_adoption`).
    On failure the handle's reference is the caller's to return."""
    if _ADOPT_UNAVAILABLE:
        raise Error(Status.UNSUPPORTED, _ADOPT_UNAVAILABLE)
    table = None if h.table_inline else h.segment_table
    ptr = ExporterP()
    call(lib.devshare_exporter_adopt, byref(struct_of(h)), table, len(table or b""), 0, byref(ptr))
    exp = Export(ptr, None)  # closes ptr if it fails
    exp.keep, exp.key = keep, key
    _device_adopted.append(exp)
    return exp


def device_adoption(key) -> Export | None:
    """The newest open adopted device export made with ``key``, or None."""
    for exp in reversed(_device_adopted):
        if exp.key == key and not exp.closed:
            return exp
    return None


def _sweep_devices(keep, force: bool) -> int:
    """Close the adopted device exports whose leases all came back (not ``keep``, nor one a
    thread waits on): the library returns PyTorch's reference, then the storage is let go."""
    if not force and len(_device_adopted) < 2 * _device_swept[0] + 8:
        return 0
    closed, live = 0, []
    for exp in _device_adopted:
        if exp is keep or exp.waiters or exp.registered or (not exp.closed and exp.outstanding() > 0):
            live.append(exp)
            continue
        exp.close()
        exp.keep = None
        closed += 1
    _device_adopted[:] = live
    _device_swept[0] = len(live)
    return closed


def sweep_device_adoptions() -> int:
    """Close the adopted device exports whose leases all came back (what a channel's service
    does after taking returns); nothing to do, and no lock taken, when there are none."""
    if not _device_adopted:
        return 0
    with registry_lock:
        return _sweep_devices(None, True)


@atexit.register
def close_all() -> None:
    """At exit, close every adopted export: its ref-counter name goes away with the last holder
    instead of staying in /dev/shm. Consumers elsewhere keep their mappings."""
    with registry_lock:
        for exp in _device_adopted:
            if not exp.waiters and not exp.closed and exp.outstanding() == 0:
                try:
                    exp.close()  # returns PyTorch's reference while torch is still loaded
                except Exception:  # noqa: BLE001 - nothing useful to do at exit
                    pass
        for name, exp in list(_adopted.items()):
            if exp.waiters:
                continue  # a thread still waits on it: leave it to the process exit
            del _adopted[name]
            try:
                exp.close()
            except Exception:  # noqa: BLE001 - nothing useful to do at exit
                pass
