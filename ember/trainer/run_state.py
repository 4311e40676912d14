"""What the Trainer is doing now, and the data and devices it does it with.

:class:`TrainerState` is Lightning's ``trainer.state``: ``fn`` (the entry point that
runs: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"``), ``stage`` (the part of it
that runs: ``"train"``, ``"sanity_check"``, ``"validate"``, ``"test"``, ``"predict"``;
None between runs) and ``status`` (``"initializing"``, ``"running"``, ``"finished"``,
``"interrupted"``). The values are ``str`` enums, so ``trainer.state.stage == "train"``
holds. The Trainer sets them at stage boundaries only (the start and end of a run, the
sanity check, a validation inside fit); nothing changes per step.

:class:`RunProperties` is the Trainer's read-only view of them and of its data, devices
and callbacks (``trainer.training``, ``trainer.num_val_batches``, ``trainer.device_ids``,
``trainer.ckpt_path``, ...), with Lightning's names and meanings.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return self.value


class TrainerStatus(_StrEnum):
    """Whether a run is going on, and how the last one ended."""

    INITIALIZING = "initializing"   # the Trainer was created; nothing ran yet
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"     # the run raised (KeyboardInterrupt included) or was preempted

    @property
    def stopped(self) -> bool:
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)


class TrainerFn(_StrEnum):
    """The Trainer entry point that runs (or ran last)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(_StrEnum):
    """The part of a run that runs: ``fit`` goes through ``sanity_check``, ``train`` and
    ``validate``; the other entry points have one stage each."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


#: the stage each entry point starts in
FN_STAGE = {"fit": RunningStage.TRAINING, "validate": RunningStage.VALIDATING, "test": RunningStage.TESTING,
            "predict": RunningStage.PREDICTING}


@dataclass
class TrainerState:
    """``trainer.state``: the entry point (``fn``), its running ``stage`` and the ``status``."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    @property
    def finished(self) -> bool:
        """The last run ended normally."""
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        """The last run ended, normally or not."""
        return self.status.stopped


