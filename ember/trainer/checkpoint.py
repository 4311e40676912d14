"""A Trainer checkpoint: what it stores and restores (:func:`trainer_state`, one table;
docs/checkpointing.md), and finding one ("last", "best", an elastic restart's).
"""
from __future__ import annotations

import os
import re
import sys
import warnings

import torch

from ember.errors import CheckpointError, MisconfigurationError

STATE_VERSION = 1


# ----------------------------------------------------------------------------- save
def _cpu(v):
    return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v


def _results_state(results) -> list:
    """The epoch accumulators of the training stage (torchmetrics objects excluded)."""
    out = []
    for e in results.entries.values():
        if e.metric is not None:
            continue
        out.append({"name": e.name, "on_step": e.on_step, "on_epoch": e.on_epoch, "prog_bar": e.prog_bar,
                    "logger": e.logger, "reduce_fx": e.reduce_fx, "sync_dist": e.sync_dist,
                    "last": _cpu(e.last), "total": _cpu(e.total), "weight": e.weight, "updated": e.updated})
    return out


def _pending_grads(t):
    """Gradients of a partly accumulated window (None at a window boundary)."""
    if not t.state.grads_pending or t.state.epoch_finished:
        return None
    if t.strategy.is_sharded or t.strategy.owns_optimizer_step:
        warnings.warn(f"checkpoint saved inside a gradient accumulation window under the {t.strategy.name} "
                      "strategy: the partly accumulated gradients are not saved, so a resume from it is not "
                      "exact. Save at optimizer steps (ModelCheckpoint(every_n_train_steps=...)) instead.",
                      stacklevel=4)
        return None
    module = t.strategy.unwrap_module(t.model)
    return {n: _cpu(p.grad) for n, p in module.named_parameters() if p.grad is not None}


def trainer_state(t) -> dict:
    """``trainer_state.pt``: the loop state (``trainer.state.state_dict()``) and the state
    of the objects it names, each under its own key:

    ==================  ==========================================================
    ``loop``            the loop position and stop reason (TrainerState), with the
                        accumulation size and the epoch's batch count it was saved under
    ``schedulers``      each lr scheduler's state (after a deferred step is applied)
    ``precision``       the loss scaler's state
    ``callbacks``       each callback's ``state_dict()``, by ``state_key``
    ``rng``             every rank's RNG states (python, numpy, torch, cuda)
    ``results``         every rank's epoch accumulators of the training stage (mid-epoch:
                        the resumed epoch's values are those of an uninterrupted run)
    ``grads``           every rank's gradients of an open accumulation window
    ``callback_metrics`` the latest metrics callbacks monitor
    ``data_seed``       the seed of the data order
    ``data``            the train data's shape and a user sampler's generator (resume_data.py)
    ``data_position``   every rank's position in its train loader beyond the batch count: a
                        stateful loader's ``state_dict()``, a combined loader's positions
                        (``ember.data.resume``; None for an index-based loader)
    ``datamodule``      the datamodule's ``state_dict()``
    ==================  ==========================================================

    Optimizers are saved by the strategy (sharded under FSDP / DeepSpeed)."""
    from ember.checkpoint import io as cio
    from ember.trainer.resume_data import data_position, data_state
    t.step_rules.flush()   # a scheduler step deferred from the last optimizer step (16-mixed)
    st = t.state
    loop = st.state_dict()
    mid_epoch = loop["batches_done"] > 0
    per_rank = {"rng": cio.collect_rng_states(),
                "results": _results_state(t.metrics.results["train"]) if mid_epoch else [],
                "grads": _pending_grads(t),
                "position": data_position(t, loop["batches_done"])}
    gathered = t.strategy.all_gather_object(per_rank) if t.world_size > 1 else [per_rank]
    metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    return {
        "version": STATE_VERSION,
        "loop": {**loop, "accumulate_grad_batches": t.accumulate_grad_batches,
                 "num_training_batches": t.num_training_batches if t.num_training_batches != float("inf") else -1},
        "schedulers": [c["scheduler"].state_dict() for c in t.lr_scheduler_configs],
        "precision": t.strategy.precision.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks},
        "rng": [g["rng"] for g in gathered],
        "results": [g["results"] for g in gathered],
        "grads": [g["grads"] for g in gathered] if any(g["grads"] is not None for g in gathered) else None,
        "callback_metrics": metrics,
        "data_seed": st.data_seed,
        "data": data_state(t),   # batch size, dataset length, a user sampler's generator
        "data_position": [g["position"] for g in gathered],   # a stateful / stream / combined loader's, per rank
        "datamodule": t.datamodule.state_dict() if t.datamodule is not None else {},
    }


