"""MLflow logger (``mlflow`` is imported on first use only; ``mlflow-skinny`` is enough)."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import warnings
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

from ember.errors import invalid_choice
from ember.loggers.base import NO_RUN, Logger, add_prefix, check_status, to_scalar

#: the extra to install for MLflow
INSTALL = 'pip install "ember[mlflow]"'
#: the run status MLflow records for each of ember's end statuses
RUN_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
#: characters MLflow refuses in a metric name (it allows letters, digits, ``_ - . / : `` and space)
_BAD_NAME_CHARS = re.compile(r"[^\w/.\- :]+")
LOCAL_FILE_URI_PREFIX = "file:"


def _import_mlflow():
    from ember.checkpoint.rng import import_optional
    mlflow = import_optional("mlflow", "MLFlowLogger", INSTALL)
    import_optional("mlflow.tracking", "MLFlowLogger", INSTALL)   # MlflowClient's module
    return mlflow


def _metric_class():
    """``mlflow.entities.Metric``: imported once, keeping the user's random streams (a log
    point after the first takes it from ``sys.modules`` without copying the RNG states)."""
    import sys
    entities = sys.modules.get("mlflow.entities")
    if entities is None:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():
            import mlflow.entities as entities
    return entities.Metric


def flatten_lightning(params: Any, delimiter: str = "/") -> dict[str, Any]:
    """Lightning's flattening of hyperparameters: nested mappings, ``argparse.Namespace``
    and dataclass instances become ``{"a/b": value}``; other values are kept as they are
    (0-d tensors become numbers). An empty mapping contributes no key."""
    if params is None:
        return {}
    if isinstance(params, Namespace):
        params = vars(params)
    elif is_dataclass(params) and not isinstance(params, type):
        params = asdict(params)
    if not isinstance(params, Mapping):
        raise invalid_choice("params", type(params).__name__, ["a dict", "an argparse.Namespace", "a dataclass"])
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Namespace):
            value = vars(value)
        elif is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}{delimiter}{k}" if prefix else str(k), v)
        else:
            out[prefix] = to_scalar(value)

    for k, v in params.items():
        walk(str(k), v)
    return out


def _local_mlruns(path: str) -> bool:
    """``path`` holds an MLflow file store (an experiment folder with its ``meta.yaml``)."""
    try:
        with os.scandir(path) as entries:
            return any(e.is_dir() and e.name.isdigit() and os.path.exists(os.path.join(e.path, "meta.yaml"))
                       for e in entries)
    except OSError:
        return False


def _local_path(uri: str) -> str | None:
    """The local path of a ``file:`` URI or a plain path; None for a remote location."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return url2pathname(parsed.path)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):   # a path (C:\\ on Windows)
        return uri or None
    return None


