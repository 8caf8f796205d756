#!/usr/bin/env python3
"""What a user pays per item: a pool round trip with the producer writing and the consumer
reading every item through the public API, against torch.multiprocessing.Queue and a pipe
ping-pong measured in the same run.

One 4 KiB item in flight at a time. Each round trip is one item through both processes:

  producer, Python   v = slot.tensor((1024,), "float32"); v[0] = seq   (the item written)
                     slot.send(peer, (1024,), "float32")
                     slot = pool.acquire()                  (returns when the consumer released)
  producer, C        the item's first 8 bytes written (its sequence number), devshare_pool_send,
                     devshare_pool_acquire (bench/channel_handoff.c, method "user")
  consumer, Python   item = conn.recv(); item.tensor[0].item(); item.release()
  consumer, C        devshare_connection_recv, devshare_import_info, its first and last byte
                     read, devshare_import_release (`channel_handoff consume`)
  Queue, Py->Py      torch.multiprocessing.Queue, default sharing strategy (file_descriptor):
                     t[0] = seq on one of 64 4 KiB tensors moved to shared memory before timing
                     (round-robin), q.put((seq, t)); the consumer q.get(), t[0].item(), and an
                     ack back on a second Queue; the round trip ends when the producer has the ack
  pipe, C->C         8 bytes out through a pipe, 8 bytes back (`channel_handoff`, "pipe-floor")
  floor, Py->Py      what the package's own Python adds, measured: the same handoff with both
                     ends making the same library calls through bare ctypes (devshare_pool_acquire,
                     devshare_pool_send, devshare_connection_recv_args, devshare_import_give_back),
                     one torch tensor kept per slot and written / read as above, and no package
                     objects (no Slot, Item, lease, per-item view or bookkeeping): the least a
                     Python binding that hands out torch tensors does; not an API (it uses the
                     package's internals)

The round trip runs from just before the producer writes the item until its next acquire (or
the ack) returns: the producer's per-item work, the handoff, the consumer's read and release,
and the way back. The pool has 8 slots; during the round trips 7 stay acquired, so exactly one
cycles. Pipelined: the same loop with all 8 slots in flight (acquire, write, send as fast as
slots come back; the Queue: at most 8 tensors in flight), items per second.

Placements: "one CPU" (producer and consumer pinned to the first CPU this process may use:
every handoff is a context switch), "two CPUs" (producer on the first, consumer on the
second: every handoff wakes the other CPU), "unpinned" (the scheduler decides). Then C->C with
both ends spinning (Pool/Connection set_spin, --spin US) on two CPUs, Py->Py the same, and
C->C pipelined with 4 KiB and 64 MiB items. Ratios are taken within one placement of one run.
Last, the library's own work per item with no wake-up in it (`channel_handoff loop`: producer
and consumer in one process and thread, the same calls as the C rows, through the shared
library), with 1 and with 8 slots.

Usage: python bench/user_pays.py [--bin build/channel_handoff] [--quick] [--count N]
           [--c-count N] [--large-count N] [--spin US] [--placements one,two,any]
       python bench/user_pays.py consume ADDRESS [--poll]    (the Python consumer, internal)
       python bench/user_pays.py consume-floor ADDRESS       (the floor's consumer, internal)
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

SIZE = 4096
LARGE = 64 << 20
SLOTS = 8
SHAPE = (SIZE // 4,)
HERE = os.path.dirname(os.path.abspath(__file__))
PLACEMENTS = {"one": "one CPU", "two": "two CPUs", "any": "unpinned"}


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


# ----------------------------------------------------------------------------- consumers

def py_consumer(address, polling=False):
    """The Python channel consumer (also behind `channel_handoff run --consumer`): takes items
    until the channel closes, reading one element of each, then prints the records
    `channel_handoff consume` prints (count, then per item: before recv, 0, recv returned,
    recv returned, read, released; CLOCK_MONOTONIC ns)."""
    import devshare

    mono = time.monotonic_ns
    conn = devshare.connect(address, timeout=60)
    spin = os.environ.get("DEVSHARE_BENCH_SPIN_US")
    if spin:
        conn.set_spin(int(spin))
    recs = []
    sink = 0.0
    while True:
        tw = mono()
        try:
            item = conn.recv()
        except devshare.ChannelClosed:
            break
        tr = mono()
        sink += item.tensor[0].item()
        tt = mono()
        item.release()
        tl = mono()
        recs.append((tw, 0, tr, tr, tt, tl))
    conn.close()
    write_records(recs)


def write_records(recs):
    """What `channel_handoff consume` prints: the count, then one line of times per item."""
    out = [str(len(recs))] + [" ".join(map(str, r)) for r in recs]
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def floor_views():
    """The floor's tensors: one per slot address, made the first time (no holder)."""
    from devshare import _views

    views = {}

    def view(address):
        t = views.get(address)
        if t is None:
            t = views[address] = _views.view(address, SIZE, None, (2, 32, 1), SHAPE, None, "torch")
        return t
    return view


