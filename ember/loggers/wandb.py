"""Weights & Biases logger (``wandb`` is imported on first use only)."""

from __future__ import annotations

import os
from typing import Any

from ember.errors import invalid_choice
from ember.loggers.base import DEFAULT_NAME, NO_RUN, Logger, add_prefix, check_status, flatten_params, to_scalar

STEP_METRIC = "trainer/global_step"
INSTALL = "pip install wandb"


def _import_wandb():
    from ember.checkpoint.rng import import_optional
    return import_optional("wandb", "WandbLogger", INSTALL)


class WandbLogger(Logger):
    """Logs to a Weights & Biases run.

    Args:
        project: W&B project (``name`` of this logger). ``None``: W&B's default.
        name: display name of the run.
        save_dir: folder under which W&B creates ``wandb/<run folder>``;
            ``None`` means ``$WANDB_DIR`` or ``"."``.
        version: run id; give the id of an earlier run to resume it.
        offline: ``mode="offline"``: nothing is sent; upload later with
            ``wandb sync <save_dir>/wandb/offline-run-*``.
        log_model: ``False`` (no checkpoints), ``True`` (at ``finalize``, log
            the last checkpoint and the best one as versions of the artifact
            ``model-<run id>``), or ``"all"`` (every checkpoint when it is saved).
        prefix: prepended to every metric name as ``"{prefix}-{name}"``.
        experiment: an existing ``wandb`` run to log to instead of creating one.
        **init_kwargs: passed on to ``wandb.init`` (``entity``, ``tags``,
            ``group``, ``config``, ``notes``...).

    Metrics are logged together with ``trainer/global_step``, which every other
    metric uses as its x-axis (``define_metric``), so a resumed run whose step
    goes back never has its rows dropped by W&B's own monotone ``_step``.
    """

    def __init__(self, project: str | None = None, name: str | None = None, save_dir: str | os.PathLike | None = None,
                 version: str | None = None, offline: bool = False, log_model: bool | str = False,
                 prefix: str = "", experiment: Any = None, **init_kwargs: Any) -> None:
        if experiment is None:
            from ember.checkpoint.rng import require_package
            require_package("wandb", "WandbLogger", INSTALL)
        if log_model not in (True, False, "all"):
            raise invalid_choice("log_model", log_model, [False, True, "all"])
        if save_dir is None:
            save_dir = os.environ.get("WANDB_DIR") or "."
        self._project = project
        self._run_name = name
        self._save_dir = os.fspath(save_dir)
        self._id = version if version is None else str(version)
        self._offline = offline
        self._log_model = log_model
        self._prefix = prefix
        self._init_kwargs = init_kwargs
        self._experiment = experiment
        self._owns_run = experiment is None  # never finish a run the user handed in
        self._defined_metrics = False
        # checkpoints seen so far, for log_model=True: path -> (aliases, score)
        self._checkpoints: dict[str, tuple[tuple[str, ...], float | None]] = {}
        self._logged_artifacts: list[Any] = []
        self._run_dir: str | None = None

    # -- identity ---------------------------------------------------------
    @property
    def name(self) -> str:
        """The W&B project (what groups runs, like the experiment folder of the file loggers)."""
        if self._experiment is not None and getattr(self._experiment, "project", None):
            return self._experiment.project
        return self._project or DEFAULT_NAME

    @property
    def version(self) -> str | None:
        """The run id (``None`` until the run exists, unless ``version=`` was given)."""
        return self._experiment.id if self._experiment is not None else self._id

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        """The W&B run folder, ``save_dir/wandb/[offline-]run-<time>-<id>``
        (the parent of ``run.dir``); creates the run. Files put here are *not*
        uploaded: W&B uploads only what is in ``run.dir`` (``.../files``)."""
        if self._run_dir is not None:   # the run's folder, also after finalize(): never a second run
            return self._run_dir
        run = self.experiment
        if run is NO_RUN:   # another rank before the Trainer gave it rank 0's run
            return self._save_dir
        files_dir = getattr(run, "dir", None)
        self._run_dir = os.path.dirname(os.path.normpath(files_dir)) if files_dir else self._save_dir
        return self._run_dir

    @property
    def experiment(self):
        """The ``wandb`` run, created by ``wandb.init`` on first access. On a process whose
        global rank is not 0 (:func:`~ember.loggers.rank_zero.env_rank`) an object whose
        methods do nothing, as in Lightning: only rank 0 creates the run; under a Trainer
        the other ranks take its id and folder at setup (:meth:`use_run_key`)."""
        if self._experiment is None:
            from ember.loggers.rank_zero import env_rank
            if env_rank() != 0:
                return NO_RUN
            wandb = _import_wandb()
            if getattr(wandb, "run", None) is not None and self._id in (None, wandb.run.id):
                # the user already called wandb.init(): log into that run
                self._experiment = wandb.run
                self._owns_run = False
            else:
                os.makedirs(self._save_dir, exist_ok=True)
                kwargs = dict(project=self._project, name=self._run_name, dir=self._save_dir,
                              id=self._id, mode="offline" if self._offline else None, resume="allow")
                kwargs.update(self._init_kwargs)
                self._experiment = wandb.init(**kwargs)
                self._owns_run = True
            self._id = self._experiment.id
            files_dir = getattr(self._experiment, "dir", None)
            self._run_dir = os.path.dirname(os.path.normpath(files_dir)) if files_dir else self._run_dir
            self._defined_metrics = False
        if not self._defined_metrics and hasattr(self._experiment, "define_metric"):
            self._experiment.define_metric(STEP_METRIC)
            self._experiment.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
            self._defined_metrics = True
        return self._experiment

    def run_key(self) -> tuple[str, str]:
        """What every rank shares: the run id and folder (rank 0 creates the run; the others adopt it)."""
        return (self.experiment.id, self.log_dir)

    def use_run_key(self, key) -> None:
        self._id, self._run_dir = key

    # -- logging ----------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        row = {k: to_scalar(v) for k, v in add_prefix(metrics, self._prefix).items()}
        row[STEP_METRIC] = int(step)
        self.experiment.log(row)

    def log_hyperparams(self, params) -> None:
        """``run.config.update`` with the flattened params (``{"a": {"b": 1}}``
        becomes ``"a/b": 1``; values that are not numbers, str or bool become str)."""
        self.experiment.config.update(flatten_params(params), allow_val_change=True)

    # -- checkpoints ------------------------------------------------------
    def after_save_checkpoint(self, path: str, *, aliases=(), score: float | None = None) -> None:
        """Log the checkpoint (a directory or a single file) as a ``model``
        artifact: right away with ``log_model="all"``, at ``finalize`` with
        ``log_model=True``. The newest checkpoint gets the alias ``"latest"``;
        ``aliases`` (e.g. ``("best",)``) are added."""
        if not self._log_model:
            return
        path = os.fspath(path)
        aliases = tuple(a for a in aliases if a != "latest")
        if self._log_model == "all":
            self._log_checkpoint(path, ("latest", *aliases), score)
            return
        self._checkpoints.pop(path, None)  # re-saved: now the newest
        self._checkpoints[path] = (aliases, score)

    def _log_checkpoint(self, path: str, aliases, score) -> None:
        wandb = _import_wandb()
        run = self.experiment
        metadata = {"original_path": os.path.basename(path.rstrip(os.sep))}
        if score is not None:
            metadata["score"] = float(to_scalar(score))
        artifact = wandb.Artifact(name=f"model-{run.id}", type="model", metadata=metadata)
        if os.path.isdir(path):
            artifact.add_dir(path)
        else:
            artifact.add_file(path, name=os.path.basename(path))
        run.log_artifact(artifact, aliases=list(dict.fromkeys(aliases)))
        self._logged_artifacts.append(artifact)

    def _log_pending_checkpoints(self) -> None:
        """``log_model=True``: the newest checkpoint that still exists gets
        ``"latest"``; the newest one saved with the alias ``"best"`` gets ``"best"``."""
        exists = [p for p in self._checkpoints if os.path.exists(p)]
        todo: dict[str, list[str]] = {}
        best = [p for p in exists if "best" in self._checkpoints[p][0]]
        if best:
            todo[best[-1]] = []
        if exists:
            todo.setdefault(exists[-1], []).append("latest")
        # log the latest one last, so it is the newest version of the artifact
        for path in sorted(todo, key=lambda p: p == exists[-1]):
            aliases, score = self._checkpoints[path]
            self._log_checkpoint(path, (*todo[path], *aliases), score)
        self._checkpoints.clear()

    # -- end --------------------------------------------------------------
    def save(self) -> None:
        """W&B writes continuously; nothing to flush."""

    def finalize(self, status: str) -> None:
        """Log pending checkpoints (``log_model=True``, on success only) and
        finish the run with exit code 0 (success) or 1. A later call to any
        log method re-opens the same run id (``resume="allow"``). A run passed
        as ``experiment=`` (or one the user started with ``wandb.init``) is
        left open."""
        check_status(status)
        if self._log_model is True and status == "success" and self._checkpoints:
            self._log_pending_checkpoints()
        if self._experiment is None or not self._owns_run:
            return
        self._experiment.finish(exit_code=0 if status == "success" else 1)
        self._experiment = None
