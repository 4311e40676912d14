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
    from ember.utilities import seed_everything
    from ember.utils import find_executable_batch_size

__all__ = ["Trainer", "TrainModule", "DataModule", "Accelerator", "seed_everything", "__version__"]


def __dir__() -> list[str]:
    lazy = ("PartialState", "AcceleratorState", "DistributedType", "notebook_launcher", "find_executable_batch_size",
            "seed_everything")
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
    if name == "seed_everything":
        from ember.utilities import seed_everything
        return seed_everything
    if name == "find_executable_batch_size":
        from ember.utils import find_executable_batch_size
        return find_executable_batch_size
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
