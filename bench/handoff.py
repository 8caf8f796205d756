#!/usr/bin/env python3
"""Per-tensor handoff between two processes: devshare against torch.multiprocessing.Queue.

A producer process hands tensors, one at a time, to a consumer process that touches each one
(reads its first and last element), drops it and acknowledges. Compared in the same run, on
tensors of the same sizes:

  devshare-py   handle text over a pipe, consumer in Python (devshare.open -> torch tensor)
  devshare-c    handle text over a pipe, consumer in C (bench/handoff_consumer.c)
  queue-fd      torch.multiprocessing.Queue, sharing strategy file_descriptor (Linux default)
  queue-fs      torch.multiprocessing.Queue, sharing strategy file_system
  pipe-floor    the devshare-c pipe and processes with no tensor at all: a line out, an ack
                back; what any pipe-based handoff between these processes costs at least

Latency: one tensor in flight at a time; from just before the producer shares/puts it to just
after the consumer touched it (both read CLOCK_MONOTONIC); measure() also returns the round
trip, until the producer has read the consumer's acknowledgement (rt_p50_us, rt_p99_us).
Throughput: N tensors sent back to back, N / (last consumer timestamp - first send). Tensors
live in shared memory before timing for every method (devshare.empty for devshare,
torch.empty(...).share_memory_() for the queues), so nobody pays for an allocation or a first
copy inside the timed region; a pool of distinct tensors is handed out round-robin. Consumers are started and warmed up first.

Usage: python bench/handoff.py [--count N] [--large-count N] [--sizes 4096,67108864]
                               [--consumer build/handoff_consumer]
"""

import argparse
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

import devshare

POOL = {4096: 64, 64 << 20: 4}


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def touch(t):
    flat = t.view(-1)
    return flat[0].item() + flat[-1].item()


# ----------------------------------------------------------------------------- consumers

def devshare_py_consumer():
    """Runs in the consumer process: handle lines on stdin, acks on stdout."""
    print("ready", flush=True)
    for line in sys.stdin:
        seq, _t0, text = line.split(" ", 2)
        t = devshare.open(devshare.Handle.from_text(text))
        touch(t)
        t1 = time.monotonic_ns()
        del t
        print(f"{seq} {t1}", flush=True)


def queue_consumer(q, acks):
    acks.put("ready")
    while True:
        item = q.get()
        if item is None:
            break
        seq, _t0, t = item
        touch(t)
        t1 = time.monotonic_ns()
        del t, item
        acks.put((seq, t1))


# ----------------------------------------------------------------------------- channels

class DevshareChannel:
    send_tensor = True

    def __init__(self, cmd):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"consumer {cmd} did not start")
        self.acks = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            seq, t1 = line.split()[:2]
            self.acks.put((int(seq), int(t1)))

    def send(self, seq, t0, tensor):
        text = devshare.share(tensor).to_text() if self.send_tensor else "-"
        self.proc.stdin.write(f"{seq} {t0} {text}\n")
        self.proc.stdin.flush()

    def ack(self):
        return self.acks.get(timeout=120)

    def close(self):
        self.proc.stdin.close()
        if self.proc.wait(timeout=120) != 0:
            raise SystemExit(f"consumer exited with status {self.proc.returncode}")


class PipeFloor(DevshareChannel):
    send_tensor = False


class QueueChannel:
    def __init__(self, strategy):
        mp.set_sharing_strategy(strategy)
        ctx = mp.get_context("spawn")
        self.q, self.acks = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=queue_consumer, args=(self.q, self.acks))
        self.proc.start()
        if self.acks.get(timeout=120) != "ready":
            raise SystemExit("queue consumer did not start")

    def send(self, seq, t0, tensor):
        self.q.put((seq, t0, tensor))

    def ack(self):
        return self.acks.get(timeout=120)

    def close(self):
        self.q.put(None)
        self.proc.join(timeout=120)


def measure(channel, pool, lat_count, tput_count):
    # Warm-up: one round trip per pool tensor (first mappings, code paths).
    for i, t in enumerate(pool):
        channel.send(-1 - i, time.monotonic_ns(), t)
        channel.ack()
    lat, rt = [], []
    for i in range(lat_count):
        t0 = time.monotonic_ns()
        channel.send(i, t0, pool[i % len(pool)])
        _, t1 = channel.ack()
        t2 = time.monotonic_ns()
        lat.append((t1 - t0) / 1000)
        rt.append((t2 - t0) / 1000)
    start = time.monotonic_ns()
    for i in range(tput_count):
        channel.send(i, time.monotonic_ns(), pool[i % len(pool)])
    last = max(channel.ack()[1] for _ in range(tput_count))
    channel.close()
    return {
        "p50_us": statistics.median(lat),
        "p99_us": percentile(lat, 99),
        "rt_p50_us": statistics.median(rt),
        "rt_p99_us": percentile(rt, 99),
        "per_s": tput_count / ((last - start) / 1e9),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2000, help="tensors per measurement, small sizes")
    ap.add_argument("--large-count", type=int, default=200, help="tensors per measurement, >= 1 MiB")
    ap.add_argument("--sizes", default="4096,67108864")
    ap.add_argument("--consumer", default=os.path.join("build", "handoff_consumer"))
    args = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    py_consumer = [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
                   "import handoff; handoff.devshare_py_consumer()"]
    print(f"torch {torch.__version__}, devshare {devshare.__version__}, {os.cpu_count()} CPUs", flush=True)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        count = args.count if size < 1 << 20 else args.large_count
        n = min(POOL.get(size, 8), count)
        ds_pool = [devshare.empty((size // 4,), torch.float32) for _ in range(n)]
        q_pool = [torch.empty(size // 4, dtype=torch.float32).share_memory_() for _ in range(n)]
        for i in range(n):
            ds_pool[i].fill_(float(i))
            q_pool[i].fill_(float(i))
        for name, make, pool in [
            ("devshare-py", lambda: DevshareChannel(py_consumer), ds_pool),
            ("devshare-c", lambda: DevshareChannel([args.consumer]), ds_pool),
            ("queue-fd", lambda: QueueChannel("file_descriptor"), q_pool),
            ("queue-fs", lambda: QueueChannel("file_system"), q_pool),
            ("pipe-floor", lambda: PipeFloor([args.consumer]), ds_pool),
        ]:
            r = measure(make(), pool, count, count)
            r.update(method=name, size=size)
            rows.append(r)
            print(f"{size:>9} B  {name:<12} p50 {r['p50_us']:9.1f} us  p99 {r['p99_us']:9.1f} us  "
                  f"{r['per_s']:9.0f} tensors/s", flush=True)
        del ds_pool, q_pool
        devshare.collect()
    print()
    print("| size | method | p50 µs | p99 µs | tensors/s | p50 queue-fd / this | tensors/s this / queue-fd |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["size"] == r["size"] and b["method"] == "queue-fd")
        print(f"| {r['size']} | {r['method']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['per_s']:.0f} | "
              f"{base['p50_us'] / r['p50_us']:.1f}x | {r['per_s'] / base['per_s']:.1f}x |")


if __name__ == "__main__":
    main()
