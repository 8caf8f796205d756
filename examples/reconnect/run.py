"""Runs the reconnect example: a consumer (consumer.py) and, one after the other, two producers
(producer.py) at the same address: the first dies (SIGKILL) after its frames, the second
closes cleanly. The consumer survives the first and reconnects to the second.

    python run.py
"""

import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FRAMES = 10


def python(script, *args):
    return subprocess.Popen([sys.executable, os.path.join(HERE, script), *map(str, args)])


def main() -> None:
    # An abstract socket ("@name"): gone with the process that listens, so the next producer
    # can listen at the same address even after a crash (a socket file would stay behind).
    address = f"@devshare-example-reconnect-{os.getpid()}"
    procs = [python("consumer.py", address, 2, FRAMES)]  # it may start before any producer
    try:
        first = python("producer.py", address, 1, FRAMES, "--crash")
        procs.append(first)
        assert first.wait(timeout=30) == -signal.SIGKILL, first.returncode
        second = python("producer.py", address, 2, FRAMES)
        procs.append(second)
        assert second.wait(timeout=30) == 0, second.returncode
        assert procs[0].wait(timeout=30) == 0, procs[0].returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print("reconnect example: ok (the consumer survived a dead producer and reconnected)")


if __name__ == "__main__":
    main()
