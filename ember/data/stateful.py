"""The stateful protocol of train data: which object of a loader holds its position
(a loader, dataset or sampler with ``state_dict()`` / ``load_state_dict()``, as in
torchdata and Lightning), torchdata's ``StatefulDataLoader``, and Hugging Face
``datasets.IterableDataset`` (sharded over ranks with ``split_dataset_by_node``; its
DataLoader workers split its shards themselves).

torchdata and ``datasets`` stay optional: they are imported only when such an object
is given (or ``DataLoaderConfiguration(use_stateful_dataloader=True)`` asks for
torchdata). How a pass resumes from these states is :mod:`ember.data.resume`.
"""
from __future__ import annotations

import copy
import sys
import warnings
from typing import Any

from ember.errors import MisconfigurationError

TORCHDATA_HINT = "pip install torchdata"


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has callable ``state_dict()`` and ``load_state_dict()`` (torchdata's
    ``Stateful`` protocol)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_loader_class(required: str | None = None) -> type | None:
    """torchdata's ``StatefulDataLoader`` class, or None when torchdata is not installed.
    ``required`` (what needs it): raise MisconfigurationError naming it instead of None."""
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        if required is None:
            return None
        raise MisconfigurationError(f"{required} needs torchdata's StatefulDataLoader: {TORCHDATA_HINT}") from None
    return StatefulDataLoader


def is_stateful_loader_class(dl: Any) -> bool:
    """Whether ``dl`` is a torchdata ``StatefulDataLoader`` (or a subclass), without
    importing torchdata."""
    mod = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(mod, "StatefulDataLoader", None) if mod is not None else None
    return cls is not None and isinstance(dl, cls)


# -- Hugging Face datasets ------------------------------------------------------------------------
def is_hf_iterable(ds: Any) -> bool:
    """Whether ``ds`` is a Hugging Face ``datasets.IterableDataset`` (checked without
    importing ``datasets``: such an object exists only once it was imported)."""
    mod = sys.modules.get("datasets")
    cls = getattr(mod, "IterableDataset", None) if mod is not None else None
    return cls is not None and isinstance(ds, cls)


def hf_shuffle_buffer(ds: Any) -> bool:
    """Whether a Hugging Face IterableDataset shuffles through a buffer (``.shuffle(seed,
    buffer_size)``). Its ``state_dict()`` does not hold the buffer's content (the datasets
    documentation says so: a resume from it refills the buffer with other samples), so
    ember replays such a stream instead (:mod:`ember.data.resume`)."""
    seen, todo = set(), [getattr(ds, "_ex_iterable", None)]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo.append(getattr(node, "ex_iterable", None))
        todo.extend(getattr(node, "ex_iterables", None) or ())
    return False


def hf_shard(ds: Any, num_replicas: int, rank: int, num_workers: int, warn: bool = True) -> Any:
    """This rank's part of a Hugging Face IterableDataset: ``split_dataset_by_node`` (whole
    shards per rank when ``num_shards`` is a multiple of the ranks, else every
    ``num_replicas``-th example); the DataLoader workers then share the rank's shards (the
    dataset splits them itself). Each sample is read once per epoch over all ranks and
    workers. A rank that reads fewer batches than another would leave it waiting at the
    epoch's end unless :func:`hf_rank_batches` knows every rank's count: with ``warn``, a
    warning says so when the shards cannot split evenly."""
    if num_replicas <= 1:
        return ds
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from datasets.distributed import split_dataset_by_node
    n, parts = int(ds.num_shards), num_replicas * max(1, int(num_workers))
    if warn and n % parts:
        warnings.warn(
            f"the Hugging Face IterableDataset has {n} shard(s), not a multiple of {num_replicas} ranks x "
            f"{max(1, num_workers)} DataLoader worker(s): each sample is still read once per epoch, but the ranks "
            "may read different numbers of samples. A stream of a Dataset (its shards' lengths known) then trains "
            "the smallest number of batches on every rank; any other stream (files, a filter, a shuffle) leaves the "
            "ranks that still have batches waiting for one that ran out first. Make the shards even "
            "(Dataset.to_iterable_dataset(num_shards=a multiple of ranks x workers)), or set Trainer(limit_train_batches=N) to a count every rank reaches. Changing num_shards "
            "invalidates the checkpoints saved mid-epoch with the current shards (a resume from one is refused: "
            "its position belongs to other shards); resume those first, or resume from a checkpoint saved at an "
            "epoch end", UserWarning, stacklevel=4)
    out = split_dataset_by_node(ds, rank=rank, world_size=num_replicas)
    out.ember_num_shards = n   # the shards of the whole stream, before the split (hf_identity)
    out.ember_whole = ds       # the whole stream: its shards' lengths carry positions to other ranks (hf_reshard)
    out.ember_split = (rank, num_replicas)
    return out


