#!/usr/bin/env python3
"""Per-item handoff between two processes through a devshare channel pool, against today's
handle-per-item path, torch.multiprocessing.Queue and a bare pipe; C and Python producers and
consumers; everything measured in one run and compared in one table.

Rows, for each size:

  pool        C->C     bench/channel_handoff.c: devshare_channel_host_alloc + devshare_pool_create;
                       acquire, devshare_pool_send; the consumer's devshare_connection_recv,
                       touch, devshare_import_release; the producer's next acquire gets it back
  lease       C->C     devshare_channel_send of one region per item (a leased reference)
  handle      C->C     devshare_exporter_share_encoded, the encoding over a pipe,
                       devshare_import_encoded in the consumer, an ack back
  pipe-floor  C->C     8 bytes out, an ack back: the least any pipe-based handoff costs
  socket-floor C->C    the same over a SOCK_SEQPACKET socket pair, the kind of socket a channel is
  pipe-copy   C->C     the item's bytes through the pipe (sizes below 1 MiB)
  pool        Py->C    the pool from Python (devshare.Channel, Channel.pool, Pool.acquire,
                       Slot.send), consumer `channel_handoff consume`
  pool        Py->Py   the same with a Python consumer: devshare.connect, Connection.recv, the
                       item's torch tensor touched like bench/handoff.py's consumers do,
                       Item.release
  pool (ctypes) Py->C, Py->Py   the same through the C API and ctypes, with nothing in between
                       (the consumer's torch tensor through DLPack); when the package has no
                       channels, these are the "pool" rows
  handle      Py->C    bench/handoff.py's devshare-c (devshare.share, handle text over a pipe)
  handle      Py->Py   bench/handoff.py's devshare-py (devshare.open)
  queue-fd    Py->Py   torch.multiprocessing.Queue, sharing strategy file_descriptor (default)
  queue-fs    Py->Py   the same, file_system
  pipe-floor  Py->C    bench/handoff.py's pipe-floor (a line out, an ack back)

Latency (p50/p99): one item in flight, from just before the producer hands it until the
consumer has touched it (first and last byte or element), both sides reading CLOCK_MONOTONIC.
Round trip: until the producer has the item back (pool: acquire returns the slot; lease:
devshare_exporter_wait; queues and pipes: the acknowledgement was read). Throughput: N items
back to back, N / (last consumer touch - first hand). See bench/channel_handoff.c and
bench/handoff.py for the details of each method.

Every row is measured with the processes where the scheduler puts them ("any"), and with the
producer and every consumer pinned to one CPU ("one": each handoff is a context switch); the
C->C rows also with producer and consumer pinned to two different CPUs ("two": each handoff
wakes the other CPU). On a small or virtual machine the placement moves the figures by more
than the differences between methods, so ratios are taken within one placement. Then the ratios the targets are about, and
a step-by-step breakdown of the pool's one-at-a-time handoff (consumer polling the connection's
fd, then receiving without blocking, so that each step is timed on its own), and what the system
calls those steps are made of cost on this machine (`channel_handoff syscalls`).

Usage: python bench/channel_handoff.py [--bin build/channel_handoff]
           [--consumer build/handoff_consumer] [--count N] [--large-count N]
           [--sizes 4096,67108864] [--slots N] [--large-slots N] [--python-api auto|package|ctypes]
"""

import argparse
import ctypes
import json
import os
import select
import subprocess
import sys
import time
from ctypes import POINTER, byref, c_char_p, c_int, c_int32, c_size_t, c_uint32, c_uint64, c_void_p

import torch

import devshare
from devshare import _dlpack, _lib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import handoff  # noqa: E402 - bench/handoff.py, next to this file

LARGE = 1 << 20
CLOSED = -40  # DEVSHARE_STATUS_CLOSED
TIMEOUT = -35  # DEVSHARE_STATUS_TIMEOUT


def percentile(values, q):
    return handoff.percentile(values, q)


# ----------------------------------------------------------------------------- C API via ctypes

# A library object of our own (the same loaded libdevshare), so that the prototypes set here
# never touch the ones the package sets on its own.
_raw = None


