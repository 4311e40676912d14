"""``RunRecord``: writes ``run.json`` (start/end time, status, stop reason, best
checkpoint, epoch boundaries) into the run's log folder at the end of ``fit``, so
``ember report`` can show them; with ``report=True`` it also renders the report.

The Trainer adds one to every run. It overrides no per-step hook: it costs nothing
per step.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import time

from ember.callbacks.base import Callback

RUN_FILE = "run.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


class RunRecord(Callback):
    """Records the facts of a ``fit`` in ``<log_dir>/run.json`` (rank 0, only when
    the trainer has a logger). ``report=True``: also writes ``<log_dir>/report.html``
    (see :mod:`ember.loggers.report`) and prints its path; ``trainer.report_path`` holds it."""

    state_key = "RunRecord"

    def __init__(self, report: bool = False):
        self.report = bool(report)
        if self.report:
            import importlib.util
            if importlib.util.find_spec("matplotlib") is None:   # fail now, not after the training
                from ember.errors import MisconfigurationError
                raise MisconfigurationError("report=True draws its charts with matplotlib: "
                                            "pip install 'ember[report]' (or pip install matplotlib)")
        self.info: dict = {}
        self._epoch_steps: list = []

    def setup(self, trainer, module, stage):
        if stage == "fit":
            self._t0 = time.monotonic()
            self._epoch_steps = []
            self.info = {"start_time": _now()}

    def on_train_epoch_end(self, trainer, module):
        self._epoch_steps.append(trainer.global_step)

    def on_fit_end(self, trainer, module):
        self._write(trainer, module, "success")

    def on_exception(self, trainer, module, exception):
        if trainer.stage == "fit":
            status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
            try:   # never hide the run's own error
                self._write(trainer, module, status, error=f"{type(exception).__name__}: {exception}")
            except Exception as err:   # noqa: BLE001
                import warnings
                warnings.warn(f"RunRecord: could not write {RUN_FILE}: {err!r}", stacklevel=2)

    def _write(self, trainer, module, status: str, error: str | None = None) -> None:
        if "start_time" not in self.info:
            return
        ckpt = trainer.checkpoint_callback
        best_score = getattr(ckpt, "best_model_score", None)
        self.info.update({
            "end_time": _now(), "duration_s": round(time.monotonic() - self._t0, 3), "status": status,
            "stop_reason": trainer.stop_reason, "error": error,
            "global_step": trainer.global_step, "epochs_completed": len(self._epoch_steps),
            "epoch_end_steps": list(self._epoch_steps), "max_epochs": trainer.max_epochs,
            "max_steps": trainer.max_steps, "module": type(module).__name__,
            "strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size,
            "precision": trainer.precision,
            "best_model_path": getattr(ckpt, "best_model_path", "") or None,
            "best_model_score": None if best_score is None else float(best_score),
            "monitor": getattr(ckpt, "monitor", None),
            "last_model_path": getattr(ckpt, "last_model_path", "") or None,
        })
        if not trainer.is_global_zero:
            return
        if not trainer.loggers:
            if self.report:
                import warnings
                warnings.warn("Trainer(report=True) needs a logger (the report reads its logs); "
                              "pass logger=True or a CSVLogger / TensorBoardLogger", stacklevel=2)
            return
        log_dir = trainer.log_dir
        if not isinstance(log_dir, (str, os.PathLike)):   # a logger without a folder
            if self.report:
                import warnings
                warnings.warn(f"Trainer(report=True): the logger {type(trainer.loggers[0]).__name__} has no "
                              "log folder; use a CSVLogger or TensorBoardLogger", stacklevel=2)
            return
        log_dir = os.fspath(log_dir)
        for lg in trainer.loggers:   # flush buffered rows so the report sees every value
            lg.save()
        os.makedirs(log_dir, exist_ok=True)
        tmp = os.path.join(log_dir, RUN_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.info, f, indent=1, default=str)
        os.replace(tmp, os.path.join(log_dir, RUN_FILE))
        if self.report and status == "success":
            from ember.loggers.report import write_report
            try:
                trainer.state.report_path = write_report([log_dir], os.path.join(log_dir, "report.html"))
            except Exception as err:   # noqa: BLE001 - the run has finished: a report that fails never fails it
                import warnings
                warnings.warn(f"Trainer(report=True): the run report could not be written ({type(err).__name__}: "
                              f"{err}); the run itself succeeded. Try `ember report {log_dir}`", stacklevel=2)
                return
            print(f"run report: {trainer.report_path}")
