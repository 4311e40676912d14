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
    from ember.loggers import CSVLogger, TensorBoardLogger, WandbLogger
    for cls, name in ((TensorBoardLogger, "tensorboard"), (CSVLogger, "csv"), (WandbLogger, "wandb")):
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
        else:
            tracker = build_logger(spec, save_dir=acc.project_dir, name=project_name, **kw)
        if config is not None:
            tracker.log_hyperparams(config)
        acc.trackers.append(tracker)


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
