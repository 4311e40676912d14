"""Trainer arguments from Lightning beyond the core loop ones (``min_epochs``,
``overfit_batches``, ``barebones``, ...): validation (each error names the argument and
the fix) and what each does outside the step. Nothing here runs per step."""
from __future__ import annotations

import datetime as _dt
import re
import warnings
from typing import Any

import torch

from ember.errors import MisconfigurationError
from ember.trainer.logging import Results


def _parse_max_time(v):
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    if isinstance(v, _dt.timedelta):
        return v.total_seconds()
    if isinstance(v, dict):
        return _dt.timedelta(**v).total_seconds()
    if isinstance(v, str) and re.fullmatch(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", v):
        d, h, m, s = map(int, v.split(":"))
        return float(((d * 24 + h) * 60 + m) * 60 + s)
    raise MisconfigurationError(f"max_time={v!r} is not valid; use seconds (a positive number), "
                                "'DD:HH:MM:SS', a datetime.timedelta or a dict like {'hours': 2}")


def _check_limit(name, v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MisconfigurationError(f"{name}={v!r} is not valid; use an int number of batches, a float "
                                    "fraction in [0, 1], or None for all")
    if v < 0 or (isinstance(v, float) and v > 1.0):
        raise MisconfigurationError(f"{name}={v!r} is not valid; an int must be >= 0 and a float in [0.0, 1.0]")
    return v


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise MisconfigurationError(f"{name}={v!r} is not valid; use True or False")
    return v


def _count(name: str, v: Any, allow_none: bool = True) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MisconfigurationError(f"{name}={v!r} is not valid; use an int >= 0{' or None' if allow_none else ''}")
    return v


def set_arguments(t, *, min_epochs, min_steps, overfit_batches, limit_test_batches, limit_predict_batches,
                  reload_dataloaders_every_n_epochs, sync_batchnorm, use_distributed_sampler,
                  inference_mode, benchmark, enable_autolog_hparams, deterministic) -> None:
    """Validate and store the arguments on the Trainer ``t``."""
    t.min_epochs = _count("min_epochs", min_epochs)
    t.min_steps = _count("min_steps", min_steps)
    if isinstance(overfit_batches, bool) or not isinstance(overfit_batches, (int, float)) or overfit_batches < 0 \
            or (isinstance(overfit_batches, float) and overfit_batches > 1.0):
        raise MisconfigurationError(f"overfit_batches={overfit_batches!r} is not valid; use an int number of "
                                    "batches >= 0 or a float fraction in [0.0, 1.0] (0: off)")
    t.overfit_batches = overfit_batches
    t.limit_test_batches = _check_limit("limit_test_batches", limit_test_batches)
    t.limit_predict_batches = _check_limit("limit_predict_batches", limit_predict_batches)
    t.reload_dataloaders_every_n_epochs = _count("reload_dataloaders_every_n_epochs",
                                                 reload_dataloaders_every_n_epochs, allow_none=False)
    t.sync_batchnorm = _bool("sync_batchnorm", sync_batchnorm)
    t.use_distributed_sampler = _bool("use_distributed_sampler", use_distributed_sampler)
    t.inference_mode = _bool("inference_mode", inference_mode)
    t.enable_autolog_hparams = _bool("enable_autolog_hparams", enable_autolog_hparams)
    if benchmark is not None:
        _bool("benchmark", benchmark)
        if benchmark and deterministic:   # as Lightning: allowed, with a warning
            warnings.warn("benchmark=True with deterministic=True: cuDNN's benchmark mode picks algorithms "
                          "that are not deterministic (torch ignores cudnn.deterministic then); drop one of the "
                          "two", UserWarning, stacklevel=4)
        torch.backends.cudnn.benchmark = benchmark
    t.benchmark = benchmark
    if overfit_batches:
        t.limit_train_batches = t.limit_val_batches = overfit_batches


def resolve_barebones(barebones: Any, logger: Any, checkpointing: Any, progress_bar: Any, summary: Any,
                      callbacks: Any) -> tuple:
    """``(logger, checkpointing, progress_bar, summary)`` after ``barebones``: None means
    True (the default) unless ``barebones=True``, which turns them all off; asking for one
    of them together with ``barebones=True`` is an error naming the argument."""
    _bool("barebones", barebones)
    if not barebones:
        return (logger, checkpointing is not False, progress_bar is not False, summary is not False)
    asked = [n for n, v in (("enable_checkpointing", checkpointing), ("enable_progress_bar", progress_bar),
                            ("enable_model_summary", summary)) if v]
    if logger is not True and logger not in (False, None):   # True is the default: turned off
        asked.insert(0, "logger")
    from ember.callbacks import ModelCheckpoint, ModelSummary
    from ember.callbacks.progress import ProgressBar
    cbs = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks] if callbacks is not None else []
    asked += [f"callbacks=[{type(c).__name__}(...)]" for c in cbs
              if isinstance(c, (ModelCheckpoint, ModelSummary, ProgressBar))]
    if asked:
        raise MisconfigurationError(
            f"barebones=True turns off loggers, checkpointing, the progress bar and the model summary, but "
            f"{', '.join(asked)} asks for one; remove it or set barebones=False")
    return False, False, False, False


class BarebonesResults(Results):
    """The results of a ``barebones`` Trainer: nothing is recorded, so ``self.log`` says so."""

    def log(self, name, *args, **kwargs):
        raise MisconfigurationError(
            f"self.log({name!r}, ...) under Trainer(barebones=True): barebones keeps no metrics (no "
            "loggers, progress bar or callback_metrics); set barebones=False to log")


def convert_sync_batchnorm(t, module):
    """``sync_batchnorm=True`` under several processes: BatchNorm layers become
    SyncBatchNorm (in place, before the strategy wraps the module)."""
    if t.sync_batchnorm and t.world_size > 1:
        if t.strategy.root_device.type == "cpu" and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                                        for m in module.modules()):
            raise MisconfigurationError(
                "sync_batchnorm=True on CPU processes: torch's SyncBatchNorm runs on GPU devices only; "
                "set sync_batchnorm=False (each process then normalises with its own batch statistics)")
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return module


