"""The C ABI of include/devshare.h as ctypes sees it: constants, status codes and struct mirrors.

This module has no dependencies beyond the standard library and loads no library, so that other
code (the real-GPU suite in tests/gpu/gpu_cases.py, the layout test) can load it by file path
without importing the package. :mod:`devshare._lib` re-exports everything here.

Every mirror is checked against the C compiler's view of the header in the normal test run
(tests/python/test_abi_layout.py, with tests/c/layout_dump.c): the set of fields, their order,
every offset and size, sizeof and alignment, and the kind of each field's type. Keep
:data:`STRUCTS`, :data:`C_MACROS` and :class:`Status` complete: a struct, macro or status code
the header has and this module lacks fails that test, and so does a field added on one side only.

Struct conventions (devshare.h): structs that start with ``struct_size`` are versioned. The
caller initialises one with its ``devshare_<struct>_init`` function before use (inputs: then
fills it; outputs: the library writes at most ``struct_size`` bytes). :data:`INIT_FUNCTIONS`
names the init function of each struct.

The channel API (ABI 1.1: channels, leases, pools) adds opaque types and the prototypes of
:func:`channel_signatures`, which devshare._channel_lib binds when the library has them.
"""

from __future__ import annotations

import enum
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

# --- ABI version this package was written for -------------------------------------------------

#: The library ABI this package targets. A library works when its major version equals
#: EXPECTED_MAJOR and its minor version is at least EXPECTED_MINOR (see _lib._version_problem).
EXPECTED_MAJOR = 1
EXPECTED_MINOR = 0

# --- Constants (each is DEVSHARE_<name> in devshare.h; C_MACROS lists them for the test) ----------

MAX_NDIM = 8
KEY_CAPACITY = 128
REF_NAME_CAPACITY = 64
EVENT_HANDLE_SIZE = 64
HANDLE_EXT_CAPACITY = 112
HANDLE_SIZE = 616
HANDLE_LAYOUT_VERSION = 1
#: Largest encoding / text (with its NUL) a 1.0 library writes; a later minor may write longer
#: ones, so callers retry with the length the library reports (see Handle.to_bytes).
HANDLE_MAX_ENCODED_SIZE = 606
HANDLE_MAX_TEXT_SIZE = 819
TORCH_HANDLE_CAPACITY = 128

BACKEND_HOST = 1
BACKEND_ACL = 2
BACKEND_CUDA = 3

HANDLE_FLAG_EVENT = 1
HANDLE_FLAG_INFLIGHT = 2
#: The allocation is a list of equal VMM segments (expandable segments): see the segments record.
HANDLE_FLAG_SEGMENTED = 4
#: Host memory that travels over a channel next to its handle (a sealed memfd, no name): only
#: devshare_connection_recv imports such a handle (ABI 1.1).
HANDLE_FLAG_CHANNEL = 8

# Segmented handles (include/devshare.h; src/handle/segments.rs). The description is an extension
# record of type EXT_SEGMENTS in the handle's ext area: {u64 segment_size; u32 count; u16 kind;
# u16 flags; u32 table_crc32} (little-endian). The table (count records of the kind's size) is in
# the key area when it fits (SEGMENTS_INLINE); otherwise it travels only in the byte/text encoding
# (a section of type EXT_SEGMENTS) and in PyTorch tuples.
EXT_MUST_UNDERSTAND = 0x8000
EXT_SEGMENTS = 0x8001
SEGMENTS_ACL = 1  # one u64 shareable handle per segment (torch_npu)
SEGMENTS_CUDA_FD = 2  # one i32 POSIX fd number, valid in the producer (producer_pid)
SEGMENTS_CUDA_FABRIC = 3  # one 64-byte CUmemFabricHandle
SEGMENTS_INLINE = 1
SEGMENT_GRANULARITY = 2 << 20
MAX_SEGMENTS = 65536

