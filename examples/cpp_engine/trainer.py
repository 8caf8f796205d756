"""The trainer of the C++ engine example: registers its state dict once, then after every
optimiser step sends it to the engine (engine.cpp) as a dict, each tensor named by its key.

    python trainer.py build/cpp_engine

``ch.register(params)`` shares the storages once; every ``ch.send_batch(engine, {...})`` is one
lease per tensor, nothing shared again. The last entry, ``meta``, is [step, number of weights,
checksum]; the engine checks its copy of the weights against it. The trainer steps again only
once the engine released the sync.
"""

import os
import subprocess
import sys

import torch

import devshare

SYNCS = 10


def main(engine_exe: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.state_dict())  # float32 tensors sharing the parameters' memory
    meta = torch.zeros(3, dtype=torch.float64)  # [step, number of weights, checksum]

    address = f"@devshare-example-cpp-engine-{os.getpid()}"
    with devshare.Channel(address) as ch:
        ch.register(params)  # shared once; held until ch.unregister() or close
        ch.register(meta)
        engine = subprocess.Popen([engine_exe, address])
        try:
            peer = ch.wait_peers(1, timeout=10)[0]
            for step in range(1, SYNCS + 1):
                x, target = torch.randn(16, 32), torch.randn(16, 8)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), target).backward()
                opt.step()  # in place: the engine's next sync sees the new values
                meta[0], meta[1] = step, len(params)
                meta[2] = sum(float(t.double().sum()) for t in params.values())
                ch.send_batch(peer, {**params, "meta": meta})  # names travel with the tensors
                while any(devshare.outstanding(t) for t in (*params.values(), meta)):
                    if engine.poll() is not None:
                        raise RuntimeError(f"cpp_engine exited with {engine.returncode} at step {step}")
                    ch.service(0.01)
        except BaseException:
            engine.kill()
            raise
    # The channel is closed: the engine's next receive says CLOSED and it ends.
    rc = engine.wait(timeout=20)
    assert rc == 0, f"cpp_engine exited with {rc}"
    print(f"cpp_engine example: ok ({SYNCS} syncs of {len(params)} tensors, Python -> C++, by name)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python trainer.py PATH/TO/cpp_engine")
    main(sys.argv[1])
