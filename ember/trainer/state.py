"""Everything the Trainer stores in and restores from a checkpoint, the default
callbacks and loggers, and preemption signals."""
from __future__ import annotations

import glob
import os
import signal
import sys
import threading

import torch

from ember.errors import CheckpointError, MisconfigurationError

STATE_VERSION = 1


# ----------------------------------------------------------------------------- defaults
def default_callbacks(callbacks, checkpointing, progress_bar, summary) -> list:
    from ember.callbacks.base import Callback
    cbs = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for cb in cbs:
        if not isinstance(cb, Callback):
            raise MisconfigurationError(f"callbacks: {cb!r} is not an ember.callbacks.Callback")
    names = {type(c).__name__ for c in cbs}
    from ember.callbacks import ModelCheckpoint, ModelSummary, RichProgressBar
    from ember.callbacks.progress import ProgressBar
    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in cbs):
        cbs.append(ModelCheckpoint())
    if not checkpointing and any(isinstance(c, ModelCheckpoint) for c in cbs):
        raise MisconfigurationError("enable_checkpointing=False but a ModelCheckpoint is in callbacks; "
                                    "remove one of the two")
    if progress_bar and not any(isinstance(c, ProgressBar) for c in cbs):
        cbs.append(RichProgressBar())
    if summary and "ModelSummary" not in names:
        cbs.insert(0, ModelSummary())
    # checkpoint callbacks last, so they see what the other callbacks logged (as Lightning)
    return [c for c in cbs if not isinstance(c, ModelCheckpoint)] + [c for c in cbs if isinstance(c, ModelCheckpoint)]


def build_loggers(t) -> list:
    from ember.loggers import Logger, TensorBoardLogger
    arg = t._logger_arg
    if arg is True:
        out = [TensorBoardLogger(save_dir=t.default_root_dir)]
    elif arg is False or arg is None:
        out = []
    elif isinstance(arg, Logger):
        out = [arg]
    elif isinstance(arg, (list, tuple)) and all(isinstance(x, Logger) for x in arg):
        out = list(arg)
    else:
        raise MisconfigurationError(f"logger={arg!r} is not valid; use True (TensorBoard), False, a Logger or a list of Loggers")
    if out and t.is_global_zero and t.module is not None and t.module.hparams:
        for lg in out:
            lg.log_hyperparams(dict(t.module.hparams))
    return out


# ----------------------------------------------------------------------------- save
def trainer_state(t) -> dict:
    from ember import checkpoint_io as cio
    epoch, done = (t.current_epoch + 1, 0) if t._epoch_finished else (t.current_epoch, t._batches_done)
    state = {
        "version": STATE_VERSION,
        "loop": {"epoch": epoch, "global_step": t.global_step, "batches_done": done},
        "schedulers": [c["scheduler"].state_dict() for c in t.lr_scheduler_configs],
        "precision": t.strategy.precision.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks},
        "rng": t.strategy.all_gather_object(cio.collect_rng_states()),
        "data_seed": t._data_seed,
        "datamodule": t.datamodule.state_dict() if t.datamodule is not None else {},
    }
    return state


def checkpoint_meta(t) -> dict:
    m = t.module
    return {"strategy": t.strategy.name, "world_size": t.world_size, "precision": t.precision,
            "module_class": f"{type(m).__module__}.{type(m).__qualname__}",
            "hparams": dict(m.hparams), "epoch": t.current_epoch, "global_step": t.global_step}


def save_checkpoint(t, path: str, weights_only: bool = False) -> None:
    if t.model is None:
        raise MisconfigurationError("trainer.save_checkpoint() needs a fitted module: call fit() first")
    path = os.fspath(path)
    state = {} if weights_only else trainer_state(t)
    if not weights_only:
        for cb in t.callbacks:
            cb.on_save_checkpoint(t, t.module, state)
        t.module.on_save_checkpoint(state)
    t.strategy.save_checkpoint(path, t.model, t.optimizers, state, checkpoint_meta(t), weights_only=weights_only)


# ----------------------------------------------------------------------------- restore
def resolve_ckpt_path(t, ckpt_path) -> str:
    if ckpt_path == "best":
        cb = t.checkpoint_callback
        if cb is None or not getattr(cb, "best_model_path", ""):
            raise CheckpointError("ckpt_path='best': no best checkpoint is known (no ModelCheckpoint with a "
                                  "monitor has saved one in this Trainer)")
        return cb.best_model_path
    if ckpt_path == "last":
        found = find_last(t)
        if found is None:
            raise CheckpointError(f"ckpt_path='last': no checkpoint found under {t.default_root_dir!r}")
        return found
    path = os.fspath(ckpt_path)
    if not os.path.exists(path):
        raise CheckpointError(f"ckpt_path={path!r} does not exist")
    return path