def floor_consumer(address):
    """The floor's consumer: :func:`py_consumer` with bare library calls (see the module's
    docstring). Each receive frees the previous item's import (given back already), as the
    package does."""
    import devshare
    from devshare import _channel as C

    mono = time.monotonic_ns
    conn = devshare.connect(address, timeout=60)
    if C._RAW_RECV_ARGS is None:
        raise SystemExit("the floor needs libdevshare 1.8 (devshare_connection_recv_args)")
    out = C._ItemOut(conn._at)  # its DevshareRecvArgs: the connection set, no time limit
    recv, ref, head, words, at = C._RAW_RECV_ARGS, out.ref, out.head, out.words, C._IMPORT_WORD
    give_back = C._RAW_GIVE_BACK
    item, view = out.item, floor_views()
    recs = []
    sink = 0.0
    prev = 0
    while True:
        tw = mono()
        head[2] = prev  # DevshareRecvArgs.release
        status = recv(ref)
        prev = 0
        if status < 0:
            if status == C.Status.CLOSED:
                break
            raise C._error(status)
        imp = words[at]
        tr = mono()
        sink += view(item.data)[0].item()
        tt = mono()
        status = give_back(imp)
        if status < 0:
            raise C._error(status)
        prev = imp
        tl = mono()
        recs.append((tw, 0, tr, tr, tt, tl))
    conn.close()
    write_records(recs)


def queue_consumer(q, acks):
    acks.put("ready")
    while True:
        msg = q.get()
        if msg is None:
            break
        seq, t = msg
        t[0].item()
        t1 = time.monotonic_ns()
        del t, msg
        acks.put((seq, t1))


# ----------------------------------------------------------------------------- measurements

_seq = [0]


def pin(cpus):
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def measure_py_pool(consumer_cmd, consumer_cpus, warm, lat, tput, spin=0, floor=False):
    """A Python producer: round trips (one slot cycling) and pipelined throughput (8 slots).
    ``floor``: the producer's side of the floor (bare library calls; see the docstring)."""
    import devshare

    _seq[0] += 1
    address = f"@devshare-bench-user-pays-{os.getpid()}-{_seq[0]}"
    ch = devshare.Channel(address)
    pool = ch.pool(SIZE, SLOTS)
    env = dict(os.environ)
    if spin:
        pool.set_spin(spin)
        env["DEVSHARE_BENCH_SPIN_US"] = str(spin)
    proc = subprocess.Popen(consumer_cmd + [address], stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=pin(consumer_cpus))
    try:
        (peer,) = ch.wait_peers(1, timeout=120)
        mono = time.monotonic_ns
        def send_each(n):
            """n items through the API, each acquired, written and sent (pipelined)."""
            for i in range(n):
                slot = pool.acquire()
                v = slot.tensor(SHAPE, "float32")
                v[0] = i
                slot.send(peer, SHAPE, "float32")
                del v, slot

        if floor:
            t0, t2, start, end = floor_producer(pool, peer, warm, lat, tput)
        else:
            send_each(warm)
            held = [pool.acquire() for _ in range(SLOTS)]  # all back; all but one stay out
            slot = held.pop(0)
            t0, t2 = [0] * lat, [0] * lat
            for i in range(lat):
                t0[i] = mono()
                v = slot.tensor(SHAPE, "float32")
                v[0] = i
                slot.send(peer, SHAPE, "float32")
                del v
                slot = pool.acquire()
                t2[i] = mono()
            held.append(slot)
            for s in held:
                s.release()
            del held, slot, s
            start = mono()
            send_each(tput)
            back = [pool.acquire() for _ in range(SLOTS)]
            end = mono()
            for s in back:
                s.release()
            del back, s
        pool.close()
        ch.close()
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"consumer {consumer_cmd} exited with status {proc.returncode}")
    lines = out.split("\n")
    if int(lines[0]) != warm + lat + tput:
        raise SystemExit(f"the consumer reported {lines[0]} items, expected {warm + lat + tput}")
    recs = [tuple(map(int, line.split())) for line in lines[1 + warm:1 + warm + lat]]
    one = [(recs[i][4] - t0[i]) / 1000 for i in range(lat)]
    rt = [(t2[i] - t0[i]) / 1000 for i in range(lat)]
    return {"p50_us": percentile(one, 50), "rt_p50_us": percentile(rt, 50), "rt_p99_us": percentile(rt, 99),
            "per_s": tput / ((end - start) / 1e9)}


