"""``lightning.fabric.loggers`` under ember: the loggers with Lightning Fabric's signatures
(``root_dir``, ``name="lightning_logs"``, ``version``); files go to
``root_dir/name/version_N`` as in Fabric. ``Fabric(loggers=...)`` writes to them. (The
Trainer's loggers, :mod:`ember.loggers`, take Lightning Trainer's ``save_dir``.)"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

from ember.errors import MisconfigurationError
from ember.loggers.base import Logger
from ember.loggers.csv_logs import CSVLogger as _CSVLogger
from ember.loggers.tensorboard import TensorBoardLogger as _TensorBoardLogger

__all__ = ["Logger", "CSVLogger", "TensorBoardLogger"]

_FABRIC_NAME = "lightning_logs"


class TensorBoardLogger(_TensorBoardLogger):
    """TensorBoard event files in ``root_dir/name/version_N`` (Lightning Fabric's signature).

    Args:
        root_dir: root folder (``tensorboard --logdir root_dir``).
        name: experiment folder under ``root_dir`` (``""`` or None: none).
        version: ``None`` (next free ``version_N``), an int, or a folder name.
        default_hp_metric: also log ``hp_metric = -1`` with the hyperparameters (Fabric's default).
        prefix: prepended to every metric name.
        sub_dir: only None (a folder under the version is not supported).
        **kwargs: ``SummaryWriter``'s (``max_queue``, ``flush_secs``, ``filename_suffix``, ...);
            any other keyword is an error naming it.
    """

    def __init__(self, root_dir: Union[str, os.PathLike], name: Optional[str] = _FABRIC_NAME,
                 version: Optional[Union[int, str]] = None, default_hp_metric: bool = True, prefix: str = "",
                 sub_dir: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> None:
        if sub_dir is not None:
            raise MisconfigurationError("TensorBoardLogger(sub_dir=...) is not supported: put the folder in "
                                        "version= (e.g. version='version_0/train')")
        super().__init__(root_dir, name=name or "", version=version, default_hp_metric=default_hp_metric,
                         prefix=prefix, **kwargs)


class CSVLogger(_CSVLogger):
    """``metrics.csv`` and ``hparams.yaml`` in ``root_dir/name/version_N`` (Lightning Fabric's signature).

    Args:
        root_dir: root folder.
        name: experiment folder under ``root_dir`` (``""`` or None: none).
        version: ``None`` (next free ``version_N``), an int, or a folder name.
        prefix: prepended to every metric name.
        flush_logs_every_n_steps: rows are written once this many ``log_metrics`` calls are pending.
    """

    def __init__(self, root_dir: Union[str, os.PathLike], name: Optional[str] = _FABRIC_NAME,
                 version: Optional[Union[int, str]] = None, prefix: str = "",
                 flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(root_dir, name=name or "", version=version, flush_logs_every_n_steps=flush_logs_every_n_steps,
                         prefix=prefix)
