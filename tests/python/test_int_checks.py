"""Integers never wrap on their way into ctypes (issue 11, item 8).

ctypes keeps the low bits of an out-of-range int (``c_uint64(2**64 + 4096)`` is 4096), so the
package checks every integer before a library call: wrong types are TypeError, values outside
the C type (or the argument's own range) ValueError, sizes the library can represent but not
allocate devshare.Error with the library's status. Each case from the issue, then the audit's.
"""

from __future__ import annotations

import ctypes
import gc
import math
import pathlib
import re
import threading
import time

import numpy as np
import pytest
import torch

import devshare
from devshare import _args, _lib, _registry
from conftest import shm_objects, ours


def _no_new_objects(fn, *args, **kw):
    """Call fn expecting an exception; nothing may appear in /dev/shm meanwhile."""
    before = shm_objects()
    try:
        fn(*args, **kw)
    finally:
        assert not ours(shm_objects() - before)


# --- the cases ----------------------------------------------------------------------------


def test_a_size_beyond_uint64_is_a_value_error_not_a_4_kib_allocation():
    # 2**62 + 1024 float32 elements are 2**64 + 4096 bytes: c_uint64 made that 4096 bytes.
    with pytest.raises(ValueError, match="largest host allocation"):
        _no_new_objects(devshare.empty, (2**62 + 1024,), "float32")
    with pytest.raises(ValueError, match="largest host allocation"):
        _no_new_objects(devshare.empty, (2**62 + 1024,), "float32", like="numpy")
    # The product overflows too, not only one dimension.
    with pytest.raises(ValueError, match="largest host allocation"):
        devshare.empty((2**32, 2**32, 4), "uint8")
    with pytest.raises(ValueError, match="largest host allocation"):
        devshare.empty((2**61,), "float64")  # 2**64 bytes: exactly one past uint64
    # A dimension beyond int64 (the handle's shape type) is refused on its own.
    with pytest.raises(ValueError, match="oversized dimension"):
        devshare.empty((2**63,), "uint8")
    with pytest.raises(ValueError, match="oversized dimension"):
        devshare.empty(2**64 + 1, "uint8")


def test_a_size_the_library_can_represent_but_not_hold_gets_its_status():
    # 2**61 bytes fits the ABI; /dev/shm cannot hold it: the library refuses (capacity check).
    with pytest.raises(devshare.Error) as info:
        _no_new_objects(devshare.empty, (2**59,), "float32")
    assert info.value.status == devshare.Status.OS