SHARE_INFLIGHT = 1
SHARE_EVENT = 2
EXPORT_NO_PID_CHECK = 1
EXPORT_FABRIC = 2
IMPORT_READ_ONLY = 1
IMPORT_PEER_ACCESS_CALL = 2
IMPORT_NO_PEER_ACCESS = 4
DEVICE_FROM_HANDLE = -1
STORAGE_TO_END = (1 << 64) - 1
CLOSE_FORCE = 1
CLOSE_UNLINK = 2

# Storage-handle formats of PyTorch / torch_npu tuples (ABI 1.2): which bytes to write for arg 7.
#: What 1.0 and 1.1 wrote: cuda 'c' raw (every PyTorch), cuda 'e' version 2 (PyTorch 2.5-2.12),
#: acl version 1 (every torch_npu).
TORCH_FORMAT_DEFAULT = 0
TORCH_FORMAT_V1 = 1  # version byte 1 (torch_npu)
TORCH_FORMAT_V2 = 2  # version byte 2 (PyTorch 2.5-2.12)
TORCH_FORMAT_V3 = 3  # version byte 3 (PyTorch 2.13 and later)
#: The raw 64-byte CUDA handle / 65-byte ACL key (PyTorch <= 2.4; read by every version).
TORCH_FORMAT_UNVERSIONED = 0x100
#: The longest spin Pool.set_spin / Connection.set_spin accept, in microseconds.
MAX_SPIN_US = 1_000_000
#: How items reach a peer (PeerInfo.transport): shared memory on a Unix channel, a remote
#: channel's authenticated connection, or UCX puts.
TRANSPORT_UNIX = 0
TRANSPORT_STREAM = 1
TRANSPORT_UCX = 2
#: Longest name a lease may carry (Channel.send_batch of a dict; ABI 1.11), in bytes of UTF-8.
MAX_NAME_LEN = 1024

#: Python name -> the devshare.h macro it mirrors (checked against the compiled header).
C_MACROS = {name: "DEVSHARE_" + name for name in (
    "MAX_NDIM", "KEY_CAPACITY", "REF_NAME_CAPACITY", "EVENT_HANDLE_SIZE", "HANDLE_EXT_CAPACITY",
    "HANDLE_SIZE", "HANDLE_LAYOUT_VERSION", "HANDLE_MAX_ENCODED_SIZE", "HANDLE_MAX_TEXT_SIZE",
    "TORCH_HANDLE_CAPACITY", "BACKEND_HOST", "BACKEND_ACL", "BACKEND_CUDA", "HANDLE_FLAG_EVENT",
    "HANDLE_FLAG_INFLIGHT", "SHARE_INFLIGHT", "SHARE_EVENT", "EXPORT_NO_PID_CHECK",
    "IMPORT_READ_ONLY", "IMPORT_PEER_ACCESS_CALL", "IMPORT_NO_PEER_ACCESS", "DEVICE_FROM_HANDLE",
    "STORAGE_TO_END", "CLOSE_FORCE", "CLOSE_UNLINK", "HANDLE_FLAG_SEGMENTED", "EXT_MUST_UNDERSTAND",
    "EXT_SEGMENTS", "SEGMENTS_ACL", "SEGMENTS_CUDA_FD", "SEGMENTS_CUDA_FABRIC", "SEGMENTS_INLINE",
    "SEGMENT_GRANULARITY", "MAX_SEGMENTS", "EXPORT_FABRIC", "HANDLE_FLAG_CHANNEL",
    "TORCH_FORMAT_DEFAULT", "TORCH_FORMAT_V1", "TORCH_FORMAT_V2", "TORCH_FORMAT_V3",
    "TORCH_FORMAT_UNVERSIONED", "MAX_SPIN_US", "TRANSPORT_UNIX", "TRANSPORT_STREAM", "TRANSPORT_UCX",
    "MAX_NAME_LEN",
)}


