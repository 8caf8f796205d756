#!/usr/bin/env python3
"""One KV-cache block handed to another process and back: a devshare lease of a view of a
registered cache against torch.multiprocessing.Queue with the same view, in one run.

The cache is one tensor [blocks, block elements] (float16; --device cpu or cuda, --alloc
expandable for PyTorch's expandable segments on a GPU). Each round trip hands block i (a view:
cache[i], no copy) to a consumer process, which reads one element of it and gives it back:

  devshare   ch.register({i: cache[i]}) once, then per round trip ch.send(peer, view); the
             consumer: item = conn.recv(); item.tensor[0].item(); item.release(); the round trip
             ends when the lease is back at the producer (devshare.wait(view), which serves the
             channel meanwhile). Registered: nothing is shared again, the consumer keeps the
             cache mapped between leases; on a GPU the lease's event is one of the channel's
             reused events.
  devshare-spin
             the same, with both ends spinning before they sleep (--spin microseconds:
             conn.set_spin on the consumer, ch.set_spin on the producer, whose devshare.wait
             then polls for the release): for a stage with a CPU core of its own; each waiting
             side burns its core meanwhile.
  queue      torch.multiprocessing.Queue (spawn; the default sharing strategy on the CPU, CUDA
             IPC on a GPU): q.put(view); the consumer q.get(), t[0].item(), then an ack on a
             second Queue; the round trip ends when the producer has the ack. PyTorch's
             consumer caches the storage it opened while a tensor of it lives: it keeps the
             first block it got, as devshare's keeps its mapping.

The first --warmup round trips of each are left out. Reported: p50, p90 and min in
microseconds, and the ratio queue / devshare of the p50s (the issue's target on a GPU: p50 <=
20 us and >= 20x the Queue).

Usage: python bench/kv_block.py [--device cpu|cuda] [--alloc plain|expandable] [--count 2000]
                                [--blocks 64] [--block-kib 256] [--spin 1000] [--json FILE]
       python bench/kv_block.py --quick       (200 round trips: a smoke test)
"""

import argparse
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import time

TIMEOUT = 60.0


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def devshare_consumer(address: str, count: int, device: str, spin_us: int) -> None:
    import devshare
    import torch

    if device == "cuda":
        torch.cuda.init()
    conn = devshare.connect(address, timeout=TIMEOUT, wait=True)
    if spin_us:
        conn.set_spin(spin_us)
    for _ in range(count):
        item = conn.recv(timeout=TIMEOUT)
        item.tensor[0].item()
        item.release()
    conn.close()


def queue_consumer(q, acks, count: int) -> None:
    first = None
    for _ in range(count):
        t = q.get(timeout=TIMEOUT)
        t[0].item()
        # PyTorch caches an opened storage only while a tensor of it lives: the first block is
        # kept, so that every later block (a view of the same cache) finds it open.
        first = t if first is None else first
        del t
        acks.put(0)


def round_trips(proc, blocks, count: int, one) -> list[float]:
    """Time ``count`` round trips, ``one(view)`` each on the blocks in turn, while the consumer
    process ``proc`` (started) takes them; then wait for it (killed if still running)."""
    times = []
    try:
        for n in range(count):
            view = blocks[n % len(blocks)]
            t0 = time.perf_counter_ns()
            one(view)
            times.append((time.perf_counter_ns() - t0) / 1e3)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"consumer exited with code {proc.exitcode}")
    return times


def run_devshare(cache, count: int, ctx, spin_us: int = 0) -> list[float]:
    import devshare

    address = f"@devshare-bench-kv-block-{os.getpid()}-{spin_us}"
    blocks = {i: cache[i] for i in range(cache.shape[0])}
    with devshare.Channel(address) as ch:
        proc = ctx.Process(target=devshare_consumer, args=(address, count, cache.device.type, spin_us))
        proc.start()
        try:
            peer = ch.wait_peers(1, timeout=TIMEOUT)[0]
            ch.register(blocks)
            if spin_us:
                ch.set_spin(spin_us)
        except BaseException:
            proc.kill()
            raise

        def one(view):
            ch.send(peer, view)
            if not devshare.wait(view, timeout=TIMEOUT):
                raise TimeoutError("a lease did not come back")
        return round_trips(proc, blocks, count, one)


