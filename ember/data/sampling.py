"""Sharding samplers and resumable sampling.

Every map-style DataLoader the Trainer or the Accelerator prepares is rebuilt
around a :class:`ResumableSampler`, whose order comes from its own generator (seed +
epoch, never the global RNG): resuming mid-epoch skips *indices*, never reads the data
already seen, and leaves the global RNG streams untouched. An ``IterableDataset`` is
wrapped in a :class:`ShardedIterable`. A user's sampler carrying its own
``torch.Generator`` is kept (:func:`own_generator`; across epochs and checkpoints: the
comment above :func:`_pass_draws`). Worker seeds: :mod:`ember.data.worker_seed`.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import math
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler,
                              Sampler, SequentialSampler, get_worker_info)

from ember.data.stateful import (TORCHDATA_HINT, hf_shard, is_hf_iterable, is_stateful, is_stateful_loader_class,
                                 stateful_loader_class)
from ember.data.worker_seed import install_worker_init, loader_seed
from ember.errors import CheckpointError


class ResumableSampler(Sampler[int]):
    """Deterministic, shardable, resumable sampler.

    Same order on every rank for a given ``(seed, epoch)``; rank ``r`` of ``n``
    takes indices ``r, r+n, r+2n, ...`` of the (padded) permutation, as
    ``DistributedSampler`` does, so the samples of one global batch are spread
    over ranks exactly like one big batch would be. ``padding`` records how many
    duplicated samples were appended to make the shards even so that metrics can
    drop them.
    """

    def __init__(self, dataset_len: int, shuffle: bool = False, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, drop_last: bool = False):
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = int(seed)
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0  # number of this rank's indices to skip at the next __iter__
        #: when set, the pass's shuffle seed in place of ``seed + epoch``: the seed a plain
        #: ``RandomSampler`` draws from the global RNG at each pass (a prepared loader outside
        #: the Trainer with no seed of its own: :class:`ember.data.loader.DataLoaderShard`)
        self.pass_seed: int | None = None
        if drop_last and dataset_len % num_replicas:
            self.num_samples = dataset_len // num_replicas
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.padding = max(0, self.total_size - dataset_len)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        self.start = start

    def order(self) -> list[int]:
        """The epoch's order of the whole dataset, before padding and sharding (a
        subclass may order it otherwise: :class:`LengthGroupedSampler`)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch if self.pass_seed is None else self.pass_seed)
            return torch.randperm(self.dataset_len, generator=g).tolist()
        return list(range(self.dataset_len))

    def global_indices(self) -> list[int]:
        idx = self.order()
        if self.padding:
            idx += (idx * math.ceil(self.padding / max(1, len(idx))))[: self.padding]
        return idx[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        if self.start:
            return self._resumed()
        return iter(self.global_indices()[self.rank: self.total_size: self.num_replicas])

    def _resumed(self) -> Iterator[int]:
        # a generator: runs at the first index (see _SkipBatchSampler.__iter__)
        start, self.start = self.start, 0
        yield from self.global_indices()[self.rank: self.total_size: self.num_replicas][start:]

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict:
        out = {"seed": self.seed, "epoch": self.epoch}
        if self.pass_seed is not None:
            out["pass_seed"] = self.pass_seed
        return out

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self.pass_seed = None if state.get("pass_seed") is None else int(state["pass_seed"])


class _SkipBatchSampler(Sampler[list]):
    """Wraps a user's batch sampler; skips the first ``start`` index batches once."""

    def __init__(self, batch_sampler):
        self.batch_sampler = batch_sampler
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = start

    def __iter__(self):
        # a generator, like a plain batch sampler: nothing runs before the first batch. So
        # nothing is drawn before the DataLoader's iterator drew its base seed (from the
        # user's generator, when it is the sampler's), and ``start`` is taken by the
        # iteration that runs: a DataLoader with workers calls iter() twice and drops the first
        start, self.start = self.start, 0
        it = iter(self.batch_sampler)
        for _ in range(start):  # indices only; no data is read
            next(it, None)
        yield from it

    def __len__(self):
        return len(self.batch_sampler)

    def __getattr__(self, name):
        try:
            inner = self.__dict__["batch_sampler"]
        except KeyError:   # not initialised yet (copy / unpickle)
            raise AttributeError(name) from None
        return getattr(inner, name)


_LOADER_ARGS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                "multiprocessing_context", "prefetch_factor", "persistent_workers",
                "pin_memory_device", "in_order")


def _loader_kwargs(dl: DataLoader) -> dict:
    kw = {k: getattr(dl, k) for k in _LOADER_ARGS if hasattr(dl, k)}
    if kw.get("num_workers", 0) == 0:
        kw.pop("prefetch_factor", None)
        kw["persistent_workers"] = False
    return kw