class RunProperties:
    """The Trainer's view of its :class:`TrainerState` (``self.state``), data, devices and
    callbacks. Every property reads what setup already computed; none runs per step."""

    state: TrainerState
    strategy: Any
    callbacks: list
    num_sanity_val_steps: int

    # -- state ---------------------------------------------------------------------------
    def _stage_is(self, stage: RunningStage) -> bool:
        return self.state.stage == stage

    def _set_stage(self, stage: RunningStage, on: bool) -> None:
        if on:
            self.state.stage = stage
        elif self.state.stage == stage:
            self.state.stage = None

    training = property(lambda self: self._stage_is(RunningStage.TRAINING),
                        lambda self, v: self._set_stage(RunningStage.TRAINING, v),
                        doc="Whether the training stage of ``fit`` runs (``state.stage == 'train'``).")
    sanity_checking = property(lambda self: self._stage_is(RunningStage.SANITY_CHECKING),
                               lambda self, v: self._set_stage(RunningStage.SANITY_CHECKING, v),
                               doc="Whether the sanity check before training runs (``state.stage == "
                                   "'sanity_check'``): hooks and callbacks may skip work then.")
    validating = property(lambda self: self._stage_is(RunningStage.VALIDATING),
                          lambda self, v: self._set_stage(RunningStage.VALIDATING, v),
                          doc="Whether a validation pass runs (inside ``fit`` or ``validate()``).")
    testing = property(lambda self: self._stage_is(RunningStage.TESTING),
                       lambda self, v: self._set_stage(RunningStage.TESTING, v),
                       doc="Whether ``test()`` runs.")
    predicting = property(lambda self: self._stage_is(RunningStage.PREDICTING),
                          lambda self, v: self._set_stage(RunningStage.PREDICTING, v),
                          doc="Whether ``predict()`` runs.")

    @property
    def evaluating(self) -> bool:
        """Whether a validation, test or sanity-check pass runs."""
        return self.state.stage is not None and self.state.stage.evaluating

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint the current (or last) run restored from; None when it restored none.
        Setting it (as in Lightning) makes the next runs restore from that path when they are
        given no ``ckpt_path``, until it is set back to None."""
        return self._ckpt_path

    @ckpt_path.setter
    def ckpt_path(self, path: str | None) -> None:
        self._ckpt_path = path
        self._ckpt_path_user = path is not None

    @property
    def received_sigterm(self) -> bool:
        """Whether this run received SIGTERM (ember then saves ``last`` and ends the fit, see
        docs/checkpointing.md)."""
        import signal
        return self._signal_received is not None and self._signal_received == getattr(signal, "SIGTERM", None)

    # -- devices -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Machines this Trainer runs on."""
        return int(getattr(self.strategy, "num_nodes", 1))

    @property
    def device_ids(self) -> list[int]:
        """Device indices used on this machine: the CUDA indices, or ``0..N-1`` for N CPU processes."""
        s = self.strategy
        if s.world_size <= 1:
            return [s.root_device.index or 0]
        ids = getattr(s, "_gpu_ids", None)
        if ids:
            return list(ids)
        env = getattr(s, "cluster_environment", None)
        n = getattr(env, "local_world_size", None) or s.world_size // self.num_nodes
        return list(range(int(n)))

    @property
    def num_devices(self) -> int:
        """Devices (processes) this Trainer uses per machine."""
        return len(self.device_ids)

    # -- data ----------------------------------------------------------------------------
    @property
    def train_dataloader(self) -> Any:
        """The training DataLoader of the current (or last) fit, as prepared for the strategy; None before."""
        return self._train_loader

    @property
    def test_dataloaders(self) -> list:
        """The DataLoaders of the current (or last) ``test()``, one per dataloader given."""
        return list(self._run_loaders.get("test", ()))

    @property
    def predict_dataloaders(self) -> list:
        """The DataLoaders of the current (or last) ``predict()``, one per dataloader given."""
        return list(self._run_loaders.get("predict", ()))

    def _num_batches(self, loaders, limit) -> list:
        return [self._limit_batches(dl, limit) for dl in loaders]

    @property
    def num_val_batches(self) -> list:
        """Validation batches per val dataloader (``limit_val_batches`` applied): those of
        ``validate()`` while it runs (or ran last), else those of fit's validation."""
        if self.state.fn == TrainerFn.VALIDATING:
            return self._num_batches(self._run_loaders.get("validate", ()), self.limit_val_batches)
        return self._num_batches(self._val_loaders, self.limit_val_batches)

    @property
    def num_sanity_val_batches(self) -> list:
        """Batches per val dataloader of the sanity check before training:
        ``min(num_sanity_val_steps, num_val_batches)`` (-1: all of them)."""
        n = float("inf") if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
        return [min(n, b) for b in self._num_batches(self._val_loaders, self.limit_val_batches)]

    @property
    def num_test_batches(self) -> list:
        """Test batches per test dataloader (``limit_test_batches`` applied)."""
        return self._num_batches(self._run_loaders.get("test", ()), self.limit_test_batches)

    @property
    def num_predict_batches(self) -> list:
        """Predict batches per predict dataloader (``limit_predict_batches`` applied)."""
        return self._num_batches(self._run_loaders.get("predict", ()), self.limit_predict_batches)

    # -- callbacks -----------------------------------------------------------------------
    @property
    def early_stopping_callbacks(self) -> list:
        """The :class:`~ember.callbacks.EarlyStopping` callbacks of this Trainer."""
        from ember.callbacks.early_stopping import EarlyStopping
        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Any:
        """The first :class:`~ember.callbacks.EarlyStopping` callback, or None."""
        cbs = self.early_stopping_callbacks
        return cbs[0] if cbs else None

    @property
    def progress_bar_callback(self) -> Any:
        """The :class:`~ember.callbacks.ProgressBar` callback, or None."""
        from ember.callbacks.progress import ProgressBar
        return next((c for c in self.callbacks if isinstance(c, ProgressBar)), None)

    # -- output --------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only (Lightning prints on local rank 0 of each machine).
        While a progress bar is live on a terminal the text goes through its console, above
        the bar, so the bar is not torn; otherwise (and with ``file=``) it is the built-in
        ``print``. Not for per-step use in a hot loop: each call writes to the terminal."""
        if not self.strategy.is_global_zero:
            return
        bar = self.progress_bar_callback
        if "file" not in kwargs and bar is not None and bar.is_live:
            sep = kwargs.get("sep")
            bar.print((" " if sep is None else sep).join(map(str, args)))   # one line above the bar
            return
        print(*args, **kwargs)
