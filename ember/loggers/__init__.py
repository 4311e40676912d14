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

__all__ = ["Logger", "TensorBoardLogger", "CSVLogger", "WandbLogger", "build_logger"]

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
