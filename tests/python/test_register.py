"""Share once, lease many: ``Channel.register`` keeps tensors' storages shared with a channel so
that every later send of them is one lease, ``unregister`` lets them go, and a consumer takes a
batch with ``Connection.recv_batch`` and gives it back with ``devshare.release_batch``.

The producer is this process (CPU torch tensors); the consumer a child Python process that
reports the sum of every tensor it received, sync by sync.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import devshare
from conftest import python_env, spawn

torch = pytest.importorskip("torch")

# The consumer: argv = address, tensors per sync, syncs. Per sync: recv_batch, prints
# "NAMES <name> ..." (the dict's keys; "NAMES" alone for a list), "SYNC <sum> <sum> ...",
# release_batch, prints "RELEASED <n>", then waits for a line on stdin (the producer's go-ahead
# for the next sync).
CONSUMER = textwrap.dedent(r"""
    import sys
    import devshare
    address, n, syncs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    conn = devshare.connect(address, timeout=20, wait=True)
    for _ in range(syncs):
        batch = conn.recv_batch(n, timeout=20)
        print("NAMES", *(batch if isinstance(batch, dict) else ()), flush=True)
        assert all(it.name == key for key, it in batch.items()) if isinstance(batch, dict) else True
        items = batch.values() if isinstance(batch, dict) else batch
        print("SYNC", *(float(it.tensor.double().sum()) for it in items), flush=True)
        print("RELEASED", devshare.release_batch(batch), flush=True)
        sys.stdin.readline()
    conn.close()
