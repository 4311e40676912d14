"""What a checkpoint records about the training data, and the checks on resume.

A mid-epoch resume skips the batches the epoch already trained, by index. That is
exact only when the data is what it was: the same batch size per process and the
same dataset length (otherwise samples are skipped or trained twice), and the same
order (a user's sampler with its own generator gets its epoch-start state back; a
sampler drawing from the global RNG cannot, and is warned about). A changed batch
size or dataset length is refused unless ``EMBER_ALLOW_DATA_CHANGE=1`` is set (then
warned); under several processes rank 0's environment decides for every rank, and a
rank whose loader changed refuses for all (``Trainer`` agrees the resume checks once,
``ember.checkpoint.agree``). At an epoch end nothing is skipped or repeated: any change
is accepted.
"""
from __future__ import annotations

import os
import warnings

from ember.data import sampling as edata
from ember.data.resume import ALLOW_DATA_CHANGE_ENV, allow_data_change  # noqa: F401  (re-exported)
from ember.errors import CheckpointError


def batch_size_of(dl) -> int | None:
    """Samples per batch of this process's train loader (None: no automatic batching)."""
    from ember.data.resume import batch_size_of as of
    return of(dl)


def data_state(t) -> dict:
    """The train data's shape and order state, saved in ``trainer_state.pt["data"]``: batch
    size, dataset length (and a Hugging Face stream's shards and fingerprint,
    :func:`ember.data.resume.shape`), the class of the index sampler and a user sampler's
    generator (its state at the start of the current epoch,
    :func:`ember.data.generator_checkpoint_state`). A CombinedLoader records the shape of
    each of its loaders under ``members``."""
    from ember.data import resume
    dl = t.state.train_dataloader
    out = {**resume.shape(dl), "sampler": type(edata.index_sampler(dl)).__name__, "generator_state": None,
           **edata.generator_checkpoint_state(dl)}
    # the global batch and the position in the epoch's global order (the order that does not
    # depend on the number of processes): what a resume on another number of processes keeps (reshard)
    bs, done = out["batch_size"], t.state.state_dict()["batches_done"]
    out["world_size"] = t.world_size
    out["data_replicas"] = replicas = data_replicas(t)
    if bs:
        out["global_batch"] = bs * replicas * t.accumulate_grad_batches
        out["samples_done"] = done * bs * replicas if _global_order(dl) else None
    sampler = edata.index_sampler(dl)
    if isinstance(sampler, edata.LengthGroupedSampler):
        out["group_size"] = sampler.group
    if getattr(dl, "ember_combined", False):   # a CombinedLoader: each loader's shape and sampler generator
        out["inner_generators"] = [edata.generator_checkpoint_state(x) for x in dl.flattened]
        out["members"] = [dict(resume.shape(x), name=n) for x, n in zip(dl.flattened, dl.ember_names())]
    return out


def data_replicas(t) -> int:
    """How many processes read different data: the sampler's ``num_replicas`` (the
    data-parallel size; the ranks of one tensor-parallel group read the same batches)."""
    kw = t.strategy.distributed_sampler_kwargs() or {}
    return int(kw.get("num_replicas", 1))


def restore_data(t, saved: dict | None, path: str, allow_change: bool = False, resharded: bool = False) -> None:
    """Check the train data against what ``path`` recorded, and give a user sampler's
    generator its saved state. Checkpoints written before ``data`` was recorded pass.
    ``allow_change``: accept a changed batch size / dataset length mid-epoch with a
    warning (``EMBER_ALLOW_DATA_CHANGE=1``, as rank 0 read it). ``resharded``: the
    position was carried to another number of processes (:func:`reshard`), in samples:
    the batch size per process may differ."""
    if not saved:
        return
    dl, ls = t.state.train_dataloader, t.state
    if ls.batches_done > 0:
        _check_shape(dl, {k: v for k, v in saved.items() if k != "batch_size"} if resharded else saved, path, ls,
                     allow_change)
        sampler = edata.index_sampler(dl)
        name = type(sampler).__name__
        if saved.get("sampler") and sampler is not None and saved["sampler"] != name:
            warnings.warn(
                f"resuming {path} mid-epoch (epoch {ls.epoch}, {ls.batches_done} batches done): the train dataloader's "
                f"sampler was a {saved['sampler']} and is now a {name}, so the batches skipped are not the ones "
                "trained (samples of this epoch may repeat or be left out). Resume with the sampler the checkpoint "
                f"was saved with{_grouping_hint(saved['sampler'], name)}, or from a checkpoint saved at an epoch end",
                UserWarning, stacklevel=5)
        elif edata.draws_global_rng(sampler):
            warnings.warn(
                f"resuming {path} mid-epoch: the train dataloader's {name} draws its order from "
                "the global random generator, so the rest of this epoch is drawn anew (some samples of the epoch "
                f"may repeat or be left out). Pass {name}(..., generator=torch.Generator()"
                ".manual_seed(seed)) for an exact mid-epoch resume, or save checkpoints at epoch ends",
                UserWarning, stacklevel=5)
    # checkpoints written before generator_epoch was recorded hold the state of the loop's
    # epoch: its start when saved mid-epoch or after its last batch, else the state it starts from
    edata.restore_generator(dl, saved, legacy_epoch=ls.epoch, where=f"{path} (trainer_state.pt)")
    inner = saved.get("inner_generators")
    if getattr(dl, "ember_combined", False) and isinstance(inner, list) and len(inner) == len(dl.flattened):
        for x, s in zip(dl.flattened, inner):
            edata.restore_generator(x, s or {}, legacy_epoch=ls.epoch, where=f"{path} (trainer_state.pt)")