def own_generator(sampler: Any) -> torch.Generator | None:
    """The ``torch.Generator`` a user's sampler draws from (``RandomSampler(generator=g)``,
    ``DataLoader(shuffle=True, generator=g)``), or None. ember keeps such a sampler and its
    generator instead of replacing it with a :class:`ResumableSampler`."""
    gen = getattr(sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) else None


def agree_generator(dl: Any, all_gather_object: Callable[[Any], list], broadcast: Callable[[Any], Any], *,
                    warn: bool = True) -> bool:
    """Give the user's sampler generator of a prepared loader (:func:`own_generator`) rank
    0's state on every rank. Every rank draws the whole order from its own copy of that
    generator and keeps its shard, so the copies must agree, or samples are trained twice
    or never in an epoch. One ``all_gather_object`` of a short digest of the state; when
    the digests differ, one ``broadcast`` of rank 0's state, set on every rank, and (with
    ``warn``) a warning naming the sampler and the fix. Returns True when the state was
    replaced. Call it once per loader preparation (at setup), on every rank, with the
    strategy's collectives; a loader without a user generator costs nothing."""
    gen = own_generator(index_sampler(dl))
    if gen is None:
        return False
    state = gen.get_state()
    digest = hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16]
    digests = all_gather_object(digest)
    if len(set(digests)) <= 1:
        return False
    ref = broadcast(state)
    gen.set_state(ref.to(state.device) if isinstance(ref, torch.Tensor) else ref)
    if warn:
        sampler = index_sampler(dl)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        warnings.warn(
            f"the generator of the {type(sampler).__name__} (generator=) of the DataLoader over "
            f"{type(dl.dataset).__name__} was in a different state on rank(s) {', '.join(map(str, differ))} than on "
            "rank 0: each rank would have drawn its own order and the ranks' shards would have overlapped "
            "(samples trained twice or never in an epoch). Every rank now uses rank 0's generator state. Seed the "
            "generator alike on every rank (torch.Generator().manual_seed(seed), not seed + rank), or drop "
            "generator= and let Trainer(seed=) / Accelerator(seed=) shuffle", UserWarning, stacklevel=3)
    return True


def draws_global_rng(sampler: Any) -> bool:
    """True for a sampler with a ``generator`` attribute left None (``WeightedRandomSampler``,
    ``SubsetRandomSampler``): it draws from the global RNG when its iteration starts."""
    return hasattr(sampler, "generator") and sampler.generator is None and not isinstance(
        sampler, (ResumableSampler, SequentialSampler))


def index_sampler(dl: Any):
    """The user's index sampler inside a prepared loader (below ember's sharding and
    skipping wrappers), or None."""
    if not isinstance(dl, DataLoader):
        return None
    s = dl.batch_sampler if isinstance(dl.batch_sampler, _SkipBatchSampler) else dl.sampler
    while True:
        if isinstance(s, _SkipBatchSampler):
            s = s.batch_sampler
        elif isinstance(s, BatchSampler):
            s = s.sampler
        elif isinstance(s, _ShardedSampler):
            s = s.sampler
        else:
            return s


def is_shuffled(dl: DataLoader) -> bool:
    s = getattr(dl, "sampler", None)
    return isinstance(s, RandomSampler) or (isinstance(s, ResumableSampler) and s.shuffle)