def hf_rank_batches(ds: Any, batch_size: int, drop_last: bool, num_workers: int) -> "int | None":
    """The batches a pass over this rank's part of a Hugging Face IterableDataset yields
    (:func:`hf_shard`'s ``ds``), when the shards' lengths are known without reading
    (:func:`hf_shard_lengths`), else None. Whole shards per rank: rank ``r`` of ``n`` reads
    shards ``r, r + n, ...``, and each DataLoader worker ``w`` of ``k`` batches its own
    shards ``w, w + k, ...`` of those; otherwise (shards not a multiple of the ranks, no
    workers) every ``n``-th example."""
    whole, split = getattr(ds, "ember_whole", None), getattr(ds, "ember_split", None)
    if whole is None or split is None or not batch_size:
        return None
    try:
        lengths = hf_shard_lengths(whole)
    except ValueError:
        return None
    rank, world = split
    workers = max(1, int(num_workers or 0))
    if len(lengths) % world == 0:
        mine = [lengths[g] for g in rank_shards(len(lengths), rank, world)]
        return sum(batches_of(sum(mine[w::workers]), batch_size, drop_last) for w in range(workers))
    if workers > 1:
        return None
    return batches_of(len(range(rank, sum(lengths), world)), batch_size, drop_last)


def rank_shards(num_shards: int, rank: int, world: int) -> range:
    """The shards process ``rank`` of ``world`` reads, in order, when they split whole over
    the processes (``split_dataset_by_node``): ``rank, rank + world, ...``."""
    return range(rank, num_shards, world)


def batches_of(examples: int, batch_size: int, drop_last: bool) -> int:
    """The batches a DataLoader makes of ``examples`` read one after another."""
    return examples // batch_size if drop_last else -(-examples // batch_size)


#: the nodes of a Hugging Face stream that yield one example per example read (their state
#: is rebuilt by :func:`hf_reshard`); any other node (a filter, a batched map, a shuffle, an
#: interleave...) makes the examples per shard unknown without reading them
_HF_ONE_TO_ONE = ("RebatchedArrowExamplesIterable", "MappedExamplesIterable", "FormattedExamplesIterable")


def hf_shard_lengths(ds: Any) -> list[int]:
    """The number of examples in each shard of a Hugging Face IterableDataset, known without
    reading: a stream of a ``Dataset`` (``to_iterable_dataset(num_shards=N)``) through
    one-to-one steps only (an unbatched ``map``, formatting). Raises ValueError naming what
    makes them unknown otherwise (a stream from files or a generator, a filter, a batched map,
    a shuffle)."""
    node = getattr(ds, "_ex_iterable", None)
    while node is not None and getattr(node, "ex_iterable", None) is not None:
        name = type(node).__name__
        if name not in _HF_ONE_TO_ONE or getattr(node, "batched", False):
            raise ValueError(f"its {name}{' (batched)' if getattr(node, 'batched', False) else ''} may change the "
                             "number of examples per shard")
        if name == "RebatchedArrowExamplesIterable" and getattr(node, "batch_size", 1) != 1:
            raise ValueError(f"its RebatchedArrowExamplesIterable reads batches of {node.batch_size} examples")
        node = node.ex_iterable
    shards = (getattr(node, "kwargs", None) or {}).get("shards")
    if type(node).__name__ != "ArrowExamplesIterable" or not isinstance(shards, list) \
            or not all(hasattr(x, "__len__") for x in shards) or len(shards) != int(node.num_shards):
        raise ValueError(f"its source ({type(node).__name__}) does not say how many examples each shard holds "
                         "(only a stream of a Dataset, to_iterable_dataset(num_shards=N), does)")
    return [len(x) for x in shards]


