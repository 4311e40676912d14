"""Optuna: prune unpromising trials of a hyperparameter search from inside ``fit``.

``optuna`` is imported only when a pruned trial raises (``import ember.integrations.optuna``
imports nothing heavy); install it with ``pip install "ember[optuna]"``.

One process per trial (the usual search)::

    import optuna
    from ember.integrations.optuna import PruningCallback

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        trainer = ember.Trainer(max_epochs=10, callbacks=[PruningCallback(trial, monitor="val/loss")])
        trainer.fit(Model(lr), datamodule=data)          # raises optuna.TrialPruned when pruned
        return trainer.callback_metrics["val/loss"].item()

    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.MedianPruner())
    study.optimize(objective, n_trials=20)

Under several processes (``Trainer(devices=N)`` or ``ember launch``) every rank runs the
script; the study lives on rank 0 only: rank 0 runs ``study.optimize(objective, ...)``, the
other ranks run ``objective(None)`` once per trial, with the trial's hyperparameters sent from
rank 0 (docs/tools.md shows the whole script). ``PruningCallback(None, monitor)`` on those
ranks asks nothing; rank 0's decision (or the error its trial raised) reaches them at the
same validation, in one broadcast.
"""
from __future__ import annotations

from typing import Any

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError

#: the extra to install for the pruning callback
INSTALL = 'pip install "ember[optuna]"'

__all__ = ["PruningCallback"]


class PruningCallback(Callback):
    """Report a validation metric to an Optuna trial and stop the fit when the trial's
    pruner says so (ember's ``optuna_integration.PyTorchLightningPruningCallback``).

    Args:
        trial: the ``optuna.trial.Trial`` of this fit (the argument of the objective). On
            the ranks other than global rank 0 of a multi-process fit, pass it or ``None``:
            only rank 0 talks to the trial.
        monitor: the logged metric to report, e.g. ``"val/loss"`` (log it with
            ``sync_dist=True`` under several processes: rank 0's value is reported).

    After every validation of a fit (not the sanity check, not ``trainer.validate``), rank 0
    reports the metric with ``trial.report(value, step=epoch)`` and asks
    ``trial.should_prune()``; under several processes its verdict reaches every rank in one
    broadcast per validation (an error of the trial's storage too: rank 0 raises it, the
    others a ``DistributedOperationError`` naming it, so no rank waits). When the trial is to
    be pruned every rank asks the Trainer to stop (``trainer.request_stop("pruned")``; the
    fit stops at the epoch end, or the next optimizer step after a mid-epoch validation),
    the fit ends cleanly (``on_train_end``, checkpoints, loggers finalised with
    ``"success"``, ``trainer.stop_reason == "pruned"``), and then ``fit`` raises
    ``optuna.TrialPruned`` on every rank, so ``study.optimize`` records the trial as PRUNED.
    ``min_epochs`` does not hold a pruned trial back: the pruner's own warm-up decides.

    A ``monitor`` that was not logged is an error naming the metrics that were.
    """

    def __init__(self, trial: Any, monitor: str) -> None:
        from ember.checkpoint.rng import require_package
        require_package("optuna", "PruningCallback", INSTALL)
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationError(f"PruningCallback(monitor={monitor!r}): name the logged metric to "
                                        "report, e.g. monitor='val/loss'")
        self.trial = trial
        self.monitor = monitor
        self.pruned_epoch: int | None = None   # the epoch whose validation pruned the trial
        self._epoch: int | None = None         # the epoch of the last validation (every rank)

    def on_fit_start(self, trainer, module) -> None:
        self.pruned_epoch = self._epoch = None

    def on_validation_end(self, trainer, module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:   # every rank sees the same names (sync_dist or not): every rank raises
            raise MisconfigurationError(
                f"PruningCallback(monitor={self.monitor!r}) could not find the metric: "
                f"{trainer.describe_missing_metric(self.monitor)}. Metrics logged: "
                f"{sorted(trainer.callback_metrics)}. Log it with self.log({self.monitor!r}, ...) in "
                "validation_step (or on_validation_epoch_end), or pass the name of one of these.")
        epoch = self._epoch = trainer.current_epoch
        prune = failed = None
        if trainer.is_global_zero and self.trial is not None:
            try:   # once per validation: a Python number here is fine
                self.trial.report(float(value), step=epoch)
                prune = bool(self.trial.should_prune())
            except Exception as err:   # the study's storage: every rank ends with it, none waits
                failed = err
        if trainer.world_size > 1:   # rank 0's verdict, on every rank at this validation
            from ember.errors import DistributedOperationError
            from ember.strategies.full_load import raise_rank0_error
            prune = raise_rank0_error(trainer.strategy, failed, "PruningCallback: the trial's report failed on rank 0",
                                      value=prune, kind=DistributedOperationError)
        if failed is not None:
            raise failed
        if prune:
            self.pruned_epoch = epoch
            trainer.request_stop("pruned", agreed=trainer.world_size > 1)

    def on_fit_end(self, trainer, module) -> None:
        if trainer.stop_reason != "pruned":
            return
        from ember.checkpoint.rng import import_optional
        optuna = import_optional("optuna", "PruningCallback", INSTALL)
        epoch = self.pruned_epoch if self.pruned_epoch is not None else self._epoch
        trainer.raise_after_fit(optuna.TrialPruned(f"Trial was pruned at epoch {epoch}."))
