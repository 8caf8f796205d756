"""Runs the weight-sync example: trainer.py (producer) and engine.py (consumer), each in its own
process.

    python run.py
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SYNCS = 10


def main() -> None:
    address = f"@devshare-example-weights-{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), address, str(SYNCS)])
             for script in ("trainer.py", "engine.py")]
    try:
        for p in procs:
            assert p.wait(timeout=60) == 0, f"{p.args[1]} exited with {p.returncode}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"weight_sync example: ok ({SYNCS} syncs, registered once, checked by the engine)")


if __name__ == "__main__":
    main()