def raw():
    global _raw
    if _raw is None:
        lib = ctypes.CDLL(_lib.library_path)
        for name, restype, argtypes in [
            ("devshare_channel_listen", c_int32, [c_char_p, POINTER(c_void_p)]),
            ("devshare_channel_wait_peers", c_int32, [c_void_p, c_size_t, c_int32]),
            ("devshare_channel_peer_ids", c_int32, [c_void_p, POINTER(c_uint64), c_size_t, POINTER(c_size_t)]),
            ("devshare_channel_close", c_int32, [c_void_p]),
            ("devshare_channel_host_alloc", c_int32, [c_uint64, POINTER(c_void_p), POINTER(c_void_p)]),
            ("devshare_exporter_close", c_int32, [c_void_p, c_uint32]),
            ("devshare_pool_create", c_int32, [c_void_p, c_void_p, c_uint64, c_uint32, POINTER(c_void_p)]),
            ("devshare_pool_acquire", c_int32, [c_void_p, c_int32, POINTER(c_uint32), POINTER(c_void_p)]),
            ("devshare_pool_send", c_int32, [c_void_p, c_uint32, c_uint64, c_void_p]),
            ("devshare_pool_release", c_int32, [c_void_p, c_uint32]),
            ("devshare_pool_close", c_int32, [c_void_p]),
            ("devshare_channel_connect", c_int32, [c_char_p, c_int32, POINTER(c_void_p)]),
            ("devshare_connection_fd", c_int, [c_void_p]),
            ("devshare_connection_recv", c_int32, [c_void_p, c_int32, POINTER(_lib.ImportP)]),
            ("devshare_connection_close", c_int32, [c_void_p]),
            ("devshare_import_release", c_int32, [_lib.ImportP]),
        ]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _raw = lib
    return _raw


def ok(status):
    if status != 0:
        raise _lib.error_for(status)


class CtypesPool:
    """The producer's pool through the C API and ctypes, with nothing in between."""

    api = "ctypes"

    def __init__(self, address, size, slots):
        lib = raw()
        self.lib = lib
        self.ch, self.exp, self.pool = c_void_p(), c_void_p(), c_void_p()
        ok(lib.devshare_channel_listen(address.encode(), byref(self.ch)))
        base = c_void_p()
        ok(lib.devshare_channel_host_alloc(size * slots, byref(self.exp), byref(base)))
        for k in range(slots):
            ctypes.memset(base.value + k * size, k + 1, size)
        ok(lib.devshare_pool_create(self.ch, self.exp, size, slots, byref(self.pool)))
        self._slot, self._ptr = c_uint32(), c_void_p()
        self._slot_ref, self._ptr_ref = byref(self._slot), byref(self._ptr)
        self.peer = 0

    def wait_peer(self):
        ok(self.lib.devshare_channel_wait_peers(self.ch, 1, 120000))
        ids, n = c_uint64(), c_size_t()
        ok(self.lib.devshare_channel_peer_ids(self.ch, byref(ids), 1, byref(n)))
        self.peer = ids.value

    def acquire(self):
        ok(self.lib.devshare_pool_acquire(self.pool, -1, self._slot_ref, self._ptr_ref))
        return self._slot.value

    def send(self, slot):
        ok(self.lib.devshare_pool_send(self.pool, slot, self.peer, None))

    def release(self, slot):
        ok(self.lib.devshare_pool_release(self.pool, slot))

    def close(self):
        ok(self.lib.devshare_pool_close(self.pool))
        ok(self.lib.devshare_channel_close(self.ch))

    def free(self):
        ok(self.lib.devshare_exporter_close(self.exp, 0))


class PackagePool:
    """The producer's pool through the package: devshare.Channel, Channel.pool, Slot.send."""

    api = "package"

    def __init__(self, address, size, slots):
        self.ch = devshare.Channel(address)
        self.pool = self.ch.pool(size, slots)
        held = [self.pool.acquire() for _ in range(slots)]
        for k, s in enumerate(held):
            s.tensor().fill_(k + 1)
        for s in held:
            s.release()
        self.peer = 0

    def wait_peer(self):
        self.peer = self.ch.wait_peers(1, timeout=120)[0]

    def acquire(self):
        return self.pool.acquire()

    def send(self, slot):
        slot.send(self.peer)

    def release(self, slot):
        slot.release()

    def close(self):
        self.pool.close()
        self.ch.close()

    def free(self):
        pass


