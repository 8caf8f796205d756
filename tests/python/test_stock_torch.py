"""Stock PyTorch consumer processes (no devshare in them) and devshare host buffers (issue 11,
item 5).

The README's old recipe, ``torch.UntypedStorage._new_shared_filename_cpu(b"", name, nbytes)``,
maps through PyTorch's managed allocator, whose ``torch_shm_manager`` unlinks the name when the
consumer exits, while the producer still holds the buffer. The recipe the docs give now (the
"A consumer with stock PyTorch only" block of docs/formats.md, run here exactly as written) maps the object with
``mmap`` + ``torch.frombuffer`` and returns the reference by setting its ref-counter slot to 0.
Each test runs the consumer as a separate Python process that has no devshare.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import sys
import textwrap
import time

import pytest
import torch

import devshare
from conftest import ROOT, header_count, run, spawn, tensor_tool

DOC = ROOT / "docs" / "formats.md"  # the PyTorch interop page, where the recipe lives
SECTION = "### A consumer with stock PyTorch only"


def consumer_code() -> str:
    """The stock consumer block of the docs (the python block that defines open_shared)."""
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    end = section.find("\n## ")
    section = section if end < 0 else section[:end]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    found = [b for b in blocks if "def open_shared" in b]
    assert len(found) == 1, "the stock consumer block of docs/formats.md is missing"
    return found[0]


# Runs in the consumer process after the docs block: open, read, write, release, exit.
# devshare is made unimportable first, and checked to be absent at the end.
DRIVER = textwrap.dedent("""
    import json, sys
    info = json.loads(sys.argv[1])
    mode = sys.argv[2]
    t = open_shared(info)
    print(json.dumps(t.tolist()), flush=True)
    t.mul_(-1).sub_(1)  # every element x becomes -x - 1
    del t
    if mode == "release":
        release(info)
    assert sys.modules["devshare"] is None  # never imported (the import was blocked)
    assert not any(m.startswith("devshare.") for m in sys.modules)
    print("done", flush=True)
""")

# The old README snippet, in a consumer process of its own.
OLD_RECIPE = textwrap.dedent("""
    import json, sys, torch
    info = json.loads(sys.argv[1])
    name, nbytes = info["name"].encode(), info["alloc_size"]
    st = torch.UntypedStorage._new_shared_filename_cpu(b"", name, nbytes)
    t = torch.empty(0, dtype=getattr(torch, info["dtype"])).set_(st, 0, info["shape"], info["strides"])
    print(json.dumps(t.tolist()), flush=True)
    t[0] = 42
    print("done", flush=True)
""")


def stock_env() -> dict:
    """The consumer's environment: no path to this checkout's devshare package."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DEVSHARE_LIBRARY")}
    return env


def run_stock(info: dict, mode: str = "release"):
    code = "import sys\nsys.modules['devshare'] = None\n" + consumer_code() + DRIVER
    res = run([sys.executable, "-c", code, json.dumps(info), mode], env=stock_env(), cwd="/")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1] == "done", res.stdout
    return json.loads(lines[0])


def path_of(h: devshare.Handle) -> str:
    return "/dev/shm" + h.key.decode()


