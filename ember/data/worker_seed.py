"""DataLoader worker seeds.

A DataLoader seeds each worker with ``base_seed + worker_id`` (python ``random``,
torch, numpy), where ``base_seed`` is drawn from the loader's generator when an
epoch's iterator starts. ember seeds that generator, at every epoch, from the run
seed, the epoch and the data-parallel rank (:func:`loader_seed`): worker seeds then
differ on every rank and worker, follow from the run seed, and are the same again
when a run resumes (the run seed is in the checkpoint, the epoch in the loop state).

With ``seed_everything(seed, workers=True)`` (which sets ``EMBER_SEED_WORKERS=1``)
each worker of a prepared loader also runs :func:`worker_init` (before the
loader's own ``worker_init_fn``): it seeds python, numpy and torch from the worker's
seed, and re-seeds them before every batch from (base seed, the batch's first
sample index). A batch's random draws (augmentation, masking) then depend only on
the run seed, the epoch, the rank and the samples, not on which worker loads it or
on how many batches that worker loaded before: a run resumed mid-epoch draws
exactly what the uninterrupted run drew. (Per-batch seeding needs automatic
batching and non-persistent workers; otherwise the per-worker seeding applies.)
"""
from __future__ import annotations

import functools
import hashlib
import os
import random
from typing import Any

import torch

SEED_WORKERS_ENV = "EMBER_SEED_WORKERS"


def mix(*values: Any) -> int:
    """A 63-bit seed from the values (stable across processes, runs and platforms)."""
    h = hashlib.blake2b(",".join(str(v) for v in values).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def seed_all(seed: int) -> None:
    """Seed python ``random``, numpy (when installed) and torch (CPU and CUDA) with ``seed``."""
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed python, numpy and torch (all devices). Returns the seed used.

    ``workers=True`` sets ``EMBER_SEED_WORKERS=1`` for the rest of the process (and the
    ranks it starts; ``EMBER_SEED_WORKERS=0`` turns it off): the workers of every
    DataLoader ember prepares then seed python, numpy and torch from (run seed, epoch,
    rank, worker) and re-seed them per batch, so their random draws differ across ranks
    and workers and repeat exactly after a mid-epoch resume (see the module docstring).
    Worker seeds differ per rank and worker in any case. Public as ``ember.seed_everything``
    and ``ember.utilities.seed_everything``."""
    if seed is None:
        seed = os.environ.get("EMBER_GLOBAL_SEED", random.randint(0, 2**31 - 1))
    try:
        if isinstance(seed, (bool, float)):
            raise ValueError
        seed = int(seed)
    except (TypeError, ValueError):
        from ember.errors import MisconfigurationError
        raise MisconfigurationError(f"seed={seed!r} is not valid; use an integer (e.g. seed=42)") from None
    os.environ["EMBER_GLOBAL_SEED"] = str(seed)
    if workers:
        os.environ[SEED_WORKERS_ENV] = "1"
    seed_all(seed)
    return seed

def loader_seed(dl: Any, epoch: int) -> int | None:
    """The seed of a prepared loader's generator at ``epoch``: from its run seed (the
    resumable sampler's, restored from checkpoints), the epoch and its data-parallel
    rank. None for a loader ember did not prepare."""
    sampler = getattr(dl, "sampler", None)
    seed = getattr(sampler, "seed", None) if hasattr(sampler, "set_start") else None
    if seed is None:
        seed = getattr(dl, "ember_seed", None)
    if seed is None:
        return None
    rank = (getattr(dl, "ember_rank", None) or (0, 1))[0]
    return mix("loader", int(seed), int(epoch), int(rank))


def install_worker_init(dl, rank: int) -> None:
    """Chain :func:`worker_init` before the loader's own ``worker_init_fn`` (workers only)."""
    if int(getattr(dl, "num_workers", 0) or 0) > 0:
        dl.worker_init_fn = functools.partial(worker_init, dl.worker_init_fn, bool(dl.persistent_workers))


def worker_init(user_fn, persistent: bool, worker_id: int) -> None:
    """Runs first in every worker of a prepared loader. Under ``seed_everything(workers=True)``:
    seeds python/numpy/torch from the worker's seed and, for map-style datasets with
    non-persistent workers, re-seeds them before each batch (see the module docstring)."""
    if os.environ.get(SEED_WORKERS_ENV, "0") == "1":
        from torch.utils.data import IterableDataset, get_worker_info
        info = get_worker_info()
        base = info.seed - info.id          # the loader's base seed: (run seed, epoch, rank)
        seed_all(mix("worker", base, info.id))
        ds = info.dataset
        if not persistent and not isinstance(ds, IterableDataset):
            fetch = getattr(ds, "__getitems__", None) or functools.partial(_fetch_each, ds)
            try:   # this worker's copy of the dataset only
                ds.__getitems__ = functools.partial(_seeded_fetch, fetch, base)
            except (AttributeError, TypeError):
                pass
    if user_fn is not None:
        user_fn(worker_id)


def _fetch_each(ds, indices):
    return [ds[i] for i in indices]


def _seeded_fetch(fetch, base: int, indices):
    first = indices[0] if len(indices) else None
    seed_all(mix("batch", base, first, len(indices)))
    return fetch(indices)