def _grouping_hint(saved: str, now: str) -> str:
    """Which argument of ember's text data chose the sampler, when grouping changed (the
    default of TextClassificationData follows the module: grouped for full fine-tuning,
    random for adapters)."""
    grouped = edata.LengthGroupedSampler.__name__
    if grouped not in (saved, now):
        return ""
    return (f" (TextClassificationData / CausalLMData: group_by_length={saved == grouped}"
            " gives the checkpoint's sampler)")


def _check_shape(dl, saved: dict, path: str, ls, allow_change: bool) -> None:
    from ember.data import resume
    changed = resume.shape_changes(saved, resume.shape(dl))
    what = resume.describe_changes(changed)
    members = saved.get("members")
    if getattr(dl, "ember_combined", False) and isinstance(members, list) and len(members) == len(dl.flattened):
        for x, name, rec in zip(dl.flattened, dl.ember_names(), members):
            more = resume.shape_changes(rec, resume.shape(x))
            if more:
                changed += more
                what = ", ".join(w for w in (what, resume.describe_changes(more, f"loader {name!r}: ")) if w)
    if not changed:
        return
    hard = [k for k, _, _ in changed if k not in resume.SOFT_SHAPE]
    bs = resume.batch_size_of(dl) or 1
    if hard:
        effect = ("its position (a place in each shard of a Hugging Face IterableDataset) belongs to other "
                  "shards, so samples would be trained twice or left out")
    elif getattr(dl, "ember_combined", False):
        effect = ("each loader's resumed pass skips its batches of the new data, not the ones trained, so "
                  "samples are skipped or trained twice")
    else:
        effect = (f"the resumed epoch skips the first {ls.batches_done} batches of the new setup "
                  f"({ls.batches_done * bs} samples, where the run trained "
                  f"{ls.batches_done * (saved.get('batch_size') or bs)}"
                  " samples of another order), so samples are skipped or trained twice")
    if allow_change and not hard:
        warnings.warn(f"resuming {path} mid-epoch (epoch {ls.epoch}, {ls.batches_done} batches done) with a changed "
                      f"train dataloader ({what}), accepted because {ALLOW_DATA_CHANGE_ENV}=1: {effect}",
                      UserWarning, stacklevel=6)
        return
    fix = ("Resume with the dataset and num_shards the checkpoint was saved with, or from a checkpoint saved at an "
           "epoch end" if hard else
           "Resume with the batch size and dataset the checkpoint was saved with, resume from a checkpoint saved at "
           f"an epoch end, or set {ALLOW_DATA_CHANGE_ENV}=1 to accept it (with a warning)")
    raise CheckpointError(
        f"{path} was saved mid-epoch (epoch {ls.epoch}, {ls.batches_done} batches done) and the train dataloader "
        f"changed since ({what}): {effect}. {fix}")