class Status(enum.IntEnum):
    """``DEVSHARE_STATUS_*`` codes (stable: never renumbered)."""

    OK = 0
    NULL_ARGUMENT = -1
    INVALID_ARGUMENT = -2
    BUFFER_TOO_SMALL = -3
    TRUNCATED = -10
    BAD_MAGIC = -11
    UNSUPPORTED_VERSION = -12
    CHECKSUM_MISMATCH = -13
    BAD_TEXT = -14
    BAD_LENGTH = -15
    INVALID_HANDLE = -20
    STORAGE_OUT_OF_BOUNDS = -21
    TENSOR_OUT_OF_BOUNDS = -22
    BAD_NDIM = -23
    BAD_DTYPE = -24
    BAD_KEY = -25
    BAD_SIZE = -26
    WRONG_HOST = -27
    BACKEND_UNAVAILABLE = -30
    UNSUPPORTED = -31
    NOT_FOUND = -32
    OS = -33
    VENDOR = -34
    TIMEOUT = -35
    BUSY = -36
    ALREADY_RELEASED = -37
    MISMATCH = -38
    UNTRUSTED = -39
    #: The other end of a channel is gone, or the channel was closed (channels, ABI 1.1).
    CLOSED = -40
    INTERNAL = -99


# --- C structs (field for field as in devshare.h) ---------------------------------------------------


class DType(Structure):
    """``DevshareDType``."""

    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class TensorDesc(Structure):
    """``DevshareTensorDesc`` (input of ``devshare_exporter_share``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("dtype", DType),
        ("ndim", c_uint32),
        ("flags", c_uint32),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("storage_offset", c_uint64),
        ("storage_size", c_uint64),
        ("tensor_offset", c_int64),
        ("stream", c_void_p),
    ]


class HandleStruct(Structure):
    """``DevshareHandle`` (fixed size, HANDLE_SIZE bytes)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("layout_version", c_uint16),
        ("backend", c_uint16),
        ("flags", c_uint32),
        ("device_index", c_int32),
        ("device_uuid", c_uint8 * 16),
        ("host_id", c_uint8 * 16),
        ("producer_pid", c_int32),
        ("ndim", c_uint32),
        ("alloc_size", c_uint64),
        ("storage_offset", c_uint64),
        ("storage_size", c_uint64),
        ("tensor_offset", c_int64),
        ("dtype", DType),
        ("key_len", c_uint32),
        ("shape", c_int64 * MAX_NDIM),
        ("strides", c_int64 * MAX_NDIM),
        ("key", c_uint8 * KEY_CAPACITY),
        ("ref_slot", c_uint64),
        ("ref_name_len", c_uint32),
        ("reserved0", c_uint32),
        ("ref_name", c_uint8 * REF_NAME_CAPACITY),
        ("event_handle", c_uint8 * EVENT_HANDLE_SIZE),
        ("layout_minor", c_uint16),
        ("ext_len", c_uint16),
        ("reserved1", c_uint32),
        ("ext", c_uint8 * HANDLE_EXT_CAPACITY),
    ]


class ImportOptions(Structure):
    """``DevshareImportOptions`` (input of ``devshare_import``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("flags", c_uint32),
        ("device", c_int32),
        ("reserved", c_uint32),
        ("stream", c_void_p),
    ]


class ImportInfo(Structure):
    """``DevshareImportInfo`` (output of ``devshare_import_info``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("device", c_int32),
        ("data", c_void_p),
        ("storage", c_void_p),
        ("base", c_void_p),
        ("alloc_size", c_uint64),
        ("storage_size", c_uint64),
        ("numel", c_uint64),
        ("element_size", c_uint64),
        ("backend", c_uint16),
        ("read_only", c_uint16),
        ("reserved", c_uint32),
    ]


