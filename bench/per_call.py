#!/usr/bin/env python3
"""What each per-item Python call of a pool handoff costs, one call at a time.

Producer and consumer run in this one process (the consumer connects from a thread while the
producer serves the channel, then both are driven from the main thread), pinned to one CPU
when the affinity can be set. Each iteration hands one item round:

  producer  slot = pool.acquire()            gets the slot the consumer gave back
            v = slot.tensor(shape, dtype)    (or slot.numpy(...)) and one element written
            slot.send(peer, shape, dtype)
  consumer  item = conn.recv()               (like="numpy" for the numpy rows)
            t = item.tensor                  and one element read
            item.release()
            del v, t, item, slot             the item, the slot and their views dropped

Each call is timed on its own with time.perf_counter_ns (the timer's own cost, measured as two
back-to-back reads, is subtracted); the table gives the median and the mean per call in µs,
and the whole iteration. Layouts: "fixed", every item (4, 256) float32 at offset 0; "mixed",
the items cycle through four layouts (shape, dtype, offset), so a view cache has to tell them
apart. One slot in the pool (every item goes through the same slot) or several (--slots).

Usage: python bench/per_call.py [--count N] [--slots N] [--slot-bytes N] [--no-pin]
"""

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import devshare

LAYOUTS = {
    "fixed": [((4, 256), "float32", 0)],
    "mixed": [((4, 256), "float32", 0), ((256,), "int64", 0), ((8, 8), "float32", 64),
              ((1000,), "uint8", 24)],
}


def timer_cost(n=200_000):
    clock = time.perf_counter_ns
    best = []
    for _ in range(n):
        a = clock()
        b = clock()
        best.append(b - a)
    return statistics.median(best)


def pair(address):
    ch = devshare.Channel(address)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("conn", devshare.connect(address, timeout=60)))
    th.start()
    (peer,) = ch.wait_peers(1, timeout=60)
    th.join(60)
    return ch, box["conn"], peer


def run(kind, layouts, count, slots, slot_bytes, overhead):
    """Per-call nanoseconds (lists) over count items."""
    like = "torch" if kind == "torch" else "numpy"
    ch, conn, peer = pair(f"@devshare-bench-per-call-{os.getpid()}-{kind}-{len(layouts)}-{slots}")
    pool = ch.pool(slot_bytes, slots)
    clock = time.perf_counter_ns
    names = ("acquire", "slot view", "send", "recv", "item.tensor", "release", "drop", "iteration")
    times = {name: [0] * count for name in names}
    ta, tv, ts, tr, tt, tl, td, ti = (times[n] for n in names)
    nl = len(layouts)
    gc.disable()
    try:
        for i in range(count + 1000):  # the first 1000: warm-up, overwritten below
            k = i - 1000 if i >= 1000 else i % count
            shape, dtype, offset = layouts[i % nl]
            t0 = clock()
            slot = pool.acquire()
            t1 = clock()
            if like == "torch":
                v = slot.tensor(shape, dtype, offset)
            else:
                v = slot.numpy(shape, dtype, offset)
            t2 = clock()
            v[0] = i & 0x3F
            t3 = clock()
            slot.send(peer, shape, dtype, None, offset)
            t4 = clock()
            item = conn.recv(like=like)
            t5 = clock()
            t = item.tensor
            t6 = clock()
            got = t[0]
            t7 = clock()
            item.release()
            t8 = clock()
            if int(got.max() if got.ndim else got) != i & 0x3F:
                raise SystemExit(f"item {i}: read {got}, wrote {i & 0x3F}")
            t9 = clock()
            del v, t, got, item, slot
            t10 = clock()
            td[k] = t10 - t9 - overhead
            ta[k], tv[k], ts[k] = t1 - t0 - overhead, t2 - t1 - overhead, t4 - t3 - overhead
            tr[k], tt[k], tl[k] = t5 - t4 - overhead, t6 - t5 - overhead, t8 - t7 - overhead
            ti[k] = t10 - t0
    finally:
        gc.enable()
    conn.close()
    pool.close()
    ch.close()
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20000, help="items per row")
    ap.add_argument("--slots", type=int, default=1, help="slots in the pool")
    ap.add_argument("--slot-bytes", type=int, default=4096)
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    args = ap.parse_args()
    pinned = "unpinned"
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        pinned = f"pinned to CPU {cpu}"
    import numpy
    import torch
    print(f"devshare {devshare.__version__} (library {devshare.library_version}), torch {torch.__version__}, "
          f"numpy {numpy.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {pinned}; "
          f"{args.count} items per row, {args.slots} slot(s) of {args.slot_bytes} bytes")
    overhead = timer_cost()
    print(f"timer overhead subtracted: {overhead} ns per reading pair")
    print()
    names = ("acquire", "slot view", "send", "recv", "item.tensor", "release", "drop", "iteration")
    print("| views | layouts | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for kind in ("torch", "numpy"):
        for label, layouts in LAYOUTS.items():
            times = run(kind, layouts, args.count, args.slots, args.slot_bytes, overhead)
            cells = []
            for name in names:
                vals = times[name]
                cells.append(f"{statistics.median(vals) / 1000:.2f} ({statistics.fmean(vals) / 1000:.2f})")
            print(f"| {kind} | {label} | " + " | ".join(cells) + " |", flush=True)
    print()
    print("µs per call: median (mean). slot view is Slot.tensor / Slot.numpy; item.tensor is the "
          "property read; drop is dropping the item, the slot and the views (finalizers run there); "
          "iteration is the whole loop body, the element write and read and the "
          "timer reads included.")


if __name__ == "__main__":
    main()
