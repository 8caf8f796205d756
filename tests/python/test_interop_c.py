"""Python <-> C round trips through tensor_tool: the C side sees the right bytes, and writes on
either side are visible on the other; references come back when the consumer lets go."""

import gc

import pytest
import torch

import devshare
from conftest import header_count, maps_count, run, spawn, tensor_tool
from tensors import DLPACK, csv, info_line, logical_bytes, values

# --- Python (torch) produces, C consumes -----------------------------------------------------------

PY_CASES = {
    "float32": lambda: torch.randn(3, 4),
    "float16": lambda: torch.randn(7).half(),
    "bfloat16": lambda: torch.randn(2, 5).bfloat16(),
    "float64": lambda: torch.randn(2, 2, 2, dtype=torch.float64),
    "int64": lambda: torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
    "int32": lambda: torch.arange(-3, 3, dtype=torch.int32),
    "int16": lambda: torch.arange(-3, 3, dtype=torch.int16).reshape(2, 3),
    "int8": lambda: torch.arange(-4, 4, dtype=torch.int8),
    "uint8": lambda: torch.arange(0, 250, 10, dtype=torch.uint8),
    "bool": lambda: torch.tensor([[True, False, True], [False, False, True]]),
    "complex64": lambda: torch.randn(3, dtype=torch.complex64),
    "complex128": lambda: torch.randn(2, 2, dtype=torch.complex128),
    "transpose": lambda: torch.randn(3, 5).t(),
    "step_slice": lambda: torch.arange(30, dtype=torch.int32)[1::4],
    "step_2d": lambda: torch.randn(6, 8)[::2, 1::3],
    "storage_offset": lambda: torch.arange(20.0)[7:13],
    "permuted_offset_3d": lambda: torch.randn(4, 5, 6)[1:3, :, 2:5].permute(2, 0, 1),
    "bool_transpose_offset": lambda: (torch.arange(24).reshape(4, 6) % 3 == 0)[1:, 2:].t(),
    "bfloat16_step_offset": lambda: torch.randn(40).bfloat16()[3::5],
    "scalar": lambda: torch.tensor(3.25),
    "scalar_with_offset": lambda: torch.arange(10, dtype=torch.int16)[4],
    "empty": lambda: torch.empty(0, 3),
    "empty_view_with_offset": lambda: torch.arange(10.0)[5:5],
    "expand_zero_stride": lambda: torch.arange(3.0).expand(4, 3),
}


def _tool_open(h, new_hex=None):
    args = [tensor_tool(), "open", h.to_text()] + ([new_hex] if new_hex is not None else [])
    res = run(args)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 3 and lines[2] == "released", res.stdout
    return lines[0], lines[1]


@pytest.mark.parametrize("case", list(PY_CASES))
def test_torch_to_c(case):
    torch.manual_seed(len(case))
    t = PY_CASES[case]()
    before = logical_bytes(t)
    h = devshare.share(t)
    assert devshare.outstanding(t) == 1
    assert h.tensor_offset == t.storage_offset()
    assert h.shape == tuple(t.shape) and h.strides == t.stride()

    # A tensor whose elements alias one another (zero strides) is only read.
    writable = 0 not in t.stride() or t.numel() <= 1
    new = logical_bytes(values(t.dtype, t.shape, seed=7)) if writable else None
    info, data = _tool_open(h, new.hex() if writable else None)

    assert info == info_line(t.dtype, t.shape, t.stride())
    assert data == "data " + before.hex()
    if writable:
        assert logical_bytes(t) == new, "C's writes are not visible in Python"
    # The consumer released: the reference came back, and once the exporter is collected the
    # torch object's header is back to PyTorch's own single mapping.
    assert devshare.outstanding(t) == 0
    assert devshare.wait(t, timeout=0)
    assert header_count(h.key) == 2  # torch + the (idle) devshare exporter
    assert devshare.collect() >= 1
    assert header_count(h.key) == 1


@pytest.mark.parametrize("like", ["torch", "numpy"])
def test_devshare_empty_to_c(like):
    x = devshare.empty((4, 6), "int32", like=like)
    x[:] = torch.arange(24, dtype=torch.int32).reshape(4, 6).numpy() if like == "numpy" \
        else torch.arange(24, dtype=torch.int32).reshape(4, 6)
    view = x[1:, ::2].T if like == "numpy" else x[1:, ::2].t()
    h = devshare.share(view)
    assert h.key.startswith(b"/devshare_") and h.tensor_offset == 6
    info, data = _tool_open(h, (b"\x01\x00\x00\x00" * 9).hex())
    assert info == "info code=0 bits=32 lanes=1 ndim=2 shape=3,3 strides=2,6 numel=9"
    expected = torch.arange(24, dtype=torch.int32).reshape(4, 6)[1:, ::2].t()
    assert data == "data " + logical_bytes(expected).hex()
    assert (torch.as_tensor(x)[1:, ::2] == 1).all() and int(torch.as_tensor(x)[0].sum()) == 15
    assert devshare.outstanding(x) == 0 and devshare.outstanding(h) == 0


def test_c_consumer_sees_later_producer_writes_and_several_consumers_count():
    t = torch.zeros(4, dtype=torch.int64)
    handles = [devshare.share(t) for _ in range(3)]
    assert devshare.outstanding(t) == 3
    t += 9
    for i, h in enumerate(handles):
        _, data = _tool_open(h)
        assert data == "data " + logical_bytes(torch.full((4,), 9)).hex()
        assert devshare.outstanding(t) == 2 - i


# --- C produces, Python consumes -------------------------------------------------------------------

