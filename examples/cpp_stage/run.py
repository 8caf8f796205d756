"""Python -> C++ -> Python: a Python producer sends batches of torch tensors to a C++ stage
(stage.cpp), which answers each one with y = 2 * x + 1 in a slot of its own pool, on its own
channel, back to this process.

    python run.py build/cpp_stage

The listen / connect order (see stage.cpp): each side listens on its own channel before it
connects to the other's, and serves its channel while the other connects.
"""

import os
import subprocess
import sys

import torch

import devshare

BATCHES = 20
BATCH = 4  # tensors per batch


def main(stage_exe: str) -> None:
    tag = f"devshare-example-cpp-stage-{os.getpid()}"
    in_address, out_address = f"@{tag}-in", f"@{tag}-out"  # abstract sockets: no files

    # 1. Our channel first; then start the stage, which listens on OUT before it connects here.
    ch = devshare.Channel(in_address)
    stage = subprocess.Popen([stage_exe, in_address, out_address])
    try:
        # 2. Serve our channel while the stage connects (it connects, then waits for us).
        stage_peer = ch.wait_peers(1, timeout=10)[0]
        # 3. Only now connect to the stage's channel: it serves our handshake.
        with devshare.connect(out_address, timeout=10, wait=True) as answers:
            sent = []
            for b in range(BATCHES):
                # Plain CPU tensors, one of them a strided view. (A CPU tensor's storage moves
                # into shared memory once, at its first send; devshare.channel_empty gives
                # memory that needs no move.)
                xs = [torch.randn(8, 16) for _ in range(BATCH - 1)]
                xs.append(torch.arange(b, b + 32, dtype=torch.float32).reshape(4, 8).t())
                ch.send_batch(stage_peer, xs)
                for x in xs:
                    with answers.recv(timeout=10) as item:  # released at the end of the block
                        y = item.tensor
                        assert item.pool is not None, "the answer is a pool slot"
                        assert y.shape == x.shape and torch.equal(y, 2 * x + 1), (x, y)
                sent.extend(xs)
            # Every input came back (the stage releases each one before it answers).
            while any(devshare.outstanding(x) for x in sent):
                ch.service(0.01)
        ch.close()  # the stage's recv now says CLOSED: it waits for its answers, then ends
        rc = stage.wait(timeout=20)
    finally:
        ch.close()
        if stage.poll() is None:
            stage.kill()
            stage.wait()
    assert rc == 0, f"cpp_stage exited with {rc}"
    print(f"cpp_stage example: ok ({BATCHES * BATCH} tensors Python -> C++ -> Python)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python run.py PATH/TO/cpp_stage")
    main(sys.argv[1])
