#!/usr/bin/env python3
"""A whole 7B-shaped state dict handed from one process to another: devshare's
Channel.send_batch against PyTorch's own way (torch.multiprocessing's reductions: what
torch.multiprocessing.Queue does), measured in one run on the same kind of tensors.

The state dict has the tensor names and shapes of Llama-2-7B (and of Mistral-7B's MLP):

  model.embed_tokens.weight                       32000 x 4096
  32 layers, each:
    self_attn.{q,k,v,o}_proj.weight               4096 x 4096
    mlp.{gate,up}_proj.weight                     11008 x 4096
    mlp.down_proj.weight                          4096 x 11008
    input_layernorm.weight, post_attention_layernorm.weight   4096
  model.norm.weight                               4096
  lm_head.weight                                  32000 x 4096

291 tensors. --scale N divides every dimension by N (element counts by N^2), keeping the tensor
count and the relative shapes; the default (N=8, bfloat16) is about 210 MB instead of 13.5 GB.
The values are synthetic (random), nothing is downloaded.

Approaches (each with its own copy of the state dict and its own consumer process, started
with multiprocessing's "spawn" and connected to the producer by a multiprocessing Pipe for
control messages):

  devshare-registered
              ch.register(state_dict) once (in the first repetition), then ch.send_batch(peer,
              state_dict) each sync: every tensor one lease with nothing re-shared or
              re-described. The consumer: conn.recv_batch(291), item.tensor, touch;
              devshare.release_batch(items). Otherwise as "devshare".
  devshare    ch.send_batch(peer, state_dict): each tensor one leased item. The tensors start in
              private memory: the first send moves each storage once into PyTorch's
              file_system shared memory (one copy; reported on its own as "first"), the later
              sends lease the same storages with no copy. The consumer: conn.recv() per
              item, item.tensor, touch. Release: the consumer drops its tensors and calls
              conn.release_all(); the producer waits (devshare.wait of the list of tensors, which
              serves the channel meanwhile) until every lease came back.
  torch-fd    ForkingPickler.dumps(state_dict) with sharing strategy file_descriptor (PyTorch's
              default on Linux): torch.multiprocessing.reductions.reduce_tensor per tensor, the
              bytes over the Pipe, the consumer's pickle.loads (rebuild: one file descriptor
              fetched from the producer's resource sharer and mapped per storage), touch.
              Release: the consumer drops the state dict (unmaps). The producer learns
              nothing: PyTorch has no return path; the figure is the consumer's drop plus the
              acknowledgement.
  torch-fs    the same with sharing strategy file_system (a named shared-memory file per
              storage, opened by name in the consumer).

Every approach starts from tensors in private memory: the first sync moves each storage into
shared memory once (devshare: PyTorch's file_system memory; torch-*: the strategy's, as a
Queue's put does), later syncs find it there. What a process pays once, whichever approach
comes first (PyTorch starting its shared-memory manager), is paid before any timing. "Touch": the consumer reads one element of every
tensor (t.reshape(-1)[0].item()).

Hand-over: from just before the producer starts (send_batch / dumps) until it has read the
consumer's acknowledgement, sent after it received every tensor and touched each one.
"Of which producer": until send_batch (devshare) or dumps + send_bytes (torch) returned.
Release: from the producer's "release" message until (devshare) every tensor's leases are
back, (torch) the consumer acknowledged that it dropped everything.

Every repetition sends the same tensors. The first repetition of each approach is reported on
its own ("first": for every approach it includes the move into shared memory, and for the
torch ways the first use of the resource sharer / shared-memory manager) and is left out of
median / min.

On a GPU (--device cuda; --alloc expandable for PyTorch's expandable segments) the tensors are
made on the device; torch-fd is then PyTorch's CUDA IPC (what the Queue does with CUDA tensors:
reduce_tensor, the consumer opening each storage's handle, cached by PyTorch per storage), and
torch-fs is left out (the sharing strategy does not apply to CUDA tensors). "Touch" reads one
element of each tensor back to the host. tests/gpu/bench.sh runs it there for both allocators.

Usage: python bench/state_dict.py [--scale 8] [--dtype bfloat16] [--layers 32] [--reps 20]
                                  [--device cpu|cuda] [--alloc plain|expandable]
                                  [--only devshare,torch-fd,torch-fs] [--json FILE]
       python bench/state_dict.py --quick      (3 layers, scale 32, 1 repetition: a smoke test)
"""

