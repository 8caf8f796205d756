"""A Python consumer of a C++ pool producer (producer.cpp): starts the producer, connects to its
channel and checks every frame, zero copy.

    python consumer.py build/pool_producer

The consumer may be there before the producer listens: connect(..., wait=True) looks again
until it does. Iterating over the connection ends when the producer closes the channel.
"""

import os
import subprocess
import sys

import torch

import devshare

FRAMES = 200
ROWS, COLS = 64, 128


def main(producer_exe: str) -> None:
    address = f"@devshare-example-pool-{os.getpid()}"
    producer = subprocess.Popen([producer_exe, address, str(FRAMES)])
    try:
        pattern = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
        addresses = {}  # slot -> the data pointer it arrives at
        received = 0
        with devshare.connect(address, timeout=10, wait=True) as conn:
            for item in conn:  # ends when the producer closes the channel
                with item:  # release() at the end of the block: the slot goes back
                    frame = item.tensor  # a torch tensor over the slot, no copy
                    assert frame.shape == (ROWS, COLS) and frame.dtype == torch.float32
                    assert torch.equal(frame, pattern + received * 1000), f"frame {received}"
                    # A pool slot keeps its address for the pool's life.
                    assert addresses.setdefault(item.slot, frame.data_ptr()) == frame.data_ptr()
                received += 1
        rc = producer.wait(timeout=20)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert rc == 0, f"pool_producer exited with {rc}"
    assert received == FRAMES, f"received {received} of {FRAMES} frames"
    print(f"pool_to_python example: ok ({received} frames through {len(addresses)} slots, C++ -> Python)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python consumer.py PATH/TO/pool_producer")
    main(sys.argv[1])
