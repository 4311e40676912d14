"""The Callback base class and the :class:`Event` enum. Every hook receives the trainer
and the module as arguments; a hook nobody overrides costs nothing per step."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # for type checkers and IDEs only
    from ember.module import TrainModule

#: the ``trainer`` argument of every hook: an :class:`ember.Trainer`, read through its public
#: properties only (callbacks, loggers and strategies never import the trainer)
Trainer = Any


class Event(str, enum.Enum):
    """Every event a Trainer run fires (their order: ``ember/trainer/events.py``). The
    value is the hook's name on :class:`Callback` and, where the module has it, on
    :class:`~ember.TrainModule`."""

    SETUP = "setup"
    ON_LOAD_CHECKPOINT = "on_load_checkpoint"
    ON_FIT_START = "on_fit_start"
    ON_SANITY_CHECK_START = "on_sanity_check_start"
    ON_SANITY_CHECK_END = "on_sanity_check_end"
    ON_TRAIN_START = "on_train_start"
    ON_TRAIN_EPOCH_START = "on_train_epoch_start"
    ON_TRAIN_BATCH_START = "on_train_batch_start"
    ON_BEFORE_BACKWARD = "on_before_backward"
    ON_AFTER_BACKWARD = "on_after_backward"
    ON_BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    ON_BEFORE_ZERO_GRAD = "on_before_zero_grad"
    ON_TRAIN_BATCH_END = "on_train_batch_end"
    ON_VALIDATION_START = "on_validation_start"
    ON_VALIDATION_EPOCH_START = "on_validation_epoch_start"
    ON_VALIDATION_BATCH_START = "on_validation_batch_start"
    ON_VALIDATION_BATCH_END = "on_validation_batch_end"
    ON_VALIDATION_EPOCH_END = "on_validation_epoch_end"
    ON_VALIDATION_END = "on_validation_end"
    ON_TRAIN_EPOCH_END = "on_train_epoch_end"
    ON_TRAIN_END = "on_train_end"
    ON_FIT_END = "on_fit_end"
    ON_TEST_START = "on_test_start"
    ON_TEST_EPOCH_START = "on_test_epoch_start"
    ON_TEST_BATCH_START = "on_test_batch_start"
    ON_TEST_BATCH_END = "on_test_batch_end"
    ON_TEST_EPOCH_END = "on_test_epoch_end"
    ON_TEST_END = "on_test_end"
    ON_PREDICT_START = "on_predict_start"
    ON_PREDICT_EPOCH_START = "on_predict_epoch_start"
    ON_PREDICT_BATCH_START = "on_predict_batch_start"
    ON_PREDICT_BATCH_END = "on_predict_batch_end"
    ON_PREDICT_EPOCH_END = "on_predict_epoch_end"
    ON_PREDICT_END = "on_predict_end"
    ON_SAVE_CHECKPOINT = "on_save_checkpoint"
    ON_EXCEPTION = "on_exception"
    TEARDOWN = "teardown"

    def __str__(self) -> str:
        return self.value


#: every hook a callback can override (the values of :class:`Event`)
HOOKS = tuple(e.value for e in Event)


class Callback:
    """Override the hooks you need. ``state_dict``/``load_state_dict`` are stored
    in checkpoints under ``state_key``.

    A callback may switch hooks off per instance by listing their names in
    ``self.inactive_hooks`` before the trainer's setup (e.g. a checkpoint callback
    that only saves at epoch end does not need ``on_train_batch_end``).
    """

    inactive_hooks: frozenset = frozenset()

    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints (plain values and tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        """Called at the start of fit/validate/test/predict (``stage``), after the strategy is set up."""

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        """Called at the end of fit/validate/test/predict, also after an error."""

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called once at the start of ``fit`` (after any checkpoint restore)."""

    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called once at the end of a ``fit`` that did not raise (also one stopped for a preemption signal)."""

    def on_sanity_check_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called before the validation sanity check."""

    def on_sanity_check_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the validation sanity check."""

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called before the first training epoch."""

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the last training epoch."""

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of each training epoch."""

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the end of each training epoch, after its validation (checkpoints and early stopping act here)."""

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        """Called before each ``training_step``."""

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each training batch (and its optimizer step on a window's last micro-batch)."""

    def on_before_backward(self, trainer: Trainer, module: TrainModule, loss: Any) -> None:
        """Called before the backward of each training micro-batch, with the loss that is
        back-propagated (divided by the accumulation window's size or item count)."""

    def on_after_backward(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the backward of each training micro-batch."""

    def on_before_optimizer_step(self, trainer: Trainer, module: TrainModule, optimizer: Any) -> None:
        """Called before each optimizer step, with unscaled gradients."""

    def on_before_zero_grad(self, trainer: Trainer, module: TrainModule, optimizer: Any) -> None:
        """Called before an optimizer's gradients are zeroed, after the optimizer step."""

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of a validation pass (not during the sanity check)."""

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after a validation pass, once its epoch values are emitted."""

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called before the first batch of a validation pass."""

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the last batch of a validation pass, before its values are emitted."""

    def on_validation_batch_start(self, trainer: Trainer, module: TrainModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each ``validation_step``."""

    def on_validation_batch_end(self, trainer: Trainer, module: TrainModule,
                                outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each ``validation_step`` with its output."""

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of the test loop."""

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the test loop, once its values are emitted."""

    def on_test_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called before the first test batch."""

    def on_test_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the last test batch, before its values are emitted."""

    def on_test_batch_start(self, trainer: Trainer, module: TrainModule,
                            batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each ``test_step``."""

    def on_test_batch_end(self, trainer: Trainer, module: TrainModule,
                          outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each ``test_step`` with its output."""

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the start of ``predict``."""

    def on_predict_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called at the end of ``predict``."""

    def on_predict_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        """Called before the first predict batch."""

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        """Called after the last predict batch."""

    def on_predict_batch_start(self, trainer: Trainer, module: TrainModule,
                               batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called before each ``predict_step``."""

    def on_predict_batch_end(self, trainer: Trainer, module: TrainModule,
                             outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Called after each ``predict_step`` with its output."""

    def on_save_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict) -> None:
        """Called when a checkpoint is written; add plain values or tensors to ``checkpoint``."""

    def on_load_checkpoint(self, trainer: Trainer, module: TrainModule, checkpoint: dict) -> None:
        """Called when a checkpoint is restored."""

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        """Called when fit/validate/test/predict raises (also on Ctrl-C), before the loggers are finalized."""
