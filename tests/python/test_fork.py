"""fork (issue 11, item 6): pool workers forked after imports (multiprocessing's default start
method on Linux) drop what they inherited without giving back the parent's counts or
references; the parent then releases as usual."""

import gc
import multiprocessing

import torch

import devshare
from conftest import header_count

# What the workers inherit from the parent (module globals survive fork).
_INHERITED: dict = {}


def _drop_inherited(_):
    """In a worker: read the inherited tensor, then drop it and everything else devshare made in
    the parent, the way garbage collection in a real worker would."""
    t = _INHERITED.pop("tensor", None)
    seen = -1.0 if t is None else float(t[3])
    del t
    _INHERITED.clear()
    gc.collect()
    devshare.collect()
    return seen


def test_forking_pool_workers_do_not_release_the_parents_imports():
    x = devshare.empty((64,), torch.float32)
    x.fill_(2.5)
    h = devshare.share(x)
    # Only _INHERITED refers to the import (a local would keep it alive in the workers too: they
    # run on top of this frame).
    _INHERITED["tensor"] = devshare.open(h)  # takes the handle's in-flight reference over
    before = (header_count(h.key), devshare.outstanding(x))
    assert before == (2, 1)  # the exporter and this import; the import's reference

    # maxtasksperchild=1: every task runs in a worker freshly forked from this process.
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        assert pool.map(_drop_inherited, range(4), chunksize=1) == [2.5] * 4
    assert (header_count(h.key), devshare.outstanding(x)) == before, "a worker released the parent's import"

    # The parent's import still works and releases normally.
    _INHERITED["tensor"][3] = 7.0
    assert x[3].item() == 7.0
    _INHERITED.clear()
    gc.collect()
    assert devshare.outstanding(x) == 0 and header_count(h.key) == 1
