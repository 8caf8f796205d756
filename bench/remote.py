#!/usr/bin/env python3
"""A remote channel pool over loopback TCP, against the local (Unix) channel pool and a plain
TCP socket copy of the same bytes, in one run: round trip and throughput, 4 KiB and 64 MiB.

The producer runs in this process, the consumer in a child Python process (this file, with
``--consumer``). Rows:

  remote pool   devshare.Channel("tcp://127.0.0.1:PORT"), Channel.pool; Slot.send writes the
                slot's bytes on the authenticated connection, which the consumer reads straight
                into its own copy of the slot (with --ucx: UCX puts, both ends
                DEVSHARE_REMOTE_DATA=ucx, UCX_TLS=tcp)
  local pool    devshare.Channel("@name") (Unix socket), the same pool calls; zero copy: the
                consumer maps the producer's memory
  tcp socket    a plain TCP connection over 127.0.0.1 (TCP_NODELAY): the producer sendall()s
                the item's bytes from one of its preallocated buffers, the consumer recv_into()s
                one preallocated buffer and sends a 1-byte ack

Every item is the whole slot (its size in bytes, uint8); the producer writes its first byte
(through a numpy view: Slot.numpy(), or the socket's buffer) and the consumer reads that first
byte (Connection.recv(like="numpy"), item.tensor[0]; the socket's buffer[0]), checks it and
releases (or acks). Nothing else of the item is touched by Python: what is measured is moving
the item, which for the local pool costs nothing per byte.

Round trip (p50, p99 in microseconds): one item in flight; from just before the producer
writes the item's first byte until the producer has it back. Local pool: its next
Pool.acquire returns that slot (the other slots are held, so acquire must wait for it).
Remote pool: acquire returns at once after the put (the producer's slot is free as soon as
the bytes are in the consumer's slot; the backpressure is the consumer's slots), so the round
trip ends when the producer has taken the consumer's release (Channel.service until
Channel.peer_info(peer)["slots"] shows no slot held; one peer_info call is a few
microseconds). Socket: the ack was read.

Throughput: N items back to back with up to SLOTS (4) in flight (the pool's slots; the socket
producer waits for an ack before it reuses one of its 4 buffers), from the first write until
the producer has every slot back (every ack read). items/s, and MB/s = items/s x size / 1e6.
The ratio columns compare with the tcp socket row of the same size in the same run.

The first item of a remote pool to a consumer makes the consumer allocate its copy of the pool
(and on UCX register it and connect): warm-up items (not timed) go first on every path. Both processes
read the channel key from DEVSHARE_CHANNEL_KEY_FILE; without it a temporary key file is made
for the run.

Usage: python bench/remote.py [--quick] [--small-count N] [--large-count N] [--slots N]
                              [--sizes 4096,67108864] [--ucx]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import devshare

LARGE = 1 << 20
LIMIT = 120  # seconds any one wait may take before the run is called broken
now = time.perf_counter_ns


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


# ----------------------------------------------------------------------------- consumers


def consume_pool(address: str) -> None:
    """Receive items until the producer closes the channel: read the first byte (it must be
    the item's sequence number, mod 256), release. Prints "DONE <items> <wrong>"."""
    n = wrong = 0
    with devshare.connect(address, timeout=LIMIT) as conn:
        recv = conn.recv
        while True:
            try:
                item = recv(like="numpy")
            except devshare.ChannelClosed:
                break
            if item.tensor[0] != n & 0xFF:
                wrong += 1
            item.release()
            n += 1
    print("DONE", n, wrong, flush=True)


def consume_socket(port: int, size: int) -> None:
    """Receive size-byte items into one buffer until the producer closes; read the first byte,
    ack with one byte. Prints "DONE <items> <wrong>"."""
    buf = np.zeros(size, dtype=np.uint8)
    view = memoryview(buf)
    n = wrong = 0
    with socket.create_connection(("127.0.0.1", port), timeout=LIMIT) as s:
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        recv_into, send = s.recv_into, s.send
        ack = b"a"
        while True:
            got = 0
            while got < size:
                k = recv_into(view[got:], size - got)
                if k == 0:
                    break
                got += k
            if got < size:
                break
            if buf[0] != n & 0xFF:
                wrong += 1
            send(ack)
            n += 1
    print("DONE", n, wrong, flush=True)


# ----------------------------------------------------------------------------- producers


class PoolPath:
    """The producer of a remote or local pool (devshare.Channel on ``address``)."""

    def __init__(self, address, size, slots, remote):
        self.ch = devshare.Channel(address)
        self.remote = remote
        self.size, self.slots = size, slots
        self.pool = self.ch.pool(size, slots)
        self.proc = spawn(["--consumer", "pool", address])
        self.peer = self.ch.wait_peers(1, timeout=LIMIT)[0]
        self.seq = 0

    def _put(self, slot):
        slot.numpy()[0] = self.seq & 0xFF
        slot.send(self.peer)
        self.seq += 1

    def _consumer_holds(self) -> bool:
        # Remote: the slots of its copy of the pool that the peer holds.
        return self.ch.peer_info(self.peer)["slots"] > 0

    def _all_back(self):
        if self.remote:
            while self._consumer_holds():
                self.ch.service(timeout=LIMIT)
        else:
            back = [self.pool.acquire(timeout=LIMIT) for _ in range(self.slots)]
            for s in back:
                s.release()

    def round_trips(self, n):
        pool, ch = self.pool, self.ch
        held = [pool.acquire(timeout=LIMIT) for _ in range(self.slots)]  # all but one stay here
        slot = held.pop()
        out = [0] * n
        for i in range(n):
            t0 = now()
            self._put(slot)
            slot = pool.acquire(timeout=LIMIT)
            if self.remote:
                while self._consumer_holds():
                    ch.service(timeout=LIMIT)
            out[i] = now() - t0
        held.append(slot)
        for s in held:
            s.release()
        return out

    def burst(self, n):
        acquire = self.pool.acquire
        t0 = now()
        for _ in range(n):
            self._put(acquire(timeout=LIMIT))
        self._all_back()
        return now() - t0

    def close(self):
        self.pool.close()
        self.ch.close()
        return finish(self.proc, self.seq)


class SocketPath:
    """The producer of the plain TCP socket copy: ``slots`` preallocated buffers of ``size``
    bytes, sendall, one-byte acks."""

    def __init__(self, size, slots):
        self.size, self.slots = size, slots
        self.bufs = [np.ones(size, dtype=np.uint8) for _ in range(slots)]
        self.views = [memoryview(b) for b in self.bufs]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lst:
            lst.bind(("127.0.0.1", 0))
            lst.listen(1)
            lst.settimeout(LIMIT)
            self.proc = spawn(["--consumer", "socket", str(lst.getsockname()[1]), str(size)])
            self.sock, _ = lst.accept()
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.seq = 0
        self.k = 0  # next buffer
        self.inflight = 0

    def _put(self):
        k = self.k
        self.bufs[k][0] = self.seq & 0xFF
        self.sock.sendall(self.views[k])
        self.seq += 1
        self.k = (k + 1) % self.slots
        self.inflight += 1

    def _acks(self, at_least):
        while at_least > 0:
            got = len(self.sock.recv(self.slots))
            if got == 0:
                raise SystemExit("the socket consumer hung up")
            self.inflight -= got
            at_least -= got

    def round_trips(self, n):
        out = [0] * n
        for i in range(n):
            t0 = now()
            self._put()
            self._acks(1)
            out[i] = now() - t0
        return out

    def burst(self, n):
        t0 = now()
        for _ in range(n):
            if self.inflight == self.slots:
                self._acks(1)
            self._put()
        self._acks(self.inflight)
        return now() - t0

    def close(self):
        self.sock.close()
        return finish(self.proc, self.seq)


# ----------------------------------------------------------------------------- the run


def spawn(args):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, stdout=subprocess.PIPE,
                            text=True)