def have_package_channels():
    """Whether the package has channels and the loaded library serves them (a channel opens)."""
    if not all(hasattr(devshare, name) for name in ("Channel", "Pool", "connect", "ChannelClosed")):
        return False
    try:
        devshare.Channel(f"@devshare-bench-channel-handoff-probe-{os.getpid()}").close()
    except devshare.Error:
        return False
    return True


POOLS = {"ctypes": CtypesPool, "package": PackagePool}


# ----------------------------------------------------------------------------- Python consumer

def touch(t):
    return handoff.touch(t)


def py_pool_consumer(address, api, polling=False):
    """Runs in the consumer process: takes items until the channel closes, then prints the same
    records as `channel_handoff consume`. polling: wait in poll(2) on the connection's fd, then
    receive without blocking (like `channel_handoff consume ADDRESS --poll`), so that the wait
    and the receive are timed apart; otherwise recv waits (the poll column is 0)."""
    mono = time.monotonic_ns
    recs = []
    waiter = select.poll()
    if api == "ctypes":
        lib = raw()
        conn = c_void_p()
        ok(lib.devshare_channel_connect(address.encode(), 60000, byref(conn)))
        waiter.register(lib.devshare_connection_fd(conn), select.POLLIN)
        imp = _lib.ImportP()
        imp_ref = byref(imp)
        recv, release = lib.devshare_connection_recv, lib.devshare_import_release
        while True:
            tw, tp = mono(), 0
            if polling:
                waiter.poll()
                tp = mono()
                st = recv(conn, 0, imp_ref)
                if st == TIMEOUT:
                    continue
            else:
                st = recv(conn, -1, imp_ref)
            if st == CLOSED:
                break
            ok(st)
            tr = mono()
            # The tensor holds its own reference to the import (DLPack); dropping it gives the
            # item back.
            t = torch.from_dlpack(_dlpack.capsule(_dlpack.managed_from_import(imp, True), True))
            ok(release(imp))
            ti = mono()
            touch(t)
            tt = mono()
            del t
            tl = mono()
            recs.append((tw, tp, tr, ti, tt, tl))
        ok(lib.devshare_connection_close(conn))
    else:
        conn = devshare.connect(address, timeout=60)
        waiter.register(conn.fileno(), select.POLLIN)
        while True:
            tw, tp = mono(), 0
            try:
                if polling:
                    waiter.poll()
                    tp = mono()
                    try:
                        item = conn.recv(timeout=0)  # the torch tensor is made here
                    except TimeoutError:
                        continue
                else:
                    item = conn.recv()
            except devshare.ChannelClosed:
                break
            tr = mono()
            t = item.tensor
            ti = mono()
            touch(t)
            tt = mono()
            del t
            item.release()
            tl = mono()
            recs.append((tw, tp, tr, ti, tt, tl))
        conn.close()
    out = [str(len(recs))] + [" ".join(map(str, r)) for r in recs]
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- pool measurement

_address_seq = 0


def next_address():
    global _address_seq
    _address_seq += 1
    return f"@devshare-bench-channel-handoff-py-{os.getpid()}-{_address_seq}"


def parse_records(text, expect):
    lines = text.split("\n")
    if int(lines[0]) != expect:
        raise SystemExit(f"the consumer reported {lines[0]} items, expected {expect}")
    return [tuple(map(int, line.split())) for line in lines[1:1 + expect]]


