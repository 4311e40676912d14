"""``lightning.fabric.wrappers`` under ember: what :meth:`~ember.Fabric.setup` returns, and
``_unwrap_objects`` (the original objects inside a collection of set-up ones)."""
from __future__ import annotations

from typing import Any

from ember.compat.fabric import FabricModule

__all__ = ["FabricModule", "_unwrap_objects"]


def _unwrap_one(obj: Any) -> Any:
    from ember.accelerator import AcceleratedOptimizer
    from ember.data.loader import DataLoaderShard
    compiled = getattr(obj, "_orig_mod", None)   # torch.compile's OptimizedModule
    if compiled is not None:
        obj = compiled
    if isinstance(obj, FabricModule):   # the module the strategy runs (DDP(...) under DDP), as Lightning's
        obj = obj._forward_module
        return getattr(obj, "_orig_mod", obj)
    if isinstance(obj, AcceleratedOptimizer):
        return obj.optimizer
    if isinstance(obj, DataLoaderShard):
        return obj.base
    return obj


def _unwrap_objects(collection: Any) -> Any:
    """``collection`` (an object, or dicts/lists/tuples of them) with each set-up model,
    optimizer or dataloader replaced by the object inside it (as Lightning Fabric's)."""
    from torch.utils._pytree import tree_map
    return tree_map(_unwrap_one, collection)