def prepare_dataloader(dl: Any, *, seed: int, num_replicas: int = 1, rank: int = 0,
                       shuffle: bool | None = None, pad: bool = True, even: bool = True,
                       stateful: bool = False, warn: bool = True) -> Any:
    """Rebuild ``dl`` around a :class:`ResumableSampler` (sharded when
    ``num_replicas > 1``); a custom batch sampler is kept and made skippable;
    non-DataLoader iterables are returned as they are. The loader's generator (which
    seeds its workers) is seeded per (``seed``, epoch, ``rank``): see :func:`set_epoch`.

    An ``IterableDataset`` is wrapped in a :class:`ShardedIterable` when there is
    something to shard (several ranks or workers); ``even`` is its argument (True for
    training, False for evaluation). A Hugging Face ``datasets.IterableDataset`` is split
    over the ranks with its own ``split_dataset_by_node`` instead
    (:func:`ember.data.stateful.hf_shard`).

    ``pad`` changes nothing: map-style datasets are always padded to even shards, as a
    DistributedSampler does, and ``sampler.padding`` tells metrics how many samples to drop.

    The rebuilt loader is a torchdata ``StatefulDataLoader`` when ``dl`` is one, when
    ``stateful`` asks for it (``DataLoaderConfiguration(use_stateful_dataloader=True)``),
    or when its dataset or sampler holds a state that DataLoader workers (or a sampler
    read ahead of the batches) would otherwise hide: torchdata then records that state
    with every batch (:mod:`ember.data.stateful`, :mod:`ember.data.resume`). ``warn``:
    say so when torchdata would be needed and is missing (then the data is replayed on
    a mid-epoch resume).
    """
    if not isinstance(dl, DataLoader):
        return dl
    if getattr(dl, "ember_seed", None) is not None and getattr(dl, "ember_rank", None) == (rank, num_replicas):
        return dl   # prepared before
    if is_stateful(dl) and not is_stateful_loader_class(dl):
        # a DataLoader subclass of the user's with its own state: rebuilding it would lose both
        if num_replicas > 1 and warn:
            warnings.warn(f"the {type(dl).__name__} (a DataLoader with its own state_dict()/load_state_dict()) is "
                          f"used as it is, its state saved with every checkpoint: under {num_replicas} processes "
                          "it must give each rank its own share of the data itself (ember does not shard it). "
                          "Use a plain DataLoader or torchdata's StatefulDataLoader to have it sharded",
                          UserWarning, stacklevel=4)
        return dl
    gen = torch.Generator()
    gen.manual_seed(seed)
    user_gen = own_generator(getattr(dl, "sampler", None)) if shuffle is None else None
    if user_gen is not None and dl.generator is user_gen:
        gen = user_gen   # DataLoader(shuffle=True, generator=g): g also draws the worker base seed, as in torch
    kw = _loader_kwargs(dl)
    cls = _loader_class(dl, stateful, warn)
    if cls is not DataLoader and is_stateful_loader_class(dl):
        kw["snapshot_every_n_steps"] = getattr(dl, "snapshot_every_n_steps", 1)
    out = _rebuild(dl, gen, kw, seed=seed, num_replicas=num_replicas, rank=rank, shuffle=shuffle, even=even,
                   cls=cls, warn=warn)
    if out is dl:
        return dl
    out.ember_seed, out.ember_rank = int(seed), (rank, num_replicas)
    install_worker_init(out, rank)
    return out


def _loader_class(dl: DataLoader, stateful: bool, warn: bool) -> type:
    """The class of the rebuilt loader: torchdata's StatefulDataLoader when ``dl`` is one,
    when ``stateful`` asks for it, or when the dataset or the user's sampler holds a state
    that only it records in step with the batches (a dataset with DataLoader workers, each
    with its own copy; a sampler, which the DataLoader reads ahead); else DataLoader."""
    if is_stateful_loader_class(dl):
        return stateful_loader_class("a StatefulDataLoader")
    if stateful:
        return stateful_loader_class("DataLoaderConfiguration(use_stateful_dataloader=True)")
    workers = int(getattr(dl, "num_workers", 0) or 0)
    holder = None
    if is_stateful(dl.dataset) and workers > 0:
        holder = f"its dataset ({type(dl.dataset).__name__}, read by {workers} DataLoader workers)"
    sampler = getattr(dl, "sampler", None)
    if holder is None and not isinstance(dl.dataset, IterableDataset) and is_stateful(sampler) \
            and not isinstance(sampler, ResumableSampler):
        holder = f"its sampler ({type(sampler).__name__})"
    if holder is None:
        return DataLoader
    cls = stateful_loader_class()
    if cls is None:
        if warn:
            warnings.warn(
                f"the DataLoader over {type(dl.dataset).__name__}: {holder} has state_dict()/load_state_dict(), which "
                "torchdata's StatefulDataLoader records with every batch; torchdata is not installed, so a mid-epoch "
                f"resume replays the epoch's batches instead of loading that state ({TORCHDATA_HINT})",
                UserWarning, stacklevel=4)
        return DataLoader
    return cls