class ItemStruct(Structure):
    """``DevshareItem`` (output of ``devshare_connection_recv_item``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("reserved", c_uint32),
        ("import", c_void_p),  # DevshareImport * (a keyword: getattr(item, "import"))
        ("pool", c_uint32),
        ("slot", c_uint32),
        ("device", c_int32),
        ("backend", c_uint16),
        ("read_only", c_uint16),
        ("ndim", c_uint32),
        ("dtype", DType),
        ("data", c_void_p),
        ("nbytes", c_uint64),
        ("shape", c_int64 * MAX_NDIM),
        ("strides", c_int64 * MAX_NDIM),
        ("layout_id", c_uint64),  # 1.8; a library before it leaves it 0
        ("name", c_void_p),  # 1.15 (const char *); a library before it leaves it NULL
        ("name_len", c_uint64),  # 1.15
    ]


class RecvArgs(Structure):
    """``DevshareRecvArgs`` (1.8: ``devshare_connection_recv_args``'s one argument)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("timeout_ms", c_int32),
        ("conn", c_void_p),  # DevshareConnection *
        ("release", c_void_p),  # DevshareImport *
        ("item", ItemStruct),
    ]


class BackendInfo(Structure):
    """``DevshareBackendInfo`` (output of ``devshare_probe``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("backend", c_uint16),
        ("usable", c_uint16),
        ("name", c_char * 16),
        ("detail", c_char * 512),
    ]


class TorchArgs(Structure):
    """``DevshareTorchArgs``: the fields of one ``reduce_tensor`` 15-tuple (arg numbers in the
    comments), for ``devshare_handle_from_torch`` and ``devshare_torch_discard``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("backend", c_uint16),
        ("reserved0", c_uint16),
        ("dtype", DType),  # arg 5
        ("ndim", c_uint32),
        ("shape", POINTER(c_int64)),  # arg 1
        ("strides", POINTER(c_int64)),  # arg 2 (NULL: C-contiguous)
        ("tensor_offset", c_int64),  # arg 3, elements
        ("device", c_int32),  # arg 6
        ("producer_pid", c_int32),  # 0: read from a /torch_<pid>_... ref-counter name
        ("handle", POINTER(c_uint8)),  # arg 7
        ("handle_len", c_size_t),
        ("storage_size", c_uint64),  # arg 8, bytes
        ("storage_offset", c_uint64),  # arg 9, bytes
        ("ref_name", POINTER(c_uint8)),  # arg 11
        ("ref_name_len", c_size_t),
        ("ref_slot", c_uint64),  # arg 12
        ("event_handle", POINTER(c_uint8)),  # arg 13
        ("event_handle_len", c_size_t),
        ("event_sync_required", c_uint32),  # arg 14
        ("reserved1", c_uint32),
    ]


class TorchStorage(Structure):
    """``DevshareTorchStorage``: the storage 8-tuple of ``_share_cuda_()`` / ``_share_npu_()``,
    from ``devshare_handle_to_torch``."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("device", c_int32),  # item 0
        ("handle_len", c_uint32),
        ("ref_name_len", c_uint32),
        ("handle", c_uint8 * TORCH_HANDLE_CAPACITY),  # item 1
        ("storage_size", c_uint64),  # item 2
        ("storage_offset", c_uint64),  # item 3
        ("ref_slot", c_uint64),  # item 5
        ("ref_name", c_uint8 * REF_NAME_CAPACITY),  # item 4
        ("event_handle", c_uint8 * EVENT_HANDLE_SIZE),  # item 6
        ("event_sync_required", c_uint32),  # item 7
        ("reserved", c_uint32),
    ]


class PeerInfo(Structure):
    """``DevsharePeerInfo`` (output of ``devshare_channel_peer_info``): a consumer connected to a
    channel, as the kernel vouched for it when it connected (``SO_PEERCRED``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("pid", c_int32),
        ("uid", c_uint32),
        ("gid", c_uint32),
        ("id", c_uint64),  # the channel's id for the peer (> 0)
        ("tgid", c_int32),  # the pid it announced in the handshake
        ("reserved", c_uint32),
        ("leases", c_uint64),  # leases and attached pools it has not given back
        ("protocol_errors", c_uint64),  # its messages the producer refused
        ("transport", c_uint32),  # TRANSPORT_UNIX / _STREAM / _UCX (1.9)
        ("reserved2", c_uint32),
        ("slots", c_uint64),  # pool slots it holds now (1.9)
    ]