def checkpoint_meta(t) -> dict:
    from ember.checkpoint.trust import optimizer_names
    from ember.hparams import datamodule_meta
    m = t.module
    return {"strategy": t.strategy.name, "world_size": t.world_size, "precision": t.precision,
            "module_class": f"{type(m).__module__}.{type(m).__qualname__}",
            "hparams": dict(m.hparams), "epoch": t.current_epoch, "global_step": t.global_step,
            "optimizers": optimizer_names(t.optimizers), **datamodule_meta(t.datamodule)}


def save_checkpoint(t, path: str, weights_only: bool = False) -> None:
    """``trainer.save_checkpoint``: the strategy writes the weights, optimizers,
    :func:`trainer_state` and :func:`checkpoint_meta` atomically at ``path``."""
    from ember.trainer.checks import check_finite_at
    if t.model is None:
        raise MisconfigurationError("trainer.save_checkpoint() needs a fitted module: call fit() first")
    from ember.checkpoint.trust import check_save_target
    path = os.fspath(path)
    check_save_target(path, "trainer.save_checkpoint")   # every rank, read-only: no collective
    check_finite_at(t, f"before saving checkpoint {path}")
    state = {} if weights_only else trainer_state(t)
    if not weights_only:
        for cb in t.callbacks:
            cb.on_save_checkpoint(t, t.module, state)
        t.module.on_save_checkpoint(state)
    t.strategy.save_checkpoint(path, t.model, t.optimizers, state, checkpoint_meta(t), weights_only=weights_only)


# ----------------------------------------------------------------------------- find / check
def _version_key(name: str):
    m = re.fullmatch(r"version_(\d+)", name)
    return (1, int(m.group(1)), "") if m else (0, 0, name)