def _make(cls: type, dataset: Any, kw: dict, *, sampler=None, batch_sampler=None, batch_size=1, drop_last=False):
    """``cls(dataset, ...)``. A StatefulDataLoader gets ember's sampler inside a skippable
    batch sampler it cannot see into: torchdata would take ember's sampler (which has a
    ``state_dict``) for one that restores its own position and skip nothing; this way it
    fast-forwards by index, as ember does (a user's stateful sampler stays visible to it)."""
    if cls is not DataLoader:
        if sampler is not None and batch_size is not None and not (is_stateful(sampler) and
                                                                    not isinstance(sampler, ResumableSampler)):
            batch_sampler, sampler = _SkipBatchSampler(BatchSampler(sampler, batch_size, drop_last)), None
        if batch_sampler is not None and not isinstance(batch_sampler, _SkipBatchSampler):
            batch_sampler = _SkipBatchSampler(batch_sampler)
    else:
        kw = {k: v for k, v in kw.items() if k != "snapshot_every_n_steps"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")   # torchdata's own, at construction
        if batch_sampler is not None:
            return cls(dataset, batch_sampler=batch_sampler, **kw)
        if batch_size is None:
            return cls(dataset, batch_size=None, sampler=sampler, **kw)
        return cls(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kw)


def _rebuild(dl: DataLoader, gen, kw: dict, *, seed: int, num_replicas: int, rank: int, shuffle, even: bool,
             cls: type = DataLoader, warn: bool = True):
    kw = dict(kw, generator=gen)
    if isinstance(dl.dataset, IterableDataset):
        # rebuilt even with nothing to shard: the loader's generator (seeded per epoch, set_epoch)
        # draws its workers' base seed, so a resumed pass draws nothing from the global RNG
        workers = int(kw.get("num_workers", 0) or 0)
        ds = dl.dataset
        if is_hf_iterable(ds):
            ds = hf_shard(ds, num_replicas, rank, workers, warn=warn and even)
        elif not getattr(ds, "ember_sharded", False) and (num_replicas > 1 or workers > 1):
            ds = ShardedIterable(ds, num_replicas, rank, even=even, num_workers=workers)
        return _make(cls, ds, kw, batch_size=dl.batch_size, drop_last=dl.drop_last)
    if isinstance(getattr(dl, "sampler", None), LengthGroupedSampler):
        return _regroup(dl, kw, seed=seed, num_replicas=num_replicas, rank=rank, cls=cls)
    if isinstance(getattr(dl, "sampler", None), ResumableSampler) and dl.sampler.num_replicas == num_replicas \
            and (cls is DataLoader or is_stateful_loader_class(dl)):
        return dl
    user_sampler = dl.sampler
    # a user's sampler with its own generator is kept, unless the caller fixes the order (evaluation)
    keep = shuffle is None and own_generator(user_sampler) is not None
    if dl.batch_sampler is None:
        # automatic batching off (batch_size=None): each dataset item is one batch
        if isinstance(user_sampler, (RandomSampler, SequentialSampler)) and not keep:
            sampler = ResumableSampler(len(dl.dataset), seed=seed, num_replicas=num_replicas, rank=rank,
                                       shuffle=isinstance(user_sampler, RandomSampler) if shuffle is None else shuffle)
        else:
            sampler = _ShardedSampler(user_sampler, num_replicas, rank) if num_replicas > 1 else user_sampler
        return _make(cls, dl.dataset, kw, sampler=sampler, batch_size=None)
    if dl.batch_size is None or not isinstance(user_sampler, (RandomSampler, SequentialSampler)) or keep:
        if num_replicas > 1:
            # a custom sampler under DDP: shard its output deterministically
            sampler = _ShardedSampler(user_sampler, num_replicas, rank)
            if dl.batch_size is None:
                bs = dl.batch_sampler
                batch_sampler = BatchSampler(sampler, getattr(bs, "batch_size", 1), getattr(bs, "drop_last", False))
                return _make(cls, dl.dataset, kw, batch_sampler=_SkipBatchSampler(batch_sampler))
            return _make(cls, dl.dataset, kw, sampler=sampler, batch_size=dl.batch_size, drop_last=dl.drop_last)
        if dl.batch_size is None:
            return _make(cls, dl.dataset, kw, batch_sampler=_SkipBatchSampler(dl.batch_sampler))
        if cls is not DataLoader and is_stateful(user_sampler):
            return _make(cls, dl.dataset, kw, sampler=user_sampler, batch_size=dl.batch_size, drop_last=dl.drop_last)
        bs = BatchSampler(user_sampler, dl.batch_size, dl.drop_last)
        return _make(cls, dl.dataset, kw, batch_sampler=_SkipBatchSampler(bs))
    if shuffle is None:
        shuffle = isinstance(user_sampler, RandomSampler)
    sampler = ResumableSampler(len(dl.dataset), shuffle=shuffle, seed=seed, num_replicas=num_replicas,
                               rank=rank, drop_last=dl.drop_last and num_replicas > 1)
    return _make(cls, dl.dataset, kw, sampler=sampler, batch_size=dl.batch_size, drop_last=dl.drop_last)


# -- length grouping: batches of similar lengths, seeded, resumable, sharded like any ResumableSampler --
class LengthGroupedSampler(ResumableSampler):
    """A shuffled order in which each batch holds samples of similar length (little
    padding), as ``group_by_length`` does in transformers' Trainer.

    Each epoch: a permutation drawn from ``seed + epoch`` is cut into mega-batches of
    ``mega_batch_mult`` global batches (``batch_size * num_replicas`` samples), each
    sorted by length, longest first, and cut into global batches; the global batches
    are then put in a random order (the same generator), the one holding the longest
    sample first (an out-of-memory shows at the first step, not late in the epoch),
    an incomplete last batch last. Rank ``r`` takes every ``num_replicas``-th index, as
    :class:`ResumableSampler` does, so each global batch is split over the ranks, each
    rank's share of similar lengths, and an epoch gives every sample once (plus the
    duplicates that even the shards, counted in ``padding``). Resuming skips indices.

    ``seed=None`` takes the run seed when the Trainer or the Accelerator prepares the
    loader (``Trainer(seed=)``); preparing also sets ``num_replicas`` and ``rank``.
    """

    def __init__(self, lengths, batch_size: int, seed: int | None = None, mega_batch_mult: int = 50,
                 num_replicas: int = 1, rank: int = 0, drop_last: bool = False):
        lengths = [int(n) for n in lengths]
        super().__init__(len(lengths), shuffle=True, seed=0 if seed is None else seed, num_replicas=num_replicas,
                         rank=rank, drop_last=drop_last)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is not valid; use an int >= 1")
        self.lengths, self.batch_size = lengths, batch_size
        self.mega_batch_mult = max(1, int(mega_batch_mult))
        self.run_seed = seed is None   # prepare_dataloader gives it the run seed
        #: the samples grouped together (one global batch); None: ``batch_size * num_replicas``.
        #: A resume on another number of processes keeps the checkpoint's, so the order is the one
        #: the checkpoint's run follows (``ember.trainer.resume_data.reshard``)
        self.group_size: int | None = None

    @property
    def group(self) -> int:
        """The samples of one group of similar lengths (a global batch of the run)."""
        return int(self.group_size or self.batch_size * self.num_replicas)

    def order(self) -> list[int]:
        n = self.dataset_len
        if n == 0:
            return []
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=g)
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        glob = self.group
        mega = glob * self.mega_batch_mult
        parts = []
        for i in range(0, n, mega):   # each mega-batch sorted, longest first (stable: ties keep the draw)
            chunk = perm[i:i + mega]
            parts.append(chunk[torch.sort(lengths[chunk], descending=True, stable=True).indices])
        grouped = torch.cat(parts)
        full = n // glob
        batches = list(grouped[:full * glob].view(full, glob)) if full else []
        rest = grouped[full * glob:]
        shuffled = [batches[int(j)] for j in torch.randperm(full, generator=g)] if full else []
        if shuffled:   # the batch with the longest sample first
            first = max(range(full), key=lambda j: (int(lengths[shuffled[j][0]]), -j))
            shuffled.insert(0, shuffled.pop(first))
        return torch.cat(shuffled + [rest]).tolist() if shuffled else rest.tolist()

    def sharded(self, num_replicas: int, rank: int, seed: int, drop_last: bool = False) -> "LengthGroupedSampler":
        """A copy for ``rank`` of ``num_replicas`` (the epoch kept; the run ``seed`` when this one
        was made with ``seed=None``)."""
        out = LengthGroupedSampler(self.lengths, self.batch_size, seed if self.run_seed else self.seed,
                                   self.mega_batch_mult, num_replicas=num_replicas, rank=rank, drop_last=drop_last)
        out.run_seed, out.epoch, out.group_size = self.run_seed, self.epoch, self.group_size
        return out


