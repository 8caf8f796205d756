"""devshare: share tensors between processes (PyTorch, numpy, C, C++) without copying.

A thin ctypes layer over the devshare C library (libdevshare.so). The producer calls
:func:`share` on a tensor and sends the returned :class:`Handle` (``to_text()`` or
``to_bytes()``) to a consumer, which calls :func:`open` on it and gets a tensor or array over
the same memory. When the consumer drops it, the producer's :func:`outstanding` count goes down.
CUDA and NPU tensors travel as PyTorch's own IPC tuples (:func:`handle_from_torch`,
:func:`torch_args`), so either side may be stock PyTorch / torch_npu.

The library is found through ``DEVSHARE_LIBRARY`` (full path), then the wheel's own copy
(``devshare/_lib/lib/libdevshare.so.1``), then next to this package, then
the build directories of the source checkout this package is imported from, then the system
loader (``libdevshare.so.1``). It must have ABI major version 1 and minor version 0 or later.

Attributes:

- :data:`library_path` (str): where the loaded library came from, exactly as it was passed to
  the loader: a full path (``DEVSHARE_LIBRARY``, next to the package, the checkout's build
  directories) or the bare soname ``"libdevshare.so.1"`` when the system loader found it.
- :data:`library_version` (str): the loaded library's ``devshare_version()`` as
  ``"MAJOR.MINOR.PATCH"`` (this package's own version is ``__version__``).

Where the wheel's C/C++ side is (pybind11's convention; also ``python -m devshare --cmake-dir |
--includes | --libs | --pkgconfig-dir``): :func:`get_cmake_dir` (for ``find_package(devshare)``),
:func:`get_include`, :func:`get_library`, :func:`get_pkgconfig_dir`.

Channels (:class:`Channel`, :func:`connect`, :func:`channel_empty`; libdevshare 1.1 or later)
hand tensors to consumer processes over a Unix socket as leases or pool slots, with
backpressure, and give them back when the consumer releases them or dies: see
:mod:`devshare._channel` for the whole picture.

``from devshare import *`` imports the API without :func:`open`, which would shadow the
builtin; use ``devshare.open``.
"""

# The package's modules, each with one job, in layers (a module imports only modules of lower
# layers; tests/python/test_module_graph.py checks it):
#   _abi, _ints, _paths                  the C ABI's mirrors; integer checks; the wheel's paths
#   _dtypes, _lib                        element types; loading the library and calling it
#   _args, _dlpack, _handle_struct       argument checks; DLPack capsules; a handle struct's extras
#   _torch_tuples, _views                PyTorch IPC tuples <-> handle structs; memory <-> tensors
#   _handle                              the Handle class
#   _registry, _torch_ipc                this process's exporters and imports; device tensors
#   _api                                 share / open / empty / outstanding / wait / discard
#   _channel_lib                         the library's channel functions, bound once
#   _ownership, _channel_memory          one process's objects; channel memory, layouts
#   _leases, _pool                       a received item's import; pools and slots
#   _connection, _producer               the consumer end and its items; Channel
#   _channel                             the channel API's one import point
#   __init__ (this facade), __main__

from . import _lib
from ._lib import (
    TORCH_FORMAT_DEFAULT,
    TORCH_FORMAT_UNVERSIONED,
    TORCH_FORMAT_V1,
    TORCH_FORMAT_V2,
    TORCH_FORMAT_V3,
    Error,
    LibraryNotFoundError,
    Status,
    status_name,
)
from ._paths import get_cmake_dir, get_include, get_library, get_pkgconfig_dir
from ._handle import Handle
from ._torch_tuples import bridge, convert_storage_handle, local_torch_format, torch_format
from ._registry import collect
from ._torch_ipc import allow_ptrace, handle_from_torch, local_pid, storage_tuple, torch_args
from ._api import discard, dlpack_capsule, empty, open, outstanding, share, wait
from ._channel import (
    Channel,
    ChannelClosed,
    Connection,
    Item,
    Pool,
    Slot,
    channel_empty,
    connect,
    release_batch,
)

__version__ = "1.20.0"

#: Where the loaded libdevshare came from, as passed to the loader: a full path, or the bare
#: soname ``"libdevshare.so.1"`` when the system loader found it.
library_path: str = _lib.library_path
#: The loaded library's version, ``"MAJOR.MINOR.PATCH"`` (from ``devshare_version()``).
library_version: str = _lib.version

for _cls in (Error, LibraryNotFoundError, Status, Handle, Channel, ChannelClosed, Connection, Item,
             Pool, Slot):
    _cls.__module__ = __name__
del _cls

# Not "open": ``from devshare import *`` must not shadow the builtin (devshare.open stays).
__all__ = [
    "Channel",
    "ChannelClosed",
    "Connection",
    "Error",
    "Handle",
    "Item",
    "LibraryNotFoundError",
    "Pool",
    "Slot",
    "Status",
    "TORCH_FORMAT_DEFAULT",
    "TORCH_FORMAT_UNVERSIONED",
    "TORCH_FORMAT_V1",
    "TORCH_FORMAT_V2",
    "TORCH_FORMAT_V3",
    "allow_ptrace",
    "bridge",
    "channel_empty",
    "collect",
    "connect",
    "convert_storage_handle",
    "discard",
    "dlpack_capsule",
    "empty",
    "get_cmake_dir",
    "get_include",
    "get_library",
    "get_pkgconfig_dir",
    "handle_from_torch",
    "library_path",
    "library_version",
    "local_pid",
    "local_torch_format",
    "outstanding",
    "release_batch",
    "share",
    "status_name",
    "storage_tuple",
    "torch_args",
    "torch_format",
    "wait",
]
