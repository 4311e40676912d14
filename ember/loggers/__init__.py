"""Experiment loggers: TensorBoard, Weights & Biases, CSV.

``import ember.loggers`` imports none of tensorboard, wandb or yaml; each
logger imports its backend on first use.
"""

from __future__ import annotations

from ember.errors import invalid_choice
from ember.loggers.base import Logger
from ember.loggers.csv_logs import CSVLogger
from ember.loggers.tensorboard import TensorBoardLogger
from ember.loggers.wandb import WandbLogger

__all__ = ["Logger", "TensorBoardLogger", "CSVLogger", "WandbLogger", "build_logger", "loggers_for"]

LOGGER_CHOICES = ("tensorboard", "wandb", "csv")


def build_logger(spec, *, save_dir, name: str | None = None, **kw) -> Logger:
    """Turn ``"tensorboard"``, ``"wandb"``, ``"csv"`` or a :class:`Logger` into a Logger.

    ``save_dir`` is the root folder; ``name`` is the experiment folder of the
    file loggers (default ``"ember_logs"``) and the *project* of W&B. Extra
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
    raise invalid_choice("log_with", spec, list(LOGGER_CHOICES))


def loggers_for(arg, save_dir) -> list[Logger]:
    """The Logger objects ``Trainer(logger=arg)`` stands for: ``True`` a TensorBoardLogger
    under ``save_dir``, ``False``/``None`` none, ``"tensorboard"``/``"csv"``/``"wandb"`` (or a
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
