"""PyTorch's own tensors over a channel (``Channel.send`` / ``send_batch`` of torch tensors), to
C, C++ and Python consumers in other processes.

The producer is a Python process. Host: real torch CPU tensors (a private storage moves into
PyTorch's ``file_system`` shared memory once). Devices: no GPU or NPU here, so "PyTorch's
share" is made the way PyTorch makes it, over the CUDA / ACL stand-ins (tests/standin): device
memory allocated with the runtime, exported by a devshare exporter standing in for the caching
allocator (its ref-counter slot is the reference PyTorch would count), and written as the
15-argument ``reduce_tensor`` tuple of this torch (``devshare.torch_args``). The channel adopts
that tuple exactly as it adopts one from ``reduce_tensor``; "PyTorch frees the block" is that
exporter's reference count reaching 0. Device producers are non-dumpable, and the 'e' consumer
drops ``CAP_SYS_PTRACE`` and checks that ``pidfd_getfd`` on the producer is refused: the segment
fds can only have come with the messages.

Every device test asserts that the stand-ins recorded no broken rule.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import time

import pytest

import devshare
from conftest import bin_dir, python_env, spawn

# The producer: argv = kind (cpu | cuda_c | cuda_e | acl_c | acl_e), address, mode (wait | stay).
# Prints EXPECT <sum per item>, LISTENING, SENT (after dropping its own references to the
# tensors), then with "wait": RETURNED <references PyTorch still counts> once every lease is back
# (or TIMEOUT), with "stay": sleeps until killed.
PRODUCER = textwrap.dedent(r"""
    import ctypes, gc, os, struct, sys, time
    from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_ubyte, c_uint64, c_ulonglong, c_ushort, c_void_p
    import torch
    import devshare
    from devshare import _dtypes, _lib, _torch_ipc
    from devshare._lib import call, lib, new_struct

    kind, address, mode = sys.argv[1:4]
    SEG = 2 << 20

    def pattern(n, start):
        return [float((start + k) % 13) for k in range(n)]

    ch = devshare.Channel(address)
    if kind == "cpu":
        base = torch.tensor(pattern(4000, 0), dtype=torch.float32)  # private memory
        other = torch.full((50,), 2.5)
        tensors = [base[:1000].view(10, 100), base[1000:1600], other]
        print("EXPECT", *(float(t.sum()) for t in tensors), flush=True)
        print("LISTENING", flush=True)
        peer = ch.wait_peers(1, timeout=20)[0]
        ch.send_batch(peer, tensors)
        del tensors
        pending = lambda: devshare.outstanding(base) + devshare.outstanding(other)
    else:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: nobody may take our fds
        data = struct.pack("<4000f", *pattern(4000, 0)) + bytes(96) + struct.pack("<600f", *pattern(600, 5))
        if kind.startswith("cuda"):
            cu = ctypes.CDLL(os.environ["DEVSHARE_CUDA_LIBRARY"])
            def ck(rc, what):
                if rc != 0:
                    raise SystemExit(f"FAIL {what}: CUDA error {rc}")
            ck(cu.cuInit(0), "cuInit")
            dev, ctx = c_int(), c_void_p()
            ck(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
            ck(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            cu.cuMemcpyHtoD_v2.argtypes = [c_ulonglong, c_void_p, c_size_t]
            fake = _lib.ExporterP()
            if kind == "cuda_c":
                ptr = c_ulonglong()
                ck(cu.cuMemAlloc_v2(byref(ptr), c_size_t(1 << 20)), "cuMemAlloc")
                start = ptr.value + 4096
                call(lib.devshare_export, _lib.BACKEND_CUDA, 0, c_void_p(ptr.value), c_uint64(1 << 20), 0, byref(fake))
                first = 4096
            else:
                class Loc(Structure):
                    _fields_ = [("type", c_int), ("id", c_int)]
                class AllocFlags(Structure):
                    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte),
                                ("usage", c_ushort), ("reserved", c_ubyte * 4)]
                class Prop(Structure):
                    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Loc),
                                ("win32HandleMetaData", c_void_p), ("allocFlags", AllocFlags)]
                class Access(Structure):
                    _fields_ = [("location", Loc), ("flags", c_int)]
                cu.cuMemCreate.argtypes = [POINTER(c_ulonglong), c_size_t, POINTER(Prop), c_ulonglong]
                cu.cuMemAddressReserve.argtypes = [POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong]
                cu.cuMemMap.argtypes = [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong]
                cu.cuMemSetAccess.argtypes = [c_ulonglong, c_size_t, POINTER(Access), c_size_t]
                prop = Prop(type=1, requestedHandleTypes=1, location=Loc(1, 0))
                phys = (c_uint64 * 3)()
                for i in range(3):
                    h = c_ulonglong()
                    ck(cu.cuMemCreate(byref(h), SEG, byref(prop), 0), "cuMemCreate")
                    phys[i] = h.value
                va = c_ulonglong()
                ck(cu.cuMemAddressReserve(byref(va), 3 * SEG, 0, 0, 0), "cuMemAddressReserve")
                for i in range(3):
                    ck(cu.cuMemMap(va.value + i * SEG, SEG, 0, phys[i], 0), "cuMemMap")
                ck(cu.cuMemSetAccess(va.value, 3 * SEG, byref(Access(Loc(1, 0), 3)), 1), "cuMemSetAccess")
                first = SEG - 8192  # the first storage spans segments 0 and 1
                start = va.value + first
                call(lib.devshare_export_segments, _lib.BACKEND_CUDA, 0, va.value, phys, 3, SEG, 0, byref(fake))
            ck(cu.cuMemcpyHtoD_v2(start, data, len(data)), "cuMemcpyHtoD")
            backend = _lib.BACKEND_CUDA
        elif kind == "acl_e":  # torch_npu's expandable segments: shareable handles
            acl = ctypes.CDLL(os.environ["DEVSHARE_ACL_LIBRARY"])
            assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
            class Loc(Structure):
                _fields_ = [("id", ctypes.c_uint32), ("type", c_int)]
            class Prop(Structure):
                _fields_ = [("handleType", c_int), ("allocationType", c_int), ("memAttr", c_int),
                            ("location", Loc), ("reserve", c_uint64)]
            acl.aclrtMallocPhysical.argtypes = [POINTER(c_void_p), c_size_t, POINTER(Prop), c_uint64]
            acl.aclrtReserveMemAddress.argtypes = [POINTER(c_void_p), c_size_t, c_size_t, c_void_p, c_uint64]
            acl.aclrtMapMem.argtypes = [c_void_p, c_size_t, c_size_t, c_void_p, c_uint64]
            prop = Prop(0, 0, 4, Loc(0, 1), 0)  # pinned HBM huge pages on device 0
            phys = (c_uint64 * 3)()
            for i in range(3):
                h = c_void_p()
                assert acl.aclrtMallocPhysical(byref(h), SEG, byref(prop), 0) == 0
                phys[i] = h.value
            va = c_void_p()
            assert acl.aclrtReserveMemAddress(byref(va), 3 * SEG, 0, None, 0) == 0
            for i in range(3):
                assert acl.aclrtMapMem(va.value + i * SEG, SEG, 0, phys[i], 0) == 0
            first = SEG - 8192  # the first storage spans segments 0 and 1
            start = va.value + first
            acl.aclrtMemcpy.argtypes = [c_void_p, c_size_t, c_void_p, c_size_t, c_int]
            assert acl.aclrtMemcpy(start, len(data), data, len(data), 1) == 0
            fake = _lib.ExporterP()
            call(lib.devshare_export_segments, _lib.BACKEND_ACL, 0, va, phys, 3, c_uint64(SEG), 0, byref(fake))
            backend = _lib.BACKEND_ACL
            ch.trust_announced_pids()
        else:  # acl_c
            acl = ctypes.CDLL(os.environ["DEVSHARE_ACL_LIBRARY"])
            assert acl.aclInit(None) == 0 and acl.aclrtSetDevice(0) == 0
            ptr = c_void_p()
            assert acl.aclrtMalloc(byref(ptr), c_size_t(SEG), 0) == 0
            first = 4096
            start = ptr.value + first
            acl.aclrtMemcpy.argtypes = [c_void_p, c_size_t, c_void_p, c_size_t, c_int]
            assert acl.aclrtMemcpy(start, len(data), data, len(data), 1) == 0
            fake = _lib.ExporterP()
            call(lib.devshare_export, _lib.BACKEND_ACL, 0, ptr, c_uint64(SEG), 0, byref(fake))
            backend = _lib.BACKEND_ACL
            ch.trust_announced_pids()  # the stand-in's bare tgid is not the kernel's pid

        def pytorch_share(offset, nbytes):
            # What reduce_tensor gives for a 1-D float32 storage of nbytes at offset: one reference.
            shape = (ctypes.c_int64 * 1)(nbytes // 4)
            desc = new_struct(_lib.TensorDesc, dtype=_lib.DType(2, 32, 1), ndim=1,
                              shape=ctypes.cast(shape, POINTER(ctypes.c_int64)), storage_offset=offset,
                              storage_size=nbytes)
            size = c_size_t()
            lib.devshare_exporter_share_encoded(fake, byref(desc), None, 0, byref(size))
            buf = ctypes.create_string_buffer(size.value)
            call(lib.devshare_exporter_share_encoded, fake, byref(desc), buf, size.value, byref(size))
            return _torch_ipc.torch_args(devshare.Handle.from_bytes(buf.raw[: size.value]))

        a, b = pytorch_share(first, 16000), pytorch_share(first + 16096, 2400)
        dt = _dtypes.from_any(torch.float32)
        # Items: a 10x100 view of storage a, storage b whole, and 50 elements of a at offset 100.
        items = [(a, (10, 100), (100, 1), 0), (b, (600,), (1,), 0), (a, (50,), (1,), 100)]
        floats = struct.unpack("<4000f", data[:16000])
        expect = [sum(floats[:1000]), sum(pattern(600, 5)), sum(floats[100:150])]
        print("EXPECT", *expect, flush=True)
        print("LISTENING", flush=True)
        peer = ch.wait_peers(1, timeout=20)[0]
        adopted, prepared = {}, []
        for args, shape, strides, off in items:
            key = id(args)
            if key not in adopted:
                adopted[key] = ch._adopt(args, backend, keep=object(), key=("stand-in", key))
            prepared.append(ch._device_desc(adopted[key], dt, shape, strides, off, 0))
        ch._send_prepared(peer, prepared)  # what send_batch does after reduce_tensor: one message
        del adopted, prepared, items, a, b
        def pending():
            n = c_uint64()
            call(lib.devshare_exporter_outstanding, fake, byref(n))
            return n.value
    gc.collect()
    print("SENT", flush=True)
    if mode == "stay":
        time.sleep(120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ch.service(0.05)
        if pending() == 0:
            print("RETURNED", pending(), flush=True)
            break
    else:
        print("TIMEOUT", pending(), flush=True)
    ch.close()
    if kind != "cpu":
        call(lib.devshare_exporter_close, fake, 0)
""")

# A Python consumer: argv = address, n, mode (release | hold). Prints ITEM <i> sum=<s>; with
# hold, HOLDING, CLOSED (once the producer is gone), STILL <i> sum=<s>, RELEASED <count>.
CONSUMER = textwrap.dedent(r"""
    import sys
    import devshare
    address, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    conn = devshare.connect(address, timeout=10)
    print("CONNECTED", flush=True)
    held = []
    for i in range(n):
        item = conn.recv(timeout=30)
        print("ITEM", i, f"sum={float(item.tensor.sum()):.1f}", flush=True)
        if mode == "hold":
            held.append(item.tensor)
        else:
            item.release()
    if mode == "hold":
        print("HOLDING", flush=True)
        try:
            conn.recv(timeout=60)
        except devshare.ChannelClosed:
            print("CLOSED", flush=True)
        for i, t in enumerate(held):
            print("STILL", i, f"sum={float(t.sum()):.1f}", flush=True)
        print("RELEASED", conn.release_all(), flush=True)
    conn.close()
""")

KINDS = ["cpu", "cuda_c", "cuda_e", "acl_c", "acl_e"]


@pytest.fixture
def env(tmp_path):
    lib_dir = os.path.dirname(os.path.realpath(devshare.library_path))
    log = tmp_path / "standin.log"
    e = python_env(DEVSHARE_LIBRARY=devshare.library_path, DEVSHARE_STANDIN_LOG=str(log),
                   DEVSHARE_CUDA_LIBRARY=os.path.join(lib_dir, "standin", "cuda", "libcuda.so.1"),
                   DEVSHARE_ACL_LIBRARY=os.path.join(lib_dir, "standin", "acl", "libascendcl.so"))
    yield e
    violations = log.read_text() if log.exists() else ""
    assert not violations, f"runtime rules broken:\n{violations}"


def _line(p, tag, timeout=30) -> str:
    """The rest of the next line of ``p``'s stdout that starts with ``tag`` (others skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith(tag):
            return line[len(tag):].strip()
    p.kill()
    raise AssertionError(f"no {tag!r} line; stderr: {p.stderr.read()}")


def _producer(env, kind, mode="wait"):
    address = f"@devshare-torch-test-{os.getpid()}-{kind}-{time.monotonic_ns()}"
    p = spawn([sys.executable, "-c", PRODUCER, kind, address, mode], env=env)
    expect = [float(x) for x in _line(p, "EXPECT").split()]
    _line(p, "LISTENING")
    return p, address, expect


def _consumer(env, which, address, n, mode=""):
    if which == "python":
        return spawn([sys.executable, "-c", CONSUMER, address, str(n), mode or "release"], env=env)
    prog = "torch_consumer" if which == "c" else "torch_consumer_cpp"
    return spawn([str(bin_dir() / prog), address, str(n)] + ([mode] if mode else []), env=env)


def _sums(p, n, tag="ITEM") -> list[float]:
    out = []
    for _ in range(n):
        fields = _line(p, tag).split()
        out.append(float([f for f in fields if f.startswith("sum=")][0][4:]))
    return out


def _kill(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


@contextlib.contextmanager
def _reaped(*procs):
    """Kill whichever of ``procs`` still runs when the block ends (a failed check included)."""
    try:
        yield
    finally:
        _kill(*procs)


def _finish(p, timeout=30):
    try:
        out, err = p.communicate(timeout=timeout)
    except Exception:
        p.kill()
        raise
    return p.returncode, out, err


@pytest.mark.parametrize("consumer", ["c", "cpp", "python"])
def test_cpu_tensors_arrive_zero_copy_and_their_leases_come_back(env, consumer):
    prod, address, expect = _producer(env, "cpu")
    cons = _consumer(env, consumer, address, 3)
    with _reaped(cons, prod):
        assert _sums(cons, 3) == pytest.approx(expect)
        rc, _, err = _finish(cons)
        assert rc == 0, err
        assert _line(prod, "RETURNED") == "0"
        assert _finish(prod)[0] == 0


@pytest.mark.parametrize("kind", ["cuda_c", "cuda_e", "acl_c", "acl_e"])
@pytest.mark.parametrize("consumer", ["c", "cpp"])
def test_device_storages_reach_c_and_cpp_consumers_and_pytorchs_references_return(env, kind, consumer):
    """Two storages, three items (two in one storage): each storage adopted once, each item an
    ordinary import; once all are released the producer returns both PyTorch references."""
    prod, address, expect = _producer(env, kind)
    cons = _consumer(env, consumer, address, 3)
    with _reaped(cons, prod):
        assert _sums(cons, 3) == pytest.approx(expect)
        rc, _, err = _finish(cons)
        assert rc == 0, err
        assert _line(prod, "RETURNED") == "0"
        assert _finish(prod)[0] == 0


@pytest.mark.parametrize("kind", ["cuda_c", "cuda_e"])
def test_a_consumer_stream_waits_for_the_events_instead_of_recv(env, kind, tmp_path):
    """devshare_connection_set_stream: the items import and read the same with the events
    waited for on the consumer's own CUDA stream; a pointer that is no stream makes the receive
    fail with the driver's refusal, which the stand-in records (in a log of its own) as a wait
    on an unknown stream: the stream really is what waits."""
    prod, address, expect = _producer(env, kind)
    cons = _consumer(env, "c", address, 3, "stream")
    with _reaped(cons, prod):
        assert _sums(cons, 3) == pytest.approx(expect)
        rc, _, err = _finish(cons)
        assert rc == 0, err
        assert _line(prod, "RETURNED") == "0"
        assert _finish(prod)[0] == 0
    bad_log = tmp_path / "bad-stream.log"
    bad_env = dict(env, DEVSHARE_STANDIN_LOG=str(bad_log))
    prod, address, expect = _producer(bad_env, kind)
    cons = _consumer(bad_env, "c", address, 3, "badstream")
    with _reaped(cons, prod):
        failed = _line(cons, "RECV_FAILED")
        assert "cuStreamWaitEvent" in failed, failed
        assert "unknown or destroyed stream 0x1000" in bad_log.read_text()
        _finish(cons)
        assert _line(prod, "RETURNED") == "0"  # the refused item's lease came back
        assert _finish(prod)[0] == 0


def test_segmented_cuda_storages_need_no_ptrace(env):
    """The producer is non-dumpable and the consumer has no CAP_SYS_PTRACE: pidfd_getfd on the
    producer is refused, yet every expandable-segment item imports (its fds came with it)."""
    prod, address, expect = _producer(env, "cuda_e")
    cons = _consumer(env, "c", address, 3, "noptrace")
    with _reaped(cons, prod):
        assert _line(cons, "PTRACE_DENIED") == ""
        assert _sums(cons, 3) == pytest.approx(expect)
        rc, _, err = _finish(cons)
        assert rc == 0, err
        assert _line(prod, "RETURNED") == "0"
        assert _finish(prod)[0] == 0


@pytest.mark.parametrize("kind", ["cpu", "cuda_c", "cuda_e"])
def test_a_consumer_killed_while_holding_gives_every_storage_back(env, kind):
    prod, address, expect = _producer(env, kind)
    cons = _consumer(env, "c", address, 3, "hold")
    with _reaped(cons, prod):
        assert _sums(cons, 3) == pytest.approx(expect)
        _line(cons, "HOLDING")
        cons.send_signal(signal.SIGKILL)
        cons.wait(10)
        assert _line(prod, "RETURNED") == "0"
        assert _finish(prod)[0] == 0


@pytest.mark.parametrize("kind, consumer", [("cpu", "c"), ("cpu", "python"), ("cuda_c", "c"),
                                            ("cuda_e", "c")])
def test_a_killed_producer_closes_and_what_consumers_hold_stays_readable(env, kind, consumer):
    """The consumer's next receive says CLOSED; the items it holds still read the same and
    release (Python: Connection.release_all). What only the killed producer would have removed
    (PyTorch's file_system objects, its ref-counters, the CUDA stand-in's objects) is removed
    here, by its pid."""
    prod, address, expect = _producer(env, kind, mode="stay")
    cons = _consumer(env, consumer, address, 3, "hold")
    try:
        assert _sums(cons, 3) == pytest.approx(expect)
        _line(cons, "HOLDING")
        _line(prod, "SENT")
        prod.send_signal(signal.SIGKILL)
        prod.wait(10)
        _line(cons, "CLOSED")
        assert _sums(cons, 3, "STILL") == pytest.approx(expect)
        released = _line(cons, "RELEASED")
        if consumer == "python":
            assert released == "3"
        rc, _, err = _finish(cons)
        assert rc == 0, err
    finally:
        _kill(cons, prod)
        _remove_shm_of(prod.pid)


def _remove_shm_of(pid: int) -> None:
    """Unlink what killed process ``pid`` left: PyTorch's and devshare's objects, and the CUDA
    stand-in's memory, IPC handle and event objects (``cusi_<kind>_<pid>_<n>``: the stand-in
    removes them at exit, which a SIGKILL skips; a real driver frees them with the process)."""
    for name in os.listdir("/dev/shm"):
        if name.startswith((f"torch_{pid}_", f"devshare_rc_{pid}_", f"devshare_{pid}_")) or \
                (name.startswith("cusi_") and f"_{pid}_" in name):
            os.unlink(os.path.join("/dev/shm", name))


def test_an_event_outlives_the_producers_references(env):
    """The producer drops every reference to its tensors right after sending (SENT is printed
    after a garbage collection); the consumer connects only then... and still opens and waits on
    each item's event (the stand-in records an event opened after it was destroyed, or never
    waited on, as a broken rule)."""
    prod, address, expect = _producer(env, "cuda_c")
    cons = _consumer(env, "c", address, 3, "hold")
    with _reaped(cons, prod):
        _line(cons, "CONNECTED")
        _line(prod, "SENT")
        time.sleep(0.3)  # the producer's references are gone; the leases hold the events
        assert _sums(cons, 3) == pytest.approx(expect)
        _line(cons, "HOLDING")
        cons.send_signal(signal.SIGKILL)
        cons.wait(10)
        assert _line(prod, "RETURNED") == "0"
        assert _finish(prod)[0] == 0
