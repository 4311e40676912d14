"""ember: a PyTorch training framework.

    from ember import Trainer, TrainModule, DataModule, Accelerator, seed_everything
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Trainer", "TrainModule", "DataModule", "Accelerator", "seed_everything", "__version__"]


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed python, numpy and torch (all devices). Returns the seed used."""
    import os
    import random

    import torch
    if seed is None:
        seed = int(os.environ.get("EMBER_GLOBAL_SEED", random.randint(0, 2**31 - 1)))
    seed = int(seed)
    os.environ["EMBER_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


def __getattr__(name):
    if name == "Trainer":
        from ember.trainer import Trainer
        return Trainer
    if name in ("TrainModule", "DataModule"):
        from ember import module
        return getattr(module, name)
    if name == "Accelerator":
        from ember.accelerator import Accelerator
        return Accelerator
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
