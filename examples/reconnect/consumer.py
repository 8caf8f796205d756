"""A consumer that survives its producer: when the producer dies (or closes), recv raises
devshare.ChannelClosed; the consumer releases everything it still holds from it
(Connection.release_all) and connects to the next producer at the same address.

    python consumer.py ADDRESS GENERATIONS FRAMES

It keeps the two newest frames (as a consumer working on a frame while the next arrives would)
and releases older ones; it checks every frame (g * 1000 + k, frame k of producer g) and stops
after GENERATIONS producers.
"""

import sys
import time

import devshare


def connect(address: str, timeout: float) -> devshare.Connection:
    """A connection to the producer at ``address``, waiting up to ``timeout`` seconds for one."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        try:
            # wait=True: looks again until a producer listens there (the next one may still be
            # starting).
            return devshare.connect(address, timeout=left, wait=True)
        except devshare.ChannelClosed:
            # A producer that just died may still be closing its listening socket: the
            # connection was taken, then dropped. Look again.
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def main(address: str, generations: int, frames: int) -> None:
    pids = []
    for generation in range(1, generations + 1):
        conn = connect(address, timeout=20)
        pids.append(conn.producer_pid)
        held = []  # the newest frames, still held
        k = 0
        try:
            while True:
                item = conn.recv(timeout=10)
                want = generation * 1000 + k
                assert bool((item.tensor == want).all()), f"frame {k} of producer {generation}"
                held.append(item)
                if len(held) > 2:
                    held.pop(0).release()  # the pool slot goes back to the producer
                k += 1
        except devshare.ChannelClosed:
            # The producer is gone (it died, or closed the channel) and everything it sent was
            # received. What we still hold stays mapped and readable until released: release
            # it all, so that nothing of that producer stays mapped.
            released = conn.release_all()
            assert all(item.released for item in held)
            conn.close()
        assert k == frames, f"received {k} of {frames} frames from producer {generation}"
        print(f"consumer: producer {generation} (pid {pids[-1]}) gone after {k} frames; "
              f"release_all() released {released}", flush=True)
    assert len(set(pids)) == generations, pids


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
