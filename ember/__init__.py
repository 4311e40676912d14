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
    "seed_everything": "ember.utilities",
    "CombinedLoader": "ember.data.combined",
}

__all__ = ["Trainer", "TrainModule", "DataModule", "Accelerator", "Fabric", "seed_everything", "__version__"]


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
