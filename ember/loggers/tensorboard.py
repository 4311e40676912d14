"""TensorBoard logger: scalars and hparams in one run folder."""

from __future__ import annotations

import os
import time
from typing import Any

from ember.loggers.base import DEFAULT_NAME, FileLogger, add_prefix, check_status, flatten_params, to_scalar


class TensorBoardLogger(FileLogger):
    """Writes TensorBoard event files to ``save_dir/name/version_N``.

    Args:
        save_dir: root folder (``tensorboard --logdir save_dir`` shows every run).
        name: experiment folder under ``save_dir`` (``""``: none).
        version: ``None`` (next free ``version_N``), an int, or a folder name.
        default_hp_metric: also log ``hp_metric = -1`` with the hparams so the
            HPARAMS tab has a metric column (the Lightning default is True).
        prefix: prepended to every metric name as ``"{prefix}-{name}"``.
        handoff_secs: scalars are kept here and handed to the writer at most every this
            many seconds (and at every ``save``/``finalize``), each with the wall time it
            was logged at. The SummaryWriter's thread then wakes once per hand-off instead
            of once per scalar, and takes the GIL from the training thread that rarely
            (docs/benchmarks.md). ``0``: hand each call's scalars over at once.
        **writer_kwargs: passed to ``torch.utils.tensorboard.SummaryWriter``
            (``max_queue``, ``flush_secs``, ``filename_suffix``...).
    """

    def __init__(self, save_dir: str | os.PathLike, name: str | None = DEFAULT_NAME, version: int | str | None = None,
                 default_hp_metric: bool = False, prefix: str = "", handoff_secs: float = 5.0, **writer_kwargs: Any):
        super().__init__(save_dir, name=name, version=version, prefix=prefix)
        self._default_hp_metric = default_hp_metric
        self._writer_kwargs = writer_kwargs
        self._experiment = None
        self._handoff_secs = float(handoff_secs)
        self._pending: list[tuple[str, Any, int, float]] = []
        self._handed_at = time.monotonic()

    @property
    def experiment(self):
        """The ``torch.utils.tensorboard.SummaryWriter`` (created on first use)."""
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._writer_kwargs)
        return self._experiment

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        wall = time.time()
        self._pending.extend((k, to_scalar(v), step, wall) for k, v in add_prefix(metrics, self._prefix).items())
        if time.monotonic() - self._handed_at >= self._handoff_secs or len(self._pending) >= 1000:
            self._hand_off()

    def _hand_off(self) -> None:
        """Give the kept scalars to the SummaryWriter (its thread writes them)."""
        self._handed_at = time.monotonic()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        writer = self.experiment
        for k, v, step, wall in pending:
            if isinstance(v, dict):
                writer.add_scalars(k, v, step, walltime=wall)
            else:
                writer.add_scalar(k, v, step, walltime=wall)

    def log_hyperparams(self, params, metrics: dict[str, float] | None = None) -> None:
        """Write ``hparams.yaml`` (nested, merged with earlier calls) into
        ``log_dir`` and record the flattened hparams in this run's event file,
        where TensorBoard's HPARAMS tab finds them.

        ``metrics`` (optional) are logged as scalars at step 0 and registered as
        the hparams metrics; with ``default_hp_metric=True`` and no metrics,
        ``hp_metric = -1`` is used."""
        from torch.utils.tensorboard.summary import hparams

        self._merge_hparams(params)
        self._write_hparams_yaml()
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        flat = flatten_params(self._hparams)
        exp, ssi, sei = hparams(flat, dict(metrics or {}))
        file_writer = self.experiment._get_file_writer()
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary)
        if metrics:
            self.log_metrics(metrics, 0)

    def save(self) -> None:
        self._hand_off()
        if self._experiment is not None:
            self._experiment.flush()

    def finalize(self, status: str) -> None:
        check_status(status)
        self._hand_off()
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
            # a later log call (e.g. trainer.test after fit) opens a new event
            # file in the same log_dir
            self._experiment = None