def stays(path: str, seconds: float = 1.5) -> bool:
    """Whether path exists throughout `seconds` (a manager unlinks within milliseconds)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not os.path.exists(path):
            return False
        time.sleep(0.02)
    return True


def vanishes(path: str, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not os.path.exists(path):
            return True
        time.sleep(0.02)
    return False


def _producer(kind):
    """(tensor to share, the buffer that keeps its memory) for each kind of producer memory."""
    if kind == "empty":
        x = devshare.empty((3, 4), "float32")
        x.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4))
        return x, x
    if kind == "view":  # strided, with a storage offset: offset and tensor_offset both used
        base = devshare.empty((5, 6), "int64")
        base.copy_(torch.arange(30).reshape(5, 6))
        return base[1:, ::2], base
    if kind == "torch":  # a plain torch tensor: share() moves it to file_system shared memory
        t = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4).t()
        return t, t
    if kind == "empty_tensor":
        x = devshare.empty((0, 3), "float16")
        return x, x
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["empty", "view", "torch", "empty_tensor"])
def test_a_stock_consumer_process_keeps_the_buffer_and_returns_the_reference(kind):
    x, owner = _producer(kind)
    expect = x.tolist()
    h1 = devshare.share(x, inflight=False)
    assert not h1.inflight
    path = path_of(h1)
    count = header_count(h1.key)  # the holders devshare knows of
    assert devshare.outstanding(x) == 1

    seen = run_stock(h1.mapping_info())

    # It read what the producer wrote, and its writes are in the producer's memory.
    assert seen == expect
    assert x.tolist() == (-x.new_tensor(expect) - 1).tolist() if x.numel() else x.tolist() == []
    # The object is still there, with the same holders: nothing unlinked, nothing counted.
    assert stays(path)
    assert header_count(h1.key) == count
    # The first handle's reference came back through release().
    assert devshare.outstanding(x) == 0
    assert devshare.wait(x, timeout=5) is True
    with pytest.raises(devshare.Error) as info:
        devshare.discard(h1)
    assert info.value.status == devshare.Status.ALREADY_RELEASED

    # Later handles still open: a devshare import (with an in-flight reference) ...
    h2 = devshare.share(x)
    y = devshare.open(h2)
    assert torch.equal(y, x)
    del y
    gc.collect()
    # ... and another stock consumer process.
    h3 = devshare.share(x, inflight=False)
    run_stock(h3.mapping_info())
    assert devshare.outstanding(x) == 0
    assert header_count(h1.key) == count
    assert x.tolist() == expect  # negated twice: -(-v - 1) - 1 == v
    del x, owner
    gc.collect()
    devshare.collect()
    assert vanishes(path)  # the last devshare holder unlinked it, as always


def test_a_c_producer_keeps_sharing_while_a_stock_consumer_process_comes_and_goes():
    # tensor_tool (C, devshare_host_alloc + devshare_exporter_share without the in-flight
    # flag) waits for its handle's reference; the stock consumer process returns it.
    vals = list(range(1, 7))
    p = spawn([tensor_tool(), "export", "0", "32", "2,3", "-", "0", "0", "24",
               b"".join(v.to_bytes(4, "little", signed=True) for v in vals).hex()])
    try:
        line = p.stdout.readline()
        assert line.startswith("handle "), line + p.stderr.read()
        h = devshare.Handle.from_text(line.split()[1])
        assert not h.inflight and h.ref_name
        path = path_of(h)
        seen = run_stock(h.mapping_info())
        assert seen == [vals[:3], vals[3:]]
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        released, data = out.splitlines()
        # The C exporter's devshare_exporter_wait saw the reference come back, and the data
        # it holds is what the consumer wrote.
        assert released == "released"
        assert data == "data " + b"".join((-v - 1).to_bytes(4, "little", signed=True)
                                          for v in vals).hex()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert vanishes(path)  # the exporter closed: whoever brings the count to 0 unlinks


def test_an_unchanged_stock_consumer_leaves_the_release_to_the_producer():
    x = devshare.empty((4,), "int32")
    x.copy_(torch.arange(4, dtype=torch.int32))
    h = devshare.share(x, inflight=False)
    run_stock(h.mapping_info(), mode="no-release")  # maps, reads, writes, exits
    assert x.tolist() == [-1, -2, -3, -4]
    assert stays(path_of(h), 0.5)
    assert devshare.outstanding(x) == 1  # nothing in stock PyTorch returns it
    devshare.discard(h)  # the producer knows the consumer exited: it gives the reference back
    assert devshare.outstanding(x) == 0
    # Later handles still open.
    assert devshare.open(devshare.share(x)).tolist() == [-1, -2, -3, -4]


def test_the_old_manager_recipe_unlinks_the_buffer():
    """The README's old snippet in a consumer process: its torch_shm_manager unlinks the
    producer's object once the consumer exits. Every check the new recipe passes fails here."""
    x = devshare.empty((4,), "float32")
    x.copy_(torch.arange(4, dtype=torch.float32))
    h = devshare.share(x)  # what the old README paired with it: an in-flight handle
    path, rc_path = path_of(h), "/dev/shm" + h.ref_name.decode()
    info = {"name": h.key.decode(), "alloc_size": h.alloc_size, "dtype": h.dtype_name,
            "shape": list(h.shape), "strides": list(h.strides)}
    res = run([sys.executable, "-c", OLD_RECIPE, json.dumps(info)], env=stock_env(), cwd="/")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout.splitlines()[0]) == [0.0, 1.0, 2.0, 3.0]
    assert x[0].item() == 42.0

    # Its manager removes the name a moment after the consumer exited ...
    assert vanishes(path), "the old recipe left the object in place: update this test and docs/formats.md"
    # ... while the producer still holds the buffer: every later handle is refused ...
    with pytest.raises(devshare.Error) as info_:
        devshare.open(devshare.share(x, inflight=False))
    assert info_.value.status == devshare.Status.NOT_FOUND
    # ... and the first handle's reference never comes back (nothing can take its in-flight
    # reference over now: the import fails too).
    assert devshare.outstanding(x) == 2
    with pytest.raises(devshare.Error) as info_:
        devshare.discard(h)
    assert info_.value.status == devshare.Status.NOT_FOUND
    del x
    gc.collect()
    # The exporter closed, and the ref-counter stays in /dev/shm for good (its header still
    # counts the in-flight reference). Clean up what the old recipe leaked.
    assert os.path.exists(rc_path)
    os.unlink(rc_path)


