"""The `Logger` base class and the helpers every logger shares.

Loggers are called by the Trainer on global rank 0 only, with plain Python
numbers (never tensors), at most every ``log_every_n_steps``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ember.errors import invalid_choice

DEFAULT_NAME = "ember_logs"
STATUSES = ("success", "failed", "interrupted")
_VERSION_DIR = re.compile(r"^version_(\d+)$")


class _NoRun:
    """The ``experiment`` of ranks other than 0 for loggers whose run only rank 0 talks to
    (MLflow, W&B): every attribute is a method that does nothing, as Lightning's
    ``DummyExperiment``; ``config.update(...)`` and the like do nothing too."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):   # copy, pickle and other protocols see a plain object
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


NO_RUN = _NoRun()


class Logger:
    """Base class of ember's experiment loggers.

    Subclasses implement :attr:`experiment` (the backend writer or run,
    created lazily), :meth:`log_metrics` and :meth:`log_hyperparams`; the
    rest has sensible defaults.
    """

    _experiment: Any = None

    # -- identity ---------------------------------------------------------
    @property
    def name(self) -> str:
        """The experiment name (a folder under ``save_dir`` for file loggers)."""
        return DEFAULT_NAME

    @property
    def version(self) -> int | str | None:
        """The run's version: an integer, a string, or a backend run id."""
        return None

    @property
    def save_dir(self) -> str | None:
        """The root folder the logger writes under."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The folder of this run."""
        return None

    @property
    def experiment(self) -> Any:
        """The underlying writer or run, created on first access."""
        raise NotImplementedError

    # -- logging ----------------------------------------------------------
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar ``metrics`` at training step ``step``."""
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any] | Any) -> None:
        """Record hyperparameters (nested dicts and arbitrary values are accepted)."""
        raise NotImplementedError

    def save(self) -> None:
        """Flush whatever is buffered to disk."""

    def finalize(self, status: str) -> None:
        """Flush and close at the end of a run. ``status`` is one of
        ``"success"``, ``"failed"``, ``"interrupted"``."""
        check_status(status)
        self.save()

    def after_save_checkpoint(self, path: str, *, aliases=(), score: float | None = None) -> None:
        """Called after a checkpoint has been written to ``path``
        (a checkpoint directory or a ``.safetensors`` file). No-op by default."""

    # -- one run under several processes ------------------------------------------------------
    def run_key(self) -> Any:
        """What identifies this logger's run where every rank must see the same (its folder,
        its run id); ``None``: nothing. Under several processes the Trainer asks rank 0 at
        setup (which may create the run there) and gives the answer to the other ranks'
        :meth:`use_run_key`, so ``trainer.log_dir`` is the same on every rank and no other
        rank creates a run."""
        return None

    def use_run_key(self, key: Any) -> None:
        """Adopt rank 0's :meth:`run_key` (the other ranks, at setup)."""

    # -- misc -------------------------------------------------------------
    def __getstate__(self) -> dict:
        # writers and runs hold files, threads and sockets: never pickle them
        state = dict(self.__dict__)
        state["_experiment"] = None
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(save_dir={self.save_dir!r}, name={self.name!r})"


class FileLogger(Logger):
    """Shared machinery of loggers that write into ``save_dir/name/version_N``.

    ``name=None`` means the default name ``"ember_logs"``; ``name=""`` writes
    the versions directly under ``save_dir``. ``version=None`` picks the next
    free ``version_N`` (computed once, on first use, then fixed); an int gives
    ``version_{int}``; a string is used as the folder name as is. Folders are
    created on the first write, not at construction.
    """

    def __init__(self, save_dir, name: str | None = DEFAULT_NAME, version: int | str | None = None,
                 prefix: str = ""):
        if save_dir is None:
            save_dir = "."
        self._save_dir = os.fspath(save_dir)
        self._name = DEFAULT_NAME if name is None else str(name)
        if isinstance(version, bool) or (version is not None and not isinstance(version, (int, str))):
            raise invalid_choice("version", version, ["None", "an int", "a str"])
        self._version = version
        self._prefix = prefix
        self._hparams: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        """``save_dir/name`` (or ``save_dir`` when ``name`` is empty)."""
        return os.path.join(self._save_dir, self._name) if self._name else self._save_dir

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.root_dir)
        return self._version

    @property
    def log_dir(self) -> str:
        v = self.version
        return os.path.join(self.root_dir, v if isinstance(v, str) else f"version_{v}")

    def run_key(self) -> int | str:
        """The version (rank 0 picks the next free ``version_N`` by listing the folder)."""
        return self.version

    def use_run_key(self, key: int | str) -> None:
        self._version = key

    @property
    def hparams(self) -> dict[str, Any]:
        """Every hyperparameter logged so far (merged, sanitised, nested)."""
        return dict(self._hparams)

    def _merge_hparams(self, params) -> dict[str, Any]:
        self._hparams.update(sanitize_params(params))
        return self._hparams

    def _write_hparams_yaml(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        save_hparams_to_yaml(os.path.join(self.log_dir, "hparams.yaml"), self._hparams)


# ---------------------------------------------------------------------------
# helpers


def check_status(status: str) -> None:
    if status not in STATUSES:
        raise invalid_choice("status", status, STATUSES)


def next_version(root_dir: str) -> int:
    """The next free integer ``N`` such that ``root_dir/version_N`` does not exist
    (one more than the largest existing version; 0 when there is none)."""
    try:
        entries = os.listdir(root_dir)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    found = [int(m.group(1)) for e in entries
             if (m := _VERSION_DIR.match(e)) and os.path.isdir(os.path.join(root_dir, e))]
    return max(found) + 1 if found else 0


def add_prefix(metrics: Mapping[str, Any], prefix: str, sep: str = "-") -> dict[str, Any]:
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{sep}{k}": v for k, v in metrics.items()}


def to_scalar(value: Any) -> Any:
    """A 0-d tensor or numpy scalar -> its Python number; anything else unchanged."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and not isinstance(value, (int, float)):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


def _as_mapping(params: Any) -> Mapping[str, Any]:
    if params is None:
        return {}
    if isinstance(params, Mapping):
        return params
    if hasattr(params, "__dict__") and not isinstance(params, type):  # argparse.Namespace, dataclasses
        return vars(params)
    raise invalid_choice("params", type(params).__name__, ["a dict", "an argparse.Namespace"])


def sanitize_params(params: Any) -> dict[str, Any]:
    """A nested copy of ``params`` that ``yaml.safe_dump`` and JSON accept:
    dict keys become strings, tuples become lists, numbers / str / bool / None
    are kept, 0-d tensors become numbers and everything else becomes ``str(value)``."""

    def clean(v: Any) -> Any:
        v = to_scalar(v)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, Mapping):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return str(v)

    return {str(k): clean(v) for k, v in _as_mapping(params).items()}


def flatten_params(params: Any, sep: str = "/") -> dict[str, bool | int | float | str]:
    """Flatten nested dicts into ``{"a/b": value}``; every value that is not a
    number, str or bool becomes ``str()`` of its sanitised form (so a tuple
    ``(1, 2)`` becomes ``"[1, 2]"``, None becomes ``"None"``)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, Mapping) and v:
            for k, x in v.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), x)
        elif isinstance(v, (bool, int, float, str)):
            out[prefix] = v
        else:
            out[prefix] = str(v)

    for k, v in sanitize_params(params).items():
        walk(k, v)
    return out


def save_hparams_to_yaml(path: str, hparams: Mapping[str, Any]) -> None:
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        import yaml

    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(dict(hparams), f, sort_keys=False)
    os.replace(tmp, path)