import argparse
import json
import multiprocessing
import os
import pickle
import platform
import statistics
import sys
import time

# PyTorch's CUDA allocator reads its setting when CUDA starts; set (or cleared) before torch is
# imported, here and in the spawned consumers, which import this module again and inherit it.
if "--alloc" in sys.argv[1:-1] and sys.argv[sys.argv.index("--alloc") + 1] == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
elif "--device" in sys.argv[1:-1] and sys.argv[sys.argv.index("--device") + 1] == "cuda":
    # plain: whatever the environment said (under either of the names PyTorch reads)
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.pop("PYTORCH_ALLOC_CONF", None)

import torch
import torch.multiprocessing
from multiprocessing.reduction import ForkingPickler

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 11008, 32000, 32
APPROACHES = ("devshare-registered", "devshare", "torch-fd", "torch-fs")
TIMEOUT = 50.0  # seconds; any single wait longer than this is a failure, not a measurement


def state_dict_shapes(scale: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = HIDDEN // scale, INTERMEDIATE // scale, VOCAB // scale
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        for proj in ("q", "k", "v", "o"):
            shapes.append((f"{p}self_attn.{proj}_proj.weight", (h, h)))
        shapes.append((f"{p}mlp.gate_proj.weight", (i, h)))
        shapes.append((f"{p}mlp.up_proj.weight", (i, h)))
        shapes.append((f"{p}mlp.down_proj.weight", (h, i)))
        shapes.append((f"{p}input_layernorm.weight", (h,)))
        shapes.append((f"{p}post_attention_layernorm.weight", (h,)))
    shapes.append(("model.norm.weight", (h,)))
    shapes.append(("lm_head.weight", (v, h)))
    return shapes


def make_state_dict(shapes, dtype, seed: int, device: str = "cpu") -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(shape, generator=g, dtype=torch.float32, device=device).to(dtype)
            for name, shape in shapes}


def touch(t) -> float:
    return t.reshape(-1)[0].item()


def recv_msg(conn, proc, what: str):
    """The next control message, or an error naming what was awaited (no silent hang)."""
    deadline = time.monotonic() + TIMEOUT
    while not conn.poll(0.5):
        if proc is not None and not proc.is_alive():
            raise RuntimeError(f"consumer exited (code {proc.exitcode}) while the producer "
                               f"waited for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} from the consumer within {TIMEOUT} s")
    return conn.recv()


# ----------------------------------------------------------------------------- consumers


def devshare_consumer(address: str, count: int, reps: int, ctl, batch: bool = False) -> None:
    import devshare

    conn = devshare.connect(address, timeout=30)
    ctl.send("ready")
    for _ in range(reps):
        if batch:
            items = conn.recv_batch(count, timeout=TIMEOUT)
            if isinstance(items, dict):  # the state dict's keys travelled as names
                items = list(items.values())
            tensors = [item.tensor for item in items]
            for t in tensors:
                touch(t)
        else:
            items, tensors = [], []
            for _ in range(count):
                item = conn.recv(timeout=TIMEOUT)
                t = item.tensor
                touch(t)
                items.append(item)
                tensors.append(t)
        ctl.send("got")
        if ctl.recv() != "release":
            raise RuntimeError("unexpected control message")
        tensors.clear()
        released = devshare.release_batch(items) if batch else conn.release_all()
        items.clear()
        ctl.send(released)
    conn.close()


def torch_consumer(reps: int, ctl) -> None:
    ctl.send("ready")
    for _ in range(reps):
        sd = pickle.loads(ctl.recv_bytes())
        for t in sd.values():
            touch(t)
        ctl.send("got")
        if ctl.recv() != "release":
            raise RuntimeError("unexpected control message")
        del sd
        ctl.send(0)


# ----------------------------------------------------------------------------- producers