# --- Opaque types of the channel API (ABI 1.1) -----------------------------------------------------


class ChannelStruct(Structure):
    """Opaque ``DevshareChannel`` (the producer end of a channel)."""


class ConnectionStruct(Structure):
    """Opaque ``DevshareConnection`` (the consumer end of a channel)."""


class PoolStruct(Structure):
    """Opaque ``DevsharePool`` (fixed slots of one allocation, handed out over a channel)."""


ChannelP = POINTER(ChannelStruct)
ConnectionP = POINTER(ConnectionStruct)
PoolP = POINTER(PoolStruct)

#: The first library minor version with the channel API.
CHANNEL_MINOR = 1


def channel_signatures(exporter_p, import_p) -> list:
    """(name, restype, argtypes) of the channel, lease and pool functions (ABI 1.1; int32 results
    are statuses). ``exporter_p`` / ``import_p`` are the ``POINTER(DevshareExporter)`` and
    ``POINTER(DevshareImport)`` types the rest of the package passes (devshare._lib makes them);
    the test compares the result with devshare.h's prototypes like the package's other
    signatures. They are bound by devshare._channel_lib, not at load time, so that a 1.0 library
    still loads (without channels)."""
    desc = POINTER(TensorDesc)
    return [
        ("devshare_channel_listen", c_int32, [c_char_p, POINTER(ChannelP)]),
        ("devshare_channel_restrict", c_int32,
         [ChannelP, POINTER(c_uint32), c_size_t, POINTER(c_int32), c_size_t]),
        ("devshare_channel_fd", c_int32, [ChannelP]),
        ("devshare_channel_service", c_int32, [ChannelP, c_int32]),
        ("devshare_channel_wait_peers", c_int32, [ChannelP, c_size_t, c_int32]),
        ("devshare_channel_peer_ids", c_int32, [ChannelP, POINTER(c_uint64), c_size_t, POINTER(c_size_t)]),
        ("devshare_channel_peer_info", c_int32, [ChannelP, c_uint64, POINTER(PeerInfo)]),
        ("devshare_channel_send", c_int32, [ChannelP, c_uint64, exporter_p, desc]),
        ("devshare_channel_close", c_int32, [ChannelP]),
        ("devshare_channel_host_alloc", c_int32, [c_uint64, POINTER(exporter_p), POINTER(c_void_p)]),
        ("devshare_pool_create", c_int32, [ChannelP, exporter_p, c_uint64, c_uint32, POINTER(PoolP)]),
        ("devshare_pool_acquire", c_int32, [PoolP, c_int32, POINTER(c_uint32), POINTER(c_void_p)]),
        ("devshare_pool_id", c_int32, [PoolP, POINTER(c_uint32)]),
        ("devshare_pool_send", c_int32, [PoolP, c_uint32, c_uint64, desc]),
        ("devshare_pool_release", c_int32, [PoolP, c_uint32]),
        ("devshare_pool_info", c_int32, [PoolP, POINTER(c_uint64), POINTER(c_uint32), POINTER(c_uint32)]),
        ("devshare_pool_close", c_int32, [PoolP]),
        ("devshare_channel_connect", c_int32, [c_char_p, c_int32, POINTER(ConnectionP)]),
        ("devshare_connection_fd", c_int32, [ConnectionP]),
        ("devshare_connection_info", c_int32, [ConnectionP, POINTER(c_uint64), POINTER(c_int32)]),
        ("devshare_connection_recv", c_int32, [ConnectionP, c_int32, POINTER(import_p)]),
        ("devshare_import_pool_slot", c_int32, [import_p, POINTER(c_uint32), POINTER(c_uint32)]),
        ("devshare_connection_close", c_int32, [ConnectionP]),
        ("devshare_peer_info_init", c_int32, [POINTER(PeerInfo), c_uint32]),
    ]