def _regroup(dl: DataLoader, kw: dict, *, seed: int, num_replicas: int, rank: int,
             cls: type = DataLoader) -> DataLoader:
    """A loader over a :class:`LengthGroupedSampler`, rebuilt for this rank and the run seed."""
    s = dl.sampler
    if dl.batch_size is not None and dl.batch_size != s.batch_size:
        raise ValueError(f"LengthGroupedSampler(batch_size={s.batch_size}) sits in a DataLoader with "
                         f"batch_size={dl.batch_size}; give both the same batch size")
    drop_last = bool(dl.drop_last and num_replicas > 1)
    if s.num_replicas == num_replicas and s.rank == rank and s.drop_last == drop_last \
            and (not s.run_seed or s.seed == int(seed)) and (cls is DataLoader or is_stateful_loader_class(dl)):
        return dl
    return _make(cls, dl.dataset, kw, sampler=s.sharded(num_replicas, rank, seed, drop_last),
                 batch_size=dl.batch_size, drop_last=dl.drop_last)


class _ShardedSampler(Sampler[int]):
    """Shard any sampler's output over ranks (padding to even shards)."""

    def __init__(self, sampler, num_replicas: int, rank: int):
        self.sampler, self.num_replicas, self.rank = sampler, num_replicas, rank
        self.start = 0

    def set_epoch(self, epoch):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def set_start(self, start):
        self.start = start

    def __iter__(self):
        # a generator: runs at the first index (see _SkipBatchSampler.__iter__)
        start, self.start = self.start, 0
        idx = list(self.sampler)
        n = math.ceil(len(idx) / self.num_replicas) * self.num_replicas
        idx += idx[: n - len(idx)]
        yield from idx[self.rank::self.num_replicas][start:]

    def __len__(self):
        return math.ceil(len(self.sampler) / self.num_replicas)

    @property
    def padding(self):
        return math.ceil(len(self.sampler) / self.num_replicas) * self.num_replicas - len(self.sampler)