def hf_reshard(part: Any, old_world: int, consumed: int, saved_state: dict, rank: int,
               world: int) -> tuple[dict, list[int]]:
    """Carry the position in a Hugging Face IterableDataset's shards, saved by ``old_world``
    processes that had each read ``consumed`` examples of their part of the epoch, to
    ``part``: the part of process ``rank`` of ``world`` now (:func:`hf_shard`).

    Process ``r`` of ``n`` reads the shards ``r, r + n, r + 2n, ...`` one after the other
    (``split_dataset_by_node``), so the examples read of every shard follow from
    ``consumed`` and the shards' lengths (:func:`hf_shard_lengths`). This process's state is
    built from them: the shards it now reads that are done, then the one it is inside, at
    its example. ``saved_state`` (one of the old processes' ``state_dict()``) gives the
    epoch. Returns that state and the examples left in the epoch for every new process (by
    rank). Raises ValueError with the reason when the position cannot be carried: the
    lengths are unknown, the shards do not divide over both numbers of processes, or the
    shards this process now reads (merged from several old processes) are not, in their
    order, read to their end, then at most one read in part, then not read at all (what one
    ``state_dict()`` holds)."""
    whole = getattr(part, "ember_whole", None) if world > 1 else part
    if whole is None:
        raise ValueError("it was not split over the processes by ember")
    lengths = hf_shard_lengths(whole)
    n = len(lengths)
    if n % old_world or n % world:
        raise ValueError(f"its {n} shards are not a multiple of both numbers of processes")
    read = [0] * n
    for r in range(old_world):   # each old process read its shards in order, `consumed` examples in all
        left = int(consumed)
        for g in rank_shards(n, r, old_world):
            read[g] = min(lengths[g], left)
            left -= read[g]
        if left:
            raise ValueError(f"process {r} of {old_world} read {consumed} examples, more than its shards hold")
    mine = list(rank_shards(n, rank, world))
    done = 0
    while done < len(mine) and read[mine[done]] == lengths[mine[done]]:
        done += 1
    at = read[mine[done]] if done < len(mine) else 0
    if any(read[g] for g in mine[done + 1:]):
        where = ", ".join(f"shard {g}: {read[g]} of {lengths[g]}" for g in mine)
        raise ValueError(f"process {rank} of {world} now reads shards that {old_world} processes left at places one "
                         f"state_dict() cannot hold ({where} read): it holds the shards read to their end, then one "
                         "place inside one shard, then shards not read at all")
    me_read = sum(read[g] for g in mine)
    left_all = [sum(lengths[g] - read[g] for g in rank_shards(n, r, world)) for r in range(world)]

    def fill(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        kind = out.get("type")
        if "shard_idx" in out:
            out.update(shard_idx=done, shard_example_idx=at)
        elif kind == "RebatchedArrowExamplesIterable":
            # its Arrow path resumes from previous_state (a place between the source's tables: the
            # shard's start) and skips num_chunks_since_previous_state chunks of one example
            inner = fill(out.get("examples_iterable"))
            if not isinstance(inner, dict) or "shard_idx" not in inner:
                raise ValueError("its state holds a RebatchedArrowExamplesIterable over another step")
            out.update(examples_iterable=inner, previous_state=dict(inner, shard_example_idx=0) if me_read else None,
                       batch_idx=me_read, num_chunks_since_previous_state=at if me_read else 0, cropped_chunk_length=0)
        elif kind == "MappedExamplesIterable":
            out.update(examples_iterable=fill(out.get("examples_iterable")), previous_state=None,
                       num_examples_since_previous_state=0, previous_state_example_idx=me_read)
        elif kind is not None:
            raise ValueError(f"its state holds a {kind}, whose position ember cannot carry")
        elif "examples_iterable" in out:
            out["examples_iterable"] = fill(out["examples_iterable"])
        return out

    state = fill(copy.deepcopy(part.state_dict()))
    if isinstance(saved_state, dict) and "epoch" in saved_state:
        state["epoch"] = saved_state["epoch"]
    return state, left_all


def hf_identity(ds: Any) -> dict:
    """What a checkpoint records to recognise a Hugging Face IterableDataset on resume:
    ``num_shards`` (of the whole stream, before :func:`hf_shard` split it over the ranks)
    and ``fingerprint``, a short digest of cheap facts that differ between data sets: the
    dataset's name and config, and for the source of its stream the number of shards and
    the first shard (a ``Dataset`` shard's own fingerprint and length, else its name: a
    file, a generator argument). Nothing is read from the data. Its state (the position in
    each shard) is right only for the same shards: a resume with other ones is refused."""
    import hashlib
    facts: list = [getattr(ds.info, "dataset_name", None), getattr(ds.info, "config_name", None)]
    seen, todo = set(), [getattr(ds, "_ex_iterable", None)]
    while todo:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        kids = [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or ())]
        if not any(k is not None for k in kids):   # a source of the stream
            facts.append(type(node).__name__)
            for key, value in sorted((getattr(node, "kwargs", None) or {}).items()):
                if isinstance(value, (list, tuple)) and value:
                    first = value[0]
                    name = getattr(first, "_fingerprint", None)
                    name = f"{name}/{len(first)}" if name is not None else repr(first)[:300]
                    facts.append((key, len(value), name))
        todo.extend(k for k in kids if k is not None)
    digest = hashlib.sha256(repr(facts).encode()).hexdigest()[:16]
    n = getattr(ds, "ember_num_shards", None)
    return {"num_shards": int(n if n is not None else ds.num_shards), "fingerprint": digest}
