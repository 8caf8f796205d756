"""PyTorch / torch_npu device IPC tuples (reduce_tensor's 15 args) <-> devshare handles.

No GPU or NPU is needed: the tuples are synthetic (PyTorch's byte forms), PyTorch's
consumers (rebuild_cuda_tensor, rebuild_npu_tensor) and producer (reduce_tensor) are replaced by
recorders, and "CUDA tensors" are CPU tensors whose device says cuda. The C library still does
every conversion and check.
"""

from __future__ import annotations

import os
import pickle
import sys
import types

import pytest
import torch
import torch.multiprocessing.reductions as reductions

import devshare
import pytorch_reader

RAW_CUDA = bytes(range(64))  # a raw cudaIpcMemHandle_t
ACL_KEY = b"acl-ipc-key-0123456789"  # the C string inside the 65-byte buffer
REF_NAME = b"/torch_4242_1234567_0"
STORAGE_CLS = type(torch.empty(0)._typed_storage())
NO_EVENT = bytes(64)


def cuda_args(handle=RAW_CUDA, **kw) -> tuple:
    """A reduce_tensor 15-tuple for a (2, 3) float32 view at element offset 2 of a 64-byte
    storage that lies 512 bytes into its allocation."""
    f = dict(cls=torch.Tensor, shape=torch.Size([2, 3]), stride=(3, 1), offset=2,
             storage_cls=STORAGE_CLS, dtype=torch.float32, device=1, handle=handle,
             size=64, storage_offset=512, requires_grad=False, ref=REF_NAME, slot=7,
             event=NO_EVENT, sync=False)
    f.update(kw)
    return (f["cls"], f["shape"], f["stride"], f["offset"], f["storage_cls"], f["dtype"],
            f["device"], f["handle"], f["size"], f["storage_offset"], f["requires_grad"],
            f["ref"], f["slot"], f["event"], f["sync"])


def acl_buffer(key=ACL_KEY, garbage=b"\xab\xcd") -> bytes:
    """A 65-byte ACL key buffer: the key, its NUL, then unspecified bytes."""
    buf = key + b"\0" + garbage
    return buf.ljust(65, b"\xee")


def normalized(key=ACL_KEY) -> bytes:
    return key.ljust(65, b"\0")


MIB = 1 << 20
FABRIC = bytes(range(64))  # one CUmemFabricHandle


def npu_e(segment_size: int, handles, count=None) -> bytes:
    """torch_npu's 'e' storage handle: [1]['e'][u64 segment_size][u64 n][n x u64 shareable handle]
    (host-endian; `count` overrides n)."""
    n = len(handles) if count is None else count
    return (bytes([1]) + b"e" + segment_size.to_bytes(8, sys.byteorder) + n.to_bytes(8, sys.byteorder)
            + b"".join(h.to_bytes(8, sys.byteorder) for h in handles))


def cuda_e(pid: int, segment_size: int, count: int, records: bytes, version=2, pad=b"\xde\xad\xbe\xef") -> bytes:
    """PyTorch CUDA's 'e' storage handle: [version]['e'][i32 pid][4 padding bytes, not zeroed by
    PyTorch][u64 segment_size][u64 n][n x i32 fd or n x 64-byte fabric handle]."""
    return (bytes([version]) + b"e" + pid.to_bytes(4, sys.byteorder, signed=True) + pad
            + segment_size.to_bytes(8, sys.byteorder) + count.to_bytes(8, sys.byteorder) + records)


def fds(numbers) -> bytes:
    return b"".join(f.to_bytes(4, sys.byteorder, signed=True) for f in numbers)


def cuda_e3(pid: int, segment_size: int, count: int, handle_type: int, records: bytes,
            pads=(b"\x11\x22\x33\x44", b"\x55\x66\x77\x88")) -> bytes:
    """PyTorch 2.13+ CUDA 'e' handle: [3]['e'][i32 pid][4 pad][u64 segment_size][u64 n]
    [i32 handle_type][4 pad][records]."""
    return (bytes([3]) + b"e" + pid.to_bytes(4, sys.byteorder, signed=True) + pads[0]
            + segment_size.to_bytes(8, sys.byteorder) + count.to_bytes(8, sys.byteorder)
            + handle_type.to_bytes(4, sys.byteorder, signed=True) + pads[1] + records)


def same_cuda_e(a: bytes, b: bytes) -> bool:
    """Two CUDA 'e' handles are the same but for the padding (never compare them bytewise)."""
    return a[:6] == b[:6] and a[10:] == b[10:]


def status_error(args, backend="cuda") -> devshare.Error:
    with pytest.raises(devshare.Error) as info:
        devshare.handle_from_torch(args, backend)
    return info.value