class MLFlowLogger(Logger):
    """Logs to an `MLflow <https://mlflow.org>`_ run, with Lightning's ``MLFlowLogger`` arguments.

    Install the extra: ``pip install "ember[mlflow]"`` (``mlflow-skinny`` is enough).

    Args:
        experiment_name: the MLflow experiment; created when it does not exist.
        run_name: the new run's name (the ``mlflow.runName`` tag).
        tracking_uri: where the runs are recorded (``http://...``, ``sqlite:///...``,
            ``file:...``, ``databricks``). ``None``: ``$MLFLOW_TRACKING_URI``, else a local store
            in ``save_dir``: an SQLite database ``save_dir/mlflow.db`` with the artifacts under
            ``save_dir`` (MLflow 3 refuses new file stores), or, when ``save_dir`` already holds
            a file store (``mlruns`` of earlier MLflow versions), that file store (MLflow then
            asks for ``MLFLOW_ALLOW_FILE_STORE=true``).
        tags: tags set on a new run.
        save_dir: the local folder of the default store (above), and of the run's local folder
            :attr:`log_dir` (checkpoints) when the artifacts are not local.
        log_model: ``False`` (no checkpoint uploaded), ``True`` (at the end of a successful fit,
            the best checkpoint, or the newest when none is best), ``"all"`` (every checkpoint,
            when it is saved). Each goes to the run's artifacts as ``checkpoints/<name>/``, with
            ``checkpoints/<name>.json`` holding its aliases (``latest``, ``best``) and score.
        prefix: prepended to every metric name as ``"{prefix}-{name}"``.
        artifact_location: the artifact location of a new experiment.
        run_id: continue this existing run (e.g. after ``ckpt_path="last"``) instead of starting
            a new one: it is set back to RUNNING, and its params are known (a param logged
            again with the same value is fine; MLflow never changes one).
        synchronous: passed to MLflow's ``log_batch`` (``False``: log in the background).

    What is sent: hyperparameters as params (nested values flattened as Lightning does,
    ``{"optim": {"lr": 0.1}}`` -> ``optim/lr``; values longer than MLflow's limit are cut,
    with a warning); metrics with the global step, in one ``log_batch`` request per log
    point. The run ends ``FINISHED`` after a fit, ``FAILED`` when fit raised, ``KILLED``
    after Ctrl-C; a later ``trainer.test()`` logs into the same run.

    :attr:`experiment` is the ``mlflow.tracking.MlflowClient`` (as in Lightning):
    ``self.logger.experiment.log_text(self.logger.run_id, "...", "notes.txt")``.
    Under several processes only rank 0 creates the run; the other ranks take its ids at
    setup (no other rank talks to the tracking server).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, experiment_name: str = "lightning_logs", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, Any] | None = None,
                 save_dir: str | os.PathLike | None = "./mlruns", log_model: bool | str = False, prefix: str = "",
                 artifact_location: str | None = None, run_id: str | None = None,
                 synchronous: bool | None = None) -> None:
        from ember.checkpoint.rng import require_package
        require_package("mlflow", "MLFlowLogger", INSTALL)
        if log_model not in (True, False, "all"):
            raise invalid_choice("log_model", log_model, [False, True, "all"])
        self._save_dir = os.fspath(save_dir) if save_dir is not None else "./mlruns"
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self._local_default = tracking_uri is None
        if tracking_uri is None:
            if _local_mlruns(self._save_dir):
                tracking_uri = LOCAL_FILE_URI_PREFIX + os.path.abspath(self._save_dir)
                self._local_default = False
            else:
                tracking_uri = "sqlite:///" + os.path.abspath(os.path.join(self._save_dir, "mlflow.db"))
        self._tracking_uri = os.fspath(tracking_uri)
        self._experiment_name = experiment_name
        self._run_name = run_name
        self.tags = dict(tags) if tags else None
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._run_dir: str | None = None
        self._batch_kwargs = {} if synchronous is None else {"synchronous": synchronous}
        self._experiment = None          # the MlflowClient, once the run exists
        self._params: dict[str, str] = {}   # what the run holds (MLflow never changes a param)
        self._names: dict[str, str] = {}    # metric name -> the name MLflow accepts
        self._warned: set[str] = set()
        self._checkpoints: dict[str, tuple[tuple[str, ...], float | None]] = {}

    # -- the run ------------------------------------------------------------------------------
    @property
    def experiment(self):
        """The ``mlflow.tracking.MlflowClient`` of the run (the run is created on first access,
        or the run ``run_id`` is continued). On a process whose global rank is not 0
        (:func:`~ember.loggers.rank_zero.env_rank`) an object whose methods do nothing, as in Lightning:
        ``self.logger.experiment.log_text(...)`` in a hook that runs on every rank logs once."""
        if self._experiment is not None:
            return self._experiment
        from ember.loggers.rank_zero import env_rank
        if env_rank() != 0:
            return NO_RUN
        _import_mlflow()
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # MLflow names a run by drawing from Python's `random`
            return self._start_run()

    def _start_run(self):
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():
            from mlflow.tracking import MlflowClient
            from mlflow.tracking.context.registry import resolve_tags
        if self._local_default:
            os.makedirs(self._save_dir, exist_ok=True)
        client = MlflowClient(self._tracking_uri)
        if self._run_id is not None:
            run = client.get_run(self._run_id)
            if run.info.status != "RUNNING":
                client.update_run(self._run_id, status="RUNNING")
            self._params = dict(run.data.params)
        else:
            exp = client.get_experiment_by_name(self._experiment_name)
            if exp is not None and exp.lifecycle_stage != "deleted":
                experiment_id = exp.experiment_id
            else:
                location = self._artifact_location
                if location is None and self._local_default:
                    location = os.path.abspath(self._save_dir)   # next to mlflow.db, not in the cwd
                experiment_id = client.create_experiment(self._experiment_name, artifact_location=location)
            tags = dict(self.tags or {})
            if self._run_name is not None:
                tags["mlflow.runName"] = self._run_name
            run = client.create_run(experiment_id, tags=resolve_tags(tags), run_name=self._run_name)
            self._run_id = run.info.run_id
        self._experiment_id = run.info.experiment_id
        local = _local_path(run.info.artifact_uri or "")
        self._run_dir = os.path.dirname(local.rstrip(os.sep)) if local else \
            os.path.join(self._save_dir, self._experiment_id, self._run_id)
        self._experiment = client
        return client

    @property
    def run_id(self) -> str:
        """The MLflow run id (creates the run)."""
        if self._run_id is None or self._experiment_id is None:
            _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> str:
        """The MLflow experiment id (creates the run)."""
        if self._experiment_id is None:
            _ = self.experiment
        return self._experiment_id

    # -- identity -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The experiment id (as Lightning's MLFlowLogger)."""
        return self.experiment_id

    @property
    def version(self) -> str:
        """The run id (as Lightning's MLFlowLogger)."""
        return self.run_id

    @property
    def tracking_uri(self) -> str:
        """Where the runs are recorded."""
        return self._tracking_uri

    @property
    def save_dir(self) -> str | None:
        """The local folder of the store: the path of a ``file:`` or local SQLite tracking URI,
        else ``None`` (a tracking server)."""
        uri = self._tracking_uri
        if uri.startswith(LOCAL_FILE_URI_PREFIX):
            return _local_path(uri)
        if uri.startswith("sqlite:///"):
            return os.path.dirname(uri[len("sqlite:///"):]) or "."
        return None

    @property
    def log_dir(self) -> str:
        """The run's local folder: where its artifacts are when they are local
        (``<artifact location>/<run id>``), else ``save_dir/<experiment id>/<run id>``.
        The Trainer keeps its checkpoints in ``log_dir/checkpoints``."""
        if self._run_dir is None:
            _ = self.experiment
        return self._run_dir

    def run_key(self) -> tuple[str, str, str]:
        """What every rank shares (rank 0 creates the run; the others adopt it)."""
        return (self.experiment_id, self.run_id, self.log_dir)

    def use_run_key(self, key) -> None:
        self._experiment_id, self._run_id, self._run_dir = key

    # -- logging --------------------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _metric_name(self, name: str) -> str:
        out = self._names.get(name)
        if out is None:
            out = self._names[name] = _BAD_NAME_CHARS.sub("", name)
            if out != name:
                self._warn_once(f"name:{name}", f"MLFlowLogger: MLflow allows only letters, digits, '_', '-', '.', "
                                f"'/', ':' and ' ' in a metric name; {name!r} is logged as {out!r}")
        return out

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """All of ``metrics`` at ``step`` in one ``log_batch`` request (values that are not
        numbers are dropped with a warning, once per name)."""
        Metric = _metric_class()   # (the RNG states are copied at the first import only)
        stamp = int(time.time() * 1000)
        step = int(step or 0)
        batch = []
        for k, v in add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            v = to_scalar(v)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                self._warn_once(f"value:{k}", f"MLFlowLogger: metric {k!r} = {v!r} is not a number; MLflow "
                                "records numbers only, so it is not logged")
                continue
            batch.append(Metric(key=self._metric_name(k), value=float(v), timestamp=stamp, step=step))
        if not batch:
            return
        client = self.experiment
        for i in range(0, len(batch), 1000):   # MLflow's limit per request
            client.log_batch(self._run_id, metrics=batch[i:i + 1000], **self._batch_kwargs)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | Any) -> None:
        """Record ``params`` as the run's params, flattened as Lightning does. A value longer
        than MLflow's limit is cut to it (a warning names the keys). MLflow never changes a
        param: one logged again with another value keeps its first value (a warning names it)."""
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():
            from mlflow.entities import Param
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        flat = {k: str(v) for k, v in flatten_lightning(params).items()}
        cut = sorted(k for k, v in flat.items() if len(v) > MAX_PARAM_VAL_LENGTH)
        if cut:
            warnings.warn(f"MLFlowLogger: the values of {', '.join(cut)} are longer than MLflow's limit of "
                          f"{MAX_PARAM_VAL_LENGTH} characters; they are logged cut to that length",
                          RuntimeWarning, stacklevel=2)
            flat.update({k: flat[k][:MAX_PARAM_VAL_LENGTH] for k in cut})
        client = self.experiment
        changed = sorted(k for k, v in flat.items() if k in self._params and self._params[k] != v)
        if changed:
            warnings.warn(f"MLFlowLogger: {', '.join(changed)} already have other values in run {self._run_id}; "
                          "MLflow never changes a param, so they keep their first values", RuntimeWarning,
                          stacklevel=2)
        new = [Param(k, v) for k, v in flat.items() if k not in self._params]
        for i in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            client.log_batch(self._run_id, params=new[i:i + MAX_PARAMS_TAGS_PER_BATCH], **self._batch_kwargs)
        self._params.update({p.key: p.value for p in new})

    # -- checkpoints ------------------------------------------------------------------------------
    def after_save_checkpoint(self, path: str, *, aliases=(), score: float | None = None) -> None:
        """Upload the checkpoint at ``path`` to the run's artifacts, when ``log_model`` says."""
        if not self._log_model:
            return
        path = os.fspath(path)
        aliases = tuple(dict.fromkeys(("latest", *aliases)))
        if self._log_model == "all":
            self._upload(path, aliases, score)
            return
        self._checkpoints.pop(path, None)   # saved again: now the newest
        self._checkpoints[path] = (aliases, score)

    def _upload(self, path: str, aliases, score) -> None:
        client = self.experiment
        name = os.path.basename(path.rstrip(os.sep))
        if os.path.isdir(path):
            client.log_artifacts(self._run_id, path, f"checkpoints/{name}")
        else:
            client.log_artifact(self._run_id, path, f"checkpoints/{name}")
        meta = {"original_path": path, "aliases": list(aliases),
                "score": None if score is None else float(to_scalar(score))}
        with tempfile.TemporaryDirectory() as tmp:
            file = os.path.join(tmp, f"{name}.json")
            with open(file, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
            client.log_artifact(self._run_id, file, "checkpoints")

    def _upload_best(self) -> None:
        exists = [p for p in self._checkpoints if os.path.exists(p)]
        best = [p for p in exists if "best" in self._checkpoints[p][0]]
        pick = best[-1] if best else (exists[-1] if exists else None)
        if pick is not None:
            aliases, score = self._checkpoints[pick]
            self._upload(pick, aliases, score)
        self._checkpoints.clear()

    # -- end --------------------------------------------------------------------------------------
    def finalize(self, status: str) -> None:
        """End the run with the MLflow status of ``status`` (:data:`RUN_STATUS`), after the
        upload ``log_model=True`` asks for. Nothing happens when no run was started."""
        check_status(status)
        if self._experiment is None:
            return
        if self._log_model is True and status == "success" and self._checkpoints:
            self._upload_best()
        self._experiment.set_terminated(self._run_id, RUN_STATUS[status])

    def __repr__(self) -> str:
        return (f"MLFlowLogger(experiment_name={self._experiment_name!r}, tracking_uri={self._tracking_uri!r}, "
                f"run_id={self._run_id!r})")
