"""Handle encoding, attributes, and bad input: errors with the library's message, never a crash."""

import gc
import pickle
import random

import numpy as np
import pytest
import torch

import devshare


def test_handle_round_trips_and_attributes():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[1:, ::2]
    h = devshare.share(t)
    other = devshare.share(t)
    try:
        assert isinstance(h, devshare.Handle)
        assert devshare.Handle.from_bytes(h.to_bytes()) == h
        assert devshare.Handle.from_text(h.to_text()) == h
        assert devshare.Handle.from_text("  " + h.to_text() + "\n") == h
        assert pickle.loads(pickle.dumps(h)) == h
        assert hash(devshare.Handle.from_bytes(h.to_bytes())) == hash(h)
        assert h.to_text().startswith("devshare1:") and len(h.to_bytes()) <= devshare._lib.HANDLE_MAX_ENCODED_SIZE
        assert str(h) == h.to_text()

        assert h.backend == "host" and h.device_index == 0
        assert h.dtype == (2, 32, 1) and h.dtype_name == "float32"
        assert h.torch_dtype() is torch.float32 and h.numpy_dtype() == np.float32
        assert h.shape == (3, 3) and h.strides == (6, 2) and h.ndim == 2 and h.numel == 9
        assert h.tensor_offset == 6 and h.element_size == 4
        assert h.storage_offset == 0 and h.storage_size == 96 and h.alloc_size == 96
        assert h.key.startswith(b"/torch_") and h.ref_name.startswith(b"/devshare_rc_")
        assert h.ref_slot >= 0 and h.producer_pid > 0
        assert h.flags & 2 and h.inflight
        assert "float32" in repr(h) and "(3, 3)" in repr(h)

        assert other != h and other.key == h.key and other.ref_slot != h.ref_slot
        assert devshare.outstanding(t) == 2
    finally:
        # Every shared handle carries an in-flight reference: open and drop them to return it.
        for x in (h, other):
            devshare.open(x)
        gc.collect()
    assert devshare.outstanding(t) == 0


def _error(fn, *args):
    with pytest.raises(devshare.Error) as info:
        fn(*args)
    e = info.value
    assert isinstance(e, RuntimeError)
    assert isinstance(e.status, int) and e.status < 0
    assert e.status_name == devshare.status_name(e.status)
    assert e.message and e.message in str(e) and e.status_name in str(e)
    return e


@pytest.fixture
def handle_bytes():
    a = devshare.empty((5,), "int32", like="numpy")
    h = devshare.share(a)
    yield h.to_bytes()
    # Return the reference (and the in-flight count) before the buffer goes.
    devshare.open(h, like="numpy")
    gc.collect()


