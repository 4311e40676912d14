"""CSV logger: ``metrics.csv`` and ``hparams.yaml`` in a plain folder."""

from __future__ import annotations

import csv
import os
from typing import Any

from ember.errors import MisconfigurationError
from ember.loggers.base import DEFAULT_NAME, FileLogger, add_prefix, check_status, to_scalar

METRICS_FILE = "metrics.csv"


class _CSVWriter:
    """Buffers metric rows and writes them to ``log_dir/metrics.csv``.

    The first column is ``step``; then one column per metric name, in order
    of first appearance. A row holds what one ``log_metrics`` call logged;
    other cells are empty. When a later row brings a metric the file has no
    column for, the whole file is rewritten with the union of the columns.
    """

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, METRICS_FILE)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        self._file_columns: list[str] | None = None  # header of the file on disk

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": int(step)}
        for k, v in metrics.items():
            if k == "step":
                raise MisconfigurationError(
                    "metric name 'step' is reserved by CSVLogger for the step column; rename the metric")
            row[k] = to_scalar(v)
            if k not in self.columns:
                self.columns.append(k)
        self.rows.append(row)

    def _read_header(self) -> list[str] | None:
        if not os.path.isfile(self.metrics_file_path):
            return None
        with open(self.metrics_file_path, newline="", encoding="utf-8") as f:
            return next(csv.reader(f), None)

    def save(self) -> None:
        if not self.rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        if self._file_columns is None:
            # a file from an earlier run into the same version folder: keep its rows
            self._file_columns = self._read_header()
            if self._file_columns:
                self.columns = self._file_columns + [c for c in self.columns if c not in self._file_columns]
        if self._file_columns is not None and self._file_columns != self.columns:
            self._rewrite()
        else:
            new = self._file_columns is None
            with open(self.metrics_file_path, "a" if not new else "w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, fieldnames=self.columns, restval="")
                if new:
                    w.writeheader()
                w.writerows(self.rows)
        self._file_columns = list(self.columns)
        self.rows = []

    def _rewrite(self) -> None:
        with open(self.metrics_file_path, newline="", encoding="utf-8") as f:
            old_rows = list(csv.DictReader(f))
        tmp = self.metrics_file_path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, restval="")
            w.writeheader()
            w.writerows(old_rows)
            w.writerows(self.rows)
        os.replace(tmp, self.metrics_file_path)


class CSVLogger(FileLogger):
    """Logs metrics to ``save_dir/name/version_N/metrics.csv`` and
    hyperparameters to ``hparams.yaml`` next to it. No dependency beyond
    PyYAML; handy where TensorBoard or W&B are not wanted.

    Args:
        save_dir: root folder.
        name: experiment folder under ``save_dir`` (``""``: none).
        version: ``None`` (next free ``version_N``), an int, or a folder name.
        flush_logs_every_n_steps: rows are buffered and written once this many
            ``log_metrics`` calls are pending, and on ``save()`` / ``finalize()``.
        prefix: prepended to every metric name as ``"{prefix}-{name}"``.
    """

    def __init__(self, save_dir: str | os.PathLike, name: str | None = DEFAULT_NAME, version: int | str | None = None,
                 flush_logs_every_n_steps: int = 100, prefix: str = ""):
        super().__init__(save_dir, name=name, version=version, prefix=prefix)
        if not isinstance(flush_logs_every_n_steps, int) or flush_logs_every_n_steps < 1:
            raise MisconfigurationError(
                f"flush_logs_every_n_steps={flush_logs_every_n_steps!r} is not valid; use an int >= 1")
        self._flush_every = flush_logs_every_n_steps
        self._experiment = None

    @property
    def experiment(self) -> _CSVWriter:
        """The writer that buffers rows for ``metrics.csv``."""
        if self._experiment is None:
            self._experiment = _CSVWriter(self.log_dir)
        return self._experiment

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self.experiment
        writer.log_metrics(add_prefix(metrics, self._prefix), step)
        if len(writer.rows) >= self._flush_every:
            self.save()

    def log_hyperparams(self, params) -> None:
        """Merge ``params`` into ``hparams.yaml`` (nested; values that are not
        numbers, strings, bools or None are stored as ``str(value)``)."""
        self._merge_hparams(params)
        self._write_hparams_yaml()

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.save()

    def finalize(self, status: str) -> None:
        check_status(status)
        self.save()
