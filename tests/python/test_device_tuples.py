"""PyTorch / torch_npu device IPC tuples (reduce_tensor's 15 args) <-> devshare handles.

No GPU or NPU is needed: the tuples are synthetic (PyTorch's byte forms), PyTorch's
consumers (rebuild_cuda_tensor, rebuild_npu_tensor) and producer (reduce_tensor) are replaced by
recorders, and "CUDA tensors" are CPU tensors whose device says cuda. The C library still does
every conversion and check.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.multiprocessing.reductions as reductions

import devshare

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


def test_cuda_expandable_segment_handle_is_refused_naming_expandable_segments_and_the_setting():
    e_handle = bytes([2]) + b"e" + bytes(24) + (3).to_bytes(4, "little")
    e = status_error(cuda_args(e_handle))
    assert e.status == devshare.Status.UNSUPPORTED
    assert "expandable_segments" in e.message and "PYTORCH_CUDA_ALLOC_CONF" in e.message


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


def test_npu_expandable_segment_handle_is_refused_naming_PYTORCH_NPU_ALLOC_CONF():
    e_handle = bytes([1]) + b"e" + (1 << 21).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(8)
    e = status_error(cuda_args(e_handle), "npu")
    assert e.status == devshare.Status.UNSUPPORTED
    assert "expandable_segments" in e.message and "PYTORCH_NPU_ALLOC_CONF" in e.message


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
    e_handle = bytes([2]) + b"e" + bytes(28)
    monkeypatch.setattr(reductions, "reduce_tensor",
                        FakeReduce(handle=e_handle, ref=ref_counter.name, slot=ref_counter.slot))
    with pytest.raises(devshare.Error, match="PYTORCH_CUDA_ALLOC_CONF"):
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