def _divisor_hint(global_batch: int, batch_size: int, world_size: int) -> str:
    """Process counts and batch sizes per process that divide ``global_batch``."""
    procs = [p for p in range(1, global_batch // max(batch_size, 1) + 1) if (global_batch // batch_size) % p == 0] \
        if global_batch % batch_size == 0 else []
    sizes = [b for b in range(1, global_batch // world_size + 1) if (global_batch // world_size) % b == 0] \
        if global_batch % world_size == 0 else []
    hints = []
    if procs:
        hints.append(f"{' or '.join(map(str, procs[-4:]))} process(es) at batch size {batch_size}")
    if sizes:
        hints.append(f"batch size {' or '.join(map(str, sizes[-4:]))} per process on {world_size} processes")
    return " or ".join(hints) if hints else f"a batch size per process x processes that divides {global_batch}"


def _global_order(dl) -> bool:
    """Whether the batches of ``dl`` on every process cut one order that does not depend on
    the number of processes (process ``r`` of ``n`` takes items ``r, r+n, ...``): an
    index-based loader (ember's sampler, a user's sampler sharded by ember), or a stream
    without state read without DataLoader workers (:class:`~ember.data.ShardedIterable`
    interleaves it the same way; a resumed pass replays it)."""
    from torch.utils.data import DataLoader, IterableDataset

    from ember.data import resume
    from ember.data.stateful import is_hf_iterable
    kind = resume.kind_of(dl)
    if kind == resume.INDEX:
        return True
    return kind == resume.REPLAY and isinstance(dl, DataLoader) and isinstance(dl.dataset, IterableDataset) \
        and not int(getattr(dl, "num_workers", 0) or 0) and not is_hf_iterable(resume._dataset(dl))


def _carried_stream(dl) -> bool:
    """Whether a mid-epoch position in ``dl`` is carried to another number of processes
    shard by shard: a Hugging Face IterableDataset read without DataLoader workers, whose
    state is the dataset's own or, in torchdata's StatefulDataLoader, the loader's with the
    dataset's inside (:func:`ember.data.stateful.hf_reshard`)."""
    from ember.data import resume
    from ember.data.stateful import is_hf_iterable, is_stateful_loader_class
    if resume.kind_of(dl) != resume.STATE or not is_hf_iterable(resume._dataset(dl)):
        return False
    holder = resume.state_holder(dl)
    return holder is resume._dataset(dl) or (holder is dl and is_stateful_loader_class(dl)
                                             and not int(getattr(dl, "num_workers", 0) or 0))


def _keep_group_size(dl, saved: dict) -> None:
    """A :class:`~ember.data.LengthGroupedSampler` keeps the group size the checkpoint's
    run grouped by (its global batch, which a resume on another number of processes keeps:
    the order of the run it continues)."""
    sampler = edata.index_sampler(dl)
    if isinstance(sampler, edata.LengthGroupedSampler) and saved.get("group_size"):
        sampler.group_size = int(saved["group_size"])


def reshard(t, state: dict, path: str) -> str | None:
    """Carry a checkpoint saved by another number of processes over to this one.

    * The global batch is kept: ``accumulate_grad_batches`` not given, it becomes the
      recorded global batch / (batch size per process x processes); when no whole number
      does, the resume is refused (:class:`CheckpointError` naming both global batches and
      the fix). Given, it wins, with a warning when the global batch changes.
    * The position: the samples of the epoch's global order already trained, counted at the
      start of the accumulation window the save fell in (a partly accumulated window is
      replayed from its start: its gradients belong to the old processes' shards, and the
      weights and optimizer did not change within it, so the replay gives the same step).
      The batch count of the epoch becomes that many samples in batches of the new
      processes; every process's sampler slices the same global order, so the rest of the
      epoch is trained once, its padding recomputed for the new number of processes.
      Index-based loaders, and streams without state read without workers (replayed to the
      new batch count, with the replay warning). A Hugging Face IterableDataset read without
      workers counts the same way, and its shards' positions are carried to the processes
      that now read them (:func:`restore_position`); another loader with its own
      per-process state is refused there.
    * A :class:`~ember.data.LengthGroupedSampler` keeps the checkpoint's group size (the
      order of the run it continues); on the checkpoint's number of processes too, with
      its batch size (a run that was itself resumed on another number of processes).

    Returns the sentence the restore line adds, or None when the number of processes is
    the checkpoint's (then nothing changes: same-size resumes stay bit-exact), and where
    nothing is carried over (no automatic batching, a CombinedLoader, DeepSpeed, whose
    engine fixed its accumulation at setup): the world-size warning then says so."""
    from ember.data import resume
    t.state.reshard_stream = None   # set below when a stream's shard positions are carried
    saved, loop = state.get("data") or {}, state.get("loop") or {}
    # processes that read different data (the data-parallel size; the world size in checkpoints
    # written before it was recorded, which had no tensor-parallel resumes of this kind)
    old_w = int(saved.get("data_replicas") or saved.get("world_size") or len(state.get("rng") or []) or t.world_size)
    new_w = data_replicas(t)
    dl = t.state.train_dataloader
    old_b, new_b = saved.get("batch_size"), resume.batch_size_of(dl)
    if old_w == new_w and old_b and old_b == new_b:
        _keep_group_size(dl, saved)   # a run resumed before on another number of processes keeps its groups
    if old_w == new_w or not old_b or not new_b or getattr(dl, "ember_combined", False) \
            or getattr(t.strategy, "owns_optimizer_step", False):   # DeepSpeed configured its accumulation at setup
        return None
    old_a = int(loop.get("accumulate_grad_batches") or 1)
    glob = int(saved.get("global_batch") or old_b * old_w * old_a)
    per = new_b * new_w
    if getattr(t, "accumulate_given", True):
        acc = t.accumulate_grad_batches
        if per * acc != glob and t.is_global_zero:
            warnings.warn(f"resuming {path} (saved by {old_w} process(es)) on {new_w} with accumulate_grad_batches={acc} "
                          f"as given: the global batch is now {per * acc} samples per optimizer step ({new_b} per "
                          f"process x {new_w} x {acc}), where the checkpoint was trained with {glob}; the learning-rate "
                          f"schedule was written for {glob}. Leave accumulate_grad_batches out to keep {glob}",
                          UserWarning, stacklevel=5)
    else:
        if glob % per:
            raise CheckpointError(
                f"{path} was trained with a global batch of {glob} samples per optimizer step ({old_b} per process x "
                f"{old_w} process(es) x accumulate_grad_batches={old_a}); this run has {new_b} per process x {new_w} "
                f"processes = {per} per micro-batch, and no whole accumulate_grad_batches gives {glob}. Resume with "
                f"{_divisor_hint(glob, new_b, new_w)}, or pass Trainer(accumulate_grad_batches=N) to train on with a "
                f"global batch of {per} x N (the learning-rate schedule was written for {glob})")
        acc = glob // per
        t.accumulate_grad_batches = acc
        if t.step_rules is not None:
            t.step_rules.accumulation_steps = acc
    _keep_group_size(dl, saved)
    st = t.state
    done = st.batches_done
    carried = done and _carried_stream(dl)
    if done and (_global_order(dl) or carried):
        window_start = done - done % old_a
        position = window_start * old_b * old_w   # samples of the epoch's global order trained
        if position % per:
            raise CheckpointError(
                f"{path} was saved after {position} samples of epoch {st.epoch} (in the order every number of "
                f"processes shares); this run's {new_b} per process x {new_w} processes = {per} samples per "
                f"micro-batch does not divide it, so the rest of the epoch cannot start at a batch boundary. "
                f"Resume with {_divisor_hint(position, new_b, new_w)}, or from a checkpoint saved at an epoch end")
        st.batches_done = position // per
        st.batch_idx = max(st.batches_done - 1, 0)
        if carried:   # each old process had read window_start batches of its shards (restore_position)
            st.reshard_stream = (old_w, window_start * old_b)
    return (f"Saved by {old_w} process(es), resumed by {new_w}: accumulate_grad_batches={acc} "
            f"{'keeps' if per * acc == glob else 'changes'} the global batch of {glob} samples per optimizer step"
            f"{'' if per * acc == glob else f' to {per * acc}'} ({new_b} per process x {new_w} x {acc}).")


def data_position(t, done: int) -> dict | None:
    """This rank's position in its train loader beyond the batch count, for
    ``trainer_state.pt["data_position"]`` (:func:`ember.data.resume.position`): after
    ``done`` batches of the current epoch (0: at an epoch's end). A position restored
    from a checkpoint and not yet used (saved again before the resumed pass began) is
    recorded as it is."""
    from ember.data import resume
    st = t.state
    if st.data_position is not None:
        return resume.as_saved(st.data_position)
    if st.train_dataloader is None:
        return None
    return resume.position(st.train_dataloader, st.train_pass, done)


def _holds_state(pos) -> bool:
    """Whether a recorded position holds a loader's own state (a stateful loader's, or one
    of a CombinedLoader's loaders')."""
    if not isinstance(pos, dict):
        return False
    if pos.get("kind") == "state" and pos.get("state") is not None:
        return True
    return any(_holds_state(x.get("pos")) for x in pos.get("inner") or [] if isinstance(x, dict))


def restore_position(t, saved: list | None, path: str) -> None:
    """Keep this rank's saved train-data position for the resumed pass
    (``trainer.state.data_position``). Saved mid-epoch by another number of processes, the
    positions belong to other shards: a loader's own state (a stateful loader, a Hugging
    Face stream, torchdata's StatefulDataLoader) is refused, naming the loader and both
    numbers of processes (its per-process states cannot be split or merged); a loader
    without one (a stream, a CombinedLoader of index-based loaders) replays the batches
    already trained, with a warning."""
    st = t.state
    st.data_position = None
    if not saved:
        return
    if len(saved) != t.world_size:
        if st.batches_done and any(_holds_state(p) for p in saved):
            from ember.data import resume
            why = ("those states cannot be split or merged over "
                   f"{t.world_size} process(es) without training samples twice or leaving some out")
            if st.reshard_stream is not None:
                try:
                    return _carry_stream(t, saved, path)
                except ValueError as err:
                    why = f"its shards' positions cannot be carried to {t.world_size} process(es): {err}"
            raise CheckpointError(
                f"{path} was saved mid-epoch (epoch {st.epoch}, {st.batches_done} batches done) by {len(saved)} "
                f"process(es) and is resumed by {t.world_size}: the train dataloader "
                f"({resume.describe(st.train_dataloader)}) records its position per process (its state_dict(): a "
                f"place in the old processes' shards), and {why}. Resume on "
                f"{len(saved)} process(es), or from a checkpoint saved at an epoch end (which any number of "
                "processes continues)")
        if st.batches_done and any(p for p in saved) and t.is_global_zero:
            warnings.warn(f"resuming {path} mid-epoch with {t.world_size} process(es): it was saved by {len(saved)}, "
                          "so the positions its ranks recorded in their train loaders (the states of stateful "
                          "loaders) belong to other shards and are not used; the resumed epoch replays its first "
                          f"{st.batches_done} batches instead (not exact)", UserWarning, stacklevel=5)
        return
    from ember.data import resume
    # loaded now: a state the loader refuses raises where the ranks agree on the restore
    st.data_position = resume.apply_position(st.train_dataloader, saved[t.global_rank], st.batches_done,
                                             f"{path} (trainer_state.pt)")


def _carry_stream(t, saved: list, path: str) -> None:
    """A Hugging Face IterableDataset saved mid-epoch by another number of processes
    (:func:`reshard` counted the examples each old process had read): this process's state
    is rebuilt from the shards' positions (:func:`ember.data.stateful.hf_reshard`) and
    loaded, so every example of the epoch not read yet is read by the process that now
    reads its shard. Those processes are left different numbers of examples; their steps
    must pair up, so every process ends the epoch after the smallest number of batches
    (``TrainerState.epoch_batches``, computed alike on every rank from the checkpoint and
    the shards: no collective), as ranks with loaders of different lengths do
    (``checks.agree_train_batches``); a warning on rank 0 names the examples left out.
    Raises ValueError with the reason when the position cannot be carried."""
    from ember.data import resume
    from ember.data.stateful import batches_of, hf_reshard
    st, dl = t.state, t.state.train_dataloader
    old_w, consumed = st.reshard_stream
    if st.epoch_batches is not None:   # restored from the checkpoint's loop position
        raise ValueError("the epoch it was saved in was itself resumed on another number of processes, so its "
                         "processes did not read their shards from the epoch's start and the samples read of each "
                         "shard do not follow from the samples trained")
    first = next((p for p in saved if isinstance(p, dict) and p.get("kind") == resume.STATE), None) or {}
    old = first.get("state") or {}
    old = old.get("dataset_state") or old if isinstance(old, dict) else {}   # inside a StatefulDataLoader's
    state, left = hf_reshard(resume._dataset(dl), old_w, consumed, old, t.global_rank, t.world_size)
    bs = resume.batch_size_of(dl) or 1
    if resume.state_holder(dl) is dl:   # torchdata's StatefulDataLoader without workers: its state around it
        done = st.batches_done
        state = dict(dl.state_dict(), dataset_state=state, _num_yielded=done, _sampler_iter_yielded=done,
                     _sampler_iter_state={"samples_yielded": done * bs})
    batches = [batches_of(n, bs, bool(getattr(dl, "drop_last", False))) for n in left]
    ends = min(batches)
    st.epoch_batches = st.batches_done + ends
    if ends != max(batches) and t.is_global_zero:
        trained = sum(min(n, ends * bs) for n in left)
        shown = ", ".join(f"rank {r}: {n}" for r, n in enumerate(left))
        warnings.warn(
            f"resuming {path} mid-epoch (epoch {st.epoch}) on {t.world_size} process(es), saved by {old_w}: each shard "
            "of the Hugging Face IterableDataset continues where it was, on the process that now reads it, which "
            f"leaves the processes different numbers of examples of this epoch ({shown}). Their steps must pair up, "
            f"so every process trains {ends} more batch(es) of it, the smallest, and {sum(left) - trained} "
            "example(s) of this epoch are left out (the next epochs read every example). Save at an epoch end, or "
            f"resume on {old_w} process(es), to train them", UserWarning, stacklevel=6)
    st.data_position = resume.apply_position(dl, {"kind": resume.STATE, "state": state}, st.batches_done,
                                             f"{path} (trainer_state.pt)")
