"""The Accelerator's trackers (``log_with=``, ``init_trackers``, ``get_tracker``): ember
loggers built by name."""
from __future__ import annotations

import os
from typing import Any

from ember.errors import MisconfigurationError, invalid_choice


# -- trackers ------------------------------------------------------------------------------------
def tracker_name(spec: Any) -> str:
    """The name of a ``log_with`` entry (a string, or a Logger's name)."""
    if isinstance(spec, str):
        return spec.strip().lower()
    from ember.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
    for cls, name in ((TensorBoardLogger, "tensorboard"), (CSVLogger, "csv"), (WandbLogger, "wandb"),
                      (MLFlowLogger, "mlflow")):
        if isinstance(spec, cls):
            return name
    name = getattr(spec, "tracker_name", None) or type(spec).__name__.lower()
    return name[:-6] if name.endswith("logger") and len(name) > 6 else name


def check_log_with(log_with: Any) -> list:
    """``log_with`` as a list, each entry checked (at construction)."""
    from ember.loggers import LOGGER_CHOICES, Logger
    specs = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    out = []
    for s in specs:
        key = s.strip().lower() if isinstance(s, str) else None
        if not isinstance(s, Logger) and key not in LOGGER_CHOICES + ("all",):
            raise invalid_choice("log_with", s, list(LOGGER_CHOICES) + ["all", "a Logger", "a list of these"])
        if key == "mlflow":
            from ember.checkpoint.rng import require_package
            from ember.loggers.mlflow_logs import INSTALL
            require_package("mlflow", 'log_with="mlflow"', INSTALL)   # said at construction, before any work
        out += ["tensorboard", "csv"] if key == "all" else [key or s]
    return out


def init_trackers(acc: Any, project_name: str, config: dict | None, init_kwargs: dict | None) -> None:
    """``Accelerator.init_trackers``."""
    from ember.loggers import build_logger
    from ember.loggers.base import next_version
    acc.trackers = []
    acc._log_step = 0
    if not acc.is_main_process:
        return
    init_kwargs = init_kwargs or {}
    version = None  # file loggers share one version_N folder
    for spec in acc.log_with:
        key = tracker_name(spec)
        kw = dict(init_kwargs.get(key, {}))
        if key in ("tensorboard", "csv") and isinstance(spec, str):
            if version is None:
                version = kw.get("version", next_version(os.path.join(acc.project_dir, project_name)))
            kw.setdefault("version", version)
        if key == "wandb" and isinstance(spec, str):   # kw may hold the run's own ``name``
            from ember.loggers import WandbLogger
            tracker = WandbLogger(project=kw.pop("project", project_name), save_dir=acc.project_dir, **kw)
        elif key == "mlflow" and isinstance(spec, str):
            tracker = mlflow_tracker(acc, project_name, kw)
        else:
            tracker = build_logger(spec, save_dir=acc.project_dir, name=project_name, **kw)
        if config is not None:
            tracker.log_hyperparams(config)
        acc.trackers.append(tracker)


def mlflow_tracker(acc: Any, project_name: str, kw: dict) -> Any:
    """``log_with="mlflow"`` with Accelerate's MLflowTracker semantics: the experiment is
    ``$MLFLOW_EXPERIMENT_NAME``, else ``project_name``; ``$MLFLOW_RUN_ID`` and ``$MLFLOW_TAGS``
    (JSON) win over ``run_id`` / ``tags`` in ``init_kwargs["mlflow"]``; ``run_name`` and
    ``description`` are taken too; the tracking URI is ``$MLFLOW_TRACKING_URI``, else a local
    store in ``project_dir/mlruns`` (the other MLFlowLogger arguments may be given there too)."""
    import json
    from ember.loggers import MLFlowLogger
    kw = dict(kw)
    if kw.pop("nested_run", False):
        raise MisconfigurationError('init_kwargs={"mlflow": {"nested_run": True}}: ember logs to its own run, '
                                    "never a nested one; leave nested_run out")
    experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or kw.pop("experiment_name", None) or project_name
    run_id = os.environ.get("MLFLOW_RUN_ID") or kw.pop("run_id", None)
    tags = os.environ.get("MLFLOW_TAGS") or kw.pop("tags", None)
    if isinstance(tags, str):
        tags = json.loads(tags)
    tags = dict(tags or {})
    description = kw.pop("description", None)
    if description is not None:
        tags["mlflow.note.content"] = description
    kw.setdefault("save_dir", os.path.join(acc.project_dir, "mlruns"))
    return MLFlowLogger(experiment_name=experiment, run_id=run_id, tags=tags or None, **kw)


class _NullTracker:
    """``get_tracker`` on non-main processes: every method does nothing."""
    name = "null"

    def __getattr__(self, name):
        return lambda *a, **k: None


def get_tracker(acc: Any, name: str, unwrap: bool) -> Any:
    """``Accelerator.get_tracker``."""
    if not acc.is_main_process:
        return _NullTracker()
    key = name.strip().lower()
    for tracker in acc.trackers:
        if tracker_name(tracker) == key:
            return tracker.experiment if unwrap else tracker
    have = [tracker_name(t) for t in acc.trackers]
    raise MisconfigurationError(f"get_tracker({name!r}): no such tracker; "
                                + (f"initialised: {have}" if have else
                                   "none is initialised (pass log_with= and call init_trackers() first)"))