class ShardedIterable(IterableDataset):
    """This rank's and this DataLoader worker's share of an ``IterableDataset``.

    Every rank reads the same stream; it is cut into rounds of
    ``num_replicas * num_workers`` items and worker ``w`` of rank ``r`` takes item
    ``r * num_workers + w`` of each round. So a global batch holds consecutive items of
    the stream, as one process with the combined batch would, and no item is read
    twice. ``even=True`` leaves out an incomplete last round (fewer than
    ``num_replicas * num_workers`` items): every rank and worker then yields the same
    number of items and the ranks end the epoch together, with no collective.
    ``even=False`` yields every item (ranks may differ by one item).

    The wrapped dataset must yield the same items in the same order on every rank
    (seed its shuffling with the run seed). A dataset that already splits its stream
    by rank and worker sets ``ember_sharded = True`` and is left as it is; it must
    then give every rank the same number of batches.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, even: bool = True, num_workers: int = 0):
        self.dataset, self.num_replicas, self.rank = dataset, int(num_replicas), int(rank)
        self.even, self.num_workers = bool(even), int(num_workers)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        n = self.num_replicas * workers
        me = self.rank * workers + worker
        it = iter(self.dataset)
        while True:
            group = list(itertools.islice(it, n))
            if len(group) < n:
                if not self.even and me < len(group):
                    yield group[me]
                return
            yield group[me]

    def __len__(self) -> int:
        """Items this rank yields, when the stream's length is known and the loader has
        at most one worker (otherwise a DataLoader would count batches wrongly)."""
        if self.num_workers > 1:
            raise TypeError("the number of batches is not known: several workers share the stream")
        total, n = len(self.dataset), self.num_replicas
        if self.even:
            return total // n
        return max(0, (total - self.rank + n - 1) // n)

    def __getattr__(self, name):
        try:
            inner = self.__dict__["dataset"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(inner, name)


class LookAhead:
    """Iterate ``loader`` keeping ``depth`` batches ahead: once the end of the pass is
    within ``depth`` batches, :attr:`length` (its number of batches, counting ``start``
    batches already done before this iteration) is known. The Trainer and the
    Accelerator use it on loaders of unknown length under gradient accumulation, to size
    the last accumulation window and step on its last batch. With ``count``,
    :attr:`counts` maps the index of each batch read to ``count(batch)`` (the items its
    loss sums over), so a window's count is known at its first batch; the reader pops them."""

    def __init__(self, loader, depth: int, start: int = 0, count=None):
        self.loader, self.depth, self.start = loader, max(1, int(depth)), int(start)
        self.length: int | None = None
        self.count, self.counts = count, {}

    def __iter__(self):
        self.length = None
        self.counts = {}
        it, buf, taken = iter(self.loader), collections.deque(), self.start
        while True:
            while self.length is None and len(buf) <= self.depth:
                try:
                    buf.append(next(it))
                except StopIteration:
                    self.length = taken
                    break
                if self.count is not None:
                    self.counts[taken] = self.count(buf[-1])
                taken += 1
            if not buf:
                return
            yield buf.popleft()


def sampler_of(dl: Any):
    """The resumable sampler (or skippable batch sampler) inside a prepared loader."""
    if not isinstance(dl, DataLoader):
        return None
    bs = dl.batch_sampler
    if isinstance(bs, _SkipBatchSampler):
        return bs
    return dl.sampler if hasattr(dl.sampler, "set_start") else None


def set_epoch(dl: Any, epoch: int) -> None:
    """Use the data order of ``epoch``, and seed the loader's generator (the base of its
    worker seeds) from (run seed, ``epoch``, data-parallel rank). An ``IterableDataset``
    with a ``set_epoch`` (a Hugging Face ``IterableDataset``: its shard order and shuffle
    follow the epoch) gets the epoch too; a :class:`~ember.data.combined.CombinedLoader`
    passes it to each of its loaders."""
    own_set = getattr(dl, "ember_set_epoch", None)
    if own_set is not None:
        own_set(epoch)
        return
    ds = getattr(dl, "dataset", None)
    if isinstance(ds, IterableDataset) and callable(getattr(ds, "set_epoch", None)):
        ds.set_epoch(epoch)
    own = own_generator(index_sampler(dl))
    if own is not None:   # before the sampler's set_epoch: a replayed pass is the previous epoch's
        _generator_to_epoch(dl, own, epoch)
    s = sampler_of(dl)
    if s is not None:
        if hasattr(s, "set_epoch"):
            s.set_epoch(epoch)
        elif hasattr(getattr(s, "batch_sampler", None), "sampler") and hasattr(s.batch_sampler.sampler, "set_epoch"):
            s.batch_sampler.sampler.set_epoch(epoch)
    elif callable(getattr(getattr(dl, "sampler", None), "set_epoch", None)):   # a user's stateful sampler, kept
        dl.sampler.set_epoch(epoch)
    gen = getattr(dl, "generator", None)
    seed = loader_seed(dl, epoch)
    if isinstance(gen, torch.Generator) and seed is not None and gen is not own:   # never reseed the user's
        gen.manual_seed(seed)


