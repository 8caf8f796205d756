"""Remote channels (``tcp://HOST:PORT``) from Python: the README's pool producer/consumer pair
over loopback TCP (items on the authenticated connection; no UCX needed), the key both ends must
hold, and what a remote channel refuses.

The producer runs in this process and the consumer in a child interpreter (conftest's
``spawn``), which reports one line per item on its stdout; children still running when a test
ends are killed (``_reaped``). Both ends read their key from ``DEVSHARE_CHANNEL_KEY_FILE``: a
file of random bytes, mode 0600, in the test's ``tmp_path`` (set with monkeypatch here, passed
with ``env=`` to the child). Every blocking call has a generous limit so that a bug fails the
test instead of hanging it; nothing asserts on how long anything takes.

Every test here runs and can fail; none needs UCX.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import textwrap
import threading
import time
import zlib

import numpy as np
import pytest
import torch

import devshare
from conftest import python_env, spawn

LIMIT = 120  # seconds: only ever reached when something is broken

SLOT_NBYTES = 4 << 20  # the README's pool: 8 slots of 4 MiB, items of 1024 x 1024 float32
COUNT = 8
SHAPE = (1024, 1024)
FRAMES = 20  # more items than slots: the consumer's slots are reused

# The README's consumer, with the address (and like="numpy": recv(like=...) instead of the
# iteration, which yields torch tensors) from argv. use() reports the item: its pool and slot,
# the address of its first element, dtype, shape and the CRC-32 of its bytes. torch is imported
# up front, as in the README: a remote producer's first Slot.send waits (at most 10 s) for the
# consumer to register its copy of the pool, which it does inside recv(), and a first recv()
# that had to import torch itself could take longer than that on a cold, loaded machine.
CONSUMER = textwrap.dedent(r"""
    import sys, zlib
    import devshare, torch  # torch before connecting: see the note above

    address, like = sys.argv[1], sys.argv[2]

    def use(item, t):
        if like == "torch":
            ptr, data = t.data_ptr(), t.numpy()
        else:
            ptr, data = t.__array_interface__["data"][0], t
        print("ITEM", item.pool, item.slot, ptr, data.dtype, "x".join(map(str, t.shape)),
              zlib.crc32(memoryview(data).cast("B")), flush=True)

    def items(conn):
        if like == "torch":
            yield from conn
            return
        while True:
            try:
                yield conn.recv(like="numpy")
            except devshare.ChannelClosed:
                return

    n = 0
    with devshare.connect(address, timeout=5) as conn:
        for item in items(conn):                       # ends when the producer is gone
            with item:                                 # release() gives the slot back
                use(item, item.tensor)                 # zero copy; same address per slot
            n += 1
    print("DONE", n, flush=True)
""")

# A consumer that only connects, and reports how the connection went.
CONNECT_ONLY = textwrap.dedent(r"""
    import sys
    import devshare
    try:
        devshare.connect(sys.argv[1], timeout=30).close()
        print("CONNECTED", flush=True)
    except devshare.Error as e:
        print("REFUSED", int(e.status), e.status_name, "|", e.message, flush=True)
""")


@pytest.fixture
def remote_env(tmp_path, monkeypatch):
    """This process's key file and UCX over TCP, in os.environ; returns (key path, the
    environment for a child with the same key)."""
    key = _key_file(tmp_path / "channel.key")
    monkeypatch.setenv("DEVSHARE_CHANNEL_KEY_FILE", str(key))
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    return key, python_env(DEVSHARE_LIBRARY=devshare.library_path)


def _key_file(path, data: bytes | None = None):
    """A key file of 32 random bytes (or ``data``), mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32) if data is None else data)
    os.chmod(path, 0o600)  # whatever the umask
    return path


def _listen() -> devshare.Channel:
    """A remote channel on a free loopback port (picked by binding a socket to port 0; another
    one if something else took it meanwhile)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            return devshare.Channel(f"tcp://127.0.0.1:{port}")
        except devshare.Error as e:
            if e.status != devshare.Status.BUSY:
                raise
    raise AssertionError("no free loopback port in 20 tries")


@contextlib.contextmanager
def _reaped(*procs):
    """Kill whichever of ``procs`` still runs when the block ends (a failed check included)."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(LIMIT)


def _finish(p, timeout=LIMIT):
    try:
        out, err = p.communicate(timeout=timeout)
    except Exception:
        p.kill()
        raise
    return p.returncode, out, err


def _frame(k: int, like: str):
    """Item k: 1024 x 1024 values that differ for every k and position (float32 for torch,
    int32 for numpy)."""
    v = (np.arange(SHAPE[0] * SHAPE[1], dtype=np.int64) * 7 + k * 13) % 100003
    if like == "torch":
        return torch.from_numpy(v.astype(np.float32).reshape(SHAPE))
    return v.astype(np.int32).reshape(SHAPE)


def _crc(frame) -> int:
    a = frame.numpy() if isinstance(frame, torch.Tensor) else frame
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"))


# --- The README's pair, across processes ------------------------------------------------------


