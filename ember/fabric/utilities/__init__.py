"""``lightning.fabric.utilities`` under ember: rank-zero helpers, :class:`Throughput` and
:class:`ThroughputMonitor` (the Fabric form: ``ThroughputMonitor(fabric)``),
:func:`measure_flops`, :func:`is_overridden`, and :mod:`~ember.fabric.utilities.types`."""
from __future__ import annotations

import inspect
from typing import Any, Optional

from ember.fabric.utilities import types
from ember.fabric.utilities.throughput import Throughput, ThroughputMonitor, measure_flops
from ember.data.worker_seed import seed_everything
from ember.loggers.rank_zero import (rank_zero_debug, rank_zero_deprecation, rank_zero_info, rank_zero_only,
                                     rank_zero_warn)

__all__ = ["rank_zero_only", "rank_zero_warn", "rank_zero_info", "rank_zero_debug", "rank_zero_deprecation",
           "seed_everything", "Throughput", "ThroughputMonitor", "measure_flops", "is_overridden", "types"]


def is_overridden(method_name: str, instance: Optional[object] = None, parent: Optional[type] = None) -> bool:
    """Whether ``instance``'s class overrides ``parent``'s method ``method_name``
    (Lightning's ``is_overridden``). ``parent`` defaults to ember's TrainModule,
    DataModule or Callback, whichever ``instance`` is."""
    if instance is None:
        return False
    if parent is None:
        from ember.callbacks.base import Callback
        from ember.module import DataModule, TrainModule
        parent = next((p for p in (TrainModule, DataModule, Callback) if isinstance(instance, p)), None)
        if parent is None:
            raise ValueError(f"is_overridden: give parent= for a {type(instance).__name__}")
    instance_attr = getattr(instance, method_name, None)
    if instance_attr is None:
        return False
    parent_attr = getattr(parent, method_name, None)
    if parent_attr is None:
        raise ValueError(f"is_overridden: {parent.__name__} has no method {method_name!r}")
    own = inspect.unwrap(getattr(instance_attr, "__func__", instance_attr))
    base = inspect.unwrap(parent_attr)
    return getattr(own, "__code__", own) is not getattr(base, "__code__", base)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'ember.fabric.utilities' has no attribute {name!r}")