class RefCounterObject:
    """A real ref-counter object in PyTorch's layout (/dev/shm, a 64-byte header whose int32
    mapping count is 1 for its producer, then 10000 int64 slots) with one slot set to 1, as
    reduce_tensor leaves it; ``slot_value()`` reads the slot back."""

    def __init__(self, slot):
        self.slot = slot
        # PyTorch's name form (/torch_<pid>_<digits>_<digits>) and mode (0600): devshare opens
        # nothing else.
        self.name = f"/torch_{os.getpid()}_{int.from_bytes(os.urandom(4), 'little')}_{slot}".encode()
        self.path = "/dev/shm/" + self.name[1:].decode()
        buf = bytearray(64 + 8 * 10000)
        buf[0:4] = (1).to_bytes(4, "little")
        buf[64 + 8 * slot:72 + 8 * slot] = (1).to_bytes(8, "little")
        with os.fdopen(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as f:
            f.write(buf)

    def slot_value(self) -> int:
        with open(self.path, "rb") as f:
            f.seek(64 + 8 * self.slot)
            return int.from_bytes(f.read(8), "little", signed=True)

    def remove(self):
        os.unlink(self.path)


@pytest.fixture
def ref_counter():
    rc = RefCounterObject(slot=5)
    yield rc
    rc.remove()


# --- tuple -> handle: PyTorch (cuda) ----------------------------------------------------------------


def test_cuda_raw_64_byte_handle_gives_a_cuda_handle_with_every_tuple_field():
    h = devshare.handle_from_torch(cuda_args())
    assert isinstance(h, devshare.Handle)
    assert h.backend == "cuda" and h.backend_id == 3
    assert h.device_index == 1
    assert h.key == RAW_CUDA
    assert h.storage_offset == 512 and h.storage_size == 64
    assert h.alloc_size == 512 + 64  # the tuple does not carry the allocation's size
    assert h.ref_name == REF_NAME and h.ref_slot == 7
    assert h.producer_pid == 4242  # from /torch_<pid>_...
    assert h.flags == 0 and not h.inflight
    assert h.shape == (2, 3) and h.strides == (3, 1) and h.tensor_offset == 2
    assert h.dtype == (2, 32, 1) and h.torch_dtype() is torch.float32


@pytest.mark.parametrize("version", [1, 2, 3])
def test_cuda_versioned_c_handle_of_versions_1_to_3_gives_the_raw_ipc_handle_as_key(version):
    h = devshare.handle_from_torch(cuda_args(bytes([version]) + b"c" + RAW_CUDA))
    assert h.key == RAW_CUDA and h.backend == "cuda"


def test_cuda_handle_version_4_is_refused_with_an_error_naming_the_version():
    e = status_error(cuda_args(bytes([4]) + b"c" + RAW_CUDA))
    assert e.status == devshare.Status.UNSUPPORTED_VERSION
    assert "version 4" in e.message


def test_cuda_handle_of_65_bytes_is_refused_as_a_bad_key():
    e = status_error(cuda_args(RAW_CUDA + b"\0"))
    assert e.status == devshare.Status.BAD_KEY and "65 bytes" in e.message


def test_cuda_versioned_handle_cut_short_is_refused_as_a_bad_key():
    e = status_error(cuda_args(bytes([2]) + b"c" + RAW_CUDA[:63]))
    assert e.status == devshare.Status.BAD_KEY


def test_cuda_event_sync_required_copies_the_event_and_sets_the_event_flag():
    event = bytes(range(100, 164))
    h = devshare.handle_from_torch(cuda_args(event=event, sync=True))
    assert h.flags & 1
    args = devshare.torch_args(h)
    assert args[13] == event and args[14] is True


def test_ref_counter_name_without_a_pid_leaves_producer_pid_unknown():
    assert devshare.handle_from_torch(cuda_args(ref=b"/devshare_rc_abc")).producer_pid == 0
    h = devshare.handle_from_torch(cuda_args(ref=b"", slot=None))
    assert h.producer_pid == 0 and h.ref_name == b""


def test_explicit_producer_pid_wins_over_the_ref_counter_name():
    assert devshare.handle_from_torch(cuda_args(), "cuda", producer_pid=99).producer_pid == 99


def test_reduce_tensor_pair_and_handle_classmethod_give_the_same_handle():
    args = cuda_args()
    h = devshare.handle_from_torch(args)
    assert devshare.handle_from_torch((reductions.rebuild_cuda_tensor, args)) == h
    assert devshare.Handle.from_torch_args(args, backend="cuda") == h


def test_handle_from_a_cuda_tuple_survives_bytes_and_text_round_trips():
    h = devshare.handle_from_torch(cuda_args(event=bytes(range(64)), sync=True))
    assert devshare.Handle.from_bytes(h.to_bytes()) == h
    assert devshare.Handle.from_text(h.to_text()) == h


def test_empty_storage_with_handle_none_raises_value_error_naming_the_empty_storage():
    with pytest.raises(ValueError, match="empty storage"):
        devshare.handle_from_torch(cuda_args(handle=None, size=0, ref=None, slot=None))


def test_tuple_with_more_than_8_dimensions_raises():
    with pytest.raises(ValueError, match="maximum of 8"):
        devshare.handle_from_torch(cuda_args(shape=torch.Size([1] * 9), stride=(1,) * 9, offset=0))


def test_tensor_reaching_past_its_storage_is_refused():
    e = status_error(cuda_args(shape=torch.Size([4, 5]), stride=(5, 1)))
    assert e.status == devshare.Status.TENSOR_OUT_OF_BOUNDS


def test_malformed_tuples_raise_type_or_value_errors_before_the_library():
    with pytest.raises(ValueError, match="15 args"):
        devshare.handle_from_torch(cuda_args()[:14])
    with pytest.raises(ValueError, match="backend"):
        devshare.handle_from_torch(cuda_args(), "rocm")
    with pytest.raises(TypeError, match="storage handle"):
        devshare.handle_from_torch(cuda_args(handle=RAW_CUDA.hex()))
    with pytest.raises(TypeError, match="ref-counter name"):
        devshare.handle_from_torch(cuda_args(ref="/torch_1_2_3"))
    with pytest.raises(ValueError, match="storage size"):
        devshare.handle_from_torch(cuda_args(size=-1))
    with pytest.raises(ValueError, match="device"):
        devshare.handle_from_torch(cuda_args(device=-1))
    with pytest.raises(TypeError, match="unsupported dtype"):
        devshare.handle_from_torch(cuda_args(dtype="not-a-dtype"))


# --- tuple -> handle: torch_npu (acl) ---------------------------------------------------------------


def test_npu_67_byte_c_handle_gives_the_key_cut_at_its_nul_and_zero_filled():
    h = devshare.handle_from_torch(cuda_args(bytes([1]) + b"c" + acl_buffer()), "npu")
    assert h.backend == "acl" and h.backend_id == 2
    assert h.key == normalized()
    assert h.device_index == 1 and h.storage_offset == 512 and h.storage_size == 64
    assert h.alloc_size == 576 and h.ref_name == REF_NAME and h.ref_slot == 7
    assert h.producer_pid == 4242 and h.flags == 0
    assert h.shape == (2, 3) and h.strides == (3, 1) and h.tensor_offset == 2


def test_npu_legacy_65_byte_key_is_accepted_and_normalized():
    h = devshare.handle_from_torch(cuda_args(acl_buffer()), "npu")
    assert h.key == normalized()
    assert devshare.handle_from_torch(cuda_args(acl_buffer()), "acl") == h


def test_npu_handle_version_2_is_refused_naming_the_version():
    e = status_error(cuda_args(bytes([2]) + b"c" + acl_buffer()), "npu")
    assert e.status == devshare.Status.UNSUPPORTED_VERSION and "version 2" in e.message


def test_npu_key_without_a_nul_in_its_65_bytes_is_refused():
    e = status_error(cuda_args(bytes([1]) + b"c" + b"k" * 65), "npu")
    assert e.status == devshare.Status.BAD_KEY and "NUL" in e.message


def test_npu_event_sync_required_with_a_63_byte_event_is_refused():
    e = status_error(cuda_args(acl_buffer(), event=bytes(63), sync=True), "npu")
    assert "63 bytes" in e.message


def test_npu_event_not_required_accepts_8_garbage_bytes_and_sets_no_event_flag():
    h = devshare.handle_from_torch(cuda_args(acl_buffer(), event=b"\x99" * 8, sync=False), "npu")
    assert h.flags == 0
    args = devshare.torch_args(h)
    assert args[13] == NO_EVENT and args[14] is False


# --- tuple -> handle: expandable segments ('e') -------------------------------------------------------

SEGMENTED = devshare._abi.HANDLE_FLAG_SEGMENTED


def test_npu_e_handle_gives_a_segmented_handle_with_the_storage_relative_to_the_first_segment():
    handles = [0x1111, 0x2222, 0x3333]
    h = devshare.handle_from_torch(cuda_args(npu_e(20 * MIB, handles), size=30 * MIB,
                                             storage_offset=25 * MIB, shape=torch.Size([4]),
                                             stride=(1,), offset=0), "npu")
    assert h.backend == "acl" and h.segmented and h.flags == SEGMENTED
    assert (h.segment_kind, h.segment_size, h.segment_count) == ("acl", 20 * MIB, 3)
    assert h.segments == tuple(handles) and h.table_inline
    assert h.segment_table == b"".join(x.to_bytes(8, "little") for x in handles) == h.key
    assert h.alloc_size == 60 * MIB  # count x segment_size
    assert (h.storage_offset, h.storage_size) == (25 * MIB, 30 * MIB)
    assert h.device_index == 1 and h.ref_name == REF_NAME and h.ref_slot == 7
    assert h.producer_pid == 4242  # torch_npu's 'e' form has no pid: from the ref-counter name
    # And back: stock torch_npu gets exactly the bytes it sent.
    assert devshare.torch_args(h)[7] == npu_e(20 * MIB, handles)


def test_cuda_v2_e_handle_with_fds_and_garbage_padding_gives_the_headers_pid_and_the_fds():
    e = cuda_e(31337, 2 * MIB, 3, fds([17, 18, 40]))
    h = devshare.handle_from_torch(cuda_args(e, storage_offset=4096, size=MIB, shape=torch.Size([4]),
                                             stride=(1,), offset=0))
    assert h.backend == "cuda" and h.segmented and h.segment_kind == "cuda_fd"
    assert h.segments == (17, 18, 40) and h.segment_size == 2 * MIB and h.alloc_size == 6 * MIB
    assert h.producer_pid == 31337  # the header's pid wins over the ref-counter name's 4242
    back = devshare.torch_args(h, format=devshare.TORCH_FORMAT_V2)[7]
    assert same_cuda_e(back, e) and back[6:10] == bytes(4)  # written back with zeroed padding


def test_cuda_v2_e_handle_with_fabric_records_is_told_apart_by_its_length():
    other = bytes(range(64, 128))
    e = cuda_e(31337, 2 * MIB, 2, FABRIC + other, pad=b"\xff" * 4)
    h = devshare.handle_from_torch(cuda_args(e, storage_offset=0, size=4 * MIB, shape=torch.Size([4]),
                                             stride=(1,), offset=0))
    assert h.segment_kind == "cuda_fabric" and h.segments == (FABRIC, other) and h.table_inline
    # The default format (what 1.1 wrote) keeps version 2 with fabric records; a torch 2.13+
    # consumer gets version 3, whose header names the type.
    assert same_cuda_e(devshare.torch_args(h, format=devshare.TORCH_FORMAT_DEFAULT)[7], e)
    v3 = devshare.torch_args(h, format="2.13")[7]
    assert pytorch_reader.read(3, v3) == ("e", 31337, 2 * MIB, True, FABRIC + other)


# (kind, records for n segments, the largest n whose table fits the 128-byte key area)
SEGMENT_FORMS = {
    "acl": (lambda n: npu_e(20 * MIB, [0xA000 + i for i in range(n)]), "npu", 16),
    "cuda_fd": (lambda n: cuda_e(31337, 20 * MIB, n, fds(range(100, 100 + n))), "cuda", 32),
    "cuda_fabric": (lambda n: cuda_e(31337, 20 * MIB, n, b"".join(bytes([i % 256]) * 64 for i in range(n))),
                    "cuda", 2),
}


@pytest.mark.parametrize("kind", sorted(SEGMENT_FORMS))
@pytest.mark.parametrize("n", [1, 16, 17, 4096])
def test_e_tables_of_1_16_17_and_4096_segments_round_trip_through_bytes_and_text(kind, n):
    make, backend, inline_max = SEGMENT_FORMS[kind]
    e = make(n)
    # The storage lies in the last two segments: offsets count from the first segment.
    offset = (n - 1) * 20 * MIB + 4096 if n > 1 else 4096
    h = devshare.handle_from_torch(cuda_args(e, storage_offset=offset, size=4096, shape=torch.Size([4]),
                                             stride=(1,), offset=0), backend)
    assert (h.segment_kind, h.segment_count, h.segment_size) == (kind, n, 20 * MIB)
    assert h.alloc_size == n * 20 * MIB and h.storage_offset == offset
    assert h.table_inline == (n <= inline_max)
    assert h.key == (h.segment_table if n <= inline_max else b"")
    records = e[18:] if kind == "acl" else e[26:]
    assert h.segment_table == records  # devshare's table: little-endian, like the wire on x86
    data, text = h.to_bytes(), h.to_text()
    assert len(data) > len(records) and text.startswith("devshare1:")
    for back in (devshare.Handle.from_bytes(data), devshare.Handle.from_text(text),
                 devshare.Handle.parse(data), devshare.Handle.parse(text), pickle.loads(pickle.dumps(h))):
        assert back == h and back.segments == h.segments and back.table_inline == h.table_inline
        assert back.to_bytes() == data and back.to_text() == text
        wire = devshare.torch_args(back, format=devshare.TORCH_FORMAT_DEFAULT)[7]
        assert wire == e if kind == "acl" else same_cuda_e(wire, e)


def test_a_long_table_handle_keeps_its_encoding_and_the_struct_alone_cannot_make_one():
    h = devshare.handle_from_torch(cuda_args(SEGMENT_FORMS["acl"][0](17), storage_offset=0, size=4096,
                                             shape=torch.Size([4]), stride=(1,), offset=0), "npu")
    assert not h.table_inline and "table in the encoding" in repr(h)
    with pytest.raises(ValueError, match="byte encoding"):
        devshare.Handle(h._h)
    # The struct alone does not encode (the table is not in it): the library says so.
    with pytest.raises(devshare.Error, match="not inline"):
        h._write(devshare._lib.lib.devshare_handle_encode, 606, 0)
    # A damaged table is refused by its checksum.
    data = bytearray(h.to_bytes())
    data[-10] ^= 1
    with pytest.raises(devshare.Error) as info:
        devshare.Handle.from_bytes(bytes(data))
    assert info.value.status == devshare.Status.CHECKSUM_MISMATCH


# (backend, storage handle, storage_offset, status, words in the message)
MALFORMED_E = [
    ("zero segments (acl)", "npu", npu_e(20 * MIB, []), 0, devshare.Status.INVALID_HANDLE, "zero segments"),
    ("zero segments (cuda)", "cuda", cuda_e(9, 2 * MIB, 0, b""), 0, devshare.Status.INVALID_HANDLE, "zero segments"),
    ("count/length mismatch (acl)", "npu", npu_e(20 * MIB, [1], count=2), 0, devshare.Status.BAD_LENGTH,
     "says 2 segments"),
    ("count/length mismatch (cuda)", "cuda", cuda_e(9, 2 * MIB, 3, fds([1, 2])), 0, devshare.Status.BAD_LENGTH,
     "neither 12"),
    ("header cut short", "npu", bytes([1]) + b"e" + bytes(8), 0, devshare.Status.BAD_LENGTH, "inside its header"),
    ("segment size 0", "npu", npu_e(0, [1]), 0, devshare.Status.BAD_SIZE, "granularity"),
    ("segment size not a multiple of 2 MiB", "cuda", cuda_e(9, 3 * MIB, 1, fds([5])), 0, devshare.Status.BAD_SIZE,
     "granularity"),
    ("n x segment_size overflows", "npu", npu_e(1 << 62, [1, 2, 3]), 0, devshare.Status.BAD_SIZE, "overflows"),
    ("more segments than the maximum", "npu", npu_e(2 * MIB, [1] * 65537), 0, devshare.Status.BAD_SIZE,
     "above the maximum"),
    ("storage past the last segment", "npu", npu_e(2 * MIB, [1]), 2 * MIB - 32, devshare.Status.STORAGE_OUT_OF_BOUNDS,
     "exceeds alloc_size"),
    ("negative fd", "cuda", cuda_e(9, 2 * MIB, 2, fds([5, -1])), 0, devshare.Status.INVALID_HANDLE,
     "fd -1 is negative"),
    ("pid 0", "cuda", cuda_e(0, 2 * MIB, 1, fds([5])), 0, devshare.Status.INVALID_HANDLE, "pid 0"),
    ("CUDA 'e' version 1", "cuda", cuda_e(9, 2 * MIB, 1, fds([5]), version=1), 0,
     devshare.Status.UNSUPPORTED_VERSION, "version 1"),
    ("CUDA 'e' version 4", "cuda", cuda_e(9, 2 * MIB, 1, fds([5]), version=4), 0,
     devshare.Status.UNSUPPORTED_VERSION, "version 4"),
    ("CUDA 'e' version 3, unknown handle type", "cuda", cuda_e3(9, 2 * MIB, 1, 3, fds([5])), 0,
     devshare.Status.INVALID_HANDLE, "handle type 3"),
    ("CUDA 'e' version 3, type disagrees with the records", "cuda", cuda_e3(9, 2 * MIB, 1, 2, fds([5])), 0,
     devshare.Status.BAD_LENGTH, "handle type 2 (fabric records)"),
    ("CUDA 'e' version 3 with a version-2 header", "cuda", cuda_e(9, 2 * MIB, 1, b"", version=3), 0,
     devshare.Status.BAD_LENGTH, "32 needed"),
    ("torch_npu 'e' version 2", "npu", bytes([2]) + npu_e(2 * MIB, [1])[1:], 0, devshare.Status.UNSUPPORTED_VERSION,
     "version 2"),
]


@pytest.mark.parametrize("backend, e, storage_offset, status, words", [m[1:] for m in MALFORMED_E],
                         ids=[m[0] for m in MALFORMED_E])
def test_every_malformed_e_form_gets_its_own_status_and_message(backend, e, storage_offset, status, words):
    err = status_error(cuda_args(e, storage_offset=storage_offset, size=64), backend)
    assert err.status == status, err
    assert words in err.message, err.message


def test_cuda_e_versions_1_and_4_are_refused_by_name():
    err = status_error(cuda_args(cuda_e(9, 2 * MIB, 1, fds([5]), version=1), storage_offset=0))
    assert "version 1" in err.message and "not known" in err.message
    err = status_error(cuda_args(cuda_e(9, 2 * MIB, 1, fds([5]), version=4), storage_offset=0))
    assert "version 4" in err.message and "versions 2 and 3" in err.message


@pytest.mark.parametrize("kind, records, handle_type", [
    ("cuda_fd", fds([17, 18, 40]), 1), ("cuda_fd", fds([17, 18, 40]), 0),
    ("cuda_fabric", FABRIC * 3, 2), ("cuda_fabric", FABRIC * 3, 0)])
def test_cuda_v3_e_handles_with_garbage_padding_give_the_same_handle_as_v2(kind, records, handle_type):
    v3 = cuda_e3(31337, 2 * MIB, 3, handle_type, records)
    v2 = cuda_e(31337, 2 * MIB, 3, records)
    a = dict(storage_offset=4096, size=MIB, shape=torch.Size([4]), stride=(1,), offset=0)
    h3, h2 = devshare.handle_from_torch(cuda_args(v3, **a)), devshare.handle_from_torch(cuda_args(v2, **a))
    assert h3 == h2 and h3.segment_kind == kind and h3.producer_pid == 31337
    # Written back for a torch 2.13+ consumer: what that consumer's reader makes of it.
    back = devshare.torch_args(h3, format="2.13.0")[7]
    assert back[:2] == b"\x03e" and back[6:10] == bytes(4) and back[30:34] == bytes(4)
    want = pytorch_reader.read(3, v3, fabric_config=(kind == "cuda_fabric" and handle_type == 0))
    assert pytorch_reader.read(3, back) == want


def test_the_default_format_is_the_installed_torchs():
    own = pytorch_reader.own_version(torch.__version__)
    assert devshare.local_torch_format() == devshare.torch_format(torch.__version__) == own
    assert devshare.local_torch_format("npu") == devshare.TORCH_FORMAT_V1
    h = devshare.handle_from_torch(cuda_args(cuda_e(31337, 2 * MIB, 1, fds([9])), storage_offset=0,
                                             size=4096))
    wire = devshare.torch_args(h)[7]
    assert wire[0] == own and pytorch_reader.read(own, wire)[1:] == (31337, 2 * MIB, False, fds([9]))
    assert devshare.storage_tuple(h)[1] == wire


def test_format_arguments_are_checked():
    h = devshare.handle_from_torch(cuda_args(cuda_e(31337, 2 * MIB, 1, FABRIC), storage_offset=0, size=4096))
    with pytest.raises(devshare.Error) as info:
        devshare.torch_args(h, format=devshare.TORCH_FORMAT_V2)  # fabric: version 2 cannot say so
    assert info.value.status == devshare.Status.UNSUPPORTED and "no handle type" in info.value.message
    with pytest.raises(devshare.Error) as info:
        devshare.storage_tuple(h, format=7)
    assert info.value.status == devshare.Status.INVALID_ARGUMENT
    with pytest.raises(devshare.Error) as info:
        devshare.storage_tuple(h, format="latest")
    assert info.value.status == devshare.Status.INVALID_ARGUMENT
    with pytest.raises(TypeError):
        devshare.storage_tuple(h, format=2.0)
    with pytest.raises(devshare.Error) as info:
        devshare.storage_tuple(h, format="2.4.1")  # PyTorch <= 2.4: no expandable-segment IPC
    assert info.value.status == devshare.Status.UNSUPPORTED


# --- the version bridge -------------------------------------------------------------------------------


def test_bridge_takes_a_torch_2_13_tuple_to_torch_2_11_and_back():
    v3 = cuda_e3(31337, 20 * MIB, 2, 1, fds([5, 6]))
    args = cuda_args(v3, storage_offset=0, size=4096)
    for_211 = devshare.bridge(args, to="2.11.0+cu128")
    assert for_211[:7] == args[:7] and for_211[8:] == args[8:]  # only the storage handle changes
    assert pytorch_reader.read(2, for_211[7]) == pytorch_reader.read(3, v3)
    with pytest.raises(pytorch_reader.TorchRefused, match="future version"):
        pytorch_reader.read(2, v3)  # what torch 2.11 does without the bridge
    back = devshare.bridge(for_211, to=devshare.TORCH_FORMAT_V3)
    assert pytorch_reader.read(3, back[7]) == pytorch_reader.read(3, v3)
    # The (rebuild, args) pair and the 8-tuple keep their shape; no handle (empty storage) passes.
    fn, pair_args = devshare.bridge((reductions.rebuild_cuda_tensor, args), to=2)
    assert fn is reductions.rebuild_cuda_tensor and pair_args == for_211
    eight = args[6:10] + args[11:]
    assert devshare.bridge(eight, to=2) == for_211[6:10] + for_211[11:]
    empty = args[:7] + (None,) + args[8:]
    assert devshare.bridge(empty, to=2) == empty
    with pytest.raises(ValueError, match="15 args"):
        devshare.bridge(args[:5], to=2)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_bridge_c_handles_of_each_version_to_each_version_and_raw(version):
    key = bytes(range(64))
    c = bytes([version]) + b"c" + key
    for to in (1, 2, 3):
        assert devshare.convert_storage_handle(c, to) == bytes([to]) + b"c" + key
    assert devshare.convert_storage_handle(c, devshare.TORCH_FORMAT_UNVERSIONED) == key
    assert devshare.convert_storage_handle(key, "2.4.0") == key
    assert devshare.convert_storage_handle(key, version) == c


def test_bridge_keeps_torch_npu_handles_and_refuses_what_the_target_cannot_say():
    e = npu_e(20 * MIB, [0x11, 0x22])
    assert devshare.convert_storage_handle(e, 1, backend="npu") == e
    c = bytes([1]) + b"c" + acl_buffer()
    assert devshare.convert_storage_handle(c, 1, backend="npu") == bytes([1]) + b"c" + normalized()
    for to in (2, 3):
        with pytest.raises(devshare.Error) as info:
            devshare.convert_storage_handle(e, to, backend="npu")
        assert info.value.status == devshare.Status.UNSUPPORTED
    fabric_v3 = cuda_e3(31337, 2 * MIB, 1, 2, FABRIC)
    with pytest.raises(devshare.Error, match="no handle type"):
        devshare.convert_storage_handle(fabric_v3, 2)
    with pytest.raises(devshare.Error) as info:
        devshare.convert_storage_handle(cuda_e(9, 2 * MIB, 1, fds([5]), version=4), 3)
    assert info.value.status == devshare.Status.UNSUPPORTED_VERSION


# --- handle -> tuple --------------------------------------------------------------------------------


def test_torch_args_of_a_raw_cuda_handle_give_back_the_original_storage_fields_and_types():
    original = cuda_args(event=bytes(range(64)), sync=True)
    args = devshare.torch_args(devshare.handle_from_torch(original))
    assert len(args) == 15
    assert args[0] is torch.Tensor and args[4] is STORAGE_CLS
    assert args[1] == torch.Size([2, 3]) and isinstance(args[1], torch.Size)
    assert tuple(args[2]) == (3, 1) and args[3] == 2 and args[5] is torch.float32
    assert args[10] is False
    storage = lambda a: a[6:10] + a[11:15]  # noqa: E731 - the 8-tuple of _share_cuda_()
    assert storage(args) == storage(original)
    for i in (7, 11, 13):
        assert type(args[i]) is bytes
    assert type(args[14]) is bool
    for i in (3, 6, 8, 9, 12):
        assert type(args[i]) is int


def test_torch_args_of_a_versioned_cuda_handle_give_the_raw_64_byte_form():
    args = devshare.torch_args(devshare.handle_from_torch(cuda_args(bytes([2]) + b"c" + RAW_CUDA)))
    assert args[7] == RAW_CUDA


def test_torch_args_of_an_acl_handle_give_the_67_byte_c_form_with_the_normalized_key():
    for handle in (acl_buffer(), bytes([1]) + b"c" + acl_buffer()):
        args = devshare.handle_from_torch(cuda_args(handle), "npu").torch_args()
        assert args[7] == bytes([1]) + b"c" + normalized() and len(args[7]) == 67


def test_torch_args_device_replaces_the_producers_device_index():
    h = devshare.handle_from_torch(cuda_args(device=1))
    assert devshare.torch_args(h)[6] == 1
    assert devshare.torch_args(h, device=0)[6] == 0


def test_torch_args_of_a_host_handle_are_refused():
    t = devshare.empty(4, "float32")
    h = devshare.share(t)
    try:
        with pytest.raises(devshare.Error) as info:
            devshare.torch_args(h)
        assert info.value.status == devshare.Status.UNSUPPORTED
    finally:
        devshare.open(h)  # return the in-flight reference


# --- open() -----------------------------------------------------------------------------------------


class Recorder:
    """Stands in for rebuild_cuda_tensor / rebuild_npu_tensor."""

    def __init__(self):
        self.calls = []
        self.result = object()

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def test_open_of_a_cuda_handle_calls_rebuild_cuda_tensor_with_bytes_bool_and_ints(monkeypatch):
    rebuild = Recorder()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = devshare.handle_from_torch(cuda_args(bytes([2]) + b"c" + RAW_CUDA))
    assert devshare.open(h) is rebuild.result
    (args,) = rebuild.calls
    assert args == devshare.torch_args(h)
    assert args[7] == RAW_CUDA and args[11] == REF_NAME and args[12] == 7
    assert [type(args[i]) for i in (7, 11, 13)] == [bytes] * 3
    assert type(args[14]) is bool and args[10] is False
    assert all(type(args[i]) is int for i in (3, 6, 8, 9, 12))


def test_open_accepts_a_cuda_handle_as_text_or_bytes(monkeypatch):
    rebuild = Recorder()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = devshare.handle_from_torch(cuda_args())
    devshare.open(h.to_text())
    devshare.open(h.to_bytes())
    assert rebuild.calls == [devshare.torch_args(h)] * 2


def test_open_of_a_device_handle_refuses_numpy_and_read_only(monkeypatch):
    rebuild = Recorder()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = devshare.handle_from_torch(cuda_args())
    with pytest.raises(ValueError, match="torch tensors only"):
        devshare.open(h, like="numpy")
    with pytest.raises(ValueError, match="read_only"):
        devshare.open(h, read_only=True)
    assert rebuild.calls == []


def test_a_zero_byte_cuda_storage_is_refused_because_pytorch_would_never_return_its_reference():
    # PyTorch's consumers build an empty storage for 0 bytes and never touch the ref-counter.
    err = status_error(cuda_args(shape=torch.Size([0]), stride=(1,), offset=0, size=0, slot=3))
    assert err.status_name == "DEVSHARE_STATUS_INVALID_ARGUMENT" and "0 bytes" in str(err)


def test_open_of_a_cuda_handle_leaves_the_release_to_pytorchs_consumer(monkeypatch, ref_counter):
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", Recorder())
    devshare.open(devshare.handle_from_torch(cuda_args(ref=ref_counter.name, slot=ref_counter.slot)))
    assert ref_counter.slot_value() == 1


def fake_torch_npu(monkeypatch, rebuild=None) -> types.ModuleType:
    """Install a stand-in torch_npu (with torch_npu.multiprocessing.reductions if rebuild)."""
    npu = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    if rebuild is not None:
        mp = types.ModuleType("torch_npu.multiprocessing")
        red = types.ModuleType("torch_npu.multiprocessing.reductions")
        red.rebuild_npu_tensor = rebuild
        npu.multiprocessing, mp.reductions = mp, red
        monkeypatch.setitem(sys.modules, "torch_npu.multiprocessing", mp)
        monkeypatch.setitem(sys.modules, "torch_npu.multiprocessing.reductions", red)
    return npu


def test_open_of_an_acl_handle_calls_torch_npus_rebuild_npu_tensor_with_the_67_byte_handle(monkeypatch):
    rebuild = Recorder()
    fake_torch_npu(monkeypatch, rebuild)
    h = devshare.handle_from_torch(cuda_args(acl_buffer()), "npu")
    assert devshare.open(h) is rebuild.result
    (args,) = rebuild.calls
    assert args[7] == bytes([1]) + b"c" + normalized() and type(args[14]) is bool


def test_open_of_an_acl_handle_without_torch_npu_raises_import_error_naming_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu fails
    h = devshare.handle_from_torch(cuda_args(acl_buffer()), "npu")
    with pytest.raises(ImportError, match="torch_npu"):
        devshare.open(h)


# --- share() ----------------------------------------------------------------------------------------


def on_device(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A CPU tensor whose .device says `kind` (so share() takes the device path)."""

    class DeviceTensor(torch.Tensor):
        @property
        def device(self):
            return types.SimpleNamespace(type=kind, index=0)

    return t.as_subclass(DeviceTensor)


class FakeReduce:
    """Stands in for reduce_tensor: describes the tensor with the given storage handle."""

    def __init__(self, handle=RAW_CUDA, ref=REF_NAME, slot=7, rebuild=reductions.rebuild_cuda_tensor):
        self.handle, self.ref, self.slot, self.rebuild = handle, ref, slot, rebuild
        self.seen = []

    def __call__(self, t):
        self.seen.append(t)
        nbytes = t.untyped_storage().nbytes()
        return self.rebuild, (type(t), t.size(), t.stride(), t.storage_offset(), STORAGE_CLS,
                              t.dtype, 0, self.handle if nbytes else None, nbytes, 256, t.requires_grad,
                              self.ref if nbytes else None, self.slot if nbytes else None, NO_EVENT,
                              False)


def test_share_of_a_cuda_tensor_builds_the_handle_from_reduce_tensor_through_the_library(monkeypatch):
    fake = FakeReduce(handle=bytes([2]) + b"c" + RAW_CUDA)
    monkeypatch.setattr(reductions, "reduce_tensor", fake)
    t = on_device(torch.zeros(4, 6, dtype=torch.bfloat16), "cuda")[1:, ::2]
    h = devshare.share(t)
    assert len(fake.seen) == 1
    assert h.backend == "cuda" and h.key == RAW_CUDA and h.device_index == 0
    assert h.shape == (3, 3) and h.strides == (6, 2) and h.tensor_offset == 6
    assert h.dtype_name == "bfloat16"
    assert h.storage_offset == 256 and h.storage_size == 48 and h.alloc_size == 304
    assert h.ref_name == REF_NAME and h.ref_slot == 7
    assert h.producer_pid == os.getpid()  # this process, not the name's 4242
    assert devshare.outstanding(h) == 0  # PyTorch's allocator tracks it, not a devshare exporter


def test_share_then_open_hands_a_stock_consumer_the_producers_storage_fields(monkeypatch):
    monkeypatch.setattr(reductions, "reduce_tensor", FakeReduce())
    rebuild = Recorder()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    t = on_device(torch.arange(10, dtype=torch.int64), "cuda")[2:8]
    _, produced = FakeReduce()(t)
    devshare.open(devshare.share(t))
    (consumed,) = rebuild.calls
    assert consumed[1:4] == produced[1:4] and consumed[5] is torch.int64
    assert consumed[6:10] + consumed[11:15] == produced[6:10] + produced[11:15]


def test_share_of_a_cuda_tensor_that_requires_grad_shares_its_detached_data(monkeypatch):
    fake = FakeReduce()
    monkeypatch.setattr(reductions, "reduce_tensor", fake)
    base = torch.ones(3, requires_grad=True)
    devshare.share(on_device(base * 2, "cuda"))  # a non-leaf: reduce_tensor would refuse it
    assert fake.seen[0].requires_grad is False


def test_share_of_a_cuda_tensor_with_an_unusable_handle_returns_the_reference_and_raises(monkeypatch, ref_counter):
    # A version-3 'e' handle (PyTorch 2.13): its layout is not confirmed, so it is refused.
    e_handle = cuda_e(4242, 2 * MIB, 1, fds([5]), version=3)
    monkeypatch.setattr(reductions, "reduce_tensor",
                        FakeReduce(handle=e_handle, ref=ref_counter.name, slot=ref_counter.slot))
    with pytest.raises(devshare.Error, match="version 3"):
        devshare.share(on_device(torch.zeros(4), "cuda"))
    # reduce_tensor set the slot to 1; without the decrement the block would stay in limbo.
    assert ref_counter.slot_value() == 0


def test_share_of_an_npu_tensor_with_an_unusable_handle_returns_the_reference(monkeypatch, ref_counter):
    fake_torch_npu(monkeypatch)
    monkeypatch.setattr(reductions, "reduce_tensor",
                        FakeReduce(handle=bytes([2]) + b"c" + acl_buffer(), ref=ref_counter.name,
                                   slot=ref_counter.slot))
    with pytest.raises(devshare.Error, match="version 2"):
        devshare.share(on_device(torch.zeros(4), "npu"))
    assert ref_counter.slot_value() == 0


def test_share_and_open_of_a_cuda_tensor_in_an_expandable_segment_with_a_long_table(monkeypatch, ref_counter):
    # 40 segments of 2 MiB: 160 bytes of fds, too long for the handle struct.
    e = cuda_e(31337, 2 * MIB, 40, fds(range(200, 240)))
    monkeypatch.setattr(reductions, "reduce_tensor",
                        FakeReduce(handle=e, ref=ref_counter.name, slot=ref_counter.slot))
    rebuild = Recorder()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = devshare.share(on_device(torch.zeros(4, 6), "cuda"))
    assert h.segmented and h.segment_kind == "cuda_fd" and not h.table_inline
    assert h.segments == tuple(range(200, 240)) and h.producer_pid == 31337
    assert ref_counter.slot_value() == 1  # the handle is the tuple's reference, still owed
    # The consumer gets the text (or bytes) and opens it with stock PyTorch.
    for sent in (h.to_text(), h.to_bytes()):
        devshare.open(sent)
    assert len(rebuild.calls) == 2
    for args in rebuild.calls:
        # In the format of the torch that rebuilds it (this process's).
        assert args[7][0] == pytorch_reader.own_version(torch.__version__) and type(args[7]) is bytes
        assert pytorch_reader.same_segments(args[7], e)
        assert args[8:10] == (96, 256) and args[11] == ref_counter.name and args[12] == ref_counter.slot
    assert ref_counter.slot_value() == 1  # releasing is PyTorch's consumer's job (the recorder's here)


def test_share_and_open_of_an_npu_tensor_in_an_expandable_segment_with_a_long_table(monkeypatch):
    handles = [0x5000 + i for i in range(20)]  # 160 bytes of shareable handles
    e = npu_e(2 * MIB, handles)
    rebuild = Recorder()
    fake_torch_npu(monkeypatch, rebuild)
    monkeypatch.setattr(reductions, "reduce_tensor", FakeReduce(handle=e))
    h = devshare.share(on_device(torch.zeros(2, 2), "npu"))
    assert h.backend == "acl" and h.segments == tuple(handles) and not h.table_inline
    assert devshare.open(devshare.Handle.from_text(h.to_text())) is rebuild.result
    (args,) = rebuild.calls
    assert args[7] == e  # exactly what torch_npu sent: its 'e' form has no padding


def test_share_of_a_cuda_tensor_with_an_inline_e_table_opens_with_the_e_bytes(monkeypatch):
    e = cuda_e(31337, 2 * MIB, 1, fds([9]))
    monkeypatch.setattr(reductions, "reduce_tensor", FakeReduce(handle=e))
    rebuild = Recorder()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = devshare.share(on_device(torch.zeros(3), "cuda"))
    assert h.table_inline and h.segments == (9,)
    devshare.open(h)
    assert pytorch_reader.same_segments(rebuild.calls[0][7], e)
    assert rebuild.calls[0][7][0] == pytorch_reader.own_version(torch.__version__)


def test_allow_ptrace_takes_a_pid_minus_1_or_0():
    devshare.allow_ptrace(0)  # nobody (a no-op without Yama)
    with pytest.raises(ValueError):
        devshare.allow_ptrace(-2)
    with pytest.raises(TypeError):
        devshare.allow_ptrace("any")


def test_share_of_a_cuda_tensor_with_an_empty_storage_raises_value_error(monkeypatch):
    monkeypatch.setattr(reductions, "reduce_tensor", FakeReduce())
    with pytest.raises(ValueError, match="empty storage"):
        devshare.share(on_device(torch.empty(0), "cuda"))


def test_share_of_a_cuda_tensor_with_9_dimensions_raises_before_reduce_tensor(monkeypatch):
    fake = FakeReduce()
    monkeypatch.setattr(reductions, "reduce_tensor", fake)
    with pytest.raises(ValueError, match="maximum of 8"):
        devshare.share(on_device(torch.zeros([1] * 9), "cuda"))
    assert fake.seen == []


def test_share_of_a_cuda_tensor_shared_some_other_way_is_refused(monkeypatch):
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_tensor, (1, 2, 3)))
    with pytest.raises(ValueError, match="not as a device tensor"):
        devshare.share(on_device(torch.zeros(2), "cuda"))


def test_share_of_an_npu_tensor_imports_torch_npu_and_makes_an_acl_handle(monkeypatch):
    fake_torch_npu(monkeypatch)
    monkeypatch.setattr(reductions, "reduce_tensor", FakeReduce(handle=bytes([1]) + b"c" + acl_buffer()))
    h = devshare.share(on_device(torch.zeros(2, 2), "npu"))
    assert h.backend == "acl" and h.key == normalized() and h.producer_pid == os.getpid()


def test_share_of_an_npu_tensor_without_torch_npu_raises_import_error_naming_torch_npu(monkeypatch):
    fake = FakeReduce()
    monkeypatch.setattr(reductions, "reduce_tensor", fake)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ImportError, match="torch_npu"):
        devshare.share(on_device(torch.zeros(2), "npu"))
    assert fake.seen == []


def test_share_of_a_tensor_on_another_device_type_is_refused():
    with pytest.raises(ValueError, match="CPU, CUDA and NPU"):
        devshare.share(on_device(torch.zeros(2), "xpu"))


def test_local_pid_asks_the_npu_runtime_for_the_bare_tgid():
    # The ACL stand-in (built next to the library by build.rs) reports getpid() + an offset as the
    # bare tgid, like a container would.
    import pathlib
    import subprocess
    standin = pathlib.Path(devshare.library_path).resolve().parent / "standin" / "acl" / "libascendcl.so"
    assert standin.exists(), f"the ACL stand-in is built next to the library: {standin}"
    code = ("import os, devshare; print(devshare.local_pid('npu', 0), os.getpid())")
    env = dict(os.environ, DEVSHARE_ACL_LIBRARY=str(standin), ACL_STANDIN_TGID_OFFSET="1000000",
               PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    tgid, pid = map(int, out.stdout.split())
    assert tgid == pid + 1000000


def test_local_pid_is_the_process_id_for_cuda_and_refuses_unknown_backends():
    assert devshare.local_pid("cuda", 0) == os.getpid()
    with pytest.raises(ValueError):
        devshare.local_pid("tpu")
