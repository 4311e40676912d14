"""The Accelerator: custom training loops on ember's strategies and precisions
(Accelerate's style). Guide: ``docs/accelerator.md``."""
from ember.accelerator.accelerator import Accelerator
from ember.accelerator.prepared import AcceleratedOptimizer, AcceleratedScheduler
from ember.data.loader import DataLoaderShard
from ember.errors import DistributedOperationError

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "DataLoaderShard",
           "DistributedOperationError"]