def channel_signatures_1_2(import_p) -> list:
    """The channel functions 1.2 added (bound when the library has them; without them a peer
    cannot be disconnected on request and :meth:`Item.release` unmaps at once)."""
    return [
        ("devshare_channel_disconnect", c_int32, [ChannelP, c_uint64]),
        ("devshare_channel_trust_announced_pids", c_int32, [ChannelP, c_uint32]),
        ("devshare_import_give_back", c_int32, [import_p]),
    ]


#: The first library minor version with adopted device exports (devshare_exporter_adopt).
ADOPT_MINOR = 4


def adopt_signatures(handle_p, exporter_p) -> list:
    """(name, restype, argtypes) of the 1.4 function that adopts a PyTorch / torch_npu device
    share (bound by devshare._registry when the library has it)."""
    return [
        ("devshare_exporter_adopt", c_int32,
         [handle_p, c_char_p, c_size_t, c_uint32, POINTER(exporter_p)]),
    ]


def channel_signatures_1_4(exporter_p, import_p) -> list:
    """The channel functions 1.4 added: many leases in one call, opt-in spinning, the
    consumer's stream (bound by
    devshare._channel_lib when the library has them; without them a batch is sent one lease at a
    time and spinning is refused)."""
    return [
        ("devshare_channel_send_batch", c_int32,
         [ChannelP, c_uint64, POINTER(exporter_p), POINTER(POINTER(TensorDesc)), c_size_t]),
        ("devshare_pool_set_spin", c_int32, [PoolP, c_uint32]),
        ("devshare_connection_set_spin", c_int32, [ConnectionP, c_uint32]),
        ("devshare_connection_set_stream", c_int32, [ConnectionP, c_void_p]),
        ("devshare_import_describe", c_int32,
         [import_p, POINTER(ImportInfo), POINTER(HandleStruct), POINTER(c_uint32), POINTER(c_uint32)]),
    ]


def channel_signatures_1_7(import_p) -> list:
    """The channel function 1.7 added: a receive that reports the item and releases the
    previous one in the same call (bound by devshare._channel_lib when the library has it; without
    it a receive takes two calls and a release one more)."""
    return [
        ("devshare_item_init", c_int32, [POINTER(ItemStruct), c_uint32]),
        ("devshare_connection_recv_item", c_int32, [ConnectionP, c_int32, import_p, POINTER(ItemStruct)]),
    ]


def channel_signatures_1_8() -> list:
    """The channel functions 1.8 added: the receive of 1.7 with its arguments in one struct
    (one ctypes argument per item instead of four)."""
    return [
        ("devshare_recv_args_init", c_int32, [POINTER(RecvArgs), c_uint32]),
        ("devshare_connection_recv_args", c_int32, [POINTER(RecvArgs)]),
    ]


def channel_signatures_1_10(exporter_p) -> list:
    """The channel functions 1.10 added: registering an export with a channel (its consumers keep
    its allocation mapped between leases) and undoing it."""
    return [
        ("devshare_channel_register", c_int32, [ChannelP, exporter_p]),
        ("devshare_channel_unregister", c_int32, [ChannelP, exporter_p]),
    ]


def channel_signatures_1_11(exporter_p, import_p) -> list:
    """The channel functions 1.11 added: a batch of leases with their names, a received lease's
    name, and a batch received and released in one call each (bound for C callers' parity; the
    package's recv_batch receives item by item, which lets it make each item's view as it
    comes)."""
    return [
        ("devshare_channel_send_named", c_int32,
         [ChannelP, c_uint64, POINTER(exporter_p), POINTER(POINTER(TensorDesc)), POINTER(c_char_p), c_size_t]),
        ("devshare_import_name", c_int32, [import_p, POINTER(c_char_p), POINTER(c_size_t)]),
        ("devshare_connection_recv_batch", c_int32, [ConnectionP, c_int32, POINTER(ItemStruct), c_size_t]),
        ("devshare_items_release", c_int32, [POINTER(ItemStruct), c_size_t]),
    ]


