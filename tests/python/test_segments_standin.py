"""Segmented (expandable-segment) CUDA handles end to end through the Python package, on the CUDA
stand-in (tests/standin/cuda, built next to the library by build.rs): a producer process builds a
VMM allocation the way PyTorch's expandable segments do (cuMemCreate per 2 MiB segment, one
reservation, cuMemMap, cuMemSetAccess) and exports it with devshare_export_segments; a consumer
process receives the handle as text, and the package imports it. With more than 32 segments the
fd table does not fit the handle struct: it travels only in the text, and the package imports
through devshare_import_encoded. The consumer takes the producer's fds with pidfd_getfd (real
system calls: the stand-in's exports are memfds).

Each side runs in its own process with DEVSHARE_CUDA_LIBRARY pointing at the stand-in, which
records every CUDA rule broken in DEVSHARE_STANDIN_LOG; the test asserts none was.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest

import devshare
import pytorch_reader
from conftest import python_env, run, spawn

SEGMENT = 2 << 20

# The producer: argv = segments nfloats offset-bytes start; prints TEXT <text>, TORCH <hex of the
# 'e' storage handle written by the library>, TABLE <hex|->; then waits for the reference and
# prints RELEASED first=<element 0 after the consumer> outstanding=<n>.
PRODUCER = textwrap.dedent(r"""
    import ctypes, os, struct, sys
    from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_ubyte, c_uint64, c_ulonglong, c_ushort, c_void_p
    import devshare
    from devshare import _lib
    from devshare._lib import call, lib, new_struct

    nseg, n, offset, start = (int(a) for a in sys.argv[1:5])
    SEG = 2 << 20
    cu = ctypes.CDLL(os.environ["DEVSHARE_CUDA_LIBRARY"])

    class Loc(Structure):
        _fields_ = [("type", c_int), ("id", c_int)]

    class AllocFlags(Structure):
        _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte), ("usage", c_ushort),
                    ("reserved", c_ubyte * 4)]

    class Prop(Structure):  # CUmemAllocationProp
        _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Loc),
                    ("win32HandleMetaData", c_void_p), ("allocFlags", AllocFlags)]

    class Access(Structure):  # CUmemAccessDesc
        _fields_ = [("location", Loc), ("flags", c_int)]

    def ck(rc, what):
        if rc != 0:
            raise SystemExit(f"FAIL {what}: CUDA error {rc}")

    cu.cuMemCreate.argtypes = [POINTER(c_ulonglong), c_size_t, POINTER(Prop), c_ulonglong]
    cu.cuMemAddressReserve.argtypes = [POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong, c_ulonglong]
    cu.cuMemMap.argtypes = [c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong]
    cu.cuMemSetAccess.argtypes = [c_ulonglong, c_size_t, POINTER(Access), c_size_t]
    cu.cuMemUnmap.argtypes = [c_ulonglong, c_size_t]
    cu.cuMemRelease.argtypes = [c_ulonglong]
    cu.cuMemAddressFree.argtypes = [c_ulonglong, c_size_t]
    cu.cuMemcpyHtoD_v2.argtypes = [c_ulonglong, c_void_p, c_size_t]
    cu.cuMemcpyDtoH_v2.argtypes = [c_void_p, c_ulonglong, c_size_t]
    ck(cu.cuInit(0), "cuInit")
    dev, ctx = c_int(), c_void_p()
    ck(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    ck(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = Prop(type=1, requestedHandleTypes=1, location=Loc(1, 0))  # pinned, POSIX fd, device 0
    phys = (c_uint64 * nseg)()
    for i in range(nseg):
        h = c_ulonglong()
        ck(cu.cuMemCreate(byref(h), SEG, byref(prop), 0), "cuMemCreate")
        phys[i] = h.value
    va = c_ulonglong()
    ck(cu.cuMemAddressReserve(byref(va), nseg * SEG, 0, 0, 0), "cuMemAddressReserve")
    for i in range(nseg):
        ck(cu.cuMemMap(va.value + i * SEG, SEG, 0, phys[i], 0), "cuMemMap")
    ck(cu.cuMemSetAccess(va.value, nseg * SEG, byref(Access(Loc(1, 0), 3)), 1), "cuMemSetAccess")
    data = struct.pack(f"<{n}f", *(start + i for i in range(n)))
    ck(cu.cuMemcpyHtoD_v2(va.value + offset, data, len(data)), "cuMemcpyHtoD")

    exp = _lib.ExporterP()
    call(lib.devshare_export_segments, _lib.BACKEND_CUDA, 0, va.value, phys, nseg, SEG, 0, byref(exp))
    shape = (ctypes.c_int64 * 1)(n)
    desc = new_struct(_lib.TensorDesc, dtype=_lib.DType(2, 32, 1), ndim=1,
                      shape=ctypes.cast(shape, POINTER(ctypes.c_int64)), storage_offset=offset,
                      storage_size=4 * n)
    size = c_size_t()
    assert lib.devshare_exporter_share_encoded(exp, byref(desc), None, 0, byref(size)) == _lib.Status.BUFFER_TOO_SMALL
    buf = ctypes.create_string_buffer(size.value)
    call(lib.devshare_exporter_share_encoded, exp, byref(desc), buf, size.value, byref(size))
    handle = devshare.Handle.from_bytes(buf.raw[: size.value])
    lib.devshare_exporter_segment_table(exp, None, 0, byref(size))  # the length (0: inline)
    table = b""
    if size.value:
        tb = ctypes.create_string_buffer(size.value)
        call(lib.devshare_exporter_segment_table, exp, tb, size.value, byref(size))
        table = tb.raw[: size.value]
    tlen = c_size_t()
    lib.devshare_torch_storage_handle(byref(handle._h), table or None, len(table), None, 0, byref(tlen))
    eb = ctypes.create_string_buffer(tlen.value)
    call(lib.devshare_torch_storage_handle, byref(handle._h), table or None, len(table), eb, tlen.value, byref(tlen))
    print("TEXT", handle.to_text())
    print("TORCH", eb.raw[: tlen.value].hex())
    # The same in version 3 (PyTorch 2.13 and later), through the 1.2 call.
    lib.devshare_torch_storage_handle_as(byref(handle._h), table or None, len(table), 3, None, 0, byref(tlen))
    eb = ctypes.create_string_buffer(tlen.value)
    call(lib.devshare_torch_storage_handle_as, byref(handle._h), table or None, len(table), 3, eb, tlen.value,
         byref(tlen))
    print("TORCH3", eb.raw[: tlen.value].hex())
    print("TABLE", table.hex() or "-", flush=True)

    status = lib.devshare_exporter_wait(exp, 30000)
    out = c_uint64()
    call(lib.devshare_exporter_outstanding, exp, byref(out))
    first = ctypes.create_string_buffer(4)
    ck(cu.cuMemcpyDtoH_v2(first, va.value + offset, 4), "cuMemcpyDtoH")
    print("RELEASED" if status == 0 else f"STATUS {status}", f"first={struct.unpack('<f', first.raw)[0]}",
          f"outstanding={out.value}", flush=True)
    call(lib.devshare_exporter_close, exp, 0 if status == 0 else _lib.CLOSE_FORCE)
    for i in range(nseg):
        ck(cu.cuMemUnmap(va.value + i * SEG, SEG), "cuMemUnmap")
    for i in range(nseg):
        ck(cu.cuMemRelease(phys[i]), "cuMemRelease")
    ck(cu.cuMemAddressFree(va.value, nseg * SEG), "cuMemAddressFree")
""")

# The consumer: argv = text nfloats start write; imports with the package, checks, writes, releases.
CONSUMER = textwrap.dedent(r"""
    import ctypes, struct, sys
    from ctypes import byref
    import devshare
    from devshare import _api, _lib
    from devshare._lib import call, lib, new_struct

    text, n, start, write = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    h = devshare.Handle.from_text(text)
    print("HANDLE", h.segment_count, h.segment_kind, "inline" if h.table_inline else "external",
          h.storage_offset, h.storage_size, h.producer_pid)
    print("TORCH", devshare.torch_args(h, format=devshare.TORCH_FORMAT_DEFAULT)[7].hex())
    print("TORCH3", devshare.torch_args(h, format="2.13.0")[7].hex(), flush=True)
    if len(sys.argv) > 5:
        # Receive it as a PyTorch 2.13+ tuple instead: version 3, handle type argv[5], garbage in
        # both padding words; it must give the same handle and open the same way.
        args = list(devshare.torch_args(h, format=3))
        e = bytearray(args[7])
        e[6:10], e[30:34] = b"\xde\xad\xbe\xef", b"\xca\xfe\xba\xbe"
        e[26:30] = int(sys.argv[5]).to_bytes(4, sys.byteorder)
        args[7] = bytes(e)
        h3 = devshare.handle_from_torch(tuple(args))
        fields = ("backend", "flags", "device_index", "producer_pid", "alloc_size", "storage_offset",
                  "storage_size", "tensor_offset", "dtype", "shape", "strides", "segment_size",
                  "segment_kind", "segments", "table_inline", "ref_name", "ref_slot")
        diff = [f for f in fields if getattr(h3, f) != getattr(h, f)]
        print("SAME", not diff, *diff, flush=True)
        h = h3
    imp = _api._import(h, False)
    try:
        info = new_struct(_lib.ImportInfo)
        call(lib.devshare_import_info, imp, byref(info))
        got = struct.unpack(f"<{n}f", ctypes.string_at(info.data, 4 * n))
        bad = [i for i, v in enumerate(got) if v != start + i]
        print("CHECK", "ok" if not bad else f"element {bad[0]} is {got[bad[0]]}", info.alloc_size, info.numel)
        ctypes.memmove(info.data, struct.pack(f"<{n}f", *([write] * n)), 4 * n)
    finally:
        lib.devshare_import_release(imp)
    print("DONE", flush=True)
""")


@pytest.fixture
def standin_env(tmp_path):
    lib_dir = pathlib.Path(devshare.library_path).resolve().parent
    cuda = lib_dir / "standin" / "cuda" / "libcuda.so.1"
    assert cuda.exists(), f"the CUDA stand-in is built next to the library by build.rs: {cuda}"
    log = tmp_path / "standin.log"
    env = python_env(DEVSHARE_CUDA_LIBRARY=str(cuda), DEVSHARE_STANDIN_LOG=str(log),
                     DEVSHARE_LIBRARY=devshare.library_path)
    yield env
    violations = log.read_text() if log.exists() else ""
    assert not violations, f"CUDA rules broken:\n{violations}"


def _start_producer(env, nseg, n, offset, start):
    """The producer process and its first lines by tag (TEXT, TORCH, TORCH3, TABLE)."""
    producer = spawn([sys.executable, "-c", PRODUCER, str(nseg), str(n), str(offset), str(start)], env=env)
    first = {}
    for line in producer.stdout:
        tag, _, rest = line.rstrip("\n").partition(" ")
        first[tag] = rest
        if tag in ("TABLE", "FAIL"):
            break
    assert "TEXT" in first, f"producer: {first} {producer.stderr.read() if producer.poll() is not None else ''}"
    return producer, first


def _expect_released(producer, write):
    """The producer saw its reference come back and the consumer's writes, and exited cleanly."""
    out, err = producer.communicate(timeout=60)
    assert producer.returncode == 0, err
    assert out.split() == ["RELEASED", f"first={float(write)}", "outstanding=0"], (out, err)


def lines_by_tag(out: str) -> dict:
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] if " " in ln else "" for ln in out.splitlines() if ln}


