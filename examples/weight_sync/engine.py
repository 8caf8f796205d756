"""The consumer of a weight sync: an inference engine that loads each sync into its own model.

    python engine.py ADDRESS SYNCS

Each sync is ``conn.recv_batch(n)``: a dict of items by the trainer's keys (the keys travel
with the tensors), the state dict's and ``meta`` (step, checksum). The engine copies the weights
into its model by name, checks them against the checksum, and gives the whole sync back with
``devshare.release_batch(batch)``: the trainer may then step again.
"""

import sys

import torch

import devshare
from model import checksum, make_model


def main(address: str, syncs: int) -> None:
    torch.manual_seed(1)  # other weights than the trainer's until the first sync
    model = make_model()
    weights = model.state_dict()
    previous = None
    done = 0
    with devshare.connect(address, timeout=20, wait=True) as conn:
        while True:
            try:
                batch = conn.recv_batch(len(weights) + 1, timeout=20)  # the whole sync, a dict
            except devshare.ChannelClosed:
                break  # the trainer is done
            assert set(batch) == {*weights, "meta"}, sorted(batch)
            with torch.no_grad():
                for name, w in weights.items():
                    t = batch[name].tensor  # zero copy up to here: the trainer's memory
                    assert t.shape == w.shape, name
                    w.copy_(t)
            step, total = batch["meta"].tensor.tolist()
            devshare.release_batch(batch)  # the sync goes back to the trainer
            assert step == done + 1, f"sync {done + 1} says step {step}"
            assert checksum(weights.values()) == total, f"step {step}: the weights do not match"
            now = torch.cat([w.flatten() for w in weights.values()])
            assert previous is None or not torch.equal(now, previous), f"step {step}: unchanged"
            previous = now
            done += 1
    assert done == syncs, f"received {done} of {syncs} syncs"
    print(f"engine: loaded {done} syncs of {len(weights)} tensors, each checked", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
