"""Channels, leases and pools (devshare.Channel, devshare.connect, devshare.channel_empty).

The producer runs in this process and consumers in child processes started with
multiprocessing's spawn and fork methods, or as a plain interpreter that imports only numpy;
the killed-producer test turns that around. Children report through a pipe. Every blocking
call has a generous limit so that a bug fails the test instead of hanging it; nothing asserts
on how long anything takes. Channel addresses carry this process's pid.
"""

from __future__ import annotations

import gc
import itertools
import math
import multiprocessing
import os
import pickle
import select
import stat
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch

import devshare
from conftest import CHILD_PIDS, python_env, run

LIMIT = 120  # seconds: only ever reached when something is broken
_counter = itertools.count()


def _address(tag: str) -> str:
    return f"@devshare-test-{os.getpid()}-{tag}-{next(_counter)}"


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    """nbytes bytes that differ for every seed and position."""
    return ((np.arange(nbytes, dtype=np.int64) * 7 + seed * 13) % 251).astype(np.uint8)


# --- Children: their code, and how the parent talks to them ------------------------------------


def _child(fn, pipe, *args):
    """Run fn(pipe, *args) in a child; an exception goes back through the pipe."""
    try:
        fn(pipe, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        pipe.send(("error", traceback.format_exc()))
        raise


def _expect(pipe, what: str):
    """The next message from a child, which must be (what, payload): returns payload."""
    assert pipe.poll(LIMIT), f"no {what!r} from the child"
    tag, payload = pipe.recv()
    if tag == "error":
        raise AssertionError(f"the child failed:\n{payload}")
    assert tag == what, (tag, payload)
    return payload


def _wait_for(pipe, what: str):
    assert pipe.poll(LIMIT), f"the parent never said {what!r}"
    assert pipe.recv() == what


def _bytes_of(t) -> np.ndarray:
    """The bytes of a received tensor/array (zero copy)."""
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return a.reshape(-1).view(np.uint8)


def _consume_and_check(pipe, address, count, like):
    """Receive count items; item k must hold _pattern(its size, k). Reports, per item, (pool,
    slot, data address, dtype, shape, whether the bytes were right)."""
    out = []
    with devshare.connect(address, timeout=LIMIT) as conn:
        for k in range(count):
            with conn.recv(timeout=LIMIT, like=like) as item:
                t = item.tensor
                ptr = t.data_ptr() if like == "torch" else t.__array_interface__["data"][0]
                data = _bytes_of(t)
                ok = bool(np.array_equal(data, _pattern(data.size, k)))
                out.append((item.pool, item.slot, ptr, str(t.dtype), tuple(t.shape), ok))
    pipe.send(("done", out))


def _consume_many(pipe, address, count):
    """Receive count pool items; each starts with its 8-byte sequence number. Reports the
    addresses seen per slot and the items whose number was wrong."""
    ptrs: dict[int, set[int]] = {}
    wrong = []
    with devshare.connect(address, timeout=LIMIT) as conn:
        for k in range(count):
            item = conn.recv(timeout=LIMIT)
            ptrs.setdefault(item.slot, set()).add(item.tensor.data_ptr())
            if int(item.tensor[:8].view(torch.int64)[0]) != k:
                wrong.append(k)
            item.release()
    pipe.send(("done", (ptrs, wrong)))


def _hold(pipe, address, count):
    """Receive count items and hold them until the parent says 'release'; then expect one more
    item, and report the values of all (first float32 of each)."""
    with devshare.connect(address, timeout=LIMIT) as conn:
        items = [conn.recv(timeout=LIMIT) for _ in range(count)]
        pipe.send(("holding", [(i.pool, i.slot) for i in items]))
        _wait_for(pipe, "release")
        firsts = [float(i.tensor.view(torch.float32)[0]) for i in items]
        for i in items:
            i.release()
        pipe.send(("released", firsts))
        with conn.recv(timeout=LIMIT) as last:
            pipe.send(("last", (last.pool, last.slot, float(last.tensor.view(torch.float32)[0]))))


def _hold_until_killed(pipe, address, count):
    conn = devshare.connect(address, timeout=LIMIT)
    items = [conn.recv(timeout=LIMIT) for _ in range(count)]
    pipe.send(("holding", [float(i.tensor.reshape(-1)[0]) for i in items]))
    time.sleep(10 * LIMIT)  # killed by the parent


def _produce_then_wait(pipe, address):
    """A producer in the child: a pool item and a lease for the first consumer, then it waits
    to be killed."""
    with devshare.Channel(address) as ch:
        pipe.send(("listening", None))
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        pool = ch.pool(4096, 2)
        slot = pool.acquire(timeout=LIMIT)
        slot.numpy()[:] = _pattern(4096, 0)
        slot.send(peer)
        t = devshare.channel_empty((3, 1000), "int32", like="numpy")
        t[:] = np.arange(3000, dtype=np.int32).reshape(3, 1000)
        ch.send(peer, t[1:, ::2])
        pipe.send(("sent", None))
        time.sleep(10 * LIMIT)  # killed by the parent


@pytest.fixture
def children():
    """Start children with start(method, fn, *args) -> (process, parent end of a pipe); the
    ones still running at the end are killed."""
    started = []

    def start(method, fn, *args):
        ctx = multiprocessing.get_context(method)
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=_child, args=(fn, child_end) + args, daemon=True)
        p.start()
        CHILD_PIDS.add(p.pid)
        child_end.close()
        started.append(p)
        return p, parent_end

    yield start
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(LIMIT)


def _finish(proc):
    proc.join(LIMIT)
    assert proc.exitcode == 0, f"the child exited with {proc.exitcode}"


# --- Pools -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("slot_nbytes", [4096, 3 << 20])
def test_pool_items_arrive_intact(children, method, slot_nbytes):
    """Whole slots as bytes, typed 2-D views and views at an offset, to a consumer started with
    spawn and with fork, reading through torch."""
    address = _address("pool")
    n = 8
    with devshare.Channel(address) as ch:
        proc, pipe = children(method, _consume_and_check, address, n, "torch")
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        assert ch.peer_info(peer)["pid"] == proc.pid
        with ch.pool(slot_nbytes, 3) as pool:
            assert (pool.slot_nbytes, pool.count) == (slot_nbytes, 3)
            for k in range(n):
                slot = pool.acquire(timeout=LIMIT)
                if k % 3 == 0:  # the whole slot, as uint8 bytes
                    slot.numpy()[:] = _pattern(slot_nbytes, k)
                    slot.send(peer)
                elif k % 3 == 1:  # float32 rows x 256, filled through torch
                    rows = slot_nbytes // 1024
                    t = slot.tensor((rows, 256), torch.float32)
                    t.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(_pattern(rows * 1024, k)))
                    slot.send(peer, (rows, 256), torch.float32)
                else:  # 100 int16 elements 64 bytes into the slot, described by the view itself
                    v = slot.numpy((100,), "int16", offset=64)
                    v.view(np.uint8)[:] = _pattern(200, k)
                    slot.send(peer, view=v)
            result = _expect(pipe, "done")
        _finish(proc)
    assert [r[5] for r in result] == [True] * n, result
    assert {r[0] for r in result} == {pool.id}, "pool items came without their pool's id"
    rows = slot_nbytes // 1024
    assert [(r[3], r[4]) for r in result[:3]] == [
        ("torch.uint8", (slot_nbytes,)), ("torch.float32", (rows, 256)), ("torch.int16", (100,))]
    # Every slot keeps one address: items of the same slot were at the same place.
    by_slot: dict = {}
    for _, slot, ptr, dtype, _, _ in result:
        by_slot.setdefault(slot, set()).add(ptr - 64 if dtype == "torch.int16" else ptr)
    assert all(len(p) == 1 for p in by_slot.values()), by_slot


