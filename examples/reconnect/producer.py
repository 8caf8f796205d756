"""A producer of numbered frames through a pool, for consumer.py.

    python producer.py ADDRESS GENERATION FRAMES [--crash]

Listens on ADDRESS, waits for the consumer, and sends FRAMES float32 frames of 256 values
through a pool of 4 slots: frame k of generation g holds g * 1000 + k everywhere. With --crash
it then dies at once (SIGKILL: no close, no clean-up, as a crashed process); without, it closes
the channel.
"""

import os
import signal
import sys

import devshare


def main(address: str, generation: int, frames: int, crash: bool) -> None:
    with devshare.Channel(address) as ch:
        pool = ch.pool(slot_nbytes=256 * 4, count=4)
        consumer = ch.wait_peers(1, timeout=10)[0]
        for k in range(frames):
            slot = pool.acquire(timeout=10)  # waits while all 4 slots are with the consumer
            slot.tensor((256,), "float32").fill_(generation * 1000 + k)
            slot.send(consumer, shape=(256,), dtype="float32")
        if crash:
            print(f"producer {generation}: sent {frames} frames, now crashing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # Closing with slots still out is fine: the consumer keeps what it holds until it
        # releases it, and its recv raises ChannelClosed once it has received everything.
        print(f"producer {generation}: sent {frames} frames, closing", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--crash" in sys.argv[4:])