def floor_producer(pool, peer, warm, lat, tput):
    """:func:`measure_py_pool`'s loops with bare library calls: (t0, t2, start, end)."""
    from ctypes import byref, c_uint32, c_void_p

    from devshare import _channel as C

    mono = time.monotonic_ns
    ptr, peer_arg = pool._ptr, pool._peer_arg(peer)
    desc = pool._desc((2, 32, 1), SHAPE, (1,), 0)[0]
    acquire, send, forever = C._RAW_ACQUIRE, C._RAW_SEND, C._FOREVER
    index, address = c_uint32(), c_void_p()
    index_ref, address_ref = byref(index), byref(address)
    index_args = [c_uint32(k) for k in range(SLOTS)]
    view = floor_views()

    def check(status):
        if status < 0:
            raise C._error(status)

    for i in range(warm):
        check(acquire(ptr, forever, index_ref, address_ref))
        view(address.value)[0] = i
        check(send(ptr, index_args[index.value], peer_arg, desc))
    held = []
    for _ in range(SLOTS):  # all back; all but one stay out
        check(acquire(ptr, forever, index_ref, address_ref))
        held.append((index.value, address.value))
    k, a = held.pop(0)
    t0, t2 = [0] * lat, [0] * lat
    for i in range(lat):
        t0[i] = mono()
        view(a)[0] = i
        check(send(ptr, index_args[k], peer_arg, desc))
        check(acquire(ptr, forever, index_ref, address_ref))
        k, a = index.value, address.value
        t2[i] = mono()
    held.append((k, a))
    for k, _ in held:
        check(C.lib.devshare_pool_release(ptr, index_args[k]))
    start = mono()
    for i in range(tput):
        check(acquire(ptr, forever, index_ref, address_ref))
        view(address.value)[0] = i
        check(send(ptr, index_args[index.value], peer_arg, desc))
    back = []
    for _ in range(SLOTS):
        check(acquire(ptr, forever, index_ref, address_ref))
        back.append(index.value)
    end = mono()
    for k in back:
        check(C.lib.devshare_pool_release(ptr, index_args[k]))
    return t0, t2, start, end