@pytest.mark.parametrize("nseg, table", [(3, "inline"), (40, "external")])
def test_a_vmm_export_opens_through_the_package_with_its_segment_table_inline_or_in_the_text(
        standin_env, nseg, table):
    n, offset, start, write = 600_000, SEGMENT - 4096, 10, -3  # the storage spans segments 0..2
    producer, first = _start_producer(standin_env, nseg, n, offset, start)
    try:
        assert (first["TABLE"] == "-") == (table == "inline")
        c = run([sys.executable, "-c", CONSUMER, first["TEXT"], str(n), str(start), str(write)],
                env=standin_env, timeout=60)
        assert c.returncode == 0, c.stderr
        got = lines_by_tag(c.stdout)
        assert got["HANDLE"].split() == [str(nseg), "cuda_fd", table, str(offset), str(4 * n),
                                         str(producer.pid)]
        # The package's 'e' bytes (its table from the text) are the library's (the exporter's table),
        # in version 2 (the default) and 3, and each is read right by its PyTorch.
        assert got["TORCH"] == first["TORCH"] and got["TORCH3"] == first["TORCH3"]
        wire, wire3 = bytes.fromhex(first["TORCH"]), bytes.fromhex(first["TORCH3"])
        assert wire[:2] == b"\x02e" and len(wire) == 26 + 4 * nseg
        assert wire3[:2] == b"\x03e" and len(wire3) == 34 + 4 * nseg
        assert pytorch_reader.read(2, wire) == pytorch_reader.read(3, wire3)
        assert pytorch_reader.read(3, wire3)[1:4] == (producer.pid, SEGMENT, False)
        assert got["CHECK"].split() == ["ok", str(nseg * SEGMENT), str(n)]
        _expect_released(producer, write)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.communicate()


