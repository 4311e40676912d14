"""Per-process RNG states (python, numpy, torch, CUDA) as plain values for checkpoints;
:class:`keep_rng_states`; the lazy import of optional packages under it."""
from __future__ import annotations

import random
from typing import Any

import torch

from ember.errors import CheckpointError


def collect_rng_states() -> dict:
    """Python ``random``, numpy's global generator, torch CPU and (when initialised) every
    CUDA generator, as plain tensors/tuples that ``torch.load(weights_only=True)`` accepts."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = {"bit_generator": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                           "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(state: dict, where: str = "the checkpoint") -> None:
    """Restore what :func:`collect_rng_states` returned (missing entries are skipped).
    A malformed state raises CheckpointError naming ``where`` (before anything is set)."""
    try:
        _check_rng(state)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as err:
        raise CheckpointError(f"{where}: the saved RNG state is corrupt ({type(err).__name__}: {err})") from err
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            s = state["numpy"]
            np.random.set_state((s["bit_generator"], s["keys"].numpy().astype(np.uint32), s["pos"],
                                 s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([s.to("cpu", torch.uint8) for s in cuda])


def _check_rng(state: dict) -> None:
    """Raise (TypeError/ValueError...) when ``state`` cannot be restored, changing nothing."""
    if not isinstance(state, dict):
        raise TypeError(f"expected a dict, got {type(state).__name__}")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.Generator().set_state(state["torch"].to("cpu", torch.uint8))
    if "numpy" in state:
        s = state["numpy"]
        try:
            import numpy as np
        except ImportError:
            return
        np.random.RandomState().set_state((s["bit_generator"], s["keys"].numpy().astype(np.uint32), s["pos"],
                                           s["has_gauss"], s["cached_gaussian"]))


class keep_rng_states:
    """Context manager: the global random streams (python ``random``, numpy's global
    generator when numpy is imported, torch's CPU generator and, once initialised, the
    CUDA generators) are as they were when the block ends, whatever it drew. ember wraps
    in it what a loop written by hand would not run: the first import of a third-party
    library (``rich`` draws from ``random`` when it is imported), and the batches a
    resumed pass reads again to reach its position (:mod:`ember.data.resume`). Cheap
    (one state copy per stream), never used per step. Outside the main thread (a
    background checkpoint writer) it does nothing: setting the states back there would
    undo the training thread's draws."""

    def __enter__(self) -> "keep_rng_states":
        import sys
        import threading
        self._on = threading.current_thread() is threading.main_thread()
        if not self._on:
            return self
        np = sys.modules.get("numpy")
        self._np = np.random.get_state() if np is not None else None
        self._py = random.getstate()
        self._torch = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        return self

    def __exit__(self, *exc: Any) -> None:
        import sys
        if not self._on:
            return
        random.setstate(self._py)
        torch.set_rng_state(self._torch)
        np = sys.modules.get("numpy")
        if np is not None and self._np is not None:
            np.random.set_state(self._np)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)


def missing_package(package: str, needed_by: str, install: str, detail: str = "",
                    error: type[Exception] = ModuleNotFoundError) -> Exception:
    """The one error for an optional package that is not there, naming ``install``."""
    said = f" ({detail})" if detail else ""
    return error(f"{needed_by} needs the `{package}` package, which is not installed{said}: {install}")


def require_package(package: str, needed_by: str, install: str,
                    error: type[Exception] = ModuleNotFoundError) -> None:
    """Raise :func:`missing_package`'s error when ``package`` cannot be found, without
    importing it: what a constructor checks so that the error comes before any work."""
    import importlib.util
    if importlib.util.find_spec(package) is None:
        raise missing_package(package, needed_by, install, error=error)


def import_optional(module: str, needed_by: str, install: str, error: type[Exception] = ModuleNotFoundError):
    """``import module`` for an optional package, imported lazily (on first use): the import
    runs under :class:`keep_rng_states` (a first import leaves the user's random streams as
    they were), and a failed import is :func:`missing_package`'s error naming ``install``
    (e.g. ``'pip install "ember[mlflow]"'``), the import error chained to it."""
    import importlib
    try:
        with keep_rng_states():
            return importlib.import_module(module)
    except ImportError as err:
        raise missing_package(module.split(".")[0], needed_by, install, detail=str(err), error=error) from err