def measure_queue(consumer_cpus, producer_cpus, warm, lat, tput):
    """torch.multiprocessing.Queue, default sharing strategy, the same loop."""
    import torch
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_descriptor")
    ctx = mp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    tensors = [torch.zeros(SIZE // 4, dtype=torch.float32).share_memory_() for _ in range(64)]
    proc = ctx.Process(target=queue_consumer, args=(q, acks))
    if consumer_cpus:
        os.sched_setaffinity(0, consumer_cpus)  # inherited by the spawned consumer
    try:
        proc.start()
    finally:
        if consumer_cpus:
            os.sched_setaffinity(0, producer_cpus)
    if acks.get(timeout=120) != "ready":
        raise SystemExit("queue consumer did not start")
    mono = time.monotonic_ns
    n = len(tensors)
    for i in range(warm):
        t = tensors[i % n]
        t[0] = i
        q.put((i, t))
        acks.get(timeout=120)
    one, rt = [], []
    for i in range(lat):
        t0 = mono()
        t = tensors[i % n]
        t[0] = i
        q.put((i, t))
        _, t1 = acks.get(timeout=120)
        t2 = mono()
        one.append((t1 - t0) / 1000)
        rt.append((t2 - t0) / 1000)
    del t
    start = mono()
    sent = 0
    for _ in range(min(SLOTS, tput)):
        t = tensors[sent % n]
        t[0] = sent
        q.put((sent, t))
        sent += 1
    for _ in range(tput):
        acks.get(timeout=120)
        if sent < tput:
            t = tensors[sent % n]
            t[0] = sent
            q.put((sent, t))
            sent += 1
    end = mono()
    q.put(None)
    proc.join(timeout=120)
    return {"p50_us": percentile(one, 50), "rt_p50_us": percentile(rt, 50), "rt_p99_us": percentile(rt, 99),
            "per_s": tput / ((end - start) / 1e9)}


def run_c(args, cpus, methods, sizes=str(SIZE), spin=0, consumer=None, count=None):
    """channel_handoff run: its rows as dicts."""
    cmd = [args.bin, "run", "--methods", methods, "--sizes", sizes, "--count", str(count or args.c_count),
           "--large-count", str(args.large_count), "--slots", str(SLOTS), "--large-slots", str(SLOTS),
           "--cpus", cpus]
    if spin:
        cmd += ["--spin", str(spin)]
    if consumer:
        cmd += ["--consumer", consumer]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, timeout=1200).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# ----------------------------------------------------------------------------- the run

def default_bin() -> str:
    """channel_handoff beside the library named by DEVSHARE_LIBRARY (scripts/gpu_bundle.sh puts
    it there), else the CMake build's."""
    lib = os.environ.get("DEVSHARE_LIBRARY")
    if lib:
        beside = os.path.join(os.path.dirname(os.path.abspath(lib)), "channel_handoff")
        if os.access(beside, os.X_OK):
            return beside
    return os.path.join("build", "channel_handoff")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "consume":
        return py_consumer(sys.argv[2], "--poll" in sys.argv[3:])
    if len(sys.argv) >= 3 and sys.argv[1] == "consume-floor":
        return floor_consumer(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=default_bin(),
                    help="the channel_handoff program (bench/channel_handoff.c); default: the one "
                         "beside $DEVSHARE_LIBRARY (a GPU bundle has it), else build/channel_handoff")
    ap.add_argument("--quick", action="store_true", help="tiny counts (a smoke test; figures meaningless)")
    ap.add_argument("--count", type=int, default=5000, help="round trips per Python / Queue row")
    ap.add_argument("--tput-count", type=int, default=10000, help="pipelined items per Python row")
    ap.add_argument("--c-count", type=int, default=10000,
                    help="round trips (and pipelined items) per row with a C producer, 4 KiB")
    ap.add_argument("--large-count", type=int, default=2000, help="items per 64 MiB row")
    ap.add_argument("--spin", type=int, default=100, help="µs both ends spin in the spinning rows")
    ap.add_argument("--placements", default="one,two,any")
    args = ap.parse_args()
    if args.quick:
        args.count, args.tput_count, args.c_count, args.large_count = 50, 100, 100, 10
    warm = 2 * SLOTS + min(200, args.count)

    import devshare
    import torch

    allowed = sorted(os.sched_getaffinity(0))
    placements = [p for p in args.placements.split(",") if p]
    if len(allowed) < 2:
        placements = [p for p in placements if p != "two"]
    print(f"torch {torch.__version__}, devshare {devshare.__version__} (library {devshare.library_version}), "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs (may use {allowed}); "
          f"{args.count} round trips per Python row, {args.c_count} per C row", flush=True)
    py_cons = [sys.executable, os.path.join(HERE, "user_pays.py"), "consume"]
    c_cons = [args.bin, "consume"]
    floor_cons = [sys.executable, os.path.join(HERE, "user_pays.py"), "consume-floor"]
    py_cons_text = " ".join(shlex.quote(a) for a in py_cons[:-1])  # channel_handoff adds "consume ADDRESS"
    rows = []

    def add(placement, path, r, note=""):
        r = dict(r, placement=placement, path=path, note=note)
        rows.append(r)
        print(f"  {PLACEMENTS.get(placement, placement):<9} {path + (' ' + note if note else ''):<26} "
              f"round trip p50 {r['rt_p50_us']:8.1f} us  p99 {r['rt_p99_us']:8.1f} us  "
              f"one-way p50 {r['p50_us']:7.1f} us  pipelined {r['per_s']:9.0f} items/s", file=sys.stderr, flush=True)

    for placement in placements:
        prod = {allowed[0]} if placement in ("one", "two") else None
        cons = {allowed[0]} if placement == "one" else ({allowed[1]} if placement == "two" else None)
        # The C producer places itself (and its consumer): this process unpinned meanwhile.
        for r in run_c(args, placement, "user,pipe-floor"):
            add(placement, "C->C" if r["method"] == "user" else "pipe C->C", r)
        (r,) = run_c(args, placement, "user", consumer=py_cons_text, count=args.count)
        add(placement, "C->Py", r)
        if prod:
            os.sched_setaffinity(0, prod)
        try:
            add(placement, "Py->Py", measure_py_pool(py_cons, cons, warm, args.count, args.tput_count))
            add(placement, "Py->C", measure_py_pool(c_cons, cons, warm, args.count, args.tput_count))
            add(placement, "floor Py->Py", measure_py_pool(floor_cons, cons, warm, args.count, args.tput_count,
                                                           floor=True))
            add(placement, "Queue Py->Py", measure_queue(cons, prod, min(warm, 64), args.count,
                                                         min(args.count, args.tput_count)))
        finally:
            os.sched_setaffinity(0, allowed)
    if len(allowed) >= 2:
        for r in run_c(args, "two", "user", spin=args.spin):  # the pipe does not spin: its row above
            add("two", "C->C", r, f"spin {args.spin}")
        os.sched_setaffinity(0, {allowed[0]})
        try:
            add("two", "Py->Py", measure_py_pool(py_cons, {allowed[1]}, warm, args.count, args.tput_count,
                                                 spin=args.spin), f"spin {args.spin}")
        finally:
            os.sched_setaffinity(0, allowed)
    large = []
    for placement in placements:
        for r in run_c(args, placement, "user", sizes=str(LARGE)):
            large.append(dict(r, placement=placement))
            print(f"  {PLACEMENTS[placement]:<9} C->C 64 MiB pipelined {r['per_s']:9.0f} items/s "
                  f"(round trip p50 {r['rt_p50_us']:.1f} us)", file=sys.stderr, flush=True)
    loop = run_loop(args)
    for r in loop:
        print(f"  in-process loop, {r['slots']} slot(s): {r['ns']:.0f} ns per item", file=sys.stderr, flush=True)
    print_tables(rows, large, args, loop)


def run_loop(args):
    """channel_handoff loop: the library's per-item work, one process and thread (20,000 items
    per round; --quick: --c-count), as dicts; none (and a note) when the program has no `loop`
    (an older bundle's) or it failed, so that the tables above still print."""
    cmd = [args.bin, "loop", str(args.c_count if args.quick else 20000)]
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=True,
                             timeout=600).stdout
    except (subprocess.SubprocessError, OSError) as e:
        print(f"  in-process loop not measured: {e}", file=sys.stderr, flush=True)
        return []
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def find(rows, placement, path, note=""):
    return next((r for r in rows if r["placement"] == placement and r["path"] == path and r["note"] == note), None)