def _candidate_dirs(t) -> list[str]:
    """This run's checkpoint folders, most preferred first: the ModelCheckpoint dirpaths;
    else the first logger's ``checkpoints`` folder: of its version when one was given,
    else of each existing version of its name, newest version first (a logger of a run, such
    as MLflow's, first: its run's folder); without a logger, ``default_root_dir/checkpoints``.
    Other runs under the same root never count."""
    from ember.loggers.base import FileLogger, Logger
    dirs = [cb.dirpath for cb in t.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    first = t.loggers[0] if t.loggers else None
    if not dirs and first is not None and not isinstance(first, FileLogger) \
            and type(first).run_key is not Logger.run_key:
        dirs = [os.path.join(first.log_dir, "checkpoints")]   # the folder trainer.log_dir gives ModelCheckpoint
    if not dirs:
        loggers = [lg for lg in t.loggers if getattr(lg, "root_dir", None)]
        if not loggers:
            dirs = [os.path.join(t.default_root_dir, "checkpoints")]
        else:
            lg = loggers[0]
            version = getattr(lg, "_version", None)
            if version is not None:
                dirs = [os.path.join(lg.log_dir, "checkpoints")]
            elif os.path.isdir(lg.root_dir):
                versions = sorted(os.listdir(lg.root_dir), key=_version_key, reverse=True)
                dirs = [os.path.join(lg.root_dir, v, "checkpoints") for v in versions]
    return list(dict.fromkeys(os.path.normpath(d) for d in dirs))


def _saved_step(path: str) -> int | None:
    from ember.checkpoint import io as cio
    from ember.checkpoint.trust import member, read_meta
    try:
        step = read_meta(member(path, cio.META_NAME)).get("global_step")
    except CheckpointError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def find_last(t) -> str | None:
    """This run's newest complete checkpoint: the highest ``global_step`` in
    ``meta.json`` (not the modification time) in the first of :func:`_candidate_dirs`
    that has one; a real ``last`` directory (a preemption save) wins a tie, a ``last``
    symlink counts as (and is returned for) the checkpoint it points to. Staging ``*.ember-tmp`` (and older ``*.tmp``) folders and
    weights-only files never count. Reads only files (rank 0 can run it and broadcast)."""
    from ember.checkpoint import io as cio
    for d in _candidate_dirs(t):
        best, best_key = None, None
        for c in cio.list_checkpoints(d):
            if os.path.islink(c):
                continue   # 'last' -> the checkpoint it names, which is listed itself
            step = _saved_step(c)
            if step is None:
                continue
            key = (step, os.path.basename(c) == "last")
            if best_key is None or key > best_key:
                best, best_key = c, key
        if best is not None:
            link = os.path.join(d, "last")
            if os.path.islink(link) and os.path.realpath(link) == os.path.realpath(best):
                return link   # as before: 'last' names the checkpoint it links to
            return best
    return None


def _best_from_last(t) -> str | None:
    """best_model_path recorded by a ModelCheckpoint in the newest checkpoint."""
    from ember.checkpoint import io as cio
    from ember.checkpoint.trust import inside
    last = find_last(t)
    if last is None or not os.path.isfile(os.path.join(last, cio.STATE_NAME)):
        return None
    try:
        state = cio.load_torch(os.path.join(last, cio.STATE_NAME))
    except CheckpointError:
        return None
    keys = [cb.state_key for cb in t.checkpoint_callbacks]
    for key, s in (state.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and (not keys or key in keys) and isinstance(s, dict) \
                and isinstance(s.get("best_model_path"), str) and s["best_model_path"]:
            best = s["best_model_path"]
            # only a checkpoint of the same run folder (a crafted state may name any path)
            if os.path.exists(best) and inside(os.path.dirname(os.path.normpath(best)), os.path.dirname(last)) \
                    and inside(os.path.dirname(last), os.path.dirname(os.path.normpath(best))):
                return best
    return None


def elastic_restart() -> bool:
    """True in a worker group that torchrun's elastic agent restarted under ``ember launch
    --max-restarts N`` (which sets ``EMBER_ELASTIC_RESUME=1``): the attempt number every
    rank of every node agrees on (``ember.distributed.elastic.agreed_attempt``, exchanged
    once per process when the strategy is built) is above 0."""
    if os.environ.get("EMBER_ELASTIC_RESUME", "") not in ("1", "true"):
        return False
    from ember.distributed.elastic import agreed_attempt
    return agreed_attempt() > 0


def elastic_not_resumed(t) -> str | None:
    """The warning for a first attempt under ``EMBER_ELASTIC_RESUME=1`` that leaves this
    run's newest complete checkpoint alone, when ember cannot tell it from a restart:
    torchrun counts no restart when a machine joins or leaves a group (it restarts the
    workers of a new rendezvous round), and without the agents' shared store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) ember cannot agree on one either
    (:mod:`ember.distributed.elastic`), so such a group would start afresh silently. None
    otherwise (under the shared store every new worker group counts: it resumes)."""
    if os.environ.get("EMBER_ELASTIC_RESUME", "") not in ("1", "true") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from ember.distributed.elastic import agreed_attempt, under_agent_store
    if under_agent_store() or agreed_attempt() > 0:
        return None
    last = find_last(t)
    if last is None:
        return None
    return (f"EMBER_ELASTIC_RESUME=1: this worker group counts as a first attempt (TORCHELASTIC_RESTART_COUNT=0), "
            f"so it starts afresh and leaves this run's newest checkpoint {last} alone. Without the agents' shared "
            "store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) ember cannot tell a first attempt from a group that "
            "torchrun restarted because a machine joined or left (it counts no restart for that). Pass "
            "fit(ckpt_path='last') to resume it, or leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset")


def elastic_resume_path(t) -> str | None:
    """``"last"`` after an elastic restart (:func:`elastic_restart`) when this run has a
    complete checkpoint; else None (a group that failed before its first checkpoint
    starts afresh). Under several processes only rank 0 looks (the Trainer broadcasts
    its answer after setup): another node may see the run folder otherwise."""
    if not elastic_restart() or find_last(t) is None:
        return None
    return "last"


def resolve_ckpt_path(t, ckpt_path, stage: str = "fit") -> str:
    """Turn ``ckpt_path`` (a path, "last" or "best") into a path and check it before any
    work: missing, incomplete and truncated checkpoints raise CheckpointError here."""
    if ckpt_path == "best":
        cb = t.checkpoint_callback
        path = getattr(cb, "best_model_path", "") if cb is not None else ""
        path = path or _best_from_last(t)
        if not path:
            raise CheckpointError("ckpt_path='best': no best checkpoint is known (no ModelCheckpoint with a "
                                  "monitor has saved one in this Trainer or in the newest checkpoint under "
                                  f"{t.default_root_dir!r})")
    elif ckpt_path == "last":
        path = find_last(t)
        if path is None:
            searched = _candidate_dirs(t) or [os.path.join(t.default_root_dir, "checkpoints")]
            raise CheckpointError(f"ckpt_path='last': no complete checkpoint found; searched {searched}")
        if t.is_global_zero:
            print(f"ember: ckpt_path='last' resumes {path} (global_step {_saved_step(path)}, the newest "
                  "complete checkpoint of this run)", file=sys.stderr, flush=True)
    elif isinstance(ckpt_path, (str, os.PathLike)):
        path = os.fspath(ckpt_path)
    else:
        raise MisconfigurationError(f"ckpt_path={ckpt_path!r} is not valid; use a path, 'last', 'best' or None")
    precheck(path, need_state=(stage == "fit"))
    return path


def precheck(path: str, need_state: bool) -> None:
    """Cheap checks (no tensors loaded): exists, complete, file sizes as recorded,
    and holds a trainer state when a fit resumes from it."""
    from ember.checkpoint import io as cio
    if not os.path.exists(path):
        missing = getattr(cio, "_missing_message", None)
        raise CheckpointError(missing(path) if missing else f"checkpoint not found: {path} does not exist")
    if os.path.isfile(path):
        if need_state:
            raise CheckpointError(f"{path} holds weights only (no trainer state), so fit cannot resume from it; "
                                  "load it with Module.load_from_checkpoint and start a new fit, or pass it "
                                  "to validate/test/predict")
        return
    meta_file = os.path.join(path, cio.META_NAME)
    if not os.path.isfile(meta_file):
        if os.path.isfile(os.path.join(path, cio.INDEX_NAME)):   # a sharded weights export
            if need_state:
                raise CheckpointError(f"{path} is a weights export (no trainer state), so fit cannot resume "
                                      "from it; load it with Module.load_from_checkpoint and start a new fit")
            return
        cio.read_checkpoint(path, load_state=False)   # raises the detailed "incomplete" error
        raise CheckpointError(f"{path} is not a complete checkpoint (no {cio.META_NAME})")
    cio.read_meta_checked(path)   # limits, format version, files inside the directory, sizes
    if need_state and not os.path.isfile(os.path.join(path, cio.STATE_NAME)):
        raise CheckpointError(f"{path} holds weights only (no {cio.STATE_NAME}), so fit cannot resume from it; "
                              "load it with Module.load_from_checkpoint and start a new fit, or pass it to "
                              "validate/test/predict")


# ----------------------------------------------------------------------------- restore
def _warn_setup_changes(t, meta: dict, path: str, world_kept: bool = False) -> None:
    """Warn about a changed precision, or world size (unless ``world_kept``: the resume
    carried the global batch and data position over, resume_data.reshard)."""
    changes = []
    for key, now in (("world_size", t.world_size), ("precision", t.precision)):
        if key == "world_size" and world_kept:
            continue
        if key in meta and meta[key] != now:
            changes.append(f"{key} {meta[key]!r} -> {now!r}")
    if changes:
        warnings.warn(f"resuming from {path} with a different setup ({', '.join(changes)}): training continues, "
                      "but not bit-exactly as an uninterrupted run would", stacklevel=5)


def _restore_results(t, saved: list) -> None:
    from ember.trainer.logging import _Entry
    results = t.metrics.results["train"]
    results.reset()
    device = t.strategy.root_device
    for s in saved:
        e = _Entry(s["name"], s["on_step"], s["on_epoch"], s["prog_bar"], s["logger"], s["reduce_fx"],
                   s["sync_dist"], None)
        e.last = s["last"].to(device) if isinstance(s["last"], torch.Tensor) else s["last"]
        e.total = s["total"].to(device) if isinstance(s["total"], torch.Tensor) else s["total"]
        e.weight, e.updated = s["weight"], s["updated"]
        results.entries[e.name] = e


def _restore_grads(t, grads: dict, path: str) -> None:
    module = t.strategy.unwrap_module(t.model)
    params = dict(module.named_parameters())
    unknown = [n for n in grads if n not in params]
    if unknown:
        raise CheckpointError(f"{path}: accumulated gradients for unknown parameters {unknown[:10]}")
    for n, g in grads.items():
        p = params[n]
        p.grad = g.to(device=p.device, dtype=p.dtype)
    t.state.grads_pending = True


def _restore_callbacks_first(t, path: str) -> None:
    """Callbacks marked ``restore_before_optimizers`` (finetuning callbacks, which add
    parameter groups) get their state before the optimizers' states are loaded."""
    from ember.checkpoint import io as cio
    early = [cb for cb in t.callbacks if getattr(cb, "restore_before_optimizers", False)]
    sfile = os.path.join(os.fspath(path), cio.STATE_NAME)
    if not early or not os.path.isfile(sfile):
        return
    cb_states = (cio.load_torch(sfile) or {}).get("callbacks", {})
    for cb in early:
        if cb.state_key in cb_states:
            cb.load_state_dict(cb_states[cb.state_key])


def restore(t, path: str, full: bool, early: CheckpointError | None = None) -> None:
    """Load ``path`` into the fit (``full``: weights, optimizers, loop and trainer state)
    or the module (validate/test/predict).

    Under several processes the ranks agree on the outcome twice, each time with one
    ``all_gather_object`` (``ember.checkpoint.agree``): before the strategy's load (its
    own collectives and broadcasts follow) on the checks of the files as each node sees
    them (``early``: this rank's error from the checks made before setup), with rank 0's
    ``EMBER_ALLOW_DATA_CHANGE`` sent along; and after it, on everything the load and the
    trainer-state checks raised. A checkpoint one rank refuses is refused by every rank
    with the first failing rank's message."""
    from ember.trainer.resume_data import allow_data_change
    if t.world_size == 1:
        _restore(t, path, full, allow_data_change())
        return
    from ember.checkpoint.agree import agree_outcome, collective_failed
    error = early
    # a rank that does not see the path at all leaves it to the strategy's load, which
    # reads on rank 0 only where it can (FSDP's full-weights load) and fails on that rank
    # otherwise (then agreed after the load)
    if error is None and (t.is_global_zero or os.path.exists(path)):
        try:
            precheck(path, need_state=full)
        except Exception as err:   # agreed below, so no rank goes on alone
            error = err
    allow = agree_outcome(t.strategy, error, rank0_value=allow_data_change())
    error = None
    try:
        _restore(t, path, full, allow)
    except Exception as err:
        if collective_failed(err):
            raise
        error = err
    agree_outcome(t.strategy, error)


def _restore(t, path: str, full: bool, allow_data_change: bool) -> None:
    from ember.checkpoint import io as cio
    from ember.data import sampling as edata
    if full:
        _restore_callbacks_first(t, path)
    try:
        state = t.strategy.load_checkpoint(path, t.model, t.optimizers if full else [], weights_only=not full)
    except CheckpointError:
        raise
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as err:
        raise CheckpointError(f"{path} does not fit this module/optimizer setup: {type(err).__name__}: {err}") from err
    t.state.resumed = full
    t.state.ckpt_path = path   # trainer.ckpt_path
    if not full:
        return
    if not state or "loop" not in state:
        raise CheckpointError(f"{path} holds weights only (no trainer state); pass it to validate/test/predict, "
                              "or load it with Module.load_from_checkpoint and start a new fit")
    if state.get("version", 0) > STATE_VERSION:
        raise CheckpointError(f"{path} was written by a newer ember (trainer state version {state['version']}, "
                              f"this one reads <= {STATE_VERSION}); upgrade ember to resume from it")
    n_opt = len(state.get("optimizers", []))
    if n_opt != len(t.optimizers):
        raise CheckpointError(f"{path} has {n_opt} optimizer state(s) but configure_optimizers returned "
                              f"{len(t.optimizers)}")
    scheds = state.get("schedulers", [])
    if len(scheds) != len(t.lr_scheduler_configs):
        raise CheckpointError(f"{path} has {len(scheds)} scheduler state(s) but configure_optimizers returned "
                              f"{len(t.lr_scheduler_configs)}")
    loop = state["loop"]
    try:
        t.state.load_state_dict(loop)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the loop position in {cio.STATE_NAME} is unreadable ({err!r})") from err
    from ember.trainer.resume_data import reshard, restore_data, restore_position
    # another number of processes: the global batch and the position in the global order are kept
    t.state.reshard_note = note = reshard(t, state, path)
    _warn_setup_changes(t, state.get("meta") or {}, path, world_kept=note is not None)
    restore_data(t, state.get("data"), path, allow_data_change, resharded=note is not None)   # refuses a changed
    # batch size / dataset mid-epoch
    restore_position(t, state.get("data_position"), path)
    for cfg, s in zip(t.lr_scheduler_configs, scheds):
        cfg["scheduler"].load_state_dict(s)
    t.strategy.precision.load_state_dict(state.get("precision", {}))
    t.callback_metrics.update({k: torch.tensor(v) for k, v in (state.get("callback_metrics") or {}).items()})
    cb_states = state.get("callbacks", {})
    for cb in t.callbacks:
        cb.on_load_checkpoint(t, t.module, state)
        if cb.state_key in cb_states:
            cb.load_state_dict(cb_states[cb.state_key])
    if t.datamodule is not None and state.get("datamodule"):
        t.datamodule.load_state_dict(state["datamodule"])
    t.module.on_load_checkpoint(state)
    st = t.state
    st.data_seed = state.get("data_seed", st.data_seed)
    train = st.train_dataloader
    for dl in (train.flattened if getattr(train, "ember_combined", False) else [train]):   # a CombinedLoader's each
        s = getattr(dl, "sampler", None)
        if isinstance(s, edata.ResumableSampler):   # ember's: a user's sampler keeps its own seed
            s.seed = st.data_seed
        s = edata.sampler_of(dl)
        inner = getattr(getattr(s, "batch_sampler", None), "sampler", None)   # inside a StatefulDataLoader
        if isinstance(inner, edata.ResumableSampler):
            inner.seed = st.data_seed
        if getattr(dl, "ember_seed", None) is not None:
            dl.ember_seed = st.data_seed   # worker seeds follow the run seed (ember.data.worker_seed)
    same_world = len(state.get("rng") or []) == t.world_size
    rank = t.global_rank
    results = state.get("results") or []
    if st.batches_done and same_world and results:
        _restore_results(t, results[rank])
    grads = state.get("grads")
    if grads and st.batches_done and st.reshard_note is None:   # (resharded: the window is replayed)
        if not same_world or loop.get("accumulate_grad_batches") != t.accumulate_grad_batches:
            warnings.warn(f"{path} was saved inside a gradient accumulation window with another world size or "
                          "accumulate_grad_batches; the partly accumulated gradients are dropped", stacklevel=4)
        elif grads[rank] is not None:
            _restore_grads(t, grads[rank], path)
    rng = state.get("rng") or []
    if rng:
        cio.restore_rng_states(rng[rank % len(rng)])
