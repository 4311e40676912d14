"""Where a pass over a train loader stands, and how a resumed pass continues from there:
one implementation for the Trainer (``ember/trainer/loops.py``, ``checkpoint.py``) and the
Accelerator (:class:`ember.data.loader.DataLoaderShard`, ``ember/accelerator/checkpoint.py``).

A prepared train loader is of one of four kinds (:func:`kind_of`):

``index``
    a map-style loader around ember's sampler (or a user's sampler): a resumed pass
    skips the batches already trained *by index*, reading no data
    (:func:`ember.data.sampling.skip_batches`). Nothing is recorded per step.
``state``
    something in the loader holds its position (:func:`state_holder`): a torchdata
    ``StatefulDataLoader`` (which records its dataset's and sampler's state, in each
    DataLoader worker, with every batch), any other loader object with
    ``state_dict()`` / ``load_state_dict()``, or the dataset itself of a DataLoader
    without workers. A checkpoint records that state after the last batch trained (per
    rank); a resumed pass loads it and continues, reading nothing again.
``replay``
    a stream with no state (an ``IterableDataset`` without ``state_dict``), or one
    whose state does not hold everything (a Hugging Face ``IterableDataset`` with a
    shuffle buffer): a resumed pass reads the batches already trained again and
    discards them, with the global random streams kept as they were, and warns with
    the time it took. Exact when the stream yields the same items in the same order
    on every pass (seed its shuffling); a stream that does not cannot be resumed
    exactly, and the warning says so.
``combined``
    a :class:`~ember.data.combined.CombinedLoader`: each of its loaders resumes by its
    own kind at its own position.

When something reads ahead of the loop (gradient accumulation over a loader of unknown
length looks ``accumulate_grad_batches - 1`` batches ahead; CUDA prefetch one), the
state of a ``state`` loader is recorded with every batch it yields, and a checkpoint
takes the one of the last batch the loop trained; otherwise it is read when the
checkpoint is written. At an epoch's end nothing of the pass is needed (the next pass
starts afresh, as in the uninterrupted run), except the state of a stateful dataset
read in the main process, which carries over into the next pass as it does there.
"""
from __future__ import annotations

import collections
import time
import warnings
from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset

from ember.data.sampling import ShardedIterable, sampler_of, skip_batches
from ember.data.stateful import hf_shuffle_buffer, is_hf_iterable, is_stateful, is_stateful_loader_class

INDEX, STATE, REPLAY, COMBINED = "index", "state", "replay", "combined"


def _dataset(dl: Any) -> Any:
    """The user's dataset of a loader (below ember's :class:`ShardedIterable`)."""
    ds = getattr(dl, "dataset", None)
    return ds.dataset if isinstance(ds, ShardedIterable) else ds


def _user_state(dl: Any) -> bool:
    """Whether the dataset or the user's sampler of a DataLoader holds a state."""
    if is_stateful(_dataset(dl)):
        return True
    s = getattr(dl, "sampler", None)
    from ember.data.sampling import ResumableSampler
    return not isinstance(dl.dataset, IterableDataset) and is_stateful(s) and not isinstance(s, ResumableSampler)


def state_holder(dl: Any) -> Any:
    """The object whose ``state_dict()`` is where a pass over ``dl`` stands, or None: the
    loader itself when it is a torchdata ``StatefulDataLoader`` whose dataset or sampler
    holds a state, or any other loader with ``state_dict()`` / ``load_state_dict()`` (a
    DataLoader subclass of the user's included); the dataset of a plain DataLoader
    without workers (its position is the dataset's own, batch by batch)."""
    if getattr(dl, "ember_combined", False):
        return None
    if isinstance(dl, DataLoader):
        if is_stateful_loader_class(dl):
            return dl if _user_state(dl) else None
        if is_stateful(dl):   # a DataLoader subclass with its own state, used as given
            return dl
        if not int(getattr(dl, "num_workers", 0) or 0) and is_stateful(dl.dataset):
            return dl.dataset
        return None
    return dl if is_stateful(dl) else None