# -- a user sampler's own generator across epochs and checkpoints ----------------------------------
# The loader records the generator's state at the start of an epoch, before anything of the
# epoch is drawn (``ember_epoch_generator_state``), and that epoch (``ember_generator_epoch``).
# A later epoch starts from that state advanced by exactly one whole pass per epoch, replayed
# at the epoch start (_pass_draws). How far a pass really drew (DataLoader workers prefetching
# sampler indices ahead, a pass cut short by limit_train_batches or a break, a reused
# persistent-workers iterator) never reaches the next epoch: the order of every epoch depends
# only on the recorded state and the epoch, in an uninterrupted run as in a resumed one.

def _pass_draws(dl: Any, gen: torch.Generator) -> None:
    """Draw from ``gen`` what one whole pass over ``dl`` draws: the iterator's base seed when
    ``gen`` is the loader's generator, then the user's index sampler, iterated to its end
    (indices only, no data is read; a ``RandomSampler`` draws its permutation(s) and, at its
    end, one more)."""
    if getattr(dl, "generator", None) is gen:
        torch.empty((), dtype=torch.int64).random_(generator=gen)
    collections.deque(iter(index_sampler(dl)), maxlen=0)


def _generator_to_epoch(dl: Any, gen: torch.Generator, epoch: int) -> None:
    """Give the user's sampler generator its state at the start of ``epoch`` (see above).
    The first epoch of a loader (or an epoch before the recorded one) starts from the state
    the generator is in; the recorded epoch again from its recorded state."""
    snap, at = getattr(dl, "ember_epoch_generator_state", None), getattr(dl, "ember_generator_epoch", None)
    if snap is None or at is None or epoch < at:
        snap = gen.get_state()
    else:
        gen.set_state(snap)
        if epoch > at:
            for _ in range(epoch - at):
                _pass_draws(dl, gen)
            snap = gen.get_state()
    dl.ember_epoch_generator_state, dl.ember_generator_epoch = snap, int(epoch)
    if getattr(dl, "generator", None) is gen and getattr(dl, "persistent_workers", False) \
            and getattr(dl, "_iterator", None) is not None:
        # a persistent-workers iterator is reused and draws no base seed: draw it, so every
        # pass draws what _pass_draws replays
        torch.empty((), dtype=torch.int64).random_(generator=gen)


def generator_checkpoint_state(dl: Any) -> dict:
    """What a checkpoint records of a prepared loader's user sampler generator
    (:func:`own_generator`): ``generator_state``, its state at the start of epoch
    ``generator_epoch`` (None: no epoch started yet; the state it is in now). Empty for a
    loader without one. The Trainer's and the Accelerator's checkpoints both record this;
    :func:`restore_generator` reads it back."""
    gen = own_generator(index_sampler(dl))
    if gen is None:
        return {}
    snap = getattr(dl, "ember_epoch_generator_state", None)
    if snap is None:
        return {"generator_state": gen.get_state(), "generator_epoch": None}
    return {"generator_state": snap, "generator_epoch": int(dl.ember_generator_epoch)}


def restore_generator(dl: Any, saved: dict, legacy_epoch: int | None, where: str) -> None:
    """Give the user sampler generator of a prepared loader the state of
    :func:`generator_checkpoint_state`: the next :func:`set_epoch` starts its epoch from it
    (the recorded epoch again, a later one advanced by one pass per epoch). A checkpoint
    written before ``generator_epoch`` was recorded gives ``legacy_epoch``: the epoch its
    writer meant the state for. ``where`` names the checkpoint in the error raised for a
    state the generator refuses."""
    gen = own_generator(index_sampler(dl))
    state = saved.get("generator_state")
    if gen is None or not isinstance(state, torch.Tensor):
        return
    try:
        gen.set_state(state)
    except (RuntimeError, TypeError) as err:
        raise CheckpointError(f"{where}: the sampler generator state is corrupt ({err})") from err
    epoch = saved["generator_epoch"] if "generator_epoch" in saved else legacy_epoch
    dl.ember_epoch_generator_state = gen.get_state() if epoch is not None else None
    dl.ember_generator_epoch = int(epoch) if epoch is not None else None


def skip_batches(dl: Any, num_batches: int) -> bool:
    """Make the next iteration of ``dl`` start after ``num_batches`` batches without
    reading them. Returns False when the loader cannot skip by index (iterable)."""
    if num_batches <= 0:
        return True
    s = sampler_of(dl)
    if s is None:
        return False
    if isinstance(s, _SkipBatchSampler):
        s.set_start(num_batches)
    else:
        s.set_start(num_batches * (dl.batch_size or 1))
    return True