C_CASES = {
    # name: (dtype, shape or None for 0-d, strides or None, storage offset bytes, tensor offset, alloc)
    "float32": (torch.float32, (2, 3), None, 0, 0, 24),
    "float16": (torch.float16, (5,), None, 0, 0, 10),
    "bfloat16": (torch.bfloat16, (2, 2), None, 0, 0, 8),
    "int64": (torch.int64, (3,), None, 0, 0, 24),
    "bool": (torch.bool, (2, 3), None, 0, 0, 6),
    "uint8": (torch.uint8, (4, 4), None, 0, 0, 16),
    "complex64": (torch.complex64, (2,), None, 0, 0, 16),
    "transposed": (torch.float32, (3, 2), (1, 3), 0, 0, 24),
    "stepped": (torch.int32, (3,), (3,), 0, 1, 40),
    "offsets_2d": (torch.float64, (2, 3), (4, 1), 16, 2, 128),
    "bfloat16_strided_offset": (torch.bfloat16, (2, 2), (1, 4), 6, 1, 32),
    "scalar": (torch.float32, None, None, 8, 1, 16),
    "empty": (torch.float32, (0, 3), None, 0, 0, 0),
    "empty_with_offset": (torch.int16, (2, 0), None, 4, 3, 16),
}


def _c_export(dtype, shape, strides, storage_offset, tensor_offset, alloc, vals):
    code, bits = DLPACK[dtype]
    args = [tensor_tool(), "export", str(code), str(bits), "scalar" if shape is None else csv(shape),
            "-" if strides is None else csv(strides), str(storage_offset), str(tensor_offset),
            str(alloc), logical_bytes(vals).hex()]
    p = spawn(args)
    line = p.stdout.readline()
    if not line.startswith("handle "):
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"tensor_tool export: {line!r} {out!r} {err!r}")
    return p, line.split()[1]


def _finish(p):
    try:
        out, err = p.communicate(timeout=60)
    except Exception:
        p.kill()
        raise
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0] == "released", out
    return lines[1]


@pytest.mark.parametrize("case,like", [
    (case, like) for case, spec in C_CASES.items() for like in ("torch", "numpy")
    if not (like == "numpy" and spec[0] == torch.bfloat16)  # refused: see the next test
])
def test_c_to_python(case, like):
    dtype, shape, strides, so, to, alloc = C_CASES[case]
    dims = () if shape is None else shape
    vals = values(dtype, dims, seed=3)
    new = values(dtype, dims, seed=4)
    p, text = _c_export(dtype, shape, strides, so, to, alloc, vals)
    try:
        h = devshare.Handle.from_text(text)
        assert h.producer_pid == p.pid
        u = devshare.open(text, like=like)
        assert maps_count(h.key) == 1, "the import's mapping should be the only one here"
        expected_strides = h.strides
        if like == "torch":
            assert u.dtype == dtype and tuple(u.shape) == dims and u.stride() == expected_strides
            assert logical_bytes(u) == logical_bytes(vals)
            u.copy_(new)
        else:
            assert u.dtype == h.numpy_dtype() and u.shape == dims and u.flags.writeable
            assert u.strides == tuple(s * u.itemsize for s in expected_strides)
            assert logical_bytes(u) == logical_bytes(vals)
            u[...] = new.numpy()
        view = u[None]  # a view keeps the import alive too
        del u
        gc.collect()
        assert maps_count(h.key) == 1
        del view
        gc.collect()
        assert maps_count(h.key) == 0, "dropping the tensor should unmap the import"
        data = _finish(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert data == "data " + logical_bytes(new).hex(), "Python's writes are not visible in C"


def test_c_bfloat16_to_numpy_is_refused():
    vals = values(torch.bfloat16, (3,), seed=1)
    p, text = _c_export(torch.bfloat16, (3,), None, 0, 0, 6, vals)
    try:
        with pytest.raises(TypeError, match="bfloat16"):
            devshare.open(text, like="numpy")
        # Nothing was imported: the reference is still the producer's to get back.
        u = devshare.open(text, like="torch")
        assert logical_bytes(u) == logical_bytes(vals)
        del u
        gc.collect()
        _finish(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with pytest.raises(TypeError, match="bfloat16"):
        devshare.empty((2,), torch.bfloat16, like="numpy")


def test_read_only_numpy_import_of_a_c_buffer():
    vals = values(torch.float32, (4,), seed=2)
    p, text = _c_export(torch.float32, (4,), None, 0, 0, 16, vals)
    try:
        u = devshare.open(text, like="numpy", read_only=True)
        assert not u.flags.writeable and logical_bytes(u) == logical_bytes(vals)
        with pytest.raises(ValueError):
            u[0] = 1.0
        del u
        gc.collect()
        assert _finish(p) == "data " + logical_bytes(vals).hex()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_python_reshares_an_opened_c_buffer_to_c_without_copying():
    vals = values(torch.int64, (6,), seed=5)
    p, text = _c_export(torch.int64, (6,), None, 0, 0, 48, vals)
    try:
        u = devshare.open(text)
        h2 = devshare.share(u[2:5])
        assert h2.key == devshare.Handle.from_text(text).key  # the same shm object, no copy
        info, data = _tool_open(h2, (b"\xff" * 24).hex())
        assert data == "data " + logical_bytes(vals[2:5]).hex()
        assert (u[2:5] == -1).all()
        assert devshare.outstanding(u) == 0
        del u
        gc.collect()
        devshare.collect()
        expected = vals.clone()
        expected[2:5] = -1
        assert _finish(p) == "data " + logical_bytes(expected).hex()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