def print_tables(rows, large, args, loop):
    print()
    print("| placement | path | round trip p50 µs | p99 µs | Queue / this (p50) | this / pipe (p50) "
          "| pipelined items/s (8 in flight) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        q, p = find(rows, r["placement"], "Queue Py->Py"), find(rows, r["placement"], "pipe C->C")
        vq = f"{q['rt_p50_us'] / r['rt_p50_us']:.1f}x" if q and r["path"] != "Queue Py->Py" else "—"
        vp = f"{r['rt_p50_us'] / p['rt_p50_us']:.2f}x" if p and r["path"] != "pipe C->C" else "—"
        tp = f"{r['per_s']:,.0f}" if r["path"] != "pipe C->C" else "—"
        path = r["path"] + (f", {r['note']}" if r["note"] else "")
        print(f"| {PLACEMENTS[r['placement']]} | {path} | {r['rt_p50_us']:.1f} | {r['rt_p99_us']:.1f} | {vq} | {vp} "
              f"| {tp} |")
    print()
    print("| placement | C->C pipelined, 4 KiB items/s | 64 MiB items/s | 64 MiB / 4 KiB |")
    print("|---|---|---|---|")
    for r in large:
        small = find(rows, r["placement"], "C->C")
        ratio = f"{r['per_s'] / small['per_s']:.2f}x" if small else "—"
        sm = f"{small['per_s']:,.0f}" if small else "—"
        print(f"| {PLACEMENTS[r['placement']]} | {sm} | {r['per_s']:,.0f} | {ratio} |")
    print()
    print("| in-process loop (acquire + send + recv + info + release, C, one thread) | ns per item |")
    print("|---|---|")
    for r in loop:
        print(f"| {r['slots']} slot(s), 4 KiB | {r['ns']:.0f} |")
    print()
    if args.quick:
        # A smoke test's counts measure nothing a target could be judged by.
        print("--quick: tiny counts, so the figures are not measurements and no target is judged")
    print("| target | measured | met |")
    print("|---|---|---|")
    spin = f"spin {args.spin}"

    def ratio_q(placement, path):
        a, q = find(rows, placement, path), find(rows, placement, "Queue Py->Py")
        return q["rt_p50_us"] / a["rt_p50_us"] if a and q else None

    def ratio_p(placement, path, note=""):
        a, p = find(rows, placement, path, note), find(rows, placement, "pipe C->C")
        return a["rt_p50_us"] / p["rt_p50_us"] if a and p else None

    checks = [
        ("Py->Py >= 20x the Queue, one CPU", ratio_q("one", "Py->Py"), lambda v: v >= 20, "{:.1f}x"),
        ("Py->Py >= 10x the Queue, unpinned", ratio_q("any", "Py->Py"), lambda v: v >= 10, "{:.1f}x"),
        ("Py->C >= 40x the Queue, one CPU", ratio_q("one", "Py->C"), lambda v: v >= 40, "{:.1f}x"),
        ("C->C <= 1.2x the pipe ping-pong, one CPU", ratio_p("one", "C->C"), lambda v: v <= 1.2, "{:.2f}x"),
        ("C->C pipelined 4 KiB, 8 slots, >= 1,000,000 items/s blocking, one CPU",
         (find(rows, "one", "C->C") or {}).get("per_s"), lambda v: v >= 1e6, "{:,.0f}/s"),
        # The many-core machine's target; on a VM whose CPUs are shared it says little.
        ("C->C spinning, two CPUs, one-way p50 <= 0.5 µs",
         (find(rows, "two", "C->C", spin) or {}).get("p50_us"), lambda v: v <= 0.5, "{:.2f} µs"),
        ("the library's work per item, in-process loop, 1 slot, <= 0.3 µs",
         next((r["ns"] for r in loop if r["slots"] == 1), None), lambda v: v <= 300, "{:.0f} ns"),
    ]
    for text, v, ok, fmt in checks:
        if v is None:
            continue
        met = "not judged (--quick)" if args.quick else "yes" if ok(v) else "no"
        print(f"| {text} | {fmt.format(v)} | {met} |")


if __name__ == "__main__":
    main()