def find_last(t) -> str | None:
    from ember import checkpoint_io as cio
    dirs = []
    for cb in t.checkpoint_callbacks:
        if getattr(cb, "dirpath", None):
            dirs.append(cb.dirpath)
    dirs += glob.glob(os.path.join(t.default_root_dir, "**", "checkpoints"), recursive=True)
    best = None
    for d in dict.fromkeys(dirs):
        for c in cio.list_checkpoints(d):
            if os.path.basename(c) == "last" or best is None or os.path.getmtime(c) >= os.path.getmtime(best):
                if best is None or os.path.getmtime(c) >= os.path.getmtime(best):
                    best = c
    return best


def restore(t, path: str, full: bool) -> None:
    from ember import checkpoint_io as cio
    state = t.strategy.load_checkpoint(path, t.model, t.optimizers if full else [], weights_only=not full)
    t._resumed = full
    if not full:
        return
    if not state or "loop" not in state:
        raise CheckpointError(f"{path} holds weights only (no trainer state); pass it to validate/test/predict, "
                              "or load it with Module.load_from_checkpoint and start a new fit")
    loop = state["loop"]
    t.current_epoch, t.global_step, t._batches_done = loop["epoch"], loop["global_step"], loop["batches_done"]
    scheds = state.get("schedulers", [])
    if len(scheds) != len(t.lr_scheduler_configs):
        raise CheckpointError(f"{path} has {len(scheds)} scheduler state(s) but configure_optimizers returned "
                              f"{len(t.lr_scheduler_configs)}")
    for cfg, s in zip(t.lr_scheduler_configs, scheds):
        cfg["scheduler"].load_state_dict(s)
    t.strategy.precision.load_state_dict(state.get("precision", {}))
    cb_states = state.get("callbacks", {})
    for cb in t.callbacks:
        if cb.state_key in cb_states:
            cb.load_state_dict(cb_states[cb.state_key])
    if t.datamodule is not None and state.get("datamodule"):
        t.datamodule.load_state_dict(state["datamodule"])
    for cb in t.callbacks:
        cb.on_load_checkpoint(t, t.module, state)
    t.module.on_load_checkpoint(state)
    t._data_seed = state.get("data_seed", t._data_seed)
    for loader in [t._train_loader]:
        s = getattr(loader, "sampler", None)
        if s is not None and hasattr(s, "seed"):
            s.seed = t._data_seed
    rng = state.get("rng") or []
    if rng:
        cio.restore_rng_states(rng[t.global_rank % len(rng)])


# ----------------------------------------------------------------------------- preemption
_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


def install_signal_handlers(t) -> None:
    t._prev_handlers = {}
    t._signal_received = None
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        t._signal_received = signum
        t._signal_pending = True

    for s in _SIGNALS:
        try:
            t._prev_handlers[s] = signal.signal(s, handler)
        except (ValueError, OSError):
            pass
    # under several processes every rank checks at the same steps (log points): no per-step collective
    t._signal_pending = t.world_size > 1


def uninstall_signal_handlers(t) -> None:
    for s, h in getattr(t, "_prev_handlers", {}).items():
        try:
            signal.signal(s, h)
        except (ValueError, OSError, TypeError):
            pass
    t._prev_handlers = {}
    t._signal_pending = False


def check_signal(t, force: bool = False) -> bool:
    """Act on SIGTERM/SIGUSR1: save a checkpoint and leave the fit loop."""
    received = getattr(t, "_signal_received", None)
    if t.world_size > 1:
        if not force and t.global_step % t.log_every_n_steps:
            return False
        flag = torch.tensor([float(received or 0)], device=t.strategy.root_device)
        received = int(t.strategy.reduce(flag, "max").item()) or None
    if not received:
        return False
    name = signal.Signals(received).name
    cb = t.checkpoint_callback
    if cb is not None and hasattr(cb, "save_last_now"):
        path = cb.save_last_now(t)
    else:
        path = os.path.join(t.log_dir, "checkpoints", "last")
        save_checkpoint(t, path)
    if t.is_global_zero:
        print(f"ember: received {name} at step {t.global_step}; saved checkpoint {path}. "
              "Resume with trainer.fit(..., ckpt_path='last').", file=sys.stderr, flush=True)
        if received == getattr(signal, "SIGUSR1", None) and os.environ.get("SLURM_JOB_ID"):
            os.system(f"scontrol requeue {os.environ['SLURM_JOB_ID']}")
    t._stop_now = True
    t.interrupted = True
    return True