def measure_pool(pool_cls, consumer, size, slots, warm, lat, tput):
    """Like channel_handoff.c's run_pool, from Python; consumer(address) is the consumer's
    command. Returns (row, the producer's times (before send, after send, back), the consumer's
    records of the one-at-a-time items)."""
    address = next_address()
    prod = pool_cls(address, size, slots)
    consumer_cmd = consumer(address)
    proc = subprocess.Popen(consumer_cmd, stdout=subprocess.PIPE, text=True)
    try:
        prod.wait_peer()
        for _ in range(warm):
            prod.send(prod.acquire())
        held = [prod.acquire() for _ in range(slots)]  # all back; all but one stay out
        slot = held[0]
        mono = time.monotonic_ns
        t0, ts, t2 = [0] * lat, [0] * lat, [0] * lat
        for i in range(lat):
            t0[i] = mono()
            prod.send(slot)
            ts[i] = mono()
            slot = prod.acquire()
            t2[i] = mono()
        held[0] = slot
        for s in held:
            prod.release(s)
        start = mono()
        for _ in range(tput):
            prod.send(prod.acquire())
        back = [prod.acquire() for _ in range(slots)]
        for s in back:
            prod.release(s)
        prod.close()
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"consumer {consumer_cmd} exited with status {proc.returncode}")
    prod.free()
    recs = parse_records(out, warm + lat + tput)
    rl, rt = recs[warm:warm + lat], recs[warm + lat:]
    one = [(rl[i][4] - t0[i]) / 1000 for i in range(lat)]
    rnd = [(t2[i] - t0[i]) / 1000 for i in range(lat)]
    last = max(r[4] for r in rt)
    row = {
        "p50_us": percentile(one, 50),
        "p99_us": percentile(one, 99),
        "rt_p50_us": percentile(rnd, 50),
        "rt_p99_us": percentile(rnd, 99),
        "per_s": tput / ((last - start) / 1e9),
    }
    return row, (t0, ts, t2), rl


def breakdown(times, recs):
    """The median of each step of the one-at-a-time items, like channel_handoff.c's breakdown:
    woken (from just before the send until the consumer's poll returned), recv, info, touch,
    release, back (until the producer's acquire returned); hand is the send call alone. For a
    consumer that did not poll, woken is None and recv runs from just before the send until recv
    returned."""
    t0, ts, t2 = times
    n = len(t0)

    def med(a, b):
        return percentile([(b[i] - a[i]) / 1000 for i in range(n)], 50)

    wake, recv, info, tch, rel = ([r[k] for r in recs] for k in (1, 2, 3, 4, 5))
    polled = all(wake)
    return {
        "hand_us": med(t0, ts),
        "woken_us": med(t0, wake) if polled else None,
        "recv_us": med(wake, recv) if polled else med(t0, recv),
        "info_us": med(recv, info), "touch_us": med(info, tch), "release_us": med(tch, rel),
        "back_us": med(rel, t2), "p50_us": med(t0, tch), "rt_p50_us": med(t0, t2),
    }


# ----------------------------------------------------------------------------- the run

def run_c(args, size, cpus):
    """channel_handoff run for one size and placement: its C->C rows and breakdowns."""
    cmd = [args.bin, "run", "--sizes", str(size), "--count", str(args.count), "--large-count",
           str(args.large_count), "--slots", str(args.slots), "--large-slots", str(args.large_slots),
           "--cpus", cpus]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, timeout=3600).stdout
    rows, breakdowns = [], []
    for line in out.splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            (breakdowns if "breakdown" in obj else rows).append(obj)
    return rows, breakdowns


def show(row):
    print(f"{row['size']:>10} B  {row['method']:<12} {row['path']:<6} cpus {row['cpus']:<3}  "
          f"p50 {row['p50_us']:8.1f} us  p99 {row['p99_us']:8.1f} us  round trip p50 {row['rt_p50_us']:8.1f} us  "
          f"{row['per_s']:9.0f} items/s", file=sys.stderr, flush=True)