def test_pool_slots_keep_their_addresses_over_1000_items(children):
    address = _address("addresses")
    n = 1000
    with devshare.Channel(address) as ch:
        proc, pipe = children("fork", _consume_many, address, n)
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        producer_addresses: dict[int, set[int]] = {}
        with ch.pool(4096, 4) as pool:
            for k in range(n):
                slot = pool.acquire(timeout=LIMIT)
                producer_addresses.setdefault(slot.index, set()).add(slot.address)
                slot.tensor((512,), torch.int64)[0] = k
                slot.send(peer)
            consumer_addresses, wrong = _expect(pipe, "done")
        _finish(proc)
    assert wrong == []
    assert sorted(producer_addresses) == sorted(consumer_addresses) == [0, 1, 2, 3]
    assert all(len(a) == 1 for a in producer_addresses.values()), producer_addresses
    assert all(len(a) == 1 for a in consumer_addresses.values()), consumer_addresses
    # ... 4096 bytes apart, in slot order, in both processes.
    base = producer_addresses[0].copy().pop()
    assert all(producer_addresses[i] == {base + 4096 * i} for i in range(4))
    cbase = consumer_addresses[0].copy().pop()
    assert all(consumer_addresses[i] == {cbase + 4096 * i} for i in range(4))


def test_acquire_blocks_while_the_consumer_holds_every_slot(children):
    address = _address("backpressure")
    with devshare.Channel(address) as ch:
        proc, pipe = children("fork", _hold, address, 2)
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        with ch.pool(4096, 2) as pool:
            for k in range(2):
                slot = pool.acquire(timeout=LIMIT)
                slot.tensor((1,), torch.float32)[0] = 10.0 + k
                slot.send(peer)
            held = _expect(pipe, "holding")
            assert sorted(s for _, s in held) == [0, 1]
            assert pool.free_slots == 0
            with pytest.raises(TimeoutError):
                pool.acquire(timeout=0)
            with pytest.raises(TimeoutError):
                pool.acquire(timeout=0.2)  # the consumer holds both until told otherwise
            assert ch.peer_info(peer)["leases"] >= 1
            pipe.send("release")
            assert _expect(pipe, "released") == [10.0, 11.0]
            slot = pool.acquire(timeout=LIMIT)  # a returned slot
            slot.tensor((1,), torch.float32)[0] = 12.0
            slot.send(peer)
            assert _expect(pipe, "last")[1:] == (slot.index, 12.0)
        _finish(proc)


def test_slots_go_back_unsent_and_are_used_once(children):
    with devshare.Channel(_address("slots")) as ch, ch.pool(256, 2) as pool:
        a = pool.acquire(timeout=0)
        with pool.acquire(timeout=0) as b:
            assert {a.index, b.index} == {0, 1} and pool.free_slots == 0
            assert b.address - a.address == 256 * (b.index - a.index)
        assert pool.free_slots == 1  # the with block gave b back
        a.release()
        with pytest.raises(devshare.Error) as e:
            a.release()
        assert e.value.status == devshare.Status.INVALID_ARGUMENT
        with pytest.raises(devshare.Error):
            a.send(1)
        assert pool.free_slots == 2
        # A slot dropped with its views goes back once the last view is gone.
        c = pool.acquire(timeout=0)
        view = c.tensor((4,), torch.int32)
        del c
        gc.collect()
        assert pool.free_slots == 1
        del view
        gc.collect()
        assert pool.free_slots == 2
        # The views are exact: shape, dtype, offset, bounds.
        with pool.acquire(timeout=0) as d:
            assert d.numpy().shape == (256,) and d.numpy(dtype="float64").shape == (32,)
            assert d.tensor((2, 3), torch.int16, offset=4).data_ptr() == d.address + 4
            with pytest.raises(ValueError, match="beyond the 256-byte slot"):
                d.tensor((65,), torch.float32)
    with pytest.raises(ValueError, match="closed"):
        pool.acquire(timeout=0)


def test_a_pool_over_existing_memory(children):
    address = _address("memory")
    mem = devshare.channel_empty((4, 1024), torch.uint8)
    with devshare.Channel(address) as ch:
        proc, pipe = children("fork", _consume_and_check, address, 4, "numpy")
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        with ch.pool(1024, 4, memory=mem) as pool:
            for k in range(4):
                slot = pool.acquire(timeout=LIMIT)
                assert slot.address == mem.data_ptr() + 1024 * slot.index
                mem[slot.index] = torch.from_numpy(_pattern(1024, k))
                slot.send(peer)
            result = _expect(pipe, "done")
        _finish(proc)
    assert [r[5] for r in result] == [True] * 4
    with devshare.Channel(_address("memory-small")) as ch:
        with pytest.raises(ValueError, match="do not fit"):
            ch.pool(1024, 5, memory=mem)
        with pytest.raises(TypeError, match="channel_empty"):
            ch.pool(1024, 1, memory=torch.zeros(1024, dtype=torch.uint8))


# --- Leases ----------------------------------------------------------------------------------------


@pytest.fixture
def pair():
    """A channel and a connection to it, both in this process (the connect runs in a thread
    while this thread serves the channel)."""
    address = _address("pair")
    ch = devshare.Channel(address)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("conn", devshare.connect(address, timeout=LIMIT)))
    th.start()
    (peer,) = ch.wait_peers(1, timeout=LIMIT)
    th.join(LIMIT)
    conn = box["conn"]
    assert (conn.peer_id, conn.producer_pid) == (peer, os.getpid())
    yield ch, conn, peer
    conn.close()
    ch.close()


def test_a_leased_send_is_outstanding_until_released(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty((16, 64), torch.float32)
    t.copy_(torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64))
    assert devshare.outstanding(t) == 0
    ch.send(peer, t[2:5, 1::3])  # a strided view at an offset
    assert devshare.outstanding(t) == 1
    item = conn.recv(timeout=LIMIT)
    assert item.pool is None and item.slot is None
    assert torch.equal(item.tensor, t[2:5, 1::3])
    assert item.tensor.stride() == (64, 3)
    item.tensor[0, 0] = -1.0  # the same memory, no copy
    assert t[2, 1].item() == -1.0
    ch.service(timeout=0)
    assert devshare.outstanding(t) == 1 and ch.peer_info(peer)["leases"] == 1
    item.release()
    assert devshare.wait(t, timeout=LIMIT)
    assert devshare.outstanding(t) == 0 and ch.peer_info(peer)["leases"] == 0


def test_a_leased_send_of_named_host_memory(pair):
    """devshare.empty() memory (a named shm object) is leased like channel memory."""
    ch, conn, peer = pair
    a = devshare.empty((5, 5), "float32", like="numpy")
    a[:] = np.arange(25, dtype=np.float32).reshape(5, 5)
    ch.send(peer, a[1:3])
    assert devshare.outstanding(a) == 1
    with conn.recv(timeout=LIMIT, like="numpy") as item:
        assert np.array_equal(item.tensor, a[1:3])
    assert devshare.wait(a, timeout=LIMIT) and devshare.outstanding(a) == 0


