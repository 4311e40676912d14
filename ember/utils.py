"""``ember.utils``: what Accelerate users import from ``accelerate.utils``, under the
same names: ``from accelerate.utils import set_seed, ProjectConfiguration`` becomes
``from ember.utils import set_seed, ProjectConfiguration``. The configuration classes
are the Accelerator's own (:mod:`ember.accelerator.config`); the helpers live in
:mod:`ember.compat.accelerate_utils`. Differences are listed in ``docs/porting.md``.
"""
from ember.compat.accelerate_utils import (DataLoaderConfiguration, DistributedDataParallelKwargs,  # noqa: F401
                                           DistributedType, GradientAccumulationPlugin, GradScalerKwargs,
                                           InitProcessGroupKwargs, ProfileKwargs, ProjectConfiguration,
                                           TorchDynamoPlugin, broadcast, broadcast_object_list,
                                           find_executable_batch_size, gather, gather_object, is_main_process,
                                           pad_across_processes, reduce, release_memory, send_to_device, set_seed,
                                           should_reduce_batch_size, skip_first_batches, tqdm, write_basic_config)
from ember.compat.lightning import convert_lightning_checkpoint  # noqa: F401  (Lightning checkpoints)

__all__ = ["set_seed", "ProjectConfiguration", "gather", "gather_object", "broadcast", "broadcast_object_list",
           "pad_across_processes", "reduce", "send_to_device", "find_executable_batch_size",
           "release_memory", "should_reduce_batch_size", "tqdm", "DistributedType", "GradientAccumulationPlugin",
           "DataLoaderConfiguration", "write_basic_config", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "InitProcessGroupKwargs", "ProfileKwargs", "TorchDynamoPlugin", "is_main_process", "skip_first_batches"]
