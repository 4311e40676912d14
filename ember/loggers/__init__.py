"""Experiment loggers: TensorBoard, Weights & Biases, CSV, MLflow.

``import ember.loggers`` imports none of tensorboard, wandb, mlflow or yaml; each
logger imports its backend on first use.
"""

from __future__ import annotations

import os

from ember.errors import invalid_choice
from ember.loggers.base import Logger
from ember.loggers.csv_logs import CSVLogger
from ember.loggers.mlflow_logs import MLFlowLogger
from ember.loggers.tensorboard import TensorBoardLogger
from ember.loggers.wandb import WandbLogger

__all__ = ["Logger", "TensorBoardLogger", "CSVLogger", "WandbLogger", "MLFlowLogger", "build_logger", "loggers_for"]

LOGGER_CHOICES = ("tensorboard", "wandb", "csv", "mlflow")


def build_logger(spec, *, save_dir, name: str | None = None, **kw) -> Logger:
    """Turn ``"tensorboard"``, ``"wandb"``, ``"csv"``, ``"mlflow"`` or a :class:`Logger` into a Logger.

    ``save_dir`` is the root folder; ``name`` is the experiment folder of the
    file loggers (default ``"ember_logs"``), the *project* of W&B and the
    experiment of MLflow (default ``"lightning_logs"``, in ``save_dir/mlruns``). Extra
    keyword arguments go to the logger's constructor. A Logger instance is
    returned as is (``save_dir``, ``name`` and ``kw`` are then ignored).
    """
    if isinstance(spec, Logger):
        return spec
    key = spec.strip().lower() if isinstance(spec, str) else None
    if key == "tensorboard":
        return TensorBoardLogger(save_dir, **({"name": name} if name is not None else {}), **kw)
    if key == "csv":
        return CSVLogger(save_dir, **({"name": name} if name is not None else {}), **kw)
    if key == "wandb":
        return WandbLogger(project=kw.pop("project", name), save_dir=save_dir, **kw)
    if key == "mlflow":
        kw.setdefault("save_dir", os.path.join(save_dir, "mlruns"))
        return MLFlowLogger(**({"experiment_name": name} if name is not None else {}), **kw)
    raise invalid_choice("log_with", spec, list(LOGGER_CHOICES))


def loggers_for(arg, save_dir) -> list[Logger]:
    """The Logger objects ``Trainer(logger=arg)`` stands for: ``True`` a TensorBoardLogger
    under ``save_dir``, ``False``/``None`` none, ``"tensorboard"``/``"csv"``/``"wandb"``/``"mlflow"`` (or a
    list of them and of Loggers) those. The Trainer builds them when it is built (a logger
    writes nothing before its first call), so ``trainer.logger`` / ``trainer.loggers`` can be
    used before ``fit`` (``trainer.logger.log_hyperparams(...)``, as the lightning-hydra-template
    does) and ``fit`` logs into the same objects, merging the module's hparams with those."""
    if arg is True:
        return [TensorBoardLogger(save_dir)]
    if arg is False or arg is None:
        return []
    items = arg if isinstance(arg, (list, tuple)) else [arg]
    return [build_logger(x, save_dir=save_dir) for x in items]
