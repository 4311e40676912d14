"""Accelerate's configuration and state names, as ``accelerate.utils`` and
``accelerate.state`` spell them. They are the Accelerator's own
(:mod:`ember.accelerator.config`, :mod:`ember.accelerator.state`); this module only
gathers them. Users import them from :mod:`ember.utils`. Guide: ``docs/porting.md``."""
from ember.accelerator.config import (DataLoaderConfiguration, DistributedDataParallelKwargs, DistributedType,
                                      GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                                      ProfileKwargs, ProjectConfiguration, TorchDynamoPlugin)
from ember.accelerator.state import AcceleratorState, GradientState, PartialState

__all__ = ["DistributedType", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
           "ProfileKwargs", "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
           "TorchDynamoPlugin", "PartialState", "AcceleratorState", "GradientState"]