@pytest.mark.parametrize("nseg, handle_type", [(3, 1), (3, 0), (40, 1)])
def test_a_version_3_e_tuple_of_a_vmm_export_opens_in_another_process_as_version_2_does(
        standin_env, nseg, handle_type):
    """What a PyTorch 2.13+ producer sends (version 3, garbage padding, handle type 1 or 0) gives
    the consumer the handle the version-2 form gives, which imports (pidfd_getfd of the producer's
    fds), reads, writes and returns the reference exactly like it."""
    n, offset, start, write = 600_000, SEGMENT - 4096, 10, -3
    producer, first = _start_producer(standin_env, nseg, n, offset, start)
    try:
        c = run([sys.executable, "-c", CONSUMER, first["TEXT"], str(n), str(start), str(write),
                 str(handle_type)], env=standin_env, timeout=60)
        assert c.returncode == 0, c.stderr
        got = lines_by_tag(c.stdout)
        assert got["SAME"] == "True"
        assert got["CHECK"].split() == ["ok", str(nseg * SEGMENT), str(n)]
        _expect_released(producer, write)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.communicate()


def test_a_long_table_handle_cut_from_its_text_is_refused_by_name(standin_env):
    """The struct alone (what devshare_handle_from_text gives) cannot be imported: the library
    names the encoding-based calls; the package never does that (it keeps the encoding)."""
    producer = spawn([sys.executable, "-c", PRODUCER, "40", "1024", "0", "1"], env=standin_env)
    try:
        text = next(ln.split(" ", 1)[1].strip() for ln in producer.stdout if ln.startswith("TEXT"))
        code = textwrap.dedent("""
            import sys, ctypes
            import devshare
            from devshare import _lib
            from devshare._lib import lib
            h = devshare.Handle.from_text(sys.argv[1])
            imp = _lib.ImportP()
            st = lib.devshare_import(ctypes.byref(h._h), None, ctypes.byref(imp))
            print(st, _lib.last_error())
            # then return the reference, through the package (it imports with the encoding)
            real = devshare._api._import(h, False)
            lib.devshare_import_release(real)
        """)
        c = run([sys.executable, "-c", code, text], env=standin_env, timeout=60)
        assert c.returncode == 0, c.stderr
        status, _, message = c.stdout.strip().partition(" ")
        assert int(status) == devshare.Status.INVALID_ARGUMENT
        assert "devshare_import_encoded" in message and "40 segments" in message
        out, err = producer.communicate(timeout=60)
        assert "RELEASED" in out, (out, err)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.communicate()
