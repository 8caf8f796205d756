"""Mixed deployment, run in a fresh virtual environment that has only the devshare wheel (and
torch): a torch producer -> a C++ stage (built with find_package(devshare) against the wheel) ->
a torch consumer.

    python roundtrip.py STAGE_EXECUTABLE [STAGE_EXECUTABLE ...]
"""

import os
import subprocess
import sys

import torch

import devshare


def check_installed_package():
    # The package and the library come from the wheel, not from a source tree.
    pkg = os.path.dirname(os.path.realpath(devshare.__file__))
    assert "site-packages" in pkg, pkg
    assert os.path.realpath(devshare.library_path) == os.path.realpath(devshare.get_library()), \
        (devshare.library_path, devshare.get_library())
    assert devshare.get_library().startswith(pkg), devshare.get_library()
    assert not any(os.path.isfile(os.path.join(p, "Cargo.toml")) for p in sys.path if p), sys.path


def run_stage(stage: str) -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # a strided view: 4x3
    h = devshare.share(x)
    proc = subprocess.Popen([stage, h.to_text()], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("devshare1:"), f"{stage}: no handle text, got {line!r}"
        y = devshare.open(line.strip())
        assert y.shape == (4, 3) and y.dtype == torch.float32, (y.shape, y.dtype)
        assert torch.equal(y, 2 * x + 1), (y, 2 * x + 1)
        del y  # releases the stage's output: the stage's wait returns
        assert proc.wait(timeout=60) == 0, f"{stage} exited with {proc.returncode}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The stage released its import of x.
    assert devshare.wait(x, timeout=10), "the stage did not release the producer's tensor"
    print(f"ok: torch -> {os.path.basename(stage)} -> torch")


def main():
    check_installed_package()
    for stage in sys.argv[1:]:
        run_stage(stage)


if __name__ == "__main__":
    main()