def size_label(size):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def python_rows(args, apis, size, cpus):
    """The rows with a Python producer, for one size, in the current CPU placement. apis: how
    the pool rows are driven, the first one labelled "pool" (the rows the targets are about),
    the others "pool (<api>)"."""
    large = size >= LARGE
    count = args.large_count if large else args.count
    slots = args.large_slots if large else args.slots
    warm = 2 * slots
    py_handle_consumer = [sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                          "import handoff; handoff.devshare_py_consumer()"]
    rows, breakdowns = [], []

    def add(r, method, path):
        r.update(method=method, path=path, size=size, cpus=cpus)
        rows.append(r)
        show(r)

    for api in apis:
        method = "pool" if api == apis[0] else f"pool ({api})"
        pool_cls = POOLS[api]
        def py_consumer(address, polling=False):
            return [sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); import channel_handoff; "
                    f"channel_handoff.py_pool_consumer(sys.argv[1], {api!r}, {polling!r})", address]

        for path, consumer in [("Py->C", lambda a: [args.bin, "consume", a]), ("Py->Py", py_consumer)]:
            r, _, _ = measure_pool(pool_cls, consumer, size, slots, warm, count, count)
            add(r, method, path)
        # Once more, one at a time, each consumer polling first: each step on its own.
        for path, consumer in [("Py->C", lambda a: [args.bin, "consume", a, "--poll"]),
                               ("Py->Py", lambda a: py_consumer(a, True))]:
            _, times, recs = measure_pool(pool_cls, consumer, size, slots, warm, count, 1)
            b = breakdown(times, recs)
            b.update(breakdown=method, path=path, size=size, cpus=cpus)
            breakdowns.append(b)

    ds_pool = [devshare.empty((size // 4,), torch.float32) for _ in range(slots)]
    q_pool = [torch.empty(size // 4, dtype=torch.float32).share_memory_() for _ in range(slots)]
    for i in range(slots):
        ds_pool[i].fill_(float(i))
        q_pool[i].fill_(float(i))
    for method, path, make, pool in [
        ("handle", "Py->C", lambda: handoff.DevshareChannel([args.consumer]), ds_pool),
        ("handle", "Py->Py", lambda: handoff.DevshareChannel(py_handle_consumer), ds_pool),
        ("queue-fd", "Py->Py", lambda: handoff.QueueChannel("file_descriptor"), q_pool),
        ("queue-fs", "Py->Py", lambda: handoff.QueueChannel("file_system"), q_pool),
        ("pipe-floor", "Py->C", lambda: handoff.PipeFloor([args.consumer]), ds_pool),
    ]:
        add(handoff.measure(make(), pool, count, count), method, path)
    del ds_pool, q_pool
    devshare.collect()
    return rows, breakdowns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join("build", "channel_handoff"),
                    help="the channel_handoff program (bench/channel_handoff.c)")
    ap.add_argument("--consumer", default=os.path.join("build", "handoff_consumer"),
                    help="bench/handoff_consumer.c, for the handle and pipe-floor Py->C rows")
    ap.add_argument("--count", type=int, default=2000, help="items per measurement, sizes below 1 MiB")
    ap.add_argument("--large-count", type=int, default=200, help="items per measurement, >= 1 MiB")
    ap.add_argument("--sizes", default="4096,67108864")
    ap.add_argument("--slots", type=int, default=64,
                    help="pool slots (and buffers handed out round-robin by the other methods), small sizes")
    ap.add_argument("--large-slots", type=int, default=4, help="the same for sizes >= 1 MiB")
    ap.add_argument("--python-api", choices=("auto", "package", "ctypes"), default="auto",
                    help="how the Python rows drive the pool: the package's classes (devshare.Channel, "
                         "devshare.connect) or the C API through ctypes; auto: both when the package has "
                         "channels (the package's rows are the 'pool' rows), else ctypes")
    args = ap.parse_args()
    if args.python_api == "auto":
        apis = ["package", "ctypes"] if have_package_channels() else ["ctypes"]
    elif args.python_api == "package" and not have_package_channels():
        raise SystemExit("--python-api package: this devshare package has no Channel/Pool/connect")
    else:
        apis = [args.python_api]
    allowed = sorted(os.sched_getaffinity(0))
    print(f"torch {torch.__version__}, devshare {devshare.__version__} (library {devshare.library_version}), "
          f"{os.cpu_count()} CPUs; Python pool rows through: {', '.join(apis)}", flush=True)

    rows, breakdowns = [], []
    for size in [int(s) for s in args.sizes.split(",")]:
        # "any": where the scheduler puts the processes; "one": this process and every consumer
        # it starts pinned to one CPU (affinity is inherited); "two" (C->C only): producer and
        # consumer pinned to two different CPUs.
        for cpus in ("any", "one", "two") if len(allowed) >= 2 else ("any", "one"):
            c_rows, c_breakdowns = run_c(args, size, cpus)
            rows += c_rows
            breakdowns += c_breakdowns
            if cpus == "two":
                continue
            if cpus == "one":
                os.sched_setaffinity(0, {allowed[0]})
            try:
                r, b = python_rows(args, apis, size, cpus)
            finally:
                os.sched_setaffinity(0, allowed)
            rows += r
            breakdowns += b
    out = subprocess.run([args.bin, "syscalls"], stdout=subprocess.PIPE, text=True, check=True,
                         timeout=600).stdout
    calls = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print_tables(rows, breakdowns, calls)


def find(rows, size, cpus, method, path):
    return next((r for r in rows if r["size"] == size and r["cpus"] == cpus and r["method"] == method
                 and r["path"] == path), None)


TARGETS = [
    # (row, base row, kind, target at p50)
    (("pool", "C->C"), ("pipe-floor", "C->C"), "within", 2.0),
    (("pool", "Py->C"), ("queue-fd", "Py->Py"), "faster", 20.0),
    (("pool", "Py->Py"), ("queue-fd", "Py->Py"), "faster", 10.0),
]


def print_tables(rows, breakdowns, calls=()):
    print()
    print("| size | CPUs | method | path | p50 µs | p99 µs | round trip p50 µs | items/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {size_label(r['size'])} | {r['cpus']} | {r['method']} | {r['path']} | {r['p50_us']:.1f} | "
              f"{r['p99_us']:.1f} | {r['rt_p50_us']:.1f} | {r['per_s']:.0f} |")
    print()
    print("| size | CPUs | comparison | p50 ratio | items/s ratio | target (p50) | met |")
    print("|---|---|---|---|---|---|---|")
    for size in sorted({r["size"] for r in rows}):
        for cpus in ("any", "one", "two"):
            for (m, p), (bm, bp), kind, target in TARGETS:
                a, b = find(rows, size, cpus, m, p), find(rows, size, cpus, bm, bp)
                if a is None or b is None:
                    continue
                if kind == "within":
                    lat, tput = a["p50_us"] / b["p50_us"], b["per_s"] / a["per_s"]
                    text, goal, met = f"{m} {p} / {bm} {bp}", f"<= {target:g}x", lat <= target
                else:
                    lat, tput = b["p50_us"] / a["p50_us"], a["per_s"] / b["per_s"]
                    text, goal, met = f"{bm} {bp} / {m} {p}", f">= {target:g}x", lat >= target
                print(f"| {size_label(size)} | {cpus} | {text} | {lat:.1f}x | {tput:.1f}x | {goal} | "
                      f"{'yes' if met else 'no'} |")
    if breakdowns:
        print()
        print("Where one-at-a-time handoffs spend their time (p50 of each step, µs; every consumer polls "
              "the connection's fd, then receives without blocking): woken, from just before the send "
              "until the consumer's poll returned; the consumer's recv, info, touch and release; back, "
              "until the producer has the item again; hand, the send call alone. For the Python "
              "consumers: the package's recv (Connection.recv) makes the item's torch tensor, its info "
              "is reading Item.tensor, its release is Item.release; the ctypes consumer's info is making "
              "the tensor through DLPack and releasing its own import, its release is dropping the tensor.")
        print()
        print("| size | CPUs | method | path | woken | recv | info | touch | release | back | hand "
              "| handoff p50 | round trip p50 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for b in breakdowns:
            woken = "—" if b["woken_us"] is None else f"{b['woken_us']:.1f}"
            print(f"| {size_label(b['size'])} | {b['cpus']} | {b['breakdown']} | {b['path']} | {woken} | "
                  f"{b['recv_us']:.1f} | {b['info_us']:.1f} | {b['touch_us']:.1f} | {b['release_us']:.1f} | "
                  f"{b['back_us']:.1f} | {b['hand_us']:.1f} | {b['p50_us']:.1f} | {b['rt_p50_us']:.1f} |")
    if calls:
        print()
        print(f"System calls on this machine (`channel_handoff syscalls`: {calls[0]['calls']} calls each in a "
              "loop, nobody waiting on the other end):")
        print()
        print("| call | ns |")
        print("|---|---|")
        for c in calls:
            print(f"| {c['syscall']} | {c['ns']:.0f} |")


if __name__ == "__main__":
    main()