# -- callbacks and loggers: the defaults, the module's, the run folders -------------------------
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


def log_hparams(t) -> None:
    """At the setup of every run (as Lightning): the module's hyperparameters, merged with
    the datamodule's, go to every logger on global rank 0 (``enable_autolog_hparams=False``:
    none); loggers keep what was logged to them by hand next to them."""
    if not (t.loggers and t.is_global_zero and t.module is not None and t.enable_autolog_hparams):
        return
    from ember.hparams import merged_hparams
    hparams = merged_hparams(t.module, t.datamodule)
    if hparams:
        for lg in t.loggers:
            lg.log_hyperparams(hparams)


def agree_log_versions(t) -> None:
    """Under several processes, every logger whose run must be the same on every rank (a
    file logger's ``version_N`` folder, picked by listing the directory; an MLflow run) takes
    rank 0's (``Logger.run_key`` there, ``use_run_key`` on the others: one broadcast at
    setup), so ``trainer.log_dir`` and the checkpoint folder are the same on every rank and
    only rank 0 creates a run."""
    from ember.loggers.base import Logger
    shared = [lg for lg in t.loggers if type(lg).run_key is not Logger.run_key]
    if t.world_size == 1 or not shared:
        return
    from ember.errors import DistributedOperationError
    from ember.strategies.full_load import raise_rank0_error
    keys = failed = None
    if t.is_global_zero:   # creating a run can fail (a tracking server down): every rank ends with it
        try:
            keys = [lg.run_key() for lg in shared]
        except Exception as err:
            failed = err
    keys = raise_rank0_error(t.strategy, failed, "a logger's run could not be created on rank 0", value=keys,
                             kind=DistributedOperationError)
    if not t.is_global_zero:
        for lg, key in zip(shared, keys):
            lg.use_run_key(key)


def configure_callbacks(t, module) -> None:
    """``module.configure_callbacks()``: each returned callback replaces the Trainer's
    callbacks of the same type, else is added (checkpoint callbacks stay last), as Lightning."""
    from ember.module import TrainModule, overrides
    if not overrides(module, TrainModule, "configure_callbacks"):
        return
    from ember.callbacks.base import Callback
    from ember.callbacks.checkpoint import ModelCheckpoint
    extra = module.configure_callbacks()
    extra = [] if extra is None else list(extra) if isinstance(extra, (list, tuple)) else [extra]
    for cb in extra:
        if not isinstance(cb, Callback):
            raise MisconfigurationError(f"{type(module).__name__}.configure_callbacks() returned "
                                        f"{type(cb).__name__}; return Callback instances")
    if not extra:
        return
    types = {type(cb) for cb in extra}
    kept = [cb for cb in t.callbacks if type(cb) not in types and cb not in extra]
    merged = kept + extra
    t.callbacks[:] = [c for c in merged if not isinstance(c, ModelCheckpoint)] + \
        [c for c in merged if isinstance(c, ModelCheckpoint)]
