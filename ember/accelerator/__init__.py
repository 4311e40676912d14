"""The Accelerator: custom training loops on ember's strategies and precisions
(Accelerate's style). :mod:`~ember.accelerator.accelerator` is the facade,
:mod:`~ember.accelerator.prepared` what ``prepare`` returns for optimizers and
schedulers, :mod:`~ember.accelerator.checkpoint` ``save_state`` / ``load_state`` /
``save_model``, :mod:`~ember.accelerator.local_sgd` LocalSGD. The step rules it runs
on are :mod:`ember.step`, shared with the Trainer."""
from ember.accelerator.accelerator import Accelerator
from ember.accelerator.prepared import AcceleratedOptimizer, AcceleratedScheduler
from ember.data.loader import DataLoaderShard
from ember.errors import DistributedOperationError

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "DataLoaderShard",
           "DistributedOperationError"]