def test_a_huge_timeout_is_a_value_error_not_an_immediate_return():
    x = devshare.empty((4,), "float32")
    h = devshare.share(x)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="longest finite wait"):
        devshare.wait(x, timeout=2**70)  # 2**70 * 1000 ms wrapped to 0 ms in c_int64
    with pytest.raises(ValueError, match="longest finite wait"):
        devshare.wait(x, timeout=1e300)
    with pytest.raises(ValueError, match="longest finite wait"):
        devshare.wait(x, timeout=(2**63 - 1) // 1000 + 1)
    assert time.monotonic() - t0 < 5
    assert devshare.outstanding(x) == 1  # nothing was released on the way
    # Every finite wait the library can take is accepted (the last representable second).
    assert _args.timeout_ms((2**63 - 1) // 1000) == (2**63 - 1) // 1000 * 1000
    assert _args.timeout_ms(0.0001) == 1  # rounded up: a tiny timeout still waits
    assert _args.timeout_ms(None) == -1 and _args.timeout_ms(math.inf) == -1
    devshare.open(h)
    gc.collect()
    assert devshare.wait(x, timeout=0) is True


def test_timeout_types_and_signs():
    x = devshare.empty((4,), "float32")
    for bad in (True, False, "1", b"1", [1], 1j):
        with pytest.raises(TypeError, match="timeout"):
            devshare.wait(x, timeout=bad)
    for bad in (-1, -0.001, -math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            devshare.wait(x, timeout=bad)
    # The checks come first, also when nothing is outstanding.
    with pytest.raises(ValueError):
        devshare.wait(x, timeout=2**70)
    assert devshare.wait(x, timeout=np.float32(0.01)) is True
    assert devshare.wait(x, timeout=np.int64(0)) is True


def test_math_inf_waits_forever_like_none():
    x = devshare.empty((4,), "float32")
    y = devshare.open(devshare.share(x))

    def drop():
        nonlocal y
        time.sleep(0.3)
        y = None
        gc.collect()

    th = threading.Thread(target=drop)
    th.start()
    t0 = time.monotonic()
    assert devshare.wait(x, timeout=math.inf) is True
    assert time.monotonic() - t0 >= 0.25
    th.join()


@pytest.mark.parametrize("shape", ["abc", "12", "", b"ab", bytearray(b"ab"), memoryview(b"ab")])
def test_str_and_bytes_shapes_are_type_errors(shape):
    # "abc" raised ValueError (int("a")), "12" gave (1, 2), b"ab" gave (97, 98).
    with pytest.raises(TypeError, match="shape must be an int or a sequence of ints"):
        devshare.empty(shape, "float32")


@pytest.mark.parametrize("shape", [(2.7,), (2.0,), 2.0, (1, 2.5), (np.float64(3),), (True,), True,
                                   (1, False), (None,), ("2",), (b"2",), {1.5}, object()])
def test_non_integer_dimensions_are_type_errors(shape):
    # (2.7,) gave shape (2,).
    with pytest.raises(TypeError):
        devshare.empty(shape, "float32")


@pytest.mark.parametrize("shape", [(-1,), -1, (3, -2), (2**63,), 2**64])
def test_negative_and_oversized_dimensions_are_value_errors(shape):
    with pytest.raises(ValueError):
        devshare.empty(shape, "float32")


@pytest.mark.parametrize("shape,expect", [
    (3, (3,)), ((), ()), ([2, 3], (2, 3)), (torch.Size([2, 3]), (2, 3)), (np.int64(4), (4,)),
    ((np.int32(2), np.uint8(3)), (2, 3)), (range(1, 3), (1, 2)), ((0, 5), (0, 5)),
    (np.array([2, 2]), (2, 2)), ((torch.tensor(2),), (2,)),
])
def test_integer_like_shapes_are_accepted(shape, expect):
    for like in ("torch", "numpy"):
        a = devshare.empty(shape, "int16", like=like)
        assert tuple(a.shape) == expect


def test_dlpack_dtype_tuples_are_checked():
    assert devshare.empty((2,), (2, 32, 1)).dtype == torch.float32
    with pytest.raises(TypeError):
        devshare.empty((2,), (2, 32.0, 1))
    with pytest.raises(TypeError):
        devshare.empty((2,), (True, 32, 1))
    with pytest.raises(ValueError, match="dtype bits"):
        devshare.empty((2,), (2, 288, 1))  # 288 bits would have been 32 in a uint8
    with pytest.raises(ValueError, match="dtype lanes"):
        devshare.empty((2,), (2, 32, 2**16 + 1))


# --- the audit: every other integer that reaches ctypes -------------------------------------------


def test_device_indices_pids_and_slots():
    h = devshare.Handle.from_bytes(devshare.Handle.from_torch_args(_cuda_args()).to_bytes())
    with pytest.raises(ValueError, match="device"):
        devshare.torch_args(h, device=2**32)
    with pytest.raises(ValueError, match="device"):
        devshare.torch_args(h, device=-1)
    with pytest.raises(TypeError, match="device"):
        devshare.torch_args(h, device=True)
    with pytest.raises(TypeError, match="device"):
        devshare.torch_args(h, device=1.0)
    assert devshare.torch_args(h, device=np.int64(1))[6] == 1
    for bad, exc in ((2**31, ValueError), (-2, ValueError), (True, TypeError), (1.0, TypeError),
                     ("1", TypeError)):
        with pytest.raises(exc, match="pid"):
            devshare.allow_ptrace(bad)
    with pytest.raises(ValueError, match="device"):
        devshare.local_pid("cuda", 2**31)
    with pytest.raises(TypeError, match="device"):
        devshare.local_pid("cuda", False)
    # The tuple's integers: slot (uint64), storage size/offset (uint64), tensor offset (int64),
    # device (int32), producer pid (int32).
    for i, bad in ((12, 2**64), (8, 2**64), (9, -1), (3, 2**63), (6, 2**31)):
        args = list(_cuda_args())
        args[i] = bad
        with pytest.raises(ValueError):
            devshare.handle_from_torch(tuple(args))
    for i, bad in ((12, 1.0), (8, True), (3, "0"), (6, 0.0)):
        args = list(_cuda_args())
        args[i] = bad
        with pytest.raises(TypeError):
            devshare.handle_from_torch(tuple(args))
    with pytest.raises(ValueError, match="producer_pid"):
        devshare.handle_from_torch(_cuda_args(), producer_pid=2**32 + 5)
    with pytest.raises(ValueError, match=r"shape \(arg 1\)\[0\]"):
        devshare.handle_from_torch(_cuda_args(shape=(2**64 + 2,)))


def _cuda_args(shape=(2,)):
    """A synthetic reduce_tensor tuple of a CUDA tensor (no GPU needed to make a handle)."""
    return (torch.Tensor, torch.Size(shape), (1,), 0, type(torch.empty(0)._typed_storage()),
            torch.float32, 0, b"\x01" * 64, 4096, 0, False, b"/torch_1234_567_8", 3, bytes(64),
            False)


def test_every_library_call_and_struct_field_is_range_checked():
    # The backstop under the explicit checks: arguments (call) and struct fields (new_struct).
    from devshare import _ints

    exp = _registry.Export.alloc(64)
    try:
        with pytest.raises(ValueError, match="out of range"):
            _lib.call(_lib.lib.devshare_exporter_wait, exp.ptr, 2**64)
        with pytest.raises(ValueError, match="out of range"):
            exp.wait(2**63)
        with pytest.raises(TypeError):
            _lib.call(_lib.lib.devshare_exporter_wait, exp.ptr, 0.5)
        with pytest.raises(ValueError, match="out of range"):
            _lib.call(_lib.lib.devshare_host_alloc, 2**64 + 64, ctypes.byref(_lib.ExporterP()), None)
        with pytest.raises(ValueError, match=r"TensorDesc.storage_offset .* out of range"):
            _lib.new_struct(_lib.TensorDesc, storage_offset=2**64)
        with pytest.raises(ValueError, match=r"TensorDesc.tensor_offset .* out of range"):
            _lib.new_struct(_lib.TensorDesc, tensor_offset=-(2**63) - 1)
        with pytest.raises(ValueError, match=r"ImportOptions.device .* out of range"):
            _lib.new_struct(_lib.ImportOptions, device=2**31)
        with pytest.raises(ValueError, match=r"TorchArgs.ref_slot .* out of range"):
            _lib.new_struct(_lib.TorchArgs, ref_slot=-1)
        with pytest.raises(TypeError):
            _lib.new_struct(_lib.TorchArgs, ref_slot=1.0)
        with pytest.raises(ValueError, match=r"strides\[1\]"):
            _ints.int64_array("strides", [1, 2**63])
        # A share whose offsets cannot be represented is refused before the library sees it.
        with pytest.raises(ValueError, match="out of range"):
            exp.share((2, 32, 1), (1,), (1,), 2**64, 4, 0)
        with pytest.raises(ValueError, match=r"shape\[0\]"):
            exp.share((2, 32, 1), (2**64,), (1,), 0, 4, 0)
        assert exp.outstanding() == 0
    finally:
        exp.close()


def test_ctypes_call_sites_are_all_audited():
    # Every library call in the package goes through _lib.call (range-checked), or is one of
    # these, whose arguments are pointers, constants or checked just before the call. A new
    # direct call must be checked and added here.
    audited = {
        "devshare_exporter_close": "constant flags",
        "devshare_exporter_wait": "a timeout checked in range just before (else check_args) "
                                  "and a pointer",
        "devshare_channel_send": "a peer checked in range just before (peer_id), pointers and a byref "
                                 "(Channel.send of a registered tensor)",
        "devshare_imports_give_back": "an array of pointers and its length",
        "devshare_import_to_dlpack": "pointer and a ctypes output",
        "devshare_import_to_dlpack_versioned": "pointer and a ctypes output",
        "devshare_import_release": "pointer",
        "devshare_version": "no arguments",
        "devshare_last_error": "buffer and its length",
        "devshare_last_vendor_error": "no arguments",
        "devshare_torch_discard": "struct from new_struct",
        # The per-item channel calls (pointers and ctypes objects made and checked once).
        "devshare_pool_acquire": "pointer, the constant forever timeout, ctypes outputs",
        "devshare_pool_send": "pointer and ctypes integers checked when made (slot, peer, desc)",
        "devshare_connection_recv": "pointer, the constant forever timeout, a ctypes output",
        "devshare_import_give_back": "pointer",
        "devshare_import_describe": "pointer and ctypes outputs",
        "devshare_import_pool_slot": "pointer and ctypes outputs",
        "devshare_import_info": "pointer and a ctypes output",
        "devshare_import_handle": "pointer and a ctypes output",
        "devshare_connection_close": "pointer (the connection's close)",
        "devshare_connection_recv_item": "pointer, a c_int32 timeout, an import pointer or None, "
                                         "a ctypes output",
        "devshare_connection_recv_args": "a byref of the DevshareRecvArgs whose fields the "
                                         "package sets through int views (int32 timeout, pointers)",
        "devshare_connection_recv_batch": "pointer, a c_int32 timeout from wait_ms, a ctypes array of "
                                          "initialised items and a c_size_t of its length",
    }
    pkg = pathlib.Path(devshare.__file__).parent
    direct = set()
    raw = set()
    for path in pkg.glob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"(?<!call\()\blib\.(devshare_\w+)\(", text):
            direct.add(m.group(1))
        # Bound to a name to be called through it: a direct call as well.
        for m in re.finditer(r"=\s*lib\.(devshare_\w+)\b(?!\()", text):
            direct.add(m.group(1))
        # Bound without argtypes (_raw): their callers must pass ctypes objects of the C types.
        raw.update(re.findall(r"\b_raw\(\"(devshare_\w+)\"\)", text))
    assert direct <= set(audited), f"unaudited direct library calls: {sorted(direct - set(audited))}"
    assert raw, "the per-item calls are bound without argtypes"
    assert raw <= set(audited), f"unaudited calls without argtypes: {sorted(raw - set(audited))}"
    # Functions called through a variable (fn(...)) check their arguments too.
    for path in pkg.glob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"status = fn\((.*)\)", text):
            window = text[max(0, m.start() - 300):m.start()]
            assert "check_args" in window or "byref(self._h), buf, len(buf)" in m.group(0), \
                f"{path.name}: {m.group(0)} is not range-checked"


def test_a_float_timeout_of_a_receive_takes_the_fast_path_to_the_same_milliseconds():
    # Connection.recv_batch passes what is left of its timeout (a float) to every receive:
    # wait_ms takes floats at once, and must give what timeout_ms gives (rounded up), and leave
    # NaN, negative and too long ones to timeout_ms's errors.
    from devshare import _channel_lib
    for t in (0.0, 0.0001, 0.001, 0.0015, 1.5, 119.99999, 86400.25, float(_channel_lib.FAST_SECONDS)):
        assert _channel_lib.wait_ms(t) == _args.timeout_ms(t), t
    assert _channel_lib.wait_ms(math.inf) == -1
    assert _channel_lib.wait_ms(float(_channel_lib.FAST_SECONDS) + 1.0) is None  # longer than one call
    for bad in (-0.001, -math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            _channel_lib.wait_ms(bad)