@pytest.mark.parametrize("like", ["torch", "numpy"])
def test_the_readme_pair_over_tcp_delivers_every_item_in_slots_that_keep_their_address(remote_env, like):
    _, env = remote_env
    frames = [_frame(k, like) for k in range(FRAMES)]
    dtype = "float32" if like == "torch" else "int32"
    producer_slots: dict[int, set[int]] = {}
    ch = _listen()
    cons = spawn([sys.executable, "-c", CONSUMER, ch.address, like], env=env)
    with _reaped(cons):
        # The README's producer (with limits on its waits).
        with ch:
            pool = ch.pool(slot_nbytes=SLOT_NBYTES, count=COUNT)
            peer = ch.wait_peers(1, timeout=LIMIT)[0]
            for frame in frames:
                slot = pool.acquire(timeout=LIMIT)
                producer_slots.setdefault(slot.index, set()).add(slot.address)
                if like == "torch":
                    slot.tensor(SHAPE, dtype).copy_(frame)
                else:
                    slot.numpy(SHAPE, dtype)[:] = frame
                slot.send(peer, shape=SHAPE, dtype=dtype)
            info = ch.peer_info(peer)
            assert info["protocol_errors"] == 0
            assert info["transport"] == "stream", info  # on the authenticated connection
        rc, out, err = _finish(cons)  # its loop ends once the channel is closed
    assert rc == 0, f"consumer exited with {rc}; stderr:\n{err}"
    lines = out.splitlines()
    assert lines[-1] == f"DONE {FRAMES}", out
    items = [line.split()[1:] for line in lines if line.startswith("ITEM ")]
    assert len(items) == FRAMES, out
    # Every item arrived byte-exact, in order, with the layout it was sent with.
    assert [int(i[5]) for i in items] == [_crc(f) for f in frames]
    assert {(i[3], i[4]) for i in items} == {(dtype, "1024x1024")}
    assert {int(i[0]) for i in items} == {pool.id}
    # The consumer's slots were reused, each at one address, all in one allocation.
    by_slot: dict[int, set[int]] = {}
    for i in items:
        by_slot.setdefault(int(i[1]), set()).add(int(i[2]))
    assert all(0 <= s < COUNT for s in by_slot), by_slot
    assert max(sum(1 for i in items if int(i[1]) == s) for s in by_slot) >= 2, by_slot
    assert all(len(p) == 1 for p in by_slot.values()), by_slot
    bases = {p.copy().pop() - s * SLOT_NBYTES for s, p in by_slot.items()}
    assert len(bases) == 1, by_slot
    # The producer's slots were reused too, each at one address.
    assert sum(1 for _ in producer_slots) < FRAMES
    assert all(len(a) == 1 for a in producer_slots.values()), producer_slots


def test_a_consumer_with_another_key_is_refused(remote_env, tmp_path):
    _, env = remote_env
    other = _key_file(tmp_path / "other.key")
    env = dict(env, DEVSHARE_CHANNEL_KEY_FILE=str(other))
    with _listen() as ch:
        cons = spawn([sys.executable, "-c", CONNECT_ONLY, ch.address], env=env)
        with _reaped(cons):
            deadline = time.monotonic() + LIMIT
            while cons.poll() is None and time.monotonic() < deadline:
                ch.service(timeout=0.05)  # the handshake runs in the producer's calls
            rc, out, err = _finish(cons)
            ch.service(timeout=0)
            assert ch.peers() == [], "a consumer without the key was admitted"
    assert rc == 0, err
    fields = out.strip().split(" ", 3)
    assert fields[0] == "REFUSED", out
    assert int(fields[1]) == devshare.Status.UNTRUSTED, out
    assert "key" in out.split("|", 1)[1], out


# --- What a remote channel does not carry ------------------------------------------------------


@pytest.fixture
def remote_pair(remote_env):
    """A remote channel and a connection to it, both in this process (the connect runs in a
    thread while this thread serves the channel)."""
    ch = _listen()
    box = {}

    def connect():
        try:
            box["conn"] = devshare.connect(ch.address, timeout=LIMIT)
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e

    th = threading.Thread(target=connect)
    th.start()
    try:
        (peer,) = ch.wait_peers(1, timeout=LIMIT)
    finally:
        th.join(LIMIT)
    assert "error" not in box, box.get("error")
    conn = box["conn"]
    assert conn.peer_id == peer
    yield ch, conn, peer
    conn.close()
    ch.close()


def _unsupported(fn, *args, **kw) -> str:
    with pytest.raises(devshare.Error) as e:
        fn(*args, **kw)
    assert e.value.status == devshare.Status.UNSUPPORTED, e.value
    return e.value.message


def test_leases_restrict_and_spinning_are_unsupported_on_a_remote_channel(remote_pair):
    ch, conn, peer = remote_pair
    t = devshare.channel_empty((4, 4), torch.float32)
    msg = _unsupported(ch.send, peer, t)
    assert "tcp://" in msg or "remote" in msg, msg
    assert devshare.outstanding(t) == 0, "a refused lease is counted"
    _unsupported(ch.send_batch, peer, [t, t[1:]])
    assert devshare.outstanding(t) == 0
    a = devshare.empty((8,), "int32", like="numpy")
    _unsupported(ch.send, peer, a)
    _unsupported(ch.restrict, uids=[os.geteuid()])
    _unsupported(ch.restrict, pids=[os.getpid()])
    with ch.pool(4096, 2) as pool:
        _unsupported(pool.set_spin, 10)
    _unsupported(conn.set_spin, 10)
    _unsupported(ch.set_spin, 10)
    # The channel still works: a pool item reaches the connection.
    with ch.pool(4096, 2) as pool:
        slot = pool.acquire(timeout=LIMIT)
        slot.numpy((4,), "int64")[:] = [7, 8, 9, 10]
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("item", conn.recv(timeout=LIMIT, like="numpy")))
        th.start()
        try:
            slot.send(peer, shape=(4,), dtype="int64")
        finally:
            th.join(LIMIT)
        with done["item"] as item:
            assert item.tensor.tolist() == [7, 8, 9, 10]