def test_corrupted_bytes_are_refused_with_the_library_message(handle_bytes):
    b = handle_bytes
    e = _error(devshare.Handle.from_bytes, b[: len(b) // 2])
    assert e.status == devshare.Status.TRUNCATED and "devshare_handle_decode" in e.message
    e = _error(devshare.Handle.from_bytes, b"XXXX" + b[4:])
    assert e.status == devshare.Status.BAD_MAGIC
    flipped = bytearray(b)
    flipped[len(b) // 2] ^= 0x40
    e = _error(devshare.Handle.from_bytes, bytes(flipped))
    assert e.status == devshare.Status.CHECKSUM_MISMATCH
    assert e.status_name == "DEVSHARE_STATUS_CHECKSUM_MISMATCH"
    e = _error(devshare.Handle.from_bytes, b + b"\0")
    assert e.status in (devshare.Status.BAD_LENGTH, devshare.Status.TRUNCATED)
    _error(devshare.Handle.from_bytes, b"")
    # Not bytes at all.
    with pytest.raises(TypeError, match="needs bytes"):
        devshare.Handle.from_bytes("not bytes")


def test_every_single_byte_mutation_is_refused_or_valid_never_a_crash(handle_bytes):
    rng = random.Random(1234)
    good = devshare.Handle.from_bytes(handle_bytes)
    for _ in range(400):
        m = bytearray(handle_bytes)
        for _ in range(rng.randint(1, 3)):
            m[rng.randrange(len(m))] = rng.randrange(256)
        try:
            h = devshare.Handle.from_bytes(bytes(m))
        except devshare.Error as e:
            assert e.status < 0 and e.message
        else:
            assert h == good  # only a no-op mutation can decode


def test_handle_text_typos_are_refused(handle_bytes):
    text = devshare.Handle.from_bytes(handle_bytes).to_text()
    e = _error(devshare.Handle.from_text, "devshar1:" + text[len("devshare1:"):])
    assert e.status == devshare.Status.BAD_TEXT and "devshare1:" in e.message
    i = len(text) // 2
    typo = text[:i] + ("A" if text[i] != "A" else "B") + text[i + 1:]
    e = _error(devshare.Handle.from_text, typo)
    assert e.status in (devshare.Status.CHECKSUM_MISMATCH, devshare.Status.BAD_TEXT)
    e = _error(devshare.Handle.from_text, text[:i] + "!" + text[i + 1:])
    assert e.status == devshare.Status.BAD_TEXT
    _error(devshare.Handle.from_text, text[:-3])
    _error(devshare.Handle.from_text, "")
    _error(devshare.Handle.from_text, text[:i] + "\u00e9" + text[i + 1:])
    e = _error(devshare.Handle.from_text, text[:i] + "\0" + text[i:])
    assert e.status == devshare.Status.BAD_TEXT
    # open() takes text too, and reports the same way.
    e = _error(devshare.open, typo)
    with pytest.raises(TypeError):
        devshare.Handle.from_text(12345)


def test_wrong_types_raise_type_error_naming_the_type():
    with pytest.raises(TypeError, match="int"):
        devshare.share(42)
    with pytest.raises(TypeError, match="list"):
        devshare.share([1.0, 2.0])
    with pytest.raises(TypeError, match="str"):
        devshare.share("tensor")
    with pytest.raises(TypeError, match="devshare.empty"):
        devshare.share(np.zeros(3))  # ordinary numpy memory cannot be shared in place
    with pytest.raises(TypeError, match="float"):
        devshare.open(1.5)
    with pytest.raises(TypeError, match="dict"):
        devshare.outstanding({})
    with pytest.raises(TypeError):
        devshare.empty((2,), "not-a-dtype")
    with pytest.raises(ValueError):
        devshare.empty((2,), "float32", like="jax")
    with pytest.raises(ValueError):
        devshare.empty((-1,), "float32")


def test_unsupported_tensors_are_refused_clearly():
    with pytest.raises(ValueError, match="resolve_conj"):
        devshare.share(torch.ones(3, dtype=torch.complex64).conj())
    with pytest.raises(ValueError, match="strided"):
        devshare.share(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="CPU"):
        devshare.share(torch.empty(3, device="meta"))
    with pytest.raises(devshare.Error) as info:
        devshare.share(torch.zeros([1] * 9))
    assert info.value.status == devshare.Status.BAD_NDIM


def test_a_released_handle_cannot_be_opened_again():
    t = torch.arange(4.0)
    h = devshare.share(t)
    u = devshare.open(h)
    del u
    gc.collect()
    assert devshare.outstanding(t) == 0
    e = _error(devshare.open, h)
    assert e.status == devshare.Status.ALREADY_RELEASED
    assert "devshare_import" in e.message


def test_open_refuses_bad_options():
    a = devshare.empty((2,), "float32", like="numpy")
    h = devshare.share(a)
    with pytest.raises(ValueError, match="like"):
        devshare.open(h, like="cupy")
    with pytest.raises(ValueError, match="read-only"):
        devshare.open(h, like="torch", read_only=True)
    devshare.open(h, like="numpy")  # open and drop at once: takes the reference back
    gc.collect()
    assert devshare.outstanding(a) == 0


def test_error_pickles_and_status_names():
    e = devshare.Error(-35, "devshare_exporter_wait: timed out")
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.status, e2.status_name, e2.message) == (-35, "DEVSHARE_STATUS_TIMEOUT", e.message)
    assert devshare.status_name(-12345) == "DEVSHARE_STATUS_-12345"
