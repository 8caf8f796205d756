"""DLPack: torch.from_dlpack / numpy.from_dlpack of imported host buffers share memory with them,
and the C library's deleter runs exactly once, whoever ends up calling it."""

import ctypes
import gc

import numpy as np
import pytest
import torch

import devshare
from conftest import maps_count

_GetPointer = ctypes.pythonapi["PyCapsule_GetPointer"]  # private function objects
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_GetName = ctypes.pythonapi["PyCapsule_GetName"]
_GetName.restype = ctypes.c_char_p
_GetName.argtypes = [ctypes.py_object]

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# DLManagedTensorVersioned: deleter after version (8) and manager_ctx (8); DLManagedTensor:
# after DLTensor (48) and manager_ctx (8).
_DELETER_OFFSET = {b"dltensor_versioned": 16, b"dltensor": 56}
# DLTensor starts after version, manager_ctx, deleter, flags in the versioned form.
_TENSOR_OFFSET = {b"dltensor_versioned": 32, b"dltensor": 0}


class CountingDeleter:
    """Replaces a capsule's managed-tensor deleter with one that counts calls and forwards to
    the library's own deleter."""

    def __init__(self, capsule):
        self.name = _GetName(capsule)
        self.managed = _GetPointer(capsule, self.name)
        slot = ctypes.c_void_p.from_address(self.managed + _DELETER_OFFSET[self.name])
        self.original = _DELETER(slot.value)
        self.calls = 0

        @_DELETER
        def counting(m):
            self.calls += 1
            assert m == self.managed
            self.original(m)

        self._fn = counting  # keep the callback alive
        slot.value = ctypes.cast(counting, ctypes.c_void_p).value

    def data_pointer(self):
        return ctypes.c_void_p.from_address(self.managed + _TENSOR_OFFSET[self.name]).value


def _mapping_of(addr):
    """The shm name (with '/') of the /proc/self/maps mapping holding addr, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                path = parts[5] if len(parts) > 5 else ""
                return ("/" + path[len("/dev/shm/"):]).encode() if path.startswith("/dev/shm/") else None
    return None


def _producer(n=8):
    a = devshare.empty((n,), "float32", like="numpy")
    a[:] = np.arange(n, dtype=np.float32)
    return a


@pytest.mark.parametrize("versioned", [True, False])
def test_torch_from_dlpack_shares_memory_and_the_deleter_runs_once(versioned):
    a = _producer()
    h = devshare.share(a)
    assert maps_count(h.key) == 1  # the exporter's own mapping
    cap = devshare.dlpack_capsule(h, versioned=versioned)
    assert _GetName(cap) == (b"dltensor_versioned" if versioned else b"dltensor")
    # The import itself was released inside dlpack_capsule: the capsule's tensor holds it.
    assert maps_count(h.key) == 2 and devshare.outstanding(a) == 1
    counter = CountingDeleter(cap)
    # The import is a second mapping of the same shm object: another address, same memory.
    assert _mapping_of(counter.data_pointer()) == h.key

    t = torch.from_dlpack(cap)
    assert _GetName(cap).startswith(b"used_")
    del cap
    gc.collect()
    assert counter.calls == 0
    assert t.data_ptr() == counter.data_pointer()
    t[0] = 100.0
    assert a[0] == 100.0  # a write through torch is visible through numpy ...
    a[1] = -5.0
    assert t[1].item() == -5.0  # ... and the other way round
    view = t[2:]
    del t
    gc.collect()
    assert counter.calls == 0 and devshare.outstanding(a) == 1 and maps_count(h.key) == 2
    del view
    gc.collect()
    assert counter.calls == 1
    assert devshare.outstanding(a) == 0
    assert maps_count(h.key) == 1, "the import's mapping should be gone from /proc/self/maps"


@pytest.mark.parametrize("versioned", [True, False])
def test_an_unconsumed_capsule_runs_the_deleter_when_destroyed(versioned):
    a = _producer()
    h = devshare.share(a)
    cap = devshare.dlpack_capsule(h, versioned=versioned)
    counter = CountingDeleter(cap)
    assert maps_count(h.key) == 2
    del cap
    gc.collect()
    assert counter.calls == 1
    assert devshare.outstanding(a) == 0 and maps_count(h.key) == 1


def test_numpy_from_dlpack_and_open_release_the_import():
    a = _producer()
    h = devshare.share(a)
    b = devshare.open(h, like="numpy")
    assert _mapping_of(b.__array_interface__["data"][0]) == h.key
    b[3] = 42.0
    assert a[3] == 42.0
    assert maps_count(h.key) == 2 and devshare.outstanding(a) == 1
    c = b[::2]
    del b
    gc.collect()
    assert devshare.outstanding(a) == 1
    del c
    gc.collect()
    assert devshare.outstanding(a) == 0 and maps_count(h.key) == 1


def test_open_torch_and_numpy_agree_with_the_handle_layout():
    base = devshare.empty((5, 7), "float64")
    base.copy_(torch.arange(35, dtype=torch.float64).reshape(5, 7))
    view = base[1:4, 2::2].t()
    h = devshare.share(view)
    h2 = devshare.share(view)
    t = devshare.open(h)
    n = devshare.open(h2, like="numpy")
    assert t.stride() == view.stride() and tuple(t.shape) == tuple(view.shape)
    assert torch.equal(t, view) and np.array_equal(n, view.numpy())
    t[0, 0] = -1.0  # the same memory, no copy
    assert base[1, 2].item() == -1.0 and n[0, 0] == -1.0
    del t, n
    gc.collect()
    assert devshare.outstanding(base) == 0


def test_failed_consumer_does_not_leak_the_reference():
    a = _producer()
    h = devshare.share(a)
    cap = devshare.dlpack_capsule(h)
    with pytest.raises(Exception):
        np.from_dlpack(cap)  # numpy wants an object with __dlpack__, not a bare capsule
    del cap
    gc.collect()
    assert devshare.outstanding(a) == 0