def run_queue(cache, count: int, ctx) -> list[float]:
    q, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=queue_consumer, args=(q, acks, count))
    proc.start()

    def one(view):
        q.put(view)
        deadline = time.monotonic() + TIMEOUT
        while True:  # (not one long get: a consumer that died is said at once)
            try:
                return acks.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"no acknowledgement from the Queue's consumer (exit code "
                                       f"{proc.exitcode})") from None
    return round_trips(proc, [cache[i] for i in range(cache.shape[0])], count, one)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--alloc", default="plain", choices=("plain", "expandable"),
                    help="PyTorch's CUDA caching allocator: plain or expandable segments")
    ap.add_argument("--count", type=int, default=2000, help="round trips per approach")
    ap.add_argument("--warmup", type=int, default=100, help="round trips left out first")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--spin", type=int, default=1000,
                    help="microseconds both ends of devshare-spin poll before they sleep (0: no "
                         "devshare-spin row)")
    ap.add_argument("--quick", action="store_true", help="200 round trips, 20 left out")
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()
    if args.quick:
        args.count, args.warmup = 200, 20
    if args.alloc == "expandable":
        # Before torch initialises CUDA, here and in the spawned consumers (they inherit it).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif args.device == "cuda":
        # plain: whatever the environment said (under either of the names PyTorch reads)
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ.pop("PYTORCH_ALLOC_CONF", None)
    import torch

    elems = args.block_kib * 1024 // 2
    cache = torch.zeros(args.blocks, elems, dtype=torch.float16, device=args.device)
    cache[:, 0] = torch.arange(args.blocks, dtype=torch.float16, device=args.device)
    if args.device == "cpu":
        cache.share_memory_()  # both ways start from shared memory
    if args.device == "cuda" and args.alloc == "expandable":
        # The Queue's consumer takes an expandable segment's fds from this process with
        # pidfd_getfd, which Yama ptrace_scope 1 refuses a child unless this process allows it.
        import devshare
        devshare.allow_ptrace(-1)
    if args.device == "cuda":
        expandable = {seg.get("is_expandable") for seg in torch.cuda.memory_snapshot()}
        print(f"CUDA segments expandable: {sorted(expandable, key=str)}")
    ctx = multiprocessing.get_context("spawn")
    print(f"KV block: {args.blocks} blocks of {args.block_kib} KiB in one {args.device} cache "
          f"({args.alloc} allocator), {args.count} round trips each, first {args.warmup} left out")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs")
    results = {}
    # The Queue first: each approach's row is printed as soon as it is measured, with its ratio
    # (a run cut short, or an approach that fails, keeps what was measured before).
    approaches = [("queue", run_queue), ("devshare", run_devshare)]
    if args.spin:
        approaches.append(("devshare-spin", lambda *a: run_devshare(*a, spin_us=args.spin)))
    failed = []
    for name, run in approaches:
        try:
            times = run(cache, args.count + args.warmup, ctx)[args.warmup:]
        except Exception as e:  # a failed approach is a row that says so; the others still run
            failed.append(name)
            print(f"  {name}: FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        results[name] = {"p50_us": statistics.median(times), "p90_us": percentile(times, 90),
                         "min_us": min(times), "all_us": times}
        r = results[name]
        base = results.get("queue", {}).get("p50_us")
        ratio = f"{base / r['p50_us']:.1f}x" if base else "-"
        print(f"  {name}: p50 {r['p50_us']:.1f} us, p90 {r['p90_us']:.1f} us, min {r['min_us']:.1f} us, "
              f"p50 queue / this {ratio}", flush=True)
    print()
    print("| approach | device | allocator | p50 us | p90 us | min us | p50: queue / this |")
    print("|---|---|---|---|---|---|---|")
    base = results.get("queue", {}).get("p50_us")
    for name, _ in approaches:
        r = results.get(name)
        if r is None:
            print(f"| {name} | {args.device} | {args.alloc} | failed | | | |")
            continue
        ratio = f"{base / r['p50_us']:.1f}x" if base else "-"
        print(f"| {name} | {args.device} | {args.alloc} | {r['p50_us']:.1f} | {r['p90_us']:.1f} "
              f"| {r['min_us']:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "alloc": args.alloc, "blocks": args.blocks,
                       "block_kib": args.block_kib, "count": args.count,
                       "torch": torch.__version__, "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