def kind_of(dl: Any) -> str:
    """``"index"``, ``"state"``, ``"replay"`` or ``"combined"`` (see the module docstring)."""
    if getattr(dl, "ember_combined", False):
        return COMBINED
    if state_holder(dl) is not None:
        ds = _dataset(dl)
        if is_hf_iterable(ds) and hf_shuffle_buffer(ds):
            return REPLAY
        return STATE
    if sampler_of(dl) is not None:
        return INDEX
    return REPLAY


def describe(dl: Any) -> str:
    """A short name of the data behind ``dl``, for messages."""
    ds = _dataset(dl)
    if ds is None:
        return type(dl).__name__
    return f"{type(dl).__name__} over {type(ds).__module__.split('.')[0]}.{type(ds).__name__}" \
        if is_hf_iterable(ds) else f"{type(dl).__name__} over {type(ds).__name__}"


def _kept_rng():
    from ember.checkpoint.rng import keep_rng_states
    return keep_rng_states()


class TrainPass:
    """One pass over a train loader of kind ``state`` or ``replay`` (see the module
    docstring), started at batch ``start`` with the position ``saved`` a checkpoint
    recorded (None: none). Iterating it iterates the loader from there; :meth:`position`
    is what a checkpoint records after ``done`` batches. ``read_ahead``: how many batches
    the consumer may read ahead of the batches trained (then the state is recorded with
    every batch). ``warn``: this process warns about a replay (rank 0)."""

    def __init__(self, loader: Any, start: int = 0, saved: dict | None = None, *, read_ahead: int = 0,
                 warn: bool = True) -> None:
        self.loader, self.kind, self.start = loader, kind_of(loader), int(start)
        self.saved, self.warn = saved, warn
        self.holder = state_holder(loader) if self.kind == STATE else None
        self.read_ahead = int(read_ahead)
        self.produced = self.start
        self.replayed: tuple[int, float] | None = None   # (batches read again, seconds) of the last resume
        self._states: collections.deque = collections.deque(maxlen=self.read_ahead + 4)

    def __iter__(self) -> Iterator[Any]:
        it = self.open()
        holder, record = self.holder, self.holder is not None and self.read_ahead > 0
        try:
            for batch in it:
                self.produced += 1
                if record:
                    self._states.append((self.produced, holder.state_dict()))
                yield batch
        finally:
            release(self.loader, it)

    def open(self) -> Iterator[Any]:
        """The loader's iterator, at batch ``start`` (loading the saved state, or reading
        the batches before ``start`` again). A resumed pass draws nothing from the global
        random streams here: the checkpoint restored them past its start."""
        start, saved = self.start, self.saved
        self.saved = None
        self.produced = start
        if not start:
            if self.kind == STATE and (saved or {}).get("state") is not None:
                self.holder.load_state_dict(saved["state"])   # after its last batch: the next pass follows it
            else:
                restore_boundary(self.loader, saved)
            return iter(self.loader)
        with _kept_rng():
            state = (saved or {}).get("state") if self.kind == STATE else None
            if state is not None:
                if not saved.get("applied"):   # (apply_position loaded it at the restore)
                    self.holder.load_state_dict(state)
                return iter(self.loader)
            it = iter(self.loader)
            t0 = time.perf_counter()
            n = 0
            for _ in range(start):
                if next(it, _END) is _END:
                    break
                n += 1
            self.replayed = (n, time.perf_counter() - t0)
        if self.warn or self.kind == STATE:   # a stateful loader without its state: on the rank it happens
            warnings.warn(replay_message(self.loader, self.kind, start, n, self.replayed[1], saved),
                          UserWarning, stacklevel=4)
        return it

    def state_now(self) -> Any:
        """The holder's state after the batches yielded so far (None: nothing yielded)."""
        if self.holder is None or self.produced == 0:
            return None
        return self.holder.state_dict()

    def position(self, done: int) -> dict:
        """What a checkpoint records of this pass after ``done`` of its batches were trained."""
        if self.holder is None:
            return {"kind": self.kind}
        if self.read_ahead and done != self.produced:
            state = next((s for n, s in reversed(self._states) if n == done), None)
            if state is None:
                return {"kind": REPLAY}   # not recorded (should not happen): replay on resume
        else:
            state = self.state_now()
        return {"kind": STATE, "state": state}