def test_releasing_twice_raises_and_returns_once(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty(100, "int64")
    ch.send(peer, t)
    ch.send(peer, t)
    first, second = conn.recv(timeout=LIMIT), conn.recv(timeout=LIMIT)
    first.release()
    with pytest.raises(devshare.Error) as e:
        first.release()
    assert e.value.status == devshare.Status.ALREADY_RELEASED
    with pytest.raises(devshare.Error):
        first.tensor  # noqa: B018 - released: no tensor any more
    # One return reached the producer, not two: the second item is still counted.
    for _ in range(3):
        ch.service(timeout=0)
    assert devshare.outstanding(t) == 1
    with second:
        assert second.tensor.shape == (100,)
    assert second.released
    assert devshare.wait(t, timeout=LIMIT) and devshare.outstanding(t) == 0


def test_items_released_by_garbage_collection(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty(10, "float64", like="numpy")
    t[:] = 4.5
    ch.send(peer, t)
    view = conn.recv(timeout=LIMIT, like="numpy").tensor  # the item itself is dropped at once
    gc.collect()
    assert view.sum() == 45.0  # the view keeps the item alive
    ch.service(timeout=0)
    assert devshare.outstanding(t) == 1
    del view
    gc.collect()
    assert devshare.wait(t, timeout=LIMIT)


def test_a_pool_item_goes_back_when_the_last_view_of_it_is_gone(pair):
    ch, conn, peer = pair
    with ch.pool(64, 1) as pool:
        pool.acquire(timeout=0).send(peer)
        view = conn.recv(timeout=LIMIT).tensor[2:5]  # the item and its tensor are dropped at once
        gc.collect()
        with pytest.raises(TimeoutError):
            pool.acquire(timeout=0)  # the view keeps the item, so the slot is still out
        del view
        gc.collect()
        pool.acquire(timeout=LIMIT).release()


@pytest.mark.parametrize("like", ["torch", "numpy"])
def test_release_all_gives_back_the_held_items_only(pair, like):
    """Of four pool items, one released, one dropped, one kept only through a view of its
    tensor and one held: release_all gives back the two still held (the view's and the held
    one) and nothing twice; the slots all come back, and the connection keeps no record of
    items that went (1000 more items leave nothing behind)."""
    ch, conn, peer = pair
    with ch.pool(64, 4) as pool:
        for _ in range(4):
            pool.acquire(timeout=0).send(peer)
        released, dropped, viewed, held = (conn.recv(timeout=LIMIT, like=like) for _ in range(4))
        released.release()
        del dropped
        view = viewed.tensor[1:3]
        del viewed
        gc.collect()
        assert conn.release_all() == 2
        assert held.released
        assert conn.release_all() == 0
        for _ in range(4):
            pool.acquire(timeout=LIMIT).release()
        del view, held, released
        gc.collect()
        for k in range(1000):
            pool.acquire(timeout=LIMIT).send(peer)
            conn.recv(timeout=LIMIT, like=like).release()
        gc.collect()
        assert len(conn._items) == 0, "records of items that went stay behind"


@pytest.mark.parametrize("like", ["torch", "numpy"])
def test_repeated_and_changing_slot_layouts_arrive_exact(pair, like):
    """Slot.send keeps descriptors by layout, and the consumer its views (or numpy recipes) by
    slot and layout: each item still gets its own layout, and what would be refused is refused
    every time."""
    ch, conn, peer = pair
    layouts = [((4, 8), torch.float32, None, 0), ((4, 8), torch.float32, None, 0),
               ((8, 4), torch.float32, (1, 8), 0), ((3,), "int16", None, 6),
               ((4, 8), torch.float32, None, 0), ((2, 2), torch.int64, (2, 1), 8)]
    with ch.pool(256, 1) as pool:
        for k, (shape, dtype, strides, offset) in enumerate(layouts * 2):
            slot = pool.acquire(timeout=LIMIT)
            slot.tensor()[:] = torch.from_numpy(_pattern(256, k))
            slot.send(peer, shape, dtype, strides, offset)
            flat = slot.tensor(dtype=dtype, offset=offset)
            want = flat[:math.prod(shape)].view(shape) if strides is None else flat.as_strided(shape, strides)
            with conn.recv(timeout=LIMIT, like=like) as item:
                if like == "torch":
                    assert item.tensor.dtype == want.dtype and item.tensor.shape == want.shape
                    assert item.tensor.stride() == want.stride() and torch.equal(item.tensor, want)
                else:
                    w = want.numpy()
                    assert item.tensor.dtype == w.dtype and item.tensor.shape == w.shape
                    assert item.tensor.strides == w.strides and np.array_equal(item.tensor, w)
        with pool.acquire(timeout=LIMIT) as slot:
            for bad in ((8.0, 1.0), (True, 1)):
                with pytest.raises(TypeError):
                    slot.send(peer, (4, 8), torch.float32, bad)
            with pytest.raises(ValueError, match="out of range"):
                slot.send(peer, (4, 8), torch.float32, (2**63, 1))
            v = slot.tensor((4, 8), torch.float32)
            for _ in range(2):  # view= through the same cache
                assert slot._state == "acquired"
                slot.send(peer, view=v[1:3, ::2])
                with conn.recv(timeout=LIMIT) as item:
                    assert torch.equal(item.tensor, v[1:3, ::2]) and item.tensor.stride() == (8, 2)
                slot = pool.acquire(timeout=LIMIT)
                v = slot.tensor((4, 8), torch.float32)


def test_racing_releases_give_an_item_back_once(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty(8, "int32")
    for _ in range(20):
        ch.send(peer, t)
        ch.send(peer, t)
        item, other = conn.recv(timeout=LIMIT), conn.recv(timeout=LIMIT)
        start, outcomes = threading.Barrier(2), []

        def release():
            start.wait()
            try:
                item.release()
                outcomes.append("released")
            except devshare.Error as e:
                outcomes.append(e.status)

        threads = [threading.Thread(target=release) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(LIMIT)
        assert sorted(map(str, outcomes)) == sorted(["released", str(devshare.Status.ALREADY_RELEASED)])
        for _ in range(3):
            ch.service(timeout=0)
        assert devshare.outstanding(t) == 1  # only one went back: `other` is still out
        other.release()
        assert devshare.wait(t, timeout=LIMIT)


def test_file_descriptors_become_readable(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty(8)
    assert select.select([conn.fileno()], [], [], 0)[0] == []
    ch.send(peer, t)
    assert select.select([conn.fileno()], [], [], LIMIT)[0] == [conn.fileno()]
    item = conn.recv(timeout=0)
    item.release()
    assert select.select([ch.fileno()], [], [], LIMIT)[0] == [ch.fileno()]
    ch.service(timeout=0)
    assert devshare.outstanding(t) == 0


def test_send_refuses_memory_it_cannot_lease(pair):
    ch, conn, peer = pair
    with pytest.raises(TypeError, match="channel_empty"):
        ch.send(peer, np.zeros(4, dtype=np.float32))  # (a CPU torch tensor is moved to shm)
    with pytest.raises(ValueError, match="stream"):
        ch.send(peer, devshare.channel_empty(4), stream=0)
    with pytest.raises(devshare.Error) as e:
        ch.send(peer + 1000, devshare.channel_empty(4))
    assert e.value.status == devshare.Status.NOT_FOUND
    with pytest.raises(devshare.Error) as e:
        devshare.share(devshare.channel_empty(4))  # no name: only channels carry it
    assert e.value.status == devshare.Status.UNSUPPORTED
    with pytest.raises(TimeoutError):
        conn.recv(timeout=0)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_killed_consumer_gives_everything_back(children, method):
    address = _address("killed-consumer")
    t = devshare.channel_empty(1000, torch.float32)
    t.fill_(1.5)
    with devshare.Channel(address) as ch, ch.pool(4096, 1) as pool:
        proc, pipe = children(method, _hold_until_killed, address, 3)
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        ch.send(peer, t)
        ch.send(peer, t[500:])
        slot = pool.acquire(timeout=LIMIT)
        slot.tensor((1,), torch.float32)[0] = 2.5
        slot.send(peer, (1,), torch.float32)
        assert _expect(pipe, "holding") == [1.5, 1.5, 2.5]
        assert devshare.outstanding(t) == 2
        proc.kill()
        proc.join(LIMIT)
        assert devshare.wait(t, timeout=LIMIT), "the dead consumer's leases did not come back"
        assert devshare.outstanding(t) == 0
        with pool.acquire(timeout=LIMIT):  # its slot came back too
            pass
        ch.service(timeout=0)
        assert ch.peers() == []


# --- The producer goes away ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_killed_producer_closes_the_channel_and_items_stay_readable(children, method):
    address = _address("killed-producer")
    proc, pipe = children(method, _produce_then_wait, address)
    _expect(pipe, "listening")
    with devshare.connect(address, timeout=LIMIT) as conn:
        assert conn.producer_pid == proc.pid
        _expect(pipe, "sent")
        slot_item = conn.recv(timeout=LIMIT)
        lease_item = conn.recv(timeout=LIMIT, like="numpy")
        proc.kill()
        proc.join(LIMIT)
        with pytest.raises(devshare.ChannelClosed) as e:
            conn.recv(timeout=LIMIT)
        assert isinstance(e.value, devshare.Error) and e.value.status == devshare.Status.CLOSED
        # What arrived before stays valid until released.
        assert np.array_equal(slot_item.tensor.numpy(), _pattern(4096, 0))
        expected = np.arange(3000, dtype=np.int32).reshape(3, 1000)[1:, ::2]
        assert np.array_equal(lease_item.tensor, expected)
        slot_item.release()
        lease_item.release()
        assert list(conn) == []  # iterating stops at the close


def test_closing_the_channel_ends_the_consumers_stream(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty(4, "int32")
    t[:] = 7
    ch.send(peer, t)
    ch.close()
    assert ch.closed
    # Queued items first, then ChannelClosed.
    with conn.recv(timeout=LIMIT) as item:
        assert item.tensor.tolist() == [7, 7, 7, 7]
    with pytest.raises(devshare.ChannelClosed):
        conn.recv(timeout=LIMIT)
    with pytest.raises(ValueError, match="closed"):
        ch.send(peer, t)
    ch.close()  # again: nothing


# --- Processes ----------------------------------------------------------------------------------------


_INHERITED: dict = {}


def _use_inherited(pipe):
    """In a forked child: every inherited object refuses to work, naming fork."""
    messages = []
    for call in (lambda: _INHERITED["channel"].peers(), lambda: _INHERITED["connection"].recv(timeout=0),
                 lambda: _INHERITED["channel"].close(), lambda: _INHERITED["item"].release(),
                 lambda: _INHERITED["pool"].acquire(timeout=0)):
        try:
            call()
        except RuntimeError as e:
            messages.append(str(e))
        else:
            messages.append(None)
    value = int(_INHERITED["item"].tensor[0])  # the memory itself is readable
    _INHERITED.clear()
    gc.collect()  # dropping them here must not close or release the parent's
    pipe.send(("done", (messages, value)))


def test_objects_inherited_through_fork_refuse_to_work(pair, children):
    ch, conn, peer = pair
    t = devshare.channel_empty(4, "int64")
    t[:] = 9
    ch.send(peer, t)
    _INHERITED.update(channel=ch, connection=conn, item=conn.recv(timeout=LIMIT), pool=ch.pool(64, 1))
    try:
        proc, pipe = children("fork", _use_inherited)
        messages, value = _expect(pipe, "done")
        _finish(proc)
    finally:
        item = _INHERITED.pop("item")
        _INHERITED.clear()
    assert value == 9
    assert all(m is not None and "fork" in m for m in messages), messages
    # The parent's objects still work: its item is held, its channel serves, its connection receives.
    ch.service(timeout=0)
    assert devshare.outstanding(t) == 1 and ch.peers() == [peer]
    item.release()
    assert devshare.wait(t, timeout=LIMIT)
    ch.send(peer, t)
    conn.recv(timeout=LIMIT).release()


def test_channels_cannot_be_pickled(pair):
    ch, conn, _ = pair
    for obj in (ch, conn):
        with pytest.raises(TypeError, match="address"):
            pickle.dumps(obj)


_NUMPY_CONSUMER = r"""
import sys
import numpy as np
import devshare

with devshare.connect(sys.argv[1], timeout=120) as conn:
    while True:
        try:
            item = conn.recv(timeout=120, like="numpy")
        except devshare.ChannelClosed:
            break
        with item:
            a = item.tensor
            print(item.pool is not None, a.dtype, a.shape, float(a.sum()), flush=True)
assert "torch" not in sys.modules, "devshare imported torch"
print("end", flush=True)
"""


def test_a_numpy_only_consumer_process():
    """A plain interpreter (no multiprocessing, no torch) consumes through numpy."""
    address = _address("numpy")
    with devshare.Channel(address) as ch:
        box = {}
        th = threading.Thread(target=lambda: box.setdefault(
            "r", run([sys.executable, "-c", _NUMPY_CONSUMER, address], timeout=LIMIT, env=python_env())))
        th.start()
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
        with ch.pool(4096, 2) as pool:
            for k in range(3):
                with pool.acquire(timeout=LIMIT) as slot:
                    slot.numpy((1024,), "int32")[:] = k + 1
                    slot.send(peer, (1024,), "int32")
            t = devshare.channel_empty((2, 3), "float64", like="numpy")
            t[:] = 0.5
            ch.send(peer, t)
            ch.close()  # the consumer's loop ends after the queued items
        th.join(LIMIT)
    r = box["r"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["True int32 (1024,) 1024.0", "True int32 (1024,) 2048.0",
                                     "True int32 (1024,) 3072.0", "False float64 (2, 3) 3.0",
                                     "end"], r.stdout


# --- The channel itself --------------------------------------------------------------------------------


def test_path_addresses(tmp_path):
    path = tmp_path / f"channel-{os.getpid()}.sock"
    with devshare.Channel(path) as ch:
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert ch.address == str(path) and ch.peers() == []
        with pytest.raises(TimeoutError):
            ch.wait_peers(1, timeout=0)
        with pytest.raises(devshare.Error) as e:
            devshare.Channel(path)  # never replaces a file
        assert e.value.status == devshare.Status.BUSY
    assert not path.exists()
    other = tmp_path / f"file-{os.getpid()}"
    other.write_text("x")
    with pytest.raises(devshare.Error):
        devshare.Channel(other)
    assert other.read_text() == "x"
    with pytest.raises(devshare.Error):
        devshare.connect(tmp_path / f"nobody-{os.getpid()}.sock", timeout=LIMIT)


def test_restrict_refuses_other_processes():
    address = _address("restrict")
    with devshare.Channel(address) as ch:
        ch.restrict(pids=[os.getppid()])  # not this process
        errors = []

        def connect():
            try:
                devshare.connect(address, timeout=LIMIT).close()
            except devshare.Error as e:
                errors.append(e)

        th = threading.Thread(target=connect)
        th.start()
        for _ in range(LIMIT):
            if not th.is_alive():
                break
            ch.service(timeout=1)
        th.join(LIMIT)
        assert len(errors) == 1 and ch.peers() == []
        assert errors[0].status == devshare.Status.UNTRUSTED and str(os.getpid()) in errors[0].message
        ch.restrict(uids=[os.geteuid()], pids=[os.getpid()])
        counted = threading.Event()

        def stay():
            # Connected until the producer counted it: a consumer that hangs up at once may be
            # gone before wait_peers looks.
            with devshare.connect(address, timeout=LIMIT):
                counted.wait(LIMIT)

        th = threading.Thread(target=stay)
        th.start()
        peers = ch.wait_peers(1, timeout=LIMIT)
        info = ch.peer_info(peers[0])
        counted.set()
        th.join(LIMIT)
        assert info["uid"] == os.geteuid()
    with devshare.Channel(_address("bad")) as ch, pytest.raises(ValueError):
        ch.restrict(pids=[0])


def test_channel_prototypes_match_the_header(tmp_path):
    """The channel functions' ctypes prototypes (devshare._abi.channel_signatures, bound by
    devshare._channel) equal devshare.h's, and cover every channel, pool and connection
    function there."""
    import abi_check
    from devshare import _abi, _lib

    cc = abi_check.find_cc()
    assert cc is not None, "no C compiler for tests/c/layout_dump.c"
    header = abi_check.load_header()
    checker = abi_check.Checker(header, abi_check.run_dump(tmp_path, cc))
    sigs = (_abi.channel_signatures(_lib.ExporterP, _lib.ImportP) + _abi.channel_signatures_1_2(_lib.ImportP)
            + _abi.channel_signatures_1_4(_lib.ExporterP, _lib.ImportP) + _abi.channel_signatures_1_7(_lib.ImportP)
            + _abi.channel_signatures_1_8() + _abi.channel_signatures_1_10(_lib.ExporterP)
            + _abi.channel_signatures_1_11(_lib.ExporterP, _lib.ImportP) + _abi.channel_signatures_1_12()
            + _abi.channel_signatures_1_16())
    problems = [p for name, restype, argtypes in sigs
                for p in checker.function_problems(name, restype, argtypes)]
    assert not problems, problems
    ours = {name for name, _, _ in sigs}
    theirs = {f for f in header.functions
              if f.startswith(("devshare_channel_", "devshare_pool_", "devshare_connection_"))}
    theirs |= {"devshare_import_pool_slot", "devshare_peer_info_init", "devshare_import_give_back",
               "devshare_import_describe", "devshare_item_init", "devshare_recv_args_init",
               "devshare_import_name", "devshare_items_release", "devshare_imports_give_back"}
    assert ours == theirs
    # ... and they are the prototypes the package calls with.
    for name, restype, argtypes in sigs:
        fn = getattr(_lib.lib, name)
        assert (fn.restype, list(fn.argtypes)) == (restype, argtypes), name


def test_channel_empty():
    t = devshare.channel_empty((3, 4), torch.bfloat16)
    assert t.shape == (3, 4) and t.dtype == torch.bfloat16 and not t.any()
    a = devshare.channel_empty(5, "uint16", like="numpy")
    assert a.shape == (5,) and a.dtype == np.uint16
    assert devshare.Channel.host_empty((0, 2)).shape == (0, 2)
    with pytest.raises(ValueError):
        devshare.channel_empty((-1,))
    with pytest.raises(ValueError):
        devshare.channel_empty(4, like="jax")


# --- What one careless peer or thread can no longer do ------------------------------------------


def test_a_pool_of_2_31_slots_raises_instead_of_killing_the_interpreter():
    with devshare.Channel(_address("huge-pool")) as ch:
        with pytest.raises(devshare.Error):
            ch.pool(64, 2**31)  # 128 GiB: more than shared memory holds
        with pytest.raises(devshare.Error) as e:
            ch.pool(1, 2**31)  # 2 GiB of memory, but more slots than a pool may have
        assert e.value.status in (devshare.Status.BAD_SIZE, devshare.Status.OS), e.value


def test_a_tensor_used_after_its_lease_is_released_stays_mapped(pair):
    """Item.release() gives the lease back at once, but the memory stays mapped while a tensor
    over it lives: reading it after the release (and after the producer freed its side) reads
    memory, never faults."""
    ch, conn, peer = pair
    t = devshare.channel_empty(4096, "uint8")
    t[:] = 7
    ch.send(peer, t)
    item = conn.recv(timeout=LIMIT)
    kept = item.tensor[100:200]
    item.release()
    assert devshare.wait(t, timeout=LIMIT) and devshare.outstanding(t) == 0  # back at once
    del t
    gc.collect()  # the producer's own mapping and export are gone
    assert int(kept.sum()) == 7 * 100  # the consumer's mapping is not
    del kept
    gc.collect()


def test_a_pool_tensor_kept_after_release_shows_the_next_item_and_survives_the_close(pair):
    """The stale-data case, documented: a view of a pool item kept after its release reads what
    the producer writes into that slot next. It stays mapped after the connection closes too."""
    ch, conn, peer = pair
    pool = ch.pool(64, 1)
    slot = pool.acquire(timeout=LIMIT)
    slot.tensor((64,), "uint8")[:] = 1
    slot.send(peer)
    first = conn.recv(timeout=LIMIT)
    stale = first.tensor
    first.release()
    slot = pool.acquire(timeout=LIMIT)  # the same (only) slot, back at once
    slot.tensor((64,), "uint8")[:] = 2
    slot.send(peer)
    second = conn.recv(timeout=LIMIT)
    assert (second.slot, int(second.tensor[0])) == (first.slot, 2)
    assert int(stale[0]) == 2  # the next item's data: copy what you keep
    kept = second.tensor
    second.release()
    conn.close()
    pool.close()
    gc.collect()
    assert int(kept.sum()) == 2 * 64  # still mapped: nothing faults


def _pool_mappings(nbytes: int) -> int:
    """How many mappings of channel memory of exactly ``nbytes`` this process has."""
    n = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "devshare-channel" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                n += hi - lo == nbytes
    return n


@pytest.mark.skipif(not devshare._channel._RAW_RECV_ITEM, reason="needs libdevshare 1.7")
@pytest.mark.parametrize("receive", ["args", "item"])
@pytest.mark.parametrize("end", ["pool closed", "connection closed"])
def test_dropped_pool_items_are_unmapped_by_the_next_receive_or_the_close(pair, end, receive, monkeypatch):
    """A pool item given back and dropped leaves its import to the connection's next receive
    (released in the same library call, devshare_connection_recv_args or _recv_item); whatever
    is left when the pool or the connection closes is released then: nothing of the pool stays
    mapped in the consumer."""
    _receive_as(monkeypatch, receive)
    ch, conn, peer = pair
    nbytes = 3 * 8192  # a size no other mapping here has
    pool = ch.pool(nbytes // 2, 2)
    producer_only = _pool_mappings(nbytes)
    for k in range(3):
        slot = pool.acquire(timeout=LIMIT)
        slot.tensor((8,), "int64")[0] = k
        slot.send(peer, (8,), "int64")
        item = conn.recv(timeout=LIMIT)
        assert int(item.tensor[0]) == k
        assert len(conn._grave.imps) == 0, "the receive released the import left before it"
        item.release()
        del item, slot
        gc.collect()
        assert len(conn._grave.imps) == 1, "given back and dropped: left for the next receive"
        assert _pool_mappings(nbytes) == producer_only + 1
    if end == "pool closed":
        pool.close()
        with pytest.raises(TimeoutError):
            conn.recv(timeout=0)  # takes the pool's close, and releases the import left
        assert conn._grave.imps == []
    else:
        conn.close()
        assert conn._grave.imps == [] and not conn._grave.open
        pool.close()
    gc.collect()
    assert _pool_mappings(nbytes) == producer_only, "the consumer still maps the pool"


def test_disconnect_takes_a_consumers_items_back_at_once(pair):
    ch, conn, peer = pair
    t = devshare.channel_empty(256, "uint8")
    ch.send(peer, t)
    item = conn.recv(timeout=LIMIT)
    assert devshare.outstanding(t) == 1
    ch.disconnect(peer)
    assert devshare.outstanding(t) == 0 and ch.peers() == []
    with pytest.raises(devshare.ChannelClosed):
        conn.recv(timeout=LIMIT)
    with pytest.raises(devshare.Error) as e:
        ch.disconnect(peer)
    assert e.value.status == devshare.Status.NOT_FOUND
    item.release()


def test_a_finalizer_that_runs_while_a_call_is_inside_leaves_the_close_to_that_call():
    """What the interpreter's exit does to a Channel whose service() runs in a daemon thread:
    the finalizer must not free the library object under the call; the call's exit does."""
    from devshare import _channel

    closed = []

    class Probe(_channel._Owned):
        _what = "Probe"

    p = Probe()
    p._own("ptr", lambda ptr: closed.append(ptr))
    p._enter()  # a thread is inside a call
    p._fin()  # the finalizer runs (garbage, or the interpreter's exit)
    assert closed == [], "closed under a running call"
    with pytest.raises(ValueError, match="closed"):
        p._enter()  # no new calls
    p._exit()  # the call leaves: now it is closed, once
    assert closed == ["ptr"]
    p._fin()
    assert closed == ["ptr"]


_EXIT_WITH_DAEMONS = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import devshare
address = "@devshare-exit-%d" % os.getpid()
ch = devshare.Channel(address)
def serve():
    while True:
        try:
            ch.service(timeout=0.001)
        except Exception:
            return
threading.Thread(target=serve, daemon=True).start()
conn = devshare.connect(address, timeout=30)
def receive():
    while True:
        try:
            conn.recv(timeout=0.001)
        except TimeoutError:
            continue
        except Exception:
            return
threading.Thread(target=receive, daemon=True).start()
time.sleep(0.05)
# exit with both daemon threads inside calls: the finalizers run now
"""


def test_the_interpreter_exits_cleanly_with_daemon_threads_inside_channel_calls():
    python_dir = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    for i in range(20):
        r = run([sys.executable, "-c", _EXIT_WITH_DAEMONS, python_dir], env=python_env(), timeout=LIMIT)
        assert r.returncode == 0, f"exit {i}: returncode {r.returncode}: {r.stderr[-2000:]}"


_CLOSE_RACE = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import devshare
address = "@devshare-close-race-%d" % os.getpid()
ch = devshare.Channel(address)
box = {}
th = threading.Thread(target=lambda: box.setdefault("conn", devshare.connect(address, timeout=30)))
th.start()
(peer,) = ch.wait_peers(1, timeout=30)
th.join()
conn = box["conn"]
pool = ch.pool(64, 1)
held = pool.acquire(timeout=0)  # every slot out: acquire(timeout=0) times out
errors = []
def hammer(call):
    while True:
        try:
            call()
        except TimeoutError:
            time.sleep(0.0001)  # (outside a call now and then, so that a close can get through)
            continue
        except ValueError as e:  # closed: the end
            if "closed" not in str(e):
                errors.append(repr(e))
            return
        except BaseException as e:
            errors.append(repr(e))
            return
busy = 0
for obj, call in ((conn, lambda: conn.recv(timeout=0)), (pool, lambda: pool.acquire(timeout=0))):
    threads = [threading.Thread(target=hammer, args=(call,)) for _ in range(3)]
    for t in threads:
        t.start()
    while True:
        try:
            obj.close()
            break
        except devshare.Error as e:
            assert e.status == devshare.Status.BUSY, e
            busy += 1
    for t in threads:
        t.join(30)
        assert not t.is_alive()
print("busy", busy, "errors", errors)
sys.exit(1 if errors else 0)
"""


def test_closing_under_racing_calls_is_refused_or_ends_them_cleanly():
    """Threads calling recv / acquire in a loop while another closes the object: each close is
    refused (BUSY) while a call is inside, one succeeds, every later call raises 'closed', and
    nothing crashes (the library object is freed only with no call inside)."""
    python_dir = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    for i in range(3):
        r = run([sys.executable, "-c", _CLOSE_RACE, python_dir], env=python_env(), timeout=LIMIT)
        assert r.returncode == 0, f"run {i}: returncode {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}"


def test_trusting_announced_pids_is_a_switch_that_takes_a_bool():
    with devshare.Channel(_address("trust")) as ch:
        ch.trust_announced_pids(True)
        ch.trust_announced_pids(False)
        with pytest.raises(TypeError):
            ch.trust_announced_pids(1)


def test_releases_the_producers_socket_has_no_room_for_are_kept_not_lost(pair):
    """400 releases while the producer serves nothing: its socket fills up (about 280 small
    messages). The release that finds it full waits out the send patience once, the rest wait
    in the consumer's backlog (no further stall), and the consumer's next call sends them: every
    lease comes back, none is lost."""
    ch, conn, peer = pair
    tensors = [devshare.channel_empty(1) for _ in range(400)]
    ch.send_batch(peer, tensors)
    items = []
    while len(items) < 400:
        ch.service(timeout=0)  # what the consumer's socket had no room for goes out
        items.append(conn.recv(timeout=LIMIT))
    assert conn.release_all() == 400  # the producer does not read meanwhile
    assert all(item.released for item in items)
    deadline = time.monotonic() + 60
    while any(devshare.outstanding(t) for t in tensors) and time.monotonic() < deadline:
        ch.service(timeout=0.05)  # takes what arrived; the socket has room again
        with pytest.raises(TimeoutError):
            conn.recv(timeout=0)  # the consumer's next call sends its backlog
    assert sum(devshare.outstanding(t) for t in tensors) == 0


# --- Views kept per slot and layout -------------------------------------------------------------


_VIEW_LAYOUTS = [((4, 8), torch.float32, 0), ((32,), torch.int64, 0), ((4, 8), torch.float32, 0),
                 ((3, 5), torch.int16, 6), ((16,), torch.uint8, 100), ((32,), torch.int64, 0)]


def _receive_as(monkeypatch, receive):
    """Make the package receive as with an older library: "item", devshare_connection_recv_item
    (1.7) instead of devshare_connection_recv_args; "bytes-key", also without the item's
    layout_id (a 1.7 library leaves it 0), so kept views are found by the struct's bytes. Here
    that is the word of the last stride, 0 for every item of fewer dimensions than the most.
    "args": as the package does with this library."""
    from devshare import _abi, _connection
    if receive == "args":
        assert _connection.ItemOut is _connection.RecvArgsOut, \
            "this library has devshare_connection_recv_args"
        return int
    monkeypatch.setattr(_connection, "ItemOut", _connection.RecvItemOut)
    if receive == "item":
        return int
    last_stride = _abi.ItemStruct.strides.offset + 8 * (_abi.MAX_NDIM - 1)
    monkeypatch.setattr(_connection, "_LAYOUT_WORD", last_stride // 8)
    return bytes


@pytest.mark.parametrize("receive", ["args", "item", "bytes-key"])
@pytest.mark.parametrize("like", ["torch", "numpy"])
def test_kept_views_show_each_item_exactly_for_changing_layouts(pair, like, receive, monkeypatch):
    """Slot.tensor / Slot.numpy and the consumer's Item.tensor reuse what they made for a slot
    and layout: every item still gets its own layout and data, the same memory each time the
    layout repeats, a new object every time, and never the view of another layout. The
    consumer finds what it kept by the item's layout_id, or with a library that reports none by
    the item's description; and receives with one call of either kind."""
    key_type = _receive_as(monkeypatch, receive)
    ch, conn, peer = pair
    first_ptr: dict = {}
    with ch.pool(256, 1) as pool:
        for k, (shape, dtype, offset) in enumerate(_VIEW_LAYOUTS * 3):
            slot = pool.acquire(timeout=LIMIT)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            fill = torch.from_numpy(_pattern(nbytes, k))
            if like == "torch":
                v = slot.tensor(shape, dtype, offset)
                assert (v.dtype, tuple(v.shape), v.data_ptr()) == (dtype, shape, slot.address + offset)
                v.view(-1).view(torch.uint8).copy_(fill)
                again = slot.tensor(shape, dtype, offset)
                assert again is not v and again.data_ptr() == v.data_ptr() and torch.equal(again, v)
            else:
                v = slot.numpy(shape, str(dtype).split(".")[1], offset)
                assert v.shape == shape and v.__array_interface__["data"][0] == slot.address + offset
                v.reshape(-1).view(np.uint8)[:] = fill.numpy()
            slot.send(peer, shape, dtype, None, offset)
            with conn.recv(timeout=LIMIT, like=like) as item:
                t = item.tensor
                if like == "torch":
                    assert (t.dtype, tuple(t.shape), t.is_contiguous()) == (dtype, shape, True)
                    assert torch.equal(t.reshape(-1).view(torch.uint8), fill)
                    ptr = t.data_ptr()
                else:
                    assert t.shape == shape and np.array_equal(t.reshape(-1).view(np.uint8), fill.numpy())
                    ptr = t.__array_interface__["data"][0]
                key = (shape, dtype, offset)
                assert first_ptr.setdefault(key, ptr) == ptr  # one address per slot and layout
        layouts = {(s, d, o) for s, d, o in _VIEW_LAYOUTS}
        assert len(first_ptr) == len(layouts)
        if like == "torch":  # one kept view per slot and layout, on both ends
            assert len(pool._views) == len(layouts) and len(conn._views) == len(layouts)
        kept = conn._views if like == "torch" else conn._np_views
        assert len(kept) == len(layouts) and {type(k) for k in kept} == {key_type}


def test_changing_a_kept_views_shape_in_place_reaches_no_later_item(pair):
    ch, conn, peer = pair
    with ch.pool(64, 1) as pool:
        for k in range(3):
            slot = pool.acquire(timeout=LIMIT)
            v = slot.tensor((4, 4), torch.float32)
            v.fill_(float(k))
            v.unsqueeze_(0)  # in place, on this object only
            v.requires_grad_(True)
            slot.send(peer, (4, 4), torch.float32)
            with conn.recv(timeout=LIMIT) as item:
                t = item.tensor
                assert tuple(t.shape) == (4, 4) and not t.requires_grad and bool((t == k).all())
                t.resize_(2)  # in place, on this object only
                t.requires_grad_(True)


def test_kept_views_hold_their_item_and_slot_like_fresh_ones(pair):
    """With the views kept (the second round onwards): an item dropped unreleased goes back when
    the last torch view of its tensor is gone; a slot dropped unsent, when the last view of what
    Slot.tensor / Slot.numpy returned is gone; released and acquired again, over and over."""
    ch, conn, peer = pair
    with ch.pool(64, 1) as pool:
        for _ in range(3):
            slot = pool.acquire(timeout=LIMIT)
            slot.tensor((16,), torch.int32)[:] = 5
            slot.send(peer, (16,), torch.int32)
            view = conn.recv(timeout=LIMIT).tensor[2:5]  # the item is dropped at once
            gc.collect()
            with pytest.raises(TimeoutError):
                pool.acquire(timeout=0)  # the view holds the item: the slot is still out
            assert view.tolist() == [5, 5, 5]
            del view
            gc.collect()
            for make in (lambda s: s.tensor((16,), torch.int32)[1:], lambda s: s.numpy((16,), "int32")[1:]):
                view = make(pool.acquire(timeout=LIMIT))  # the slot is dropped unsent at once
                gc.collect()
                assert pool.free_slots == 0
                del view
                gc.collect()
                assert pool.free_slots == 1
            with pool.acquire(timeout=LIMIT) as slot:
                slot.release()


@pytest.mark.parametrize("slot_nbytes", [64, 128])  # the item: the whole slot, or a view into it
def test_memory_shared_beyond_a_kept_views_item_stays_mapped_and_shows_the_next_item(pair, slot_nbytes):
    """What shares an item's memory without holding the item (.numpy() of its tensor): the item
    goes back when dropped, the memory stays mapped for that array (it shows the next item of
    the slot), and nothing stays held once that array is gone."""
    ch, conn, peer = pair
    with ch.pool(slot_nbytes, 1) as pool:
        for k in range(4):
            slot = pool.acquire(timeout=LIMIT)
            slot.tensor((16,), torch.int32)[:] = k
            slot.send(peer, (16,), torch.int32)
            arr = conn.recv(timeout=LIMIT).tensor.numpy()  # the item and its tensor go at once
            gc.collect()
            (entry,) = conn._views.values()
            assert entry[2].lease is not None and entry[2].lease.released  # back, still mapped
            assert int(arr.sum()) == 16 * k
            slot = pool.acquire(timeout=LIMIT)  # the item came back
            slot.tensor((16,), torch.int32)[:] = 100 + k
            slot.send(peer, (16,), torch.int32)
            item = conn.recv(timeout=LIMIT)
            assert entry[2].lease is None  # the new item holds the same memory now
            assert int(arr.sum()) == 16 * (100 + k)  # the stale array shows the next item
            item.release()
            del arr, item
            gc.collect()
            assert entry[2].lease is None  # nothing uses the memory: nothing is kept
            pool.acquire(timeout=LIMIT).release()


def test_leases_reuse_one_recipe_per_address_and_layout_and_each_holds_its_own_storage(pair):
    """A host lease seen before (the same address and layout) is not decoded again: the
    connection keeps one recipe per address and layout, here one per block of a registered
    cache and one for a second layout, while every lease still gets a tensor and a storage of
    its own (changing one reaches no later item), shows every in-place change, and is held
    by torch views of its tensor and by what shares its storage (``.numpy()``)."""
    ch, conn, peer = pair
    cache = torch.zeros(4, 32)
    blocks = {i: cache[i] for i in range(4)}
    ch.register(blocks)
    seen = {}
    for k in range(12):
        i = k % 4
        cache[i].fill_(float(k))
        ch.send(peer, blocks[i])
        item = conn.recv(timeout=LIMIT)
        t = item.tensor
        assert item.pool is None and tuple(t.shape) == (32,) and bool((t == k).all())
        first = seen.setdefault(i, t)
        assert first.data_ptr() == t.data_ptr()
        if first is not t:
            assert t.untyped_storage()._cdata != first.untyped_storage()._cdata
        t.unsqueeze_(0)  # in place, on this object only
        item.release()
        assert devshare.wait(blocks[i], timeout=LIMIT)
    square = cache[0, :8].view(2, 4)
    ch.register(square)
    for _ in range(2):
        ch.send(peer, square)
        with conn.recv(timeout=LIMIT) as item:
            assert tuple(item.tensor.shape) == (2, 4) and item.tensor.stride() == (4, 1)
        assert devshare.wait(square, timeout=LIMIT)
    assert len(conn._lease_views) == 5 and not conn._views
    # The lease is held by a torch view of its tensor, then by a numpy array of its storage,
    # the item dropped unreleased.
    for make in (lambda t: t[2:5], lambda t: t.numpy()):
        ch.send(peer, blocks[1])
        held = make(conn.recv(timeout=LIMIT).tensor)
        gc.collect()
        assert devshare.outstanding(blocks[1]) == 1
        assert float(held[0]) == 9.0
        del held
        gc.collect()
        assert devshare.wait(blocks[1], timeout=LIMIT)


@pytest.mark.parametrize("release", ["release_batch", "release_all"])
def test_a_thousand_released_at_once_reach_a_producer_that_was_not_reading(pair, release):
    """release_batch gives a batch back in one library call and one message, and release_all
    a connection's leases the same way: with a message per lease, the producer's socket filled
    after a few hundred while it was not reading, and the rest waited for this consumer's next
    call (here there is none)."""
    ch, conn, peer = pair
    cache = torch.zeros(1000, 4)
    blocks = [cache[i] for i in range(1000)]
    ch.register(blocks)
    ch.send_batch(peer, blocks)
    batch = conn.recv_batch(1000, timeout=LIMIT)
    assert devshare.outstanding(cache) == 1000
    give_back = (lambda: devshare.release_batch(batch)) if release == "release_batch" else conn.release_all
    assert give_back() == 1000
    assert all(it.released for it in batch)
    assert give_back() == 0
    assert devshare.wait(cache, timeout=5)
    assert ch.peer_info(peer)["protocol_errors"] == 0


def test_release_batch_with_an_item_of_another_process_releases_nothing(pair):
    """An item this process inherited through fork (here: one that says so) makes
    release_batch raise before it gives anything back, also the items before it."""
    ch, conn, peer = pair
    t = devshare.channel_empty((2, 4), "int64")
    ch.send_batch(peer, [t[0], t[1]])
    items = conn.recv_batch(2, timeout=LIMIT)
    real = items[1]._lease._pid
    items[1]._lease._pid = real + 1
    try:
        with pytest.raises(RuntimeError, match="fork"):
            devshare.release_batch(items)
        assert not items[0].released and not items[1].released
    finally:
        items[1]._lease._pid = real
    assert devshare.release_batch(items) == 2
    ch.service(0)
    assert devshare.wait(t, timeout=LIMIT)


def test_release_batch_gives_back_pool_items_and_leases_together(pair):
    """One release_batch of pool items and leases: the slots come back (through the ring) and
    the leases (in one message), round after round."""
    ch, conn, peer = pair
    lent = devshare.channel_empty((2, 16), torch.int32)
    with ch.pool(64, 2) as pool:
        for rnd in range(3):
            for k in range(2):
                slot = pool.acquire(timeout=LIMIT)
                slot.tensor((16,), torch.int32)[:] = 10 * rnd + k
                slot.send(peer, (16,), torch.int32)
            lent.fill_(rnd)
            ch.send_batch(peer, [lent[0], lent[1]])
            items = [conn.recv(timeout=LIMIT) for _ in range(4)]
            assert [int(it.tensor[0]) for it in items] == [10 * rnd, 10 * rnd + 1, rnd, rnd]
            assert devshare.release_batch(items) == 4
            del items
            gc.collect()
            assert devshare.wait(lent, timeout=LIMIT)
            both = [pool.acquire(timeout=LIMIT) for _ in range(2)]  # both slots are free again
            for slot in both:
                slot.release()


def test_spinning_is_opt_in_bounded_and_delivers_the_same_items(pair):
    """Pool.set_spin / Connection.set_spin: 0..1 s accepted, more refused by name, and items
    still arrive and come back with both ends spinning."""
    ch, conn, peer = pair
    pool = ch.pool(slot_nbytes=64, count=2)
    with pytest.raises(ValueError, match="spin_us"):
        pool.set_spin(1_000_001)
    with pytest.raises(ValueError, match="spin_us"):
        conn.set_spin(-1)
    pool.set_spin(200)
    conn.set_spin(200)
    for i in range(50):
        slot = pool.acquire(timeout=LIMIT)
        slot.tensor((4,), "int32").fill_(i)
        slot.send(peer, shape=(4,), dtype="int32")
        with conn.recv(timeout=LIMIT) as item:
            assert item.tensor.tolist() == [i] * 4
    pool.set_spin(0)
    conn.set_spin(0)
    pool.close()


def test_a_connection_stream_is_a_stream_an_int_or_none(pair):
    """Connection.set_stream takes None, a raw handle or an object with cuda_stream /
    npu_stream (host items are unaffected: they still arrive), and refuses anything else."""
    ch, conn, peer = pair

    class FakeStream:
        cuda_stream = 0

    class FakeSide:
        cuda_stream = 0x5000

    passed = []
    call = conn._lib_call

    def record(fn, *args):
        passed.append(args[0])
        return call(fn, *args)

    conn._lib_call = record
    try:
        conn.set_stream(None)
        conn.set_stream(0)
        conn.set_stream(FakeStream())
        conn.set_stream(FakeSide())
    finally:
        del conn._lib_call
    # None and a raw 0: no stream (the host waits). A CUDA stream object of handle 0, PyTorch's
    # default stream, is the legacy default stream by its own name: its waits stay on the device.
    assert passed == [None, None, 1, 0x5000]
    conn.set_stream(None)
    with pytest.raises(TypeError, match="stream"):
        conn.set_stream("default")
    with pytest.raises(ValueError, match="stream"):
        conn.set_stream(-1)
    t = devshare.channel_empty(4)
    ch.send(peer, t)
    with conn.recv(timeout=LIMIT) as item:
        assert item.tensor.shape == (4,)
    conn.set_stream(None)


def test_connect_with_wait_looks_again_until_the_producer_listens():
    """connect() refuses at once (NOT_FOUND) when nothing listens; with wait=True it looks again
    until a producer started later listens, and gives up with TimeoutError after its timeout."""
    addr = _address("wait")
    with pytest.raises(devshare.Error) as e:
        devshare.connect(addr, timeout=LIMIT)
    assert e.value.status == devshare.Status.NOT_FOUND
    with pytest.raises(TimeoutError, match="nothing listened"):
        devshare.connect(addr, timeout=0.2, wait=True)
    got = {}
    done = threading.Event()

    def consumer():
        try:
            with devshare.connect(addr, timeout=LIMIT, wait=True) as conn:
                got["peer"] = conn.peer_id
                done.wait(LIMIT)  # connected until the producer has seen it
        except BaseException as e:  # noqa: BLE001 (reported below)
            got["error"] = e

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.3)  # the consumer is already looking
    try:
        with devshare.Channel(addr) as ch:
            peers = ch.wait_peers(1, timeout=LIMIT)
    finally:
        done.set()
        t.join(timeout=LIMIT)
    assert not t.is_alive()
    assert got.get("peer") == peers[0], got


def test_meta_and_sparse_tensors_are_refused_by_name(pair):
    """Channel.send of a meta tensor or a sparse one is a TypeError saying what to send instead
    (it was a KeyError 'meta' and torch's 'Cannot access data pointer'), before anything is
    sent."""
    ch, conn, peer = pair
    with pytest.raises(TypeError, match="meta tensor has no memory"):
        ch.send(peer, torch.empty(4, device="meta"))
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match=r"torch\.sparse_coo tensor cannot be shared.*to_dense"):
        ch.send(peer, sparse)
    with pytest.raises(TypeError, match="meta tensor"):
        ch.send_batch(peer, [devshare.channel_empty(5), torch.empty(2, device="meta")])
    ch.send(peer, devshare.channel_empty(4))  # nothing of the refused batch went
    with conn.recv(timeout=LIMIT) as item:
        assert item.tensor.shape == (4,)
