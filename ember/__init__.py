"""ember: a PyTorch training framework.

    from ember import Trainer, TrainModule, DataModule, Accelerator, seed_everything
"""
from __future__ import annotations

TYPE_CHECKING = False   # (not typing.TYPE_CHECKING: importing typing would cost more than ember itself)
__version__ = "0.1.0"

from ember.compat import paths as _paths   # old module paths (ember.checkpoint_io, ...) stay importable

_paths.install()

if TYPE_CHECKING:
    # what IDEs and type checkers (pyright, mypy, jedi) read: these names resolve
    # statically. At run time they are imported on first use (``__getattr__`` below),
    # so ``import ember`` stays cheap (no torch import) for the CLI and the launcher.
    from ember.accelerator import Accelerator
    from ember.compat.accelerate import AcceleratorState, DistributedType, PartialState
    from ember.module import DataModule, TrainModule
    from ember.launch.notebook import notebook_launcher
    from ember.trainer import Trainer
    from ember.utils import find_executable_batch_size

__all__ = ["Trainer", "TrainModule", "DataModule", "Accelerator", "seed_everything", "__version__"]


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
    lazy = ("PartialState", "AcceleratorState", "DistributedType", "notebook_launcher", "find_executable_batch_size")
    return sorted(set(globals()) | set(__all__) | set(lazy))


def __getattr__(name: str):
    if name == "Trainer":
        from ember.trainer import Trainer
        return Trainer
    if name in ("TrainModule", "DataModule"):
        from ember import module
        return getattr(module, name)
    if name == "Accelerator":
        from ember.accelerator import Accelerator
        return Accelerator
    if name in ("PartialState", "AcceleratorState", "DistributedType"):   # Accelerate's top-level names
        from ember.compat import accelerate as accelerator_compat
        return getattr(accelerator_compat, name)
    if name == "notebook_launcher":
        from ember.launch.notebook import notebook_launcher
        return notebook_launcher
    if name == "find_executable_batch_size":
        from ember.utils import find_executable_batch_size
        return find_executable_batch_size
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