""")


def _address(tag: str) -> str:
    return f"@devshare-test-register-{tag}-{os.getpid()}"


def _line(p, tag: str) -> str:
    while True:
        line = p.stdout.readline()
        assert line, f"consumer exited before {tag}: {p.stderr.read()}"
        if line.startswith(tag):
            return line[len(tag):].strip()


def _wait_back(ch, tensors, timeout=20.0) -> None:
    for t in tensors:
        assert devshare.wait(t, timeout=timeout), "a lease did not come back"


def _state_dict():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 64, generator=g)  # two views of one storage
    return {"w1": torch.randn(32, 16, generator=g), "w2": base[:2], "w3": base[2:].t(),
            "bias": torch.randn(16, generator=g).to(torch.bfloat16)}


@contextlib.contextmanager
def _consumer(address, n, syncs):
    """The consumer process for ``syncs`` syncs of ``n`` tensors; killed if still running."""
    p = spawn([sys.executable, "-c", CONSUMER, address, str(n), str(syncs)],
              env=python_env(), stdin=subprocess.PIPE)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def _next(p) -> None:
    """Let the consumer go on to its next sync."""
    p.stdin.write("next\n")
    p.stdin.flush()


def test_ten_syncs_of_a_registered_state_dict_see_every_in_place_change():
    address = _address("ten")
    sd = _state_dict()
    with devshare.Channel(address) as ch:
        assert ch.register(sd) == 4
        with _consumer(address, 4, 10) as p:
            peer = ch.wait_peers(1, timeout=20)[0]
            exports = None
            for sync in range(10):
                ch.send_batch(peer, sd)
                # The dict's keys travelled with it: the consumer got a dict back.
                assert _line(p, "NAMES").split() == list(sd)
                sums = [float(x) for x in _line(p, "SYNC").split()]
                assert sums == pytest.approx([float(t.double().sum()) for t in sd.values()], rel=1e-6)
                assert int(_line(p, "RELEASED")) == 4
                _wait_back(ch, sd.values())
                devshare.collect()
                # The registration kept every storage's export open across the syncs: nothing
                # was re-shared.
                now = [r.prep[0] for r in ch._registered.values()]
                assert all(not e.closed for e in now)
                if exports is not None:
                    assert [id(e) for e in now] == exports
                exports = [id(e) for e in now]
                for t in sd.values():  # an optimiser step, in place
                    t.add_(sync + 1)
                _next(p)
            assert p.wait(timeout=20) == 0, p.stderr.read()


def test_a_spinning_channel_takes_its_leases_back_and_refuses_a_spin_out_of_range():
    """Channel.set_spin: 0..1 s accepted, more (or less) refused by name; devshare.wait on
    what the channel sent spins before it sleeps, and every lease still comes back."""
    address = _address("spin")
    sd = _state_dict()
    with devshare.Channel(address) as ch:
        with pytest.raises(ValueError, match="spin_us"):
            ch.set_spin(1_000_001)
        with pytest.raises(ValueError, match="spin_us"):
            ch.set_spin(-1)
        ch.set_spin(500)
        ch.register(sd)
        with _consumer(address, 4, 3) as p:
            peer = ch.wait_peers(1, timeout=20)[0]
            for sync in range(3):
                ch.send_batch(peer, sd)
                sums = [float(x) for x in _line(p, "SYNC").split()]
                assert sums == pytest.approx([float(t.double().sum()) for t in sd.values()], rel=1e-6)
                _wait_back(ch, sd.values())
                assert all(devshare.outstanding(t) == 0 for t in sd.values())
                _next(p)
            assert p.wait(timeout=20) == 0, p.stderr.read()
        ch.set_spin(0)


def test_a_registered_tensor_given_new_memory_is_sent_from_its_new_memory():
    address = _address("moved")
    t = torch.zeros(64)
    with devshare.Channel(address) as ch:
        ch.register(t)
        with _consumer(address, 1, 2) as p:
            peer = ch.wait_peers(1, timeout=20)[0]
            ch.send(peer, t)
            assert float(_line(p, "SYNC")) == 0.0
            _line(p, "RELEASED")
            _wait_back(ch, [t])
            t.data = torch.full((64,), 3.0)  # new storage under the same tensor object
            _next(p)
            ch.send(peer, t)
            assert float(_line(p, "SYNC")) == 192.0
            _line(p, "RELEASED")
            _wait_back(ch, [t])
            _next(p)
            assert p.wait(timeout=20) == 0, p.stderr.read()


def test_unregister_lets_the_storages_exports_close_once_their_leases_are_back():
    address = _address("unregister")
    sd = _state_dict()
    with devshare.Channel(address) as ch:
        ch.register(sd)
        exports = {id(r.prep[0]): r.prep[0] for r in ch._registered.values()}
        devshare.collect()
        assert all(not e.closed for e in exports.values()), "registered exports stay open"
        assert ch.unregister([sd["w1"]]) == 3
        assert ch.unregister() == 0
        devshare.collect()
        assert all(e.closed for e in exports.values()), "unregistered exports close"


def test_a_consumer_killed_holding_a_registered_batch_leaves_the_registration_working():
    # Channel memory (sealed memfds, no names): a consumer killed while it maps a torch
    # file_system storage leaves that storage's shared-memory name counted until the producer
    # exits, as with PyTorch's own file_system strategy, which this test is not about.
    address = _address("killed")
    sd = {}
    for name, t in _state_dict().items():
        sd[name] = devshare.channel_empty(tuple(t.shape), t.dtype)
        sd[name].copy_(t)
    with devshare.Channel(address) as ch:
        ch.register(sd)
        with _consumer(address, 4, 3) as first:
            peer = ch.wait_peers(1, timeout=20)[0]
            # Killed in its third sync: by then its leases are records of windows it keeps
            # pinned (1.14), not shares.
            for _ in range(2):
                ch.send_batch(peer, sd)
                _line(first, "SYNC")
                _line(first, "RELEASED")
                _wait_back(ch, sd.values())
                _next(first)
            ch.send_batch(peer, sd)
            _line(first, "SYNC")
            first.kill()
        # The killed consumer's leases came back with its hang-up (it may or may not have
        # released them first); the registration is untouched.
        _wait_back(ch, sd.values())
        assert all(not r.prep[0].closed for r in ch._registered.values())
        with _consumer(address, 4, 1) as second:
            peer = ch.wait_peers(1, timeout=20)[-1]
            ch.send_batch(peer, sd)
            sums = [float(x) for x in _line(second, "SYNC").split()]
            assert sums == pytest.approx([float(t.double().sum()) for t in sd.values()], rel=1e-6)
            _line(second, "RELEASED")
            _next(second)
            assert second.wait(timeout=20) == 0, second.stderr.read()
        _wait_back(ch, sd.values())


def test_recv_batch_that_times_out_gives_back_what_it_had_received():
    address = _address("timeout")
    t = torch.ones(8)
    with devshare.Channel(address) as ch:
        got = []
        connecting = threading.Thread(target=lambda: got.append(devshare.connect(address, timeout=5)))
        connecting.start()
        peer = ch.wait_peers(1, timeout=5)[0]
        connecting.join()
        conn = got[0]
        ch.register(t)
        ch.send_batch(peer, [t, t])
        with pytest.raises(TimeoutError):
            conn.recv_batch(3, timeout=0.5)
        ch.service(0)
        _wait_back(ch, [t])
        assert devshare.outstanding(t) == 0
        ch.send_batch(peer, {"a": t, "b": t})
        items = conn.recv_batch(2, timeout=5)
        assert list(items) == ["a", "b"], "a dict sent comes back as a dict"
        assert [float(it.tensor.sum()) for it in items.values()] == [8.0, 8.0]
        assert devshare.release_batch(items) == 2
        assert devshare.release_batch(items) == 0, "released items are not released twice"
        _wait_back(ch, [t])
        with pytest.raises(ValueError):
            conn.recv_batch(-1)
        conn.close()


def test_recv_batch_interrupted_right_after_the_library_call_gives_every_item_back(monkeypatch):
    # A KeyboardInterrupt (here: raised as the library's batch call returns, before its status
    # is even seen) must not leak the imports the library handed out: each lease comes back.
    from devshare import _connection
    raw = _connection.RAW_RECV_BATCH

    def interrupted(*a):
        raw(*a)
        raise KeyboardInterrupt

    t = torch.ones(8)
    ch, peer, conn = _in_process(_address("interrupt"))
    with ch, conn:
        ch.register(t)
        ch.send_batch(peer, [t, t, t])
        monkeypatch.setattr(_connection, "RAW_RECV_BATCH", interrupted)
        with pytest.raises(KeyboardInterrupt):
            conn.recv_batch(3, timeout=5)
        monkeypatch.setattr(_connection, "RAW_RECV_BATCH", raw)
        ch.service(0)
        _wait_back(ch, [t], timeout=5)
        assert devshare.outstanding(t) == 0, "every lease of the interrupted batch came back"
        # The connection goes on: the next batch arrives whole.
        ch.send_batch(peer, [t, t])
        items = conn.recv_batch(2, timeout=5)
        assert [float(it.tensor.sum()) for it in items] == [8.0, 8.0]
        assert devshare.release_batch(items) == 2
        ch.service(0)
        _wait_back(ch, [t], timeout=5)


def _sync_and_check(ch, peer, conn, sd) -> None:
    """Send ``sd`` (a dict of registered tensors) to ``conn`` in this process, receive it as one
    batch (a dict: the names in order) with every value right, release it and see every lease
    back."""
    ch.send_batch(peer, sd)
    items = conn.recv_batch(len(sd), timeout=5)
    assert list(items) == list(sd), "the names, in order"
    for name, t in sd.items():
        assert torch.equal(items[name].tensor, t)
    assert devshare.release_batch(items) == len(sd)
    ch.service(0)
    _wait_back(ch, sd.values(), timeout=5)


def test_recv_batch_is_one_library_call_whose_items_carry_their_names(monkeypatch):
    # 1.15: the batch in one devshare_connection_recv_batch, each lease's name read from its
    # item; devshare_import_name is never called.
    from devshare import _connection
    calls = []
    raw = _connection.RAW_RECV_BATCH
    monkeypatch.setattr(_connection, "RAW_RECV_BATCH", lambda *a: calls.append(a) or raw(*a))

    def no_name_calls(imp):
        raise AssertionError("a name asked for per lease")

    monkeypatch.setattr(_connection, "lease_name", no_name_calls)
    sd = _state_dict()
    ch, peer, conn = _in_process(_address("batchcall"))
    with ch, conn:
        ch.register(sd)
        for _ in range(2):
            _sync_and_check(ch, peer, conn, sd)
        assert len(calls) == 2, "one library call per batch"


@pytest.mark.parametrize("library", ["no batch call", "items without names"])
def test_recv_batch_with_an_older_library_gives_the_same_dict(monkeypatch, library):
    # A 1.11-1.14 library writes no names into the items (asked for per lease then); one before
    # 1.11 has no batch call (one receive per item then).
    from devshare import _connection
    if library == "no batch call":
        monkeypatch.setattr(_connection, "RAW_RECV_BATCH", None)
    else:
        monkeypatch.setattr(_connection, "_ITEM_NAMED", _connection._ITEM_SIZE + 8)
    sd = _state_dict()
    ch, peer, conn = _in_process(_address("older"))
    with ch, conn:
        ch.register(sd)
        _sync_and_check(ch, peer, conn, sd)


def test_a_batch_item_that_fails_to_open_gives_every_lease_of_the_batch_back(monkeypatch):
    # An item whose tensor cannot be made (here: the second) fails the batch: the item made
    # before it, it, and the items after it (received by the library, never made) all go back.
    from devshare import _views
    made = []
    torch_from = _views.torch_from

    def failing_second(*args):
        made.append(None)
        if len(made) == 2:
            raise RuntimeError("the second item")
        return torch_from(*args)

    monkeypatch.setattr(_views, "torch_from", failing_second)
    ts = [torch.full((8,), float(i)) for i in range(4)]
    ch, peer, conn = _in_process(_address("fails"))
    with ch, conn:
        ch.register(ts)
        ch.send_batch(peer, ts)
        with pytest.raises(RuntimeError, match="the second item"):
            conn.recv_batch(4, timeout=5)
        ch.service(0)
        _wait_back(ch, ts, timeout=5)
        assert all(devshare.outstanding(t) == 0 for t in ts)


def test_wait_on_a_dict_or_list_waits_for_every_tensor_in_it():
    sd = _state_dict()
    ch, peer, conn = _in_process(_address("waitall"))
    with ch, conn:
        ch.register(sd)
        ch.send_batch(peer, sd)
        items = conn.recv_batch(len(sd), timeout=5)
        last = list(sd)[-1]
        # Every lease back but the last one's: still not all back.
        devshare.release_batch([it for name, it in items.items() if name != last])
        ch.service(0)
        assert not devshare.wait(sd, timeout=0.3), "the last tensor's lease is still out"
        assert not devshare.wait(list(sd.values()), timeout=0)
        assert devshare.wait([t for name, t in sd.items() if name != last], timeout=5)
        items[last].release()
        assert devshare.wait(sd, timeout=5) and devshare.wait(tuple(sd.values()), timeout=0)
        assert devshare.wait([], timeout=0) and devshare.wait({}, timeout=None)
        with pytest.raises(TypeError, match="torch tensor"):
            devshare.wait([sd["w1"], 3], timeout=0)
        with pytest.raises(ValueError, match="timeout"):
            devshare.wait(sd, timeout=-1)


def test_a_list_comes_back_as_a_list_and_bad_names_are_refused_before_sending():
    address = _address("names")
    sd = _state_dict()
    with devshare.Channel(address) as ch:
        with _consumer(address, 4, 1) as p:
            peer = ch.wait_peers(1, timeout=20)[0]
            with pytest.raises(TypeError, match="must be str"):
                ch.send_batch(peer, {1: sd["w1"]})
            with pytest.raises(ValueError, match="longer than 1024 bytes"):
                ch.send_batch(peer, {"x" * 1025: sd["w1"]})
            with pytest.raises(ValueError, match="NUL"):
                ch.send_batch(peer, {"a\0b": sd["w1"]})
            ch.send_batch(peer, list(sd.values()))
            # Nothing of the refused sends arrived first: the list is the first batch.
            assert _line(p, "NAMES") == ""
            sums = [float(x) for x in _line(p, "SYNC").split()]
            assert sums == pytest.approx([float(t.double().sum()) for t in sd.values()], rel=1e-6)
            _line(p, "RELEASED")
            _next(p)
            assert p.wait(timeout=20) == 0, p.stderr.read()


def _in_process(address):
    """A channel at ``address`` with one consumer connected from this process: (channel,
    peer, connection)."""
    ch = devshare.Channel(address)
    got = []
    connecting = threading.Thread(target=lambda: got.append(devshare.connect(address, timeout=5)))
    connecting.start()
    peer = ch.wait_peers(1, timeout=5)[0]
    connecting.join()
    return ch, peer, got[0]


def _give_back(ch, item, t) -> None:
    """Release ``item``, let ``ch`` take the return, and see every lease of ``t`` back."""
    item.release()
    ch.service(0)
    assert devshare.wait(t, timeout=5)


def test_wait_on_a_registered_tensor_follows_its_memory_not_its_registration():
    # devshare.wait finds a registered tensor's export through its registration only while the
    # tensor still has the registered layout: given new memory, it waits on that memory's
    # leases (none), not the registration's (one out).
    ch, peer, conn = _in_process(_address("wait-moved"))
    with ch:
        t = torch.arange(16.0)
        ch.register(t)
        ch.send(peer, t)
        item = conn.recv(timeout=5)
        assert item.tensor.tolist() == list(range(16))
        assert not devshare.wait(t, timeout=0), "the lease is out"
        assert devshare.outstanding(t) == 1
        old = t.data
        t.data = torch.zeros(16)  # new memory under the registered tensor object
        assert devshare.wait(t, timeout=0), "nothing was sent from the new memory"
        assert not devshare.wait(old, timeout=0), "the old memory's lease is still out"
        _give_back(ch, item, old)
        conn.close()


def test_a_registered_send_to_an_unknown_peer_is_refused_and_sends_nothing():
    ch, peer, conn = _in_process(_address("unknown-peer"))
    with ch:
        t = torch.ones(8)
        ch.register(t)
        with pytest.raises(devshare.Error) as e:
            ch.send(peer + 1000, t)
        assert e.value.status == devshare.Status.NOT_FOUND
        with pytest.raises(ValueError):
            ch.send(0, t)
        assert devshare.outstanding(t) == 0
        ch.send(peer, t)
        item = conn.recv(timeout=5)
        assert float(item.tensor.sum()) == 8.0
        _give_back(ch, item, t)
        conn.close()


def test_an_unregistered_tensor_leaves_no_registration_behind():
    from devshare import _registry

    ch, _, conn = _in_process(_address("unregistered"))
    with ch:
        t = torch.ones(8)
        ch.register(t)
        assert id(t) in _registry.registered_tensors
        ch.unregister(t)
        assert id(t) not in _registry.registered_tensors, "devshare.wait's look-up let it go"
        ch.register(t)
    assert id(t) not in _registry.registered_tensors, "closing the channel let it go"
    conn.close()


def test_a_leased_row_is_the_row_however_much_memory_follows_it():
    # A 1-D contiguous lease is made as its own elements (no strided view over the rest of
    # the storage): values and size are the row's, for every row of one storage.
    ch, peer, conn = _in_process(_address("rows"))
    with ch:
        cache = torch.arange(64 * 32, dtype=torch.float16).reshape(64, 32)
        rows = [cache[i] for i in range(64)]
        ch.register(rows)
        for _ in range(2):  # the second time through the kept recipes
            for i, row in enumerate(rows):
                ch.send(peer, row)
                item = conn.recv(timeout=5)
                assert item.tensor.shape == (32,)
                assert item.tensor.untyped_storage().nbytes() == 64
                assert torch.equal(item.tensor, cache[i])
                _give_back(ch, item, row)
        conn.close()


def test_a_channel_dropped_without_close_lets_its_registered_tensors_go():
    import gc
    import weakref

    ch = devshare.Channel(_address("dropped"))
    t = torch.ones(8)
    gone = weakref.ref(t)
    ch.register(t)
    exp = ch._registered[id(t)].prep[0]
    del t, ch
    gc.collect()
    assert gone() is None, "a registration outlived its channel"
    assert exp.closed, "the registered storage's export stayed open (its shared memory with it)"


def test_a_forked_child_dropping_an_inherited_channel_leaves_the_registrations_alone():
    import gc

    held = list(_in_process(_address("forked-drop")))  # [channel, peer, connection]
    peer, conn = held[1], held[2]
    t = torch.arange(8.0)
    held[0].register(t)
    exp = held[0]._registered[id(t)].prep[0]
    child = os.fork()
    if child == 0:  # the child: its copy of the channel is garbage, and its finalizers run
        held.clear()
        gc.collect()
        # The parent's registration: not dropped, its export not closed, in this process.
        os._exit(0 if exp.registered == 1 and not exp.closed else 3)
    assert os.waitpid(child, 0)[1] == 0, "the child closed the parent's registered export"
    ch = held[0]
    with ch:
        assert not exp.closed
        ch.send(peer, t)
        item = conn.recv(timeout=5)
        assert item.tensor.tolist() == list(range(8))
        _give_back(ch, item, t)
        conn.close()