_END = object()


def release(loader: Any, it: Any) -> None:
    """A pass left before its end (a limit, a stop, a loop that returned): shut down the
    DataLoader workers of its iterator when the loader keeps that iterator (a
    StatefulDataLoader does, for its state); otherwise they would live on until the loader
    is collected, and a later fork would copy them (its state is still readable)."""
    if getattr(loader, "_iterator", None) is it and not getattr(loader, "persistent_workers", False) \
            and callable(getattr(it, "_shutdown_workers", None)):
        it._shutdown_workers()


def replay_message(loader: Any, kind: str, start: int, got: int, seconds: float, saved: dict | None) -> str:
    """The warning of a resumed pass that read its first ``start`` batches again."""
    what = describe(loader)
    ds = _dataset(loader)
    if kind == STATE:
        why = ("the checkpoint holds no state for it (saved by another number of processes, or by a save on the "
               "main process only)")
        fix = "resume with the setup the checkpoint was saved with"
    elif is_hf_iterable(ds) and hf_shuffle_buffer(ds):
        why = ("it shuffles through a buffer (.shuffle(seed, buffer_size)), and its state_dict() does not hold the "
               "buffer's content (a resume from it would refill the buffer with other samples)")
        fix = "shuffle without a buffer (Dataset.shuffle(seed) before to_iterable_dataset) to resume from its state"
    else:
        why = "it has no state_dict()/load_state_dict() to resume from"
        fix = ("give the dataset state_dict()/load_state_dict() (or use torchdata's StatefulDataLoader) to resume "
               "from its state instead")
    short = f" (the stream ended after {got})" if got < start else ""
    return (f"resuming mid-epoch: the train dataloader ({what}) was replayed to batch {start}: {got} batch(es) "
            f"read again and discarded in {seconds:.2f} s{short}, because {why}. The resume is exact only when "
            "the stream yields the same items in the same order on every pass (a shuffle seeded with a fixed "
            f"seed); a stream that does not (reading a changing source, unseeded randomness) continues with other "
            f"samples than the uninterrupted run would. To avoid the replay, {fix}")


def end_pass(loader: Any) -> None:
    """A training pass over ``loader`` is over, to its end or not: shut down the workers of
    an iterator the loader keeps (:func:`release`; a CombinedLoader's pass does it for its
    loaders)."""
    release(loader, getattr(loader, "_iterator", None))


# -- epoch boundaries -------------------------------------------------------------------------------
def _main_dataset_holder(loader: Any) -> Any:
    """A stateful dataset read in the main process (a DataLoader without workers): its
    state carries over from one pass into the next."""
    if not isinstance(loader, DataLoader) or int(getattr(loader, "num_workers", 0) or 0):
        return None
    ds = _dataset(loader)
    return ds if is_stateful(ds) else None


def boundary_position(loader: Any) -> dict | None:
    """What a checkpoint at an epoch's end records: the state of a stateful dataset read in
    the main process (its next pass continues from it, in the uninterrupted run too); None
    for everything else (the next pass starts afresh)."""
    if getattr(loader, "ember_combined", False):
        return loader.ember_boundary()
    ds = _main_dataset_holder(loader)
    return {"kind": "boundary", "dataset": ds.state_dict()} if ds is not None else None


def restore_boundary(loader: Any, saved: dict | None) -> None:
    """Give a pass that starts at its first batch what :func:`boundary_position` recorded."""
    if not saved or saved.get("kind") != "boundary":
        return
    ds = _main_dataset_holder(loader)
    if ds is not None and saved.get("dataset") is not None:
        ds.load_state_dict(saved["dataset"])


