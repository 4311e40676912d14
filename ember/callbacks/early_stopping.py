"""EarlyStopping: stop the fit when a monitored metric stops improving. Its state
(wait count, best score) is part of the checkpoint, so patience carries across resumes."""
from __future__ import annotations

import math
import sys

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError, invalid_choice


class EarlyStopping(Callback):
    """
    Args:
        monitor: the logged metric to watch, e.g. ``"val/loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: number of checks without improvement after which training stops.
        min_delta: an improvement must exceed this (absolute) amount.
        check_finite: stop when the metric becomes NaN or infinite.
        stopping_threshold: stop as soon as the metric is better than this.
        divergence_threshold: stop as soon as the metric is worse than this.
        check_on_train_epoch_end: check at the end of every training epoch (True) or after
            every validation (False). Default: at epoch ends when validation runs once per
            epoch at its end (or not at all), else after every validation.
        strict: raise when ``monitor`` was never logged (the message lists the logged names);
            False: skip the check silently.
        verbose: print a line at every improvement and at the stop.
        log_rank_zero_only: print only on global rank zero.
    """

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = True):
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationError(f"EarlyStopping(monitor={monitor!r}): name the logged metric to watch, "
                                        "e.g. monitor='val/loss'")
        if mode not in ("min", "max"):
            raise invalid_choice("EarlyStopping(mode)", mode, ["min", "max"])
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise MisconfigurationError(f"EarlyStopping(patience={patience!r}): use an int >= 0")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise MisconfigurationError(f"EarlyStopping(min_delta={min_delta!r}): use a number >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.verbose, self.strict, self.check_finite = verbose, strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopping_reason: str | None = None
        #: the monitored value at the check that stopped the fit (None until it stops)
        self.stopped_value: float | None = None
        self._on_epoch_end = check_on_train_epoch_end

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}, mode={self.mode!r}}}"

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    # -- hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer, module):
        if self.check_on_train_epoch_end is None:
            vci = trainer.val_check_interval
            once_per_epoch = isinstance(vci, float) and vci >= 1.0 and trainer.check_val_every_n_epoch == 1
            self._on_epoch_end = once_per_epoch or not trainer.val_dataloaders
        else:
            self._on_epoch_end = self.check_on_train_epoch_end

    def on_train_epoch_end(self, trainer, module):
        if self._on_epoch_end:
            self._run_check(trainer)

    def on_validation_end(self, trainer, module):
        if trainer.stage == "fit" and not trainer.sanity_checking and not self._on_epoch_end:
            self._run_check(trainer)

    # -- the check ---------------------------------------------------------------------------
    def _run_check(self, trainer) -> None:
        if getattr(trainer, "fast_dev_run", 0):   # a smoke test never stops early (as in Lightning)
            return
        value = trainer.callback_metrics.get(self.monitor)
        before = (self.best_score, self.wait_count)
        current, stop, reason = None, False, None
        if value is not None:
            current = float(value)
            stop, reason = self._evaluate(current)
        missing = [value is None]
        if trainer.world_size > 1:
            # one small collective per check (epoch or validation end), reached by every rank,
            # also one without the metric (logged on some ranks only): every rank stops
            # together, or skips / raises together
            flags = [False] * trainer.world_size
            flags[trainer.global_rank] = value is None
            *missing, stop = trainer.strategy.agree([*flags, bool(stop)], "max")
        if any(missing):
            self.best_score, self.wait_count = before   # a skipped check counts for no rank
            if self.strict:
                raise MisconfigurationError(self._missing_message(trainer, value, missing))
            return
        if stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason, self.stopped_value = reason, current
            trainer.request_stop("early_stopping", agreed=True)
        if reason and self.verbose:
            self._print(trainer, reason)

    def _missing_message(self, trainer, value, missing: list) -> str:
        fix = "Pass strict=False to skip the check when it is missing."
        if len(missing) > 1:
            ranks = [r for r, m in enumerate(missing) if m]
            where = (f"it is missing on rank(s) {ranks}" if value is not None else
                     f"{trainer.describe_missing_metric(self.monitor)} (missing on rank(s) {ranks})")
            fix = ("Log it on every rank (a value logged on some ranks only cannot be checked alike on all "
                   "of them; sync_dist=True gives every rank the same value), or pass strict=False to skip "
                   "the check when it is missing.")
        else:
            where = trainer.describe_missing_metric(self.monitor)
        return (f"EarlyStopping(monitor={self.monitor!r}) could not find the metric: {where}. Metrics available "
                f"now: {sorted(trainer.callback_metrics)}. {fix}")

    def _evaluate(self, current: float) -> tuple[bool, str | None]:
        if self.check_finite and not math.isfinite(current):
            return True, (f"Monitored metric {self.monitor} = {current} is not finite. Previous best value was "
                          f"{self.best_score:.3f}. Signaling Trainer to stop.")
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return True, (f"Stopping threshold reached: {self.monitor} = {current} "
                          f"{'<' if self.mode == 'min' else '>'} {self.stopping_threshold}. Signaling Trainer to stop.")
        if self.divergence_threshold is not None and self._better(self.divergence_threshold, current):
            return True, (f"Divergence threshold reached: {self.monitor} = {current} "
                          f"{'>' if self.mode == 'min' else '<'} {self.divergence_threshold}. Signaling Trainer to stop.")
        delta = -self.min_delta if self.mode == "min" else self.min_delta
        if self._better(current - delta, self.best_score):
            if math.isfinite(self.best_score):
                msg = (f"Metric {self.monitor} improved by {abs(self.best_score - current):.3f} >= "
                       f"min_delta = {self.min_delta}. New best score: {current:.3f}")
            else:
                msg = f"Metric {self.monitor} improved. New best score: {current:.3f}"
            self.best_score, self.wait_count = current, 0
            return False, msg
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records. "
                          f"Best score: {self.best_score:.3f}. Signaling Trainer to stop.")
        return False, None

    def _print(self, trainer, msg: str) -> None:
        if self.log_rank_zero_only and not trainer.is_global_zero:
            return
        prefix = f"[rank {trainer.global_rank}] " if trainer.world_size > 1 and not self.log_rank_zero_only else ""
        print(f"{prefix}ember: {msg}", file=sys.stderr, flush=True)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self):
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch,
                "best_score": float(self.best_score), "patience": self.patience}

    def load_state_dict(self, state):
        self.wait_count = int(state.get("wait_count", 0))
        self.stopped_epoch = int(state.get("stopped_epoch", 0))
        self.best_score = float(state.get("best_score", self.best_score))
