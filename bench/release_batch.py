#!/usr/bin/env python3
"""A big batch given back while the producer is not reading: how long a trainer waits for its
leases when the engine releases a sync and then does something else.

A trainer registers --tensors CPU tensors and sends them as one batch, --syncs times; the engine
(a spawned process) takes each sync with recv_batch and gives it back with release_batch, then
takes the next one at once; after the last one it does something else for --idle seconds
before it exits. The trainer times each sync from its send until every lease is back
(devshare.wait). The first sync includes the engine's first torch import.

With a message per lease (before 1.12) the producer's socket filled after a few hundred leases
while the trainer was not reading, and the rest waited in the engine's backlog for its next
call: the last sync took the engine's idle time. 1.12 gives a batch back in one message.

Usage: python bench/release_batch.py [--tensors 1000] [--syncs 3] [--idle 2.0]
"""

import argparse
import multiprocessing
import os
import time

TIMEOUT = 30.0


def engine(address: str, n: int, syncs: int, idle: float) -> None:
    import devshare

    conn = devshare.connect(address, timeout=TIMEOUT, wait=True)
    for _ in range(syncs):
        devshare.release_batch(conn.recv_batch(n, timeout=TIMEOUT))
    time.sleep(idle)  # something else: no channel call
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--idle", type=float, default=2.0, help="seconds the engine is busy at the end")
    args = ap.parse_args()
    import devshare
    import torch

    tensors = {f"t{i}": torch.zeros(64) for i in range(args.tensors)}
    address = f"@devshare-bench-release-batch-{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")
    print(f"{args.tensors} registered CPU tensors per sync, {args.syncs} syncs, engine idle "
          f"{args.idle} s after the last; libdevshare {devshare.library_version}")
    print("| sync | leases back after ms |\n|---|---|")
    with devshare.Channel(address) as ch:
        proc = ctx.Process(target=engine, args=(address, args.tensors, args.syncs, args.idle))
        proc.start()
        try:
            peer = ch.wait_peers(1, timeout=TIMEOUT)[0]
            ch.register(tensors)
            for sync in range(args.syncs):
                t0 = time.perf_counter()
                ch.send_batch(peer, tensors)
                if not devshare.wait(tensors, timeout=TIMEOUT):
                    raise TimeoutError("leases did not come back")
                print(f"| {sync + 1} | {(time.perf_counter() - t0) * 1e3:.1f} |", flush=True)
            proc.join(TIMEOUT + args.idle)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return 0 if proc.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