def apply_position(loader: Any, saved: dict | None, start: int, where: str) -> dict | None:
    """Load the state a checkpoint recorded (:func:`position`) into the loader now, at the
    restore, for a pass that resumes at batch ``start``: a state the loader (or one of a
    CombinedLoader's) refuses raises here, where the ranks agree on the outcome of a
    resume (``ember.checkpoint.agree``), instead of on one rank at its first batch while
    the others wait in a collective. Returns the position, marked as loaded (the pass
    then does not load it again); a CheckpointError names ``where`` and the loader."""
    if not saved or not start:
        return saved

    def load(dl: Any, pos: dict | None) -> dict | None:
        if not pos or pos.get("kind") != STATE or pos.get("state") is None or kind_of(dl) != STATE:
            return pos
        try:
            state_holder(dl).load_state_dict(pos["state"])
        except Exception as err:
            from ember.errors import CheckpointError
            raise CheckpointError(f"{where}: the train dataloader ({describe(dl)}) refused the state the checkpoint "
                                  f"recorded for it: {type(err).__name__}: {err}. Resume with the data the "
                                  "checkpoint was saved with, or from a checkpoint saved at an epoch end") from err
        return dict(pos, applied=True)
    if getattr(loader, "ember_combined", False):
        if saved.get("kind") != "combined" or len(saved.get("inner") or []) != len(loader.flattened):
            return saved
        inner = [dict(x, pos=load(dl, x.get("pos"))) if (saved.get("mode") != "sequential" or
                                                          i == int(saved.get("current", 0))) else x
                 for i, (dl, x) in enumerate(zip(loader.flattened, saved["inner"]))]
        return dict(saved, inner=inner)
    return load(loader, saved)


def as_saved(pos: dict | None) -> dict | None:
    """A position restored and not used yet, as a checkpoint records it again (without the
    mark of :func:`apply_position`: the next restore loads it again)."""
    if not pos:
        return pos
    out = {k: v for k, v in pos.items() if k != "applied"}
    if isinstance(out.get("inner"), list):
        out["inner"] = [dict(x, pos=as_saved(x.get("pos"))) if isinstance(x, dict) else x for x in out["inner"]]
    return out


# -- what a position is right for: the data's shape ----------------------------------------------------
#: set to 1 to resume mid-epoch although the batch size or dataset length changed
ALLOW_DATA_CHANGE_ENV = "EMBER_ALLOW_DATA_CHANGE"


def allow_data_change() -> bool:
    """Whether this process's environment sets ``EMBER_ALLOW_DATA_CHANGE=1`` (under
    several processes the Trainer uses rank 0's answer on every rank)."""
    import os
    return os.environ.get(ALLOW_DATA_CHANGE_ENV, "0") == "1"


def batch_size_of(dl: Any) -> int | None:
    """Samples per batch of a prepared loader on this process (None: no automatic batching)."""
    bs = getattr(dl, "batch_size", None)
    if bs is None:
        bs = getattr(getattr(dl, "batch_sampler", None), "batch_size", None)
    return int(bs) if isinstance(bs, int) else None


def shape(dl: Any) -> dict:
    """What a position in ``dl`` is right for, recorded with it: the batch size per process
    and the dataset length (a resumed pass skips that many batches of that many samples),
    and for a Hugging Face ``IterableDataset`` its ``num_shards`` and a cheap
    ``fingerprint`` (its state is a position in each of those shards:
    :func:`ember.data.stateful.hf_identity`)."""
    from ember.data.sampling import dataset_length
    out = {"batch_size": batch_size_of(dl), "dataset_len": dataset_length(dl)}
    ds = _dataset(dl)
    if is_hf_iterable(ds):
        from ember.data.stateful import hf_identity
        out.update(hf_identity(ds))
    return out


#: the entries of :func:`shape` that ``EMBER_ALLOW_DATA_CHANGE=1`` may accept (a stream's
#: state applied to other shards is never right)
SOFT_SHAPE = ("batch_size", "dataset_len")