def num_padded(dl: Any, batches: int | float | None = None) -> int:
    """How many samples the distributed sampler duplicated to even the shards. With
    ``batches``: how many of them a pass of that many batches reached. The padding is
    the last sample of some ranks, so a full pass has all of it and a shorter one
    (``limit_val_batches``, the sanity check) none."""
    s = getattr(dl, "sampler", None)
    if s is None and isinstance(getattr(dl, "batch_sampler", None), _SkipBatchSampler):
        s = getattr(dl.batch_sampler.batch_sampler, "sampler", None)
    pad = int(getattr(s, "padding", 0) or 0)
    if pad and batches is not None:
        try:
            if batches < len(dl):
                return 0
        except TypeError:
            return 0
    return pad


def samples_per_rank(dl: Any) -> int | None:
    """How many samples one full pass of a prepared loader gives this rank (the
    sharding sampler's length, duplicates included), or None when unknown."""
    s = getattr(dl, "sampler", None)
    if s is None or not hasattr(s, "padding"):
        s = getattr(getattr(getattr(dl, "batch_sampler", None), "batch_sampler", None), "sampler", None)
    try:
        return len(s) if s is not None and hasattr(s, "padding") else None
    except TypeError:
        return None


def batch_padding(dl: Any, batch_idx: int | None, batches: int | float | None = None) -> int:
    """How many samples a ``gather_for_metrics`` call must drop.

    ``batch_idx`` is the index of the evaluation batch being processed (a per-batch
    call, as Accelerate users write it) or None (the call is made once, after the
    pass, on the concatenation of its outputs). ``batches`` is the length of the pass
    (``limit_val_batches``; None: the whole loader). The sampler's duplicates are the
    last sample of some ranks, so only the last batch of a full pass holds them: a
    per-batch call drops them there and nowhere else, the epoch-end call drops them
    from the end of the whole pass, and a shorter pass drops nothing.
    """
    pad = num_padded(dl, batches)
    if pad and batch_idx is not None:
        try:
            if batch_idx + 1 < len(dl):
                return 0
        except TypeError:
            return 0
    return pad


def has_length(dl: Any) -> bool:
    """True when ``len(dl)`` (the number of batches of a pass) is known."""
    try:
        len(dl)
    except TypeError:
        return False
    return True


def dataset_length(dl: Any) -> int | None:
    try:
        return len(dl.dataset)
    except (AttributeError, TypeError):
        return None


def prepare_for(strategy: Any, dl: Any, *, seed: int, shuffle: bool | None = None, even: bool = True,
                stateful: bool = False) -> Any:
    """``dl`` sharded over ``strategy``'s data-parallel ranks (:func:`prepare_dataloader`;
    ``even=False`` keeps every item of an IterableDataset, for evaluation) for the Trainer
    and the Accelerator alike. Under several processes a sampler kept with the user's own
    generator is agreed (:func:`agree_generator`), so every rank must call it at the same
    point. ``stateful``: rebuild it as a torchdata ``StatefulDataLoader``
    (:func:`prepare_dataloader`)."""
    kw = strategy.distributed_sampler_kwargs() or {}
    out = prepare_dataloader(dl, seed=seed, shuffle=shuffle, even=even, stateful=stateful,
                             warn=bool(getattr(strategy, "is_global_zero", True)), **kw)
    if strategy.world_size > 1:
        agree_generator(out, strategy.all_gather_object, strategy.broadcast, warn=strategy.is_global_zero)
    return out


def global_rng_draws(loader: Any) -> int:
    """How many values a plain ``DataLoader`` takes from the global torch RNG per
    ``__iter__``: its workers' base seed (no ``generator``) and, for a
    ``RandomSampler`` without a generator, the sampler's seed. A prepared loader (whose
    order comes from (seed, epoch)) takes as many per pass (:func:`draw_like_a_dataloader`),
    in the Trainer and the Accelerator alike, so dropout and any later ``torch.rand`` see
    the stream of a loop written by hand over the user's DataLoader."""
    from torch.utils.data import RandomSampler
    n = int(getattr(loader, "generator", None) is None)
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        n += 1
    return n


def draw_like_a_dataloader(n: int) -> list[int]:
    """Take ``n`` values from the global torch RNG, as a plain DataLoader's pass does (its
    workers' base seed, then a RandomSampler's seed): the user's random stream advances
    exactly as in a loop written by hand (:func:`global_rng_draws`). Returns the values
    (the last is the RandomSampler's seed when it draws one: :func:`draws_sampler_seed`)."""
    return [int(torch.empty((), dtype=torch.int64).random_().item()) for _ in range(n)]


def draws_sampler_seed(loader: Any) -> bool:
    """Whether ``loader`` (the user's DataLoader) shuffles with a ``RandomSampler`` that
    draws its seed from the global torch RNG at each pass (``shuffle=True``, no generator)."""
    sampler = getattr(loader, "sampler", None)
    return type(sampler) is RandomSampler and sampler.generator is None and not sampler.replacement \
        and sampler._num_samples is None and getattr(loader, "generator", None) is None