def run_devshare(sd: dict, reps: int, ctx, registered: bool = False
                 ) -> tuple[list[float], list[float], list[float]]:
    """registered: the producer registers the state dict once (Channel.register, inside the
    first repetition's time) and the consumer takes each sync with recv_batch / release_batch."""
    import devshare

    address = f"@devshare-bench-state-dict-{os.getpid()}"
    ch = devshare.Channel(address)
    ctl, child = ctx.Pipe()
    proc = ctx.Process(target=devshare_consumer, args=(address, len(sd), reps, child, registered))
    proc.start()
    child.close()
    hand, rel, prod = [], [], []
    try:
        peer = ch.wait_peers(1, timeout=TIMEOUT)[0]
        recv_msg(ctl, proc, "'ready'")
        tensors = list(sd.values())
        for rep in range(reps):
            t0 = time.perf_counter()
            if registered and rep == 0:
                ch.register(sd)
            ch.send_batch(peer, sd)
            ts = time.perf_counter()
            recv_msg(ctl, proc, "'got'")
            t1 = time.perf_counter()
            ctl.send("release")
            # devshare.wait serves the channel while it waits: the consumer's releases are read
            # as they come (a producer that does not call into the channel meanwhile lets the
            # socket fill, and the consumer's releases then wait for room).
            if not devshare.wait(tensors, timeout=TIMEOUT):  # every tensor's, in one call
                raise TimeoutError(f"leases not back within {TIMEOUT} s")
            t2 = time.perf_counter()
            released = recv_msg(ctl, proc, "the release acknowledgement")
            if released != len(sd):
                raise RuntimeError(f"consumer released {released} items, expected {len(sd)}")
            left = sum(devshare.outstanding(t) for t in tensors)
            if left:
                raise RuntimeError(f"{left} leases still outstanding after wait")
            hand.append((t1 - t0) * 1e3)
            rel.append((t2 - t1) * 1e3)
            prod.append((ts - t0) * 1e3)
        if not all(t.is_shared() or t.is_cuda for t in tensors):
            raise RuntimeError("a sent tensor is not in shared memory after send_batch")
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        ch.close()
    if proc.exitcode != 0:
        raise RuntimeError(f"devshare consumer exited with code {proc.exitcode}")
    return hand, rel, prod


def run_torch(sd: dict, reps: int, ctx, strategy: str) -> tuple[list[float], list[float],
                                                                 list[float]]:
    # The tensors start in private memory, as devshare's do: the first dumps moves each storage
    # into shared memory (as a Queue's put does), the later ones find it there.
    torch.multiprocessing.set_sharing_strategy(strategy)
    ctl, child = ctx.Pipe()
    proc = ctx.Process(target=torch_consumer, args=(reps, child))
    proc.start()
    child.close()
    hand, rel, prod = [], [], []
    try:
        recv_msg(ctl, proc, "'ready'")
        for _ in range(reps):
            t0 = time.perf_counter()
            ctl.send_bytes(ForkingPickler.dumps(sd))
            ts = time.perf_counter()
            recv_msg(ctl, proc, "'got'")
            t1 = time.perf_counter()
            ctl.send("release")
            recv_msg(ctl, proc, "the release acknowledgement")
            t2 = time.perf_counter()
            hand.append((t1 - t0) * 1e3)
            rel.append((t2 - t1) * 1e3)
            prod.append((ts - t0) * 1e3)
        proc.join(TIMEOUT)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"torch consumer ({strategy}) exited with code {proc.exitcode}")
    return hand, rel, prod


# ----------------------------------------------------------------------------- report