def channel_signatures_1_12() -> list:
    """The channel function 1.12 added: many received imports given back in one call (the
    leases of a connection in one message), by their addresses."""
    return [
        ("devshare_imports_give_back", c_int32, [POINTER(c_void_p), c_size_t]),
    ]


def channel_signatures_1_16() -> list:
    """The channel function 1.16 added: a producer's waits for its leases spin before they
    sleep."""
    return [
        ("devshare_channel_set_spin", c_int32, [ChannelP, c_uint32]),
    ]


#: The first library minor version with the storage-handle formats and the version bridge.
TORCH_FORMAT_MINOR = 2


def torch_format_signatures(handle_p, torch_storage_p) -> list:
    """(name, restype, argtypes) of the storage-handle format functions (ABI 1.2), bound by
    devshare._torch_tuples when the library has them (a 1.0 or 1.1 library still loads and
    writes the default format)."""
    return [
        ("devshare_handle_to_torch_as", c_int32, [handle_p, c_uint32, torch_storage_p]),
        ("devshare_torch_storage_handle_as", c_int32,
         [handle_p, c_char_p, c_size_t, c_uint32, c_void_p, c_size_t, POINTER(c_size_t)]),
        ("devshare_torch_handle_convert", c_int32,
         [c_uint16, c_char_p, c_size_t, c_uint32, c_void_p, c_size_t, POINTER(c_size_t)]),
        ("devshare_torch_format_for_version", c_int32, [c_uint16, c_char_p, POINTER(c_uint32)]),
    ]


#: C struct name -> its mirror. Every struct with fields in devshare.h must be here.
STRUCTS = {
    "DevshareDType": DType,
    "DevshareTensorDesc": TensorDesc,
    "DevshareHandle": HandleStruct,
    "DevshareImportOptions": ImportOptions,
    "DevshareImportInfo": ImportInfo,
    "DevshareBackendInfo": BackendInfo,
    "DevshareTorchArgs": TorchArgs,
    "DevshareTorchStorage": TorchStorage,
    "DevsharePeerInfo": PeerInfo,
    "DevshareItem": ItemStruct,
    "DevshareRecvArgs": RecvArgs,
}

#: Mirror -> the C function that initialises it (struct_size and the defaults). All but
#: devshare_handle_init (DevshareHandle never changes size) take the caller's sizeof as well.
INIT_FUNCTIONS = {
    TensorDesc: "devshare_tensor_desc_init",
    HandleStruct: "devshare_handle_init",
    ImportOptions: "devshare_import_options_init",
    ImportInfo: "devshare_import_info_init",
    BackendInfo: "devshare_backend_info_init",
    TorchArgs: "devshare_torch_args_init",
    TorchStorage: "devshare_torch_storage_init",
    PeerInfo: "devshare_peer_info_init",
    ItemStruct: "devshare_item_init",
    RecvArgs: "devshare_recv_args_init",
}

__all__ = [
    "EXPECTED_MAJOR", "EXPECTED_MINOR", *C_MACROS, "C_MACROS", "Status", *(c.__name__ for c in STRUCTS.values()),
    "STRUCTS", "INIT_FUNCTIONS", "ChannelStruct", "ConnectionStruct", "PoolStruct", "ChannelP",
    "ConnectionP", "PoolP", "CHANNEL_MINOR", "channel_signatures", "channel_signatures_1_2", "TORCH_FORMAT_MINOR",
    "torch_format_signatures", "ADOPT_MINOR", "adopt_signatures", "channel_signatures_1_4",
    "channel_signatures_1_7", "channel_signatures_1_8", "channel_signatures_1_10",
    "channel_signatures_1_11", "channel_signatures_1_12", "channel_signatures_1_16",
]
