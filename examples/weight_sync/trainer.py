"""The producer of a weight sync: a trainer that shares its state dict once and sends it to an
inference engine after every optimiser step.

    python trainer.py ADDRESS SYNCS

``ch.register(params)`` shares the state dict's storages once; every later
``ch.send_batch(engine, {...})`` of them is one lease per tensor, nothing shared again, and the
dict's keys travel as the leases' names. The optimiser changes the parameters in place, so the
engine's next sync sees the new values. Each sync ends with a small ``meta`` tensor (registered
too): the step and a checksum of the weights, which the engine checks.
"""

import sys

import torch

import devshare
from model import checksum, make_model


def main(address: str, syncs: int) -> None:
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.state_dict())  # tensors sharing the parameters' memory
    meta = torch.zeros(2, dtype=torch.float64)  # [step, checksum of the weights]

    with devshare.Channel(address) as ch:
        ch.register(params)  # shared once; held until ch.unregister() or close
        ch.register(meta)
        engine = ch.wait_peers(1, timeout=20)[0]
        for step in range(1, syncs + 1):
            # One training step: the optimiser updates the parameters in place. Only once the
            # engine has released the previous sync (the loop below), so it never reads a
            # half-written step.
            x, target = torch.randn(16, 32), torch.randn(16, 8)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), target).backward()
            opt.step()
            meta[0], meta[1] = step, checksum(params.values())
            ch.send_batch(engine, {**params, "meta": meta})  # one lease per tensor, named by its key
            # Wait until the engine has loaded the sync and released it (every tensor's lease;
            # the wait serves the channel meanwhile).
            if not devshare.wait([*params.values(), meta], timeout=60):
                raise TimeoutError("the engine did not release the sync within 60 s")
        print(f"trainer: sent {syncs} syncs of {len(params)} tensors", flush=True)
    # Closing the channel: the engine's next recv_batch raises ChannelClosed.


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