def shape_changes(saved: dict | None, now: dict) -> list[tuple[str, Any, Any]]:
    """The entries of :func:`shape` that differ between a checkpoint's record and ``now``
    (an entry either side did not record is not compared), as ``(key, saved, now)``."""
    saved = saved or {}
    return [(k, saved.get(k), now.get(k)) for k in ("batch_size", "dataset_len", "num_shards", "fingerprint")
            if saved.get(k) is not None and now.get(k) is not None and saved.get(k) != now.get(k)]


def check_shape(loader: Any, saved: dict, done: int, where: str, allow_change: bool = False) -> None:
    """Refuse to resume ``loader`` after ``done`` batches of a pass from a position recorded
    for data of another :func:`shape` (``saved``: the record), naming both values and the
    fix; ``allow_change`` (``EMBER_ALLOW_DATA_CHANGE=1``) accepts a changed batch size or
    dataset length with a warning, never a stream of other shards. Nothing is checked at a
    pass's start (``done == 0``): nothing is skipped or repeated."""
    changed = shape_changes(saved, shape(loader)) if done else []
    if not changed:
        return
    what = describe_changes(changed)
    hard = any(k not in SOFT_SHAPE for k, _, _ in changed)
    if hard:
        effect = ("its position (a place in each shard of a Hugging Face IterableDataset) belongs to other shards, "
                  "so samples would be trained twice or left out")
        fix = "resume with the dataset and num_shards it was saved with, or from a state saved at a pass's end"
    else:
        effect = (f"the resumed pass skips the first {done} batches of the new data, not the ones trained, so samples "
                  "are skipped or trained twice")
        fix = ("resume with the batch size and dataset it was saved with, from a state saved at a pass's end, or set "
               f"{ALLOW_DATA_CHANGE_ENV}=1 to accept it (with a warning)")
    if allow_change and not hard:
        warnings.warn(f"{where}: the dataloader ({describe(loader)}) changed since the save ({what}), accepted because "
                      f"{ALLOW_DATA_CHANGE_ENV}=1: {effect}", UserWarning, stacklevel=4)
        return
    from ember.errors import CheckpointError
    raise CheckpointError(f"{where}: the state was saved after {done} batches of a pass and the dataloader "
                          f"({describe(loader)}) changed since ({what}): {effect}. To fix it, {fix}")


def describe_changes(changes: list[tuple[str, Any, Any]], where: str = "") -> str:
    """``"batch size 8 -> 16, dataset len 64 -> 48"`` (prefixed with ``where``, a loader's name)."""
    return ", ".join(f"{where}{k.replace('_', ' ') if k in SOFT_SHAPE else k} {a} -> {b}" for k, a, b in changes)


# -- the entry points of the Trainer and the Accelerator ----------------------------------------------
def begin_pass(loader: Any, start: int, saved: dict | None, *, read_ahead: int = 0, warn: bool = True) -> Any:
    """Start a pass over a prepared train ``loader`` at batch ``start`` (0: a new pass),
    with ``saved``, the position a checkpoint recorded (:func:`position`; None: none).
    Returns what to iterate: ``loader`` itself for an index-based loader (its sampler now
    skips ``start`` batches: the per-step path is the plain loader's), else a
    :class:`TrainPass` (a combined loader's own pass for a CombinedLoader), which
    :func:`position` reads at a checkpoint."""
    kind = kind_of(loader)
    if kind == COMBINED:
        return loader.ember_begin(start, saved, read_ahead=read_ahead, warn=warn)
    if kind == INDEX:
        if start:
            skip_batches(loader, start)
        elif saved:
            restore_boundary(loader, saved)
        return loader
    return TrainPass(loader, start, saved, read_ahead=read_ahead, warn=warn)


def position(loader: Any, current: Any, done: int) -> dict | None:
    """What a checkpoint records of the train data's position, on this rank: ``current``
    is what :func:`begin_pass` returned for the pass in progress (or last run; None:
    none), ``done`` the batches of it trained, 0 at an epoch's end (see
    :func:`boundary_position`)."""
    if not done:
        return boundary_position(loader)
    if current is None or current is loader:   # index-based: the batch count is the position
        return None
    return current.position(done)
