"""Timer: measure the time spent in training, validation and testing, and stop the
fit once the training time reaches a duration. The elapsed training time is part of
the checkpoint, so the budget spans resumes. Per step it costs one
``time.monotonic()`` call; it only asks the Trainer to stop, and the ranks agree on
the stop at the loop's check points (``ember.trainer.stopping.agree_stop``)."""
from __future__ import annotations

import datetime as _dt
import re
import sys
import time

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError, invalid_choice

_STAGES = ("train", "validate", "test")


def parse_duration(duration) -> float | None:
    """``"DD:HH:MM:SS"``, a ``timedelta``, a dict of timedelta arguments, seconds, or None."""
    if duration is None:
        return None
    if isinstance(duration, _dt.timedelta):
        return duration.total_seconds()
    if isinstance(duration, dict):
        try:
            return _dt.timedelta(**duration).total_seconds()
        except TypeError as e:
            raise MisconfigurationError(f"Timer(duration={duration!r}): {e}; use keys of datetime.timedelta "
                                        "such as {'hours': 2, 'minutes': 30}") from e
    if isinstance(duration, (int, float)) and not isinstance(duration, bool) and duration >= 0:
        return float(duration)
    if isinstance(duration, str) and re.fullmatch(r"\d+:\d{1,2}:\d{1,2}:\d{1,2}", duration.strip()):
        d, h, m, s = map(int, duration.strip().split(":"))
        return float(((d * 24 + h) * 60 + m) * 60 + s)
    raise MisconfigurationError(f"Timer(duration={duration!r}) is not valid; use 'DD:HH:MM:SS', a "
                                "datetime.timedelta, a dict like {'hours': 2}, seconds, or None")


class Timer(Callback):
    """
    Args:
        duration: the training-time budget: ``"DD:HH:MM:SS"``, a ``timedelta``, a dict such as
            ``{"hours": 1, "minutes": 30}``, seconds, or None (only measure).
        interval: check after every optimizer step (``"step"``) or at every epoch end
            (``"epoch"``).
        verbose: print a line when the budget stops the fit.

    ``time_elapsed(stage)``, ``start_time(stage)``, ``end_time(stage)`` and
    ``time_remaining(stage)`` take ``"train"``, ``"validate"`` or ``"test"``; the times
    are ``time.monotonic()`` values.
    """

    def __init__(self, duration: float | str | _dt.timedelta | dict | None = None, interval: str = "step", verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise invalid_choice("Timer(interval)", interval, ["step", "epoch"])
        self._duration = parse_duration(duration)
        self._interval, self._verbose = interval, verbose
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0
        self.inactive_hooks = frozenset({"on_train_batch_end" if interval == "epoch" else "on_train_epoch_end"}
                                        if self._duration is not None else {"on_train_batch_end", "on_train_epoch_end"})

    @property
    def duration(self) -> float | None:
        """The budget in seconds (None: no limit)."""
        return self._duration

    def _stage(self, stage: str) -> str:
        stage = {"fit": "train", "training": "train", "validation": "validate"}.get(stage, stage)
        if stage not in _STAGES:
            raise invalid_choice("Timer stage", stage, list(_STAGES))
        return stage

    def start_time(self, stage: str = "train") -> float | None:
        return self._start[self._stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        return self._end[self._stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in ``stage`` (training time includes that of earlier runs resumed from)."""
        stage = self._stage(stage)
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    # -- hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer, module):
        self._start["train"], self._end["train"] = time.monotonic(), None

    def on_validation_start(self, trainer, module):
        self._start["validate"], self._end["validate"] = time.monotonic(), None

    def on_validation_end(self, trainer, module):
        self._end["validate"] = time.monotonic()

    def on_test_start(self, trainer, module):
        self._start["test"], self._end["test"] = time.monotonic(), None

    def on_test_end(self, trainer, module):
        self._end["test"] = time.monotonic()

    def on_fit_start(self, trainer, module):
        if self._duration is not None and self.time_elapsed("train") >= self._duration:
            trainer.request_stop("timer")   # the budget was used up before the checkpoint was saved

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._check(trainer)

    def on_train_epoch_end(self, trainer, module):
        self._check(trainer)

    def _check(self, trainer) -> None:
        # a local request: the loop agrees on it with the other ranks (no collective here)
        if not trainer.should_stop and self.time_elapsed("train") >= self._duration:
            trainer.request_stop("timer")

    def on_train_end(self, trainer, module):
        self._end["train"] = time.monotonic()
        if trainer.stop_reason == "timer" and self._verbose and trainer.is_global_zero:
            print(f"ember: Timer stopped the fit after {self.time_elapsed('train'):.1f} s of training "
                  f"(duration {self._duration:.1f} s) at step {trainer.global_step}.", file=sys.stderr, flush=True)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self):
        return {"time_elapsed": {s: self.time_elapsed(s) for s in _STAGES}}

    def load_state_dict(self, state):
        self._offset = float((state.get("time_elapsed") or {}).get("train", 0.0))