def finish(proc, sent):
    try:
        out, _ = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    fields = out.split()
    if proc.returncode != 0 or fields[:1] != ["DONE"]:
        raise SystemExit(f"the consumer failed (exit status {proc.returncode}): {out!r}")
    n, wrong = int(fields[1]), int(fields[2])
    if n != sent or wrong:
        raise SystemExit(f"the consumer got {n} items of {sent}, {wrong} with a wrong first byte")
    return n


def free_port_address():
    """tcp://127.0.0.1:PORT of a port that was free a moment ago (no API reports the port a
    channel on port 0 got)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def open_path(kind, size, slots, seq):
    if kind == "tcp socket":
        return SocketPath(size, slots)
    if kind == "local pool":
        return PoolPath(f"@devshare-bench-remote-{os.getpid()}-{seq}", size, slots, remote=False)
    for _ in range(20):
        try:
            return PoolPath(free_port_address(), size, slots, remote=True)
        except devshare.Error as e:
            if e.status != devshare.Status.BUSY:
                raise
    raise SystemExit("no free loopback port in 20 tries")


def measure(kind, size, slots, warm, lat, tput, seq):
    path = open_path(kind, size, slots, seq)
    try:
        t = now()
        path.round_trips(1)  # the first item (the remote consumer registers its pool here)
        first_ms = (now() - t) / 1e6
        path.burst(warm)  # every slot once at least
        path.round_trips(max(1, warm // 4))
        rts = path.round_trips(lat)
        elapsed = path.burst(tput)
    finally:
        path.close()
    per_s = tput / (elapsed / 1e9)
    return {
        "path": kind, "size": size, "first_ms": first_ms,
        "rt_p50_us": percentile(rts, 50) / 1000, "rt_p99_us": percentile(rts, 99) / 1000,
        "per_s": per_s, "mb_s": per_s * size / 1e6,
    }


def size_label(n):
    if n >= LARGE and n % LARGE == 0:
        return f"{n // LARGE} MiB"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B"


def ucx_version():
    try:
        lib = ctypes.CDLL("libucp.so.0")
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return lib.ucp_get_version_string().decode()
    except (OSError, AttributeError) as e:
        return f"not loadable ({e})"


def header(args):
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    path = ("UCX puts, UCX " + ucx_version() + f" (UCX_TLS={os.environ.get('UCX_TLS')})") if args.ucx \
        else "items on the authenticated connection"
    return (f"devshare {devshare.__version__} ({devshare.library_path}), remote pool: {path}, "
            f"Python {platform.python_version()}, numpy "
            f"{np.__version__}, Linux {platform.release()}, {os.cpu_count()} CPUs ({cpu}), "
            f"processes unpinned; {args.slots} slots; counts: round trip {args.lat_small}/"
            f"{args.lat_large}, throughput {args.tput_small}/{args.tput_large} items "
            f"(< / >= 1 MiB){', --quick' if args.quick else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--consumer", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test")
    ap.add_argument("--small-count", type=int, help="items below 1 MiB: round trips (throughput: 2x)")
    ap.add_argument("--large-count", type=int, help="items of 1 MiB and more: round trips (throughput: +10)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--sizes", default=f"4096,{64 << 20}")
    ap.add_argument("--ucx", action="store_true", help="the remote pool on UCX puts instead of the stream path")
    args = ap.parse_args()
    if args.consumer:
        if args.consumer[0] == "pool":
            consume_pool(args.consumer[1])
        else:
            consume_socket(int(args.consumer[1]), int(args.consumer[2]))
        return

    small = args.small_count or (20 if args.quick else 2000)
    large = args.large_count or (3 if args.quick else 30)
    args.lat_small, args.tput_small = small, 2 * small
    args.lat_large, args.tput_large = large, large + (3 if args.quick else 10)
    sizes = [int(s) for s in args.sizes.split(",")]

    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # Both ends (the consumers inherit it): the stream path unless --ucx.
    os.environ["DEVSHARE_REMOTE_DATA"] = "ucx" if args.ucx else "stream"
    key_dir = None
    if not os.environ.get("DEVSHARE_CHANNEL_KEY_FILE"):
        key_dir = tempfile.mkdtemp(prefix="devshare-bench-key-")
        key = os.path.join(key_dir, "channel.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        os.environ["DEVSHARE_CHANNEL_KEY_FILE"] = key  # the consumers inherit it
    try:
        print(header(args), flush=True)
        rows, seq = [], 0
        for size in sizes:
            big = size >= LARGE
            lat, tput = (args.lat_large, args.tput_large) if big else (args.lat_small, args.tput_small)
            warm = 2 * args.slots if big else max(2 * args.slots, lat // 10)
            for kind in ("remote pool", "local pool", "tcp socket"):
                seq += 1
                row = measure(kind, size, args.slots, warm, lat, tput, seq)
                print(f"# {kind} {size_label(size)}: first item {row['first_ms']:.1f} ms, round trip "
                      f"p50 {row['rt_p50_us']:.1f} us, {row['per_s']:.0f} items/s", file=sys.stderr,
                      flush=True)
                rows.append(row)
    finally:
        if key_dir:
            shutil.rmtree(key_dir, ignore_errors=True)

    print()
    print("| path | size | round trip p50 (µs) | p99 (µs) | items/s | MB/s | p50 vs socket | items/s vs socket |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next(b for b in rows if b["size"] == r["size"] and b["path"] == "tcp socket")
        print(f"| {r['path']} | {size_label(r['size'])} | {r['rt_p50_us']:.1f} | {r['rt_p99_us']:.1f} | "
              f"{r['per_s']:,.0f} | {r['mb_s']:,.1f} | {r['rt_p50_us'] / base['rt_p50_us']:.3g}x | "
              f"{r['per_s'] / base['per_s']:.3g}x |")
    print()
    print("First item (not in the table; the remote consumer makes its copy of the pool): " + ", ".join(f"{r['path']} {size_label(r['size'])} {r['first_ms']:.1f} ms"
                                    for r in rows if r["path"] != "tcp socket"))


if __name__ == "__main__":
    main()
