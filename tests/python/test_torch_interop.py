"""PyTorch CPU interop beyond tensor_tool: Python consumers in other processes, the producer's
outstanding/wait, PyTorch's own header count, and stock PyTorch opening a devshare buffer."""

import gc
import os
import sys
import textwrap

import pytest
import torch

import devshare
from conftest import header_count, python_env, run, spawn
from tensors import logical_bytes, values

CHILD = textwrap.dedent("""
    import gc, sys, torch, devshare
    t = devshare.open(sys.argv[1])
    print("opened", t.dtype, tuple(t.shape), t.stride(), flush=True)
    if sys.argv[2] == "hold":
        sys.stdin.readline()  # hold the tensor until the producer says so
    t.mul_(2)
    del t
    gc.collect()
    print("dropped", flush=True)
""")


def test_python_consumer_in_another_process():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:]
    h = devshare.share(t)
    assert header_count(h.key) == 3  # torch + devshare exporter + the in-flight reference
    res = run([sys.executable, "-c", CHILD, h.to_text(), "go"], env=python_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["opened torch.float32 (3, 3) (4, 1)", "dropped"]
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:] * 2
    assert torch.equal(t, expected)
    assert devshare.outstanding(t) == 0
    assert header_count(h.key) == 2
    devshare.collect()
    assert header_count(h.key) == 1  # PyTorch's own mapping only: its idle value


def test_wait_follows_a_consumer_that_holds_then_drops():
    t = torch.zeros(5, dtype=torch.int64)
    h = devshare.share(t)
    p = spawn([sys.executable, "-c", CHILD, h.to_text(), "hold"], env=python_env(),
              stdin=__import__("subprocess").PIPE)
    try:
        assert p.stdout.readline().startswith("opened")
        assert devshare.outstanding(t) == 1
        assert devshare.wait(t, timeout=0.05) is False
        assert devshare.wait(h, timeout=0) is False
        p.stdin.write("go\n")
        p.stdin.flush()
        assert devshare.wait(t, timeout=30) is True
        assert devshare.outstanding(h) == 0
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with pytest.raises(ValueError):
        devshare.wait(t, timeout=-1)


def test_in_process_consumer_drop_returns_reference_and_header_count():
    t = torch.randn(4, 4)
    h1, h2 = devshare.share(t), devshare.share(t[1:, ::2])
    assert devshare.outstanding(t) == 2 and header_count(h1.key) == 4
    u1 = devshare.open(h1)
    u2 = devshare.open(h2)
    assert torch.equal(u1, t) and torch.equal(u2, t[1:, ::2])
    u2.fill_(7.0)
    assert (t[1:, ::2] == 7.0).all()
    # Two imports of one allocation in this process share one mapping.
    assert header_count(h1.key) == 3
    del u1
    gc.collect()
    assert devshare.outstanding(t) == 1
    del u2
    gc.collect()
    assert devshare.outstanding(t) == 0 and header_count(h1.key) == 2
    assert devshare.collect() == 1 and header_count(h1.key) == 1


def test_collect_is_lazy_and_share_collects():
    a, b = torch.ones(3), torch.ones(3)
    ha = devshare.share(a)
    devshare.open(ha)  # opened and dropped at once
    assert devshare.outstanding(a) == 0 and header_count(ha.key) == 2
    hb = devshare.share(b)  # share() closes exporters whose references all came back
    assert header_count(ha.key) == 1 and header_count(hb.key) == 3
    devshare.open(hb)
    # Sharing again after a collect re-adopts the same storage without moving it.
    ptr = a.data_ptr()
    devshare.collect()
    ha2 = devshare.share(a)
    assert ha2.key == ha.key and a.data_ptr() == ptr
    devshare.open(ha2)


def test_storage_outlives_the_tensor_while_a_consumer_holds_it():
    t = torch.arange(6, dtype=torch.int32)
    h = devshare.share(t)
    u = devshare.open(h)
    key = h.key
    del t
    gc.collect()
    assert os.path.exists("/dev/shm" + key.decode())
    assert torch.equal(u, torch.arange(6, dtype=torch.int32))
    del u
    gc.collect()
    devshare.collect()
    assert not os.path.exists("/dev/shm" + key.decode())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                                   torch.bool, torch.complex64, torch.complex128])
def test_every_dtype_round_trips_in_process(dtype):
    t = values(dtype, (3, 4), seed=1)[:, 1::2]
    h = devshare.share(t)
    assert h.torch_dtype() == dtype
    u = devshare.open(h)
    assert u.dtype == dtype and logical_bytes(u) == logical_bytes(t)
    e = devshare.empty((2, 2), dtype)
    assert e.dtype == dtype and tuple(e.shape) == (2, 2) and e.is_contiguous()
    he = devshare.share(e)
    devshare.open(he)
    del u


def test_wait_in_a_thread_while_collect_runs():
    import threading

    t = torch.arange(8.0)
    h = devshare.share(t)
    u = devshare.open(h)
    results = []
    waiter = threading.Thread(target=lambda: results.append(devshare.wait(t, timeout=30)))
    waiter.start()
    others = [torch.ones(2) for _ in range(20)]
    del u
    gc.collect()
    for o in others:  # every share() collects; the waited-on exporter must survive it
        devshare.open(devshare.share(o))
        devshare.collect()
    waiter.join(timeout=30)
    assert results == [True]
    assert devshare.outstanding(t) == 0
