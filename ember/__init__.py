"""ember: a PyTorch training framework.

    from ember import Trainer, TrainModule, DataModule, Accelerator, seed_everything
"""
from __future__ import annotations

__version__ = "0.1.0"

from ember.compat import paths as _paths   # old module paths (ember.checkpoint_io, ...) stay importable

_paths.install()

# The top-level names, imported on first use (``__getattr__`` below) so that ``import ember``
# stays cheap (no torch import) for the CLI and the launcher. IDEs and type checkers (jedi in
# Jupyter, pyright, mypy) read them from the stub ``ember/__init__.pyi``, which imports each
# from where it lives; tests/compat/test_static_names.py keeps the two lists equal.
_LAZY = {
    "Trainer": "ember.trainer",
    "TrainModule": "ember.module",
    "DataModule": "ember.module",
    "Accelerator": "ember.accelerator",
    "Fabric": "ember.compat.fabric",
    "PartialState": "ember.compat.accelerate",
    "AcceleratorState": "ember.compat.accelerate",
    "DistributedType": "ember.compat.accelerate",
    "notebook_launcher": "ember.launch.notebook",
    "find_executable_batch_size": "ember.utils",
}

__all__ = ["Trainer", "TrainModule", "DataModule", "Accelerator", "Fabric", "seed_everything", "__version__"]


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed python, numpy and torch (all devices). Returns the seed used.

    ``workers=True`` sets ``EMBER_SEED_WORKERS=1`` for the rest of the process (and the
    ranks it starts; ``EMBER_SEED_WORKERS=0`` turns it off): the workers of every
    DataLoader ember prepares then seed python, numpy and torch from (run seed, epoch,
    rank, worker) and re-seed them per batch, so their random draws differ across ranks
    and workers and repeat exactly after a mid-epoch resume (see ``ember.data.worker_seed``).
    Worker seeds differ per rank and worker in any case."""
    import os
    import random

    import torch
    if seed is None:
        seed = os.environ.get("EMBER_GLOBAL_SEED", random.randint(0, 2**31 - 1))
    try:
        if isinstance(seed, (bool, float)):
            raise ValueError
        seed = int(seed)
    except (TypeError, ValueError):
        from ember.errors import MisconfigurationError
        raise MisconfigurationError(f"seed={seed!r} is not valid; use an integer (e.g. seed=42)") from None
    os.environ["EMBER_GLOBAL_SEED"] = str(seed)
    if workers:
        os.environ["EMBER_SEED_WORKERS"] = "1"
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY))


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value   # the next lookup is a plain attribute
    return value