def summary(times: list[float]) -> dict:
    rest = times[1:]
    return {"first": times[0],
            "median": statistics.median(rest) if rest else None,
            "min": min(rest) if rest else None,
            "all": times}


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def ratio(base, x) -> str:
    return "-" if base is None or x is None or x == 0 else f"{base / x:.1f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=8,
                    help="divide every dimension by this (element counts by its square)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--reps", type=int, default=20,
                    help="timed repetitions per approach, after the first")
    ap.add_argument("--only", default=",".join(APPROACHES))
    ap.add_argument("--quick", action="store_true",
                    help="3 layers, scale 32, 1 timed repetition: a smoke test")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--alloc", default="plain", choices=("plain", "expandable"),
                    help="PyTorch's CUDA caching allocator: plain or expandable segments")
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.scale, args.reps = 3, 32, 1
    if args.device == "cuda" and args.only == ",".join(APPROACHES):
        args.only = "devshare-registered,devshare,torch-fd"
    only = [a.strip() for a in args.only.split(",") if a.strip()]
    for a in only:
        if a not in APPROACHES:
            ap.error(f"unknown approach {a!r}; known: {', '.join(APPROACHES)}")
    dtype = getattr(torch, args.dtype)

    shapes = state_dict_shapes(args.scale, args.layers)
    nbytes = sum(torch.Size(s).numel() for _, s in shapes) * dtype.itemsize
    mib = nbytes / 2**20
    print(f"state dict: {len(shapes)} tensors, {mib:.1f} MiB ({args.dtype}, dims / {args.scale}, "
          f"{args.layers} layers) on {args.device} ({args.alloc} allocator); {args.reps} timed "
          f"repetitions + 1 first per approach")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")

    if args.device == "cuda" and args.alloc == "expandable":
        # PyTorch's consumer takes an expandable segment's fds from this process with
        # pidfd_getfd; under Yama ptrace_scope 1 a child may not, unless this process allows it
        # (devshare's channel passes its fds over the socket and needs no such permission).
        import devshare
        devshare.allow_ptrace(-1)
        try:
            with open("/proc/sys/kernel/yama/ptrace_scope") as f:
                print(f"ptrace_scope {f.read().strip()}: this process allows any to take its fds")
        except OSError:
            print("no Yama ptrace_scope")
    ctx = multiprocessing.get_context("spawn")
    results, failed = {}, {}
    default_strategy = torch.multiprocessing.get_sharing_strategy()
    if args.device == "cpu":
        # What the first approach run would pay alone, once per process (PyTorch starting its
        # shared-memory manager for file_system memory): paid here, before any timing.
        torch.multiprocessing.set_sharing_strategy("file_system")
        torch.zeros(1).share_memory_()
        torch.multiprocessing.set_sharing_strategy(default_strategy)
    for seed, name in enumerate(only):
        sd = make_state_dict(shapes, dtype, seed, args.device)
        if args.device == "cuda" and seed == 0:
            expandable = {s.get("is_expandable") for s in torch.cuda.memory_snapshot()}
            print(f"CUDA segments expandable: {sorted(expandable, key=str)}")
            if expandable != {args.alloc == "expandable"} and None not in expandable:
                raise SystemExit(f"the {args.alloc} allocator was asked for, the segments say otherwise")
        t0 = time.perf_counter()
        try:
            if name.startswith("devshare"):
                hand, rel, prod = run_devshare(sd, args.reps + 1, ctx, registered=name == "devshare-registered")
            else:
                strategy = {"torch-fd": "file_descriptor", "torch-fs": "file_system"}[name]
                try:
                    hand, rel, prod = run_torch(sd, args.reps + 1, ctx, strategy)
                finally:
                    torch.multiprocessing.set_sharing_strategy(default_strategy)
        except Exception as e:  # noqa: BLE001 - reported as the approach's row; the others still run
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"  {name}: FAILED after {time.perf_counter() - t0:.1f} s: {failed[name]}", flush=True)
            del sd
            continue
        r = results[name] = {"hand_over_ms": summary(hand), "release_ms": summary(rel),
                             "producer_ms": summary(prod)}
        # Printed now: a run stopped later keeps what it measured.
        print(f"  {name}: done in {time.perf_counter() - t0:.1f} s; hand-over first "
              f"{fmt(r['hand_over_ms']['first'])} ms, median {fmt(r['hand_over_ms']['median'])} ms; "
              f"release median {fmt(r['release_ms']['median'])} ms", flush=True)
        del sd

    base = results.get("torch-fd")
    print()
    print("| approach | tensors | MiB | first hand-over ms | hand-over ms median / min "
          "| of which producer ms | release ms median / min | hand-over: torch-fd / this "
          "| release: torch-fd / this |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        h, rl, pr = r["hand_over_ms"], r["release_ms"], r["producer_ms"]
        print(f"| {name} | {len(shapes)} | {mib:.1f} | {fmt(h['first'])} "
              f"| {fmt(h['median'])} / {fmt(h['min'])} | {fmt(pr['median'])} "
              f"| {fmt(rl['median'])} / {fmt(rl['min'])} "
              f"| {ratio(base and base['hand_over_ms']['median'], h['median'])} "
              f"| {ratio(base and base['release_ms']['median'], rl['median'])} |")
    for name, why in failed.items():
        print(f"| {name} | {len(shapes)} | {mib:.1f} | failed: {why} | | | | | |")
    print()
    print("first: the first repetition (includes moving every storage into shared memory "
          "once, on the CPU), not in median / min. of which producer: median time until send_batch / "
          "dumps + send_bytes returned. torch-* release: the consumer's drop only; the producer "
          "gets no return.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(shapes), "bytes": nbytes, "scale": args.scale,
                       "device": args.device, "alloc": args.alloc,
                       "dtype": args.dtype, "layers": args.layers, "reps": args.reps,
                       "torch": torch.__version__, "results": results, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