def test_mapping_info_fields_and_refusals():
    base = devshare.empty((4, 5), "float64")
    v = base[1:3, 1:]
    h = devshare.share(v, inflight=False)
    info = h.mapping_info()
    assert info == {
        "path": path_of(h), "size": 64 + h.alloc_size, "offset": 64 + h.storage_offset,
        "storage_size": h.storage_size, "dtype": "float64", "shape": [2, 4], "strides": [5, 1],
        "tensor_offset": h.tensor_offset, "ref_path": "/dev/shm" + h.ref_name.decode(),
        "ref_slot": h.ref_slot,
    }
    assert json.loads(json.dumps(info)) == info
    assert os.path.getsize(info["path"]) >= info["size"]
    devshare.discard(h)
    # An in-flight reference can be taken over by a devshare import only.
    h2 = devshare.share(v)
    with pytest.raises(ValueError, match="inflight=False"):
        h2.mapping_info()
    devshare.open(h2)
    # Device handles open through PyTorch's IPC.
    from test_int_checks import _cuda_args

    with pytest.raises(ValueError, match="torch_args"):
        devshare.handle_from_torch(_cuda_args()).mapping_info()


def test_the_recipe_refuses_what_it_must_not_map():
    ns: dict = {}
    exec(consumer_code(), ns)
    _map = ns["_map"]
    for bad in ("/dev/shm/../etc/passwd", "/dev/shm/other_program", "/tmp/devshare_1_ab",
                "/dev/shm/devshare_1_ab/../x", "/dev/shm/.devshare_1_ab"):
        with pytest.raises(ValueError, match="not a devshare or PyTorch shm object"):
            _map(bad)
    name = f"/dev/shm/devshare_{os.getpid()}_{'ab' * 16}"
    try:
        with open(name, "wb") as f:
            f.write(bytes(128))
        os.chmod(name, 0o644)  # group/others may read: not a private object
        with pytest.raises(PermissionError):
            _map(name)
    finally:
        os.unlink(name)
    # A missing object is FileNotFoundError, and nothing is created in its place.
    with pytest.raises(FileNotFoundError):
        _map(name)
    assert not os.path.exists(name)
    with pytest.raises(FileNotFoundError):
        ns["open_shared"]({"path": name, "size": 64})
    assert not os.path.exists(name)
    # release() of a ref-counter that is gone (the producer closed) does nothing.
    ns["release"]({"ref_path": f"/dev/shm/devshare_rc_{os.getpid()}_{'cd' * 16}", "ref_slot": 0})


def test_from_file_is_not_the_recipe():
    """torch.UntypedStorage.from_file (manager-free too) re-creates a vanished name and, given
    more bytes than the object holds, grows it and zeroes the header's first byte."""
    x = devshare.empty((4,), "float32")
    h = devshare.share(x, inflight=False)
    path = path_of(h)
    count = header_count(h.key)
    assert count >= 1
    size = os.path.getsize(path)
    st = torch.UntypedStorage.from_file(path, shared=True, nbytes=size + 4096)
    try:
        assert os.path.getsize(path) == size + 4096  # grown
        assert header_count(h.key) == count & ~0xFF  # the count's low byte written as 0
    finally:
        # Put the producer's header back as it was (only this test wrote to it).
        with open(path, "r+b") as f:
            f.write(count.to_bytes(4, "little", signed=True))
        del st
    devshare.discard(h)
    gone = f"/dev/shm/devshare_{os.getpid()}_{'ef' * 16}"
    try:
        torch.UntypedStorage.from_file(gone, shared=True, nbytes=128)
        assert os.path.exists(gone)  # a name that vanished comes back as a new object
    finally:
        if os.path.exists(gone):
            os.unlink(gone)


@pytest.mark.parametrize("producer_first", [True, False])
def test_a_stock_mapping_is_not_counted_and_outlives_the_name(producer_first):
    # The recipe in this process: the mapping is not counted in the header, so the producer's
    # close unlinks the name (it was the last devshare holder), and the mapping stays valid.
    ns: dict = {}
    exec(consumer_code(), ns)
    x = devshare.empty((2, 3), torch.float32)
    x.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    h = devshare.share(x, inflight=False)
    info = h.mapping_info()
    path = info["path"]
    y = ns["open_shared"](info)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # a second mapping ...
    y[1, 1] = 50.0
    assert x[1, 1].item() == 50.0  # ... of the same memory
    assert header_count(h.key) == 1  # the exporter only: the stock mapping counts nothing
    if producer_first:
        ns["release"](info)
        assert devshare.outstanding(x) == 0
        del x
        gc.collect()
        assert not os.path.exists(path)  # the last devshare holder unlinked it
        assert y[1, 1].item() == 50.0  # the stock mapping is still valid
        y[0, 0] = 7.0
        del y
    else:
        del y
        gc.collect()
        assert os.path.exists(path) and devshare.outstanding(x) == 1
        ns["release"](info)
        assert devshare.wait(x, timeout=5)
        del x
        gc.collect()
        assert not os.path.exists(path)
    ns["release"](info)  # again, after the producer closed: nothing to do, nothing created
    assert not os.path.exists(info["ref_path"])


def test_share_inflight_takes_a_bool():
    x = devshare.empty((2,), "float32")
    for bad in (1, "no", None):
        with pytest.raises(TypeError, match="inflight"):
            devshare.share(x, inflight=bad)
    assert devshare.outstanding(x) == 0
