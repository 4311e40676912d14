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
    "seed_everything": "ember.data.worker_seed",
    "CombinedLoader": "ember.data.combined",
    # the rest of Accelerate's top-level names (accelerate/__init__.py), where ember has them
    "DataLoaderConfiguration": "ember.compat.accelerate",
    "DistributedDataParallelKwargs": "ember.compat.accelerate",
    "GradScalerKwargs": "ember.compat.accelerate",
    "InitProcessGroupKwargs": "ember.compat.accelerate",
    "ProfileKwargs": "ember.compat.accelerate",
    "skip_first_batches": "ember.utils",
    "init_empty_weights": "ember.big_modeling.device_map",
    "init_on_device": "ember.big_modeling.device_map",
    "infer_auto_device_map": "ember.big_modeling.device_map",
    "dispatch_model": "ember.big_modeling.hooks",
    "load_checkpoint_and_dispatch": "ember.big_modeling.loading",
    "load_checkpoint_in_model": "ember.big_modeling.loading",
}

# subpackages reachable as attributes after a bare ``import ember`` (``import ember as L; L.fabric.Fabric``)
_SUBPACKAGES = ("fabric",)

# Accelerate's top-level names that ember does not offer: ``from ember import <name>``
# raises ember.errors.NotPortedError naming what to use instead.
_NOT_PORTED = {
    "cpu_offload": "ember.big_modeling.dispatch_model(model, device_map={'': 'cpu'}, main_device='cuda')",
    "cpu_offload_with_hook": "ember.big_modeling.dispatch_model(model, device_map={'': 'cpu'}, main_device='cuda')",
    "disk_offload": "ember.big_modeling.dispatch_model(model, device_map={'': 'disk'}, offload_dir=...)",
    "debug_launcher": "ember.notebook_launcher(function, args, num_processes=2) (CPU processes on a CPU machine)",
    "ParallelismConfig": "a strategy: ember.strategies.FSDPStrategy or ModelParallelStrategy "
                         "(Accelerator(strategy=...))",
    "AutocastKwargs": "Accelerator(precision=...) and `with accelerator.autocast():`",
    "DDPCommunicationHookType": "ember.strategies.DDPStrategy (Accelerator(strategy=DDPStrategy(...)))",
    "DeepSpeedPlugin": "ember.strategies.DeepSpeedStrategy (Accelerator(strategy='deepspeed'))",
    "FullyShardedDataParallelPlugin": "ember.strategies.FSDPStrategy (Accelerator(strategy='fsdp'))",
    "is_rich_available": "importlib.util.find_spec('rich') is not None",
    "synchronize_rng_states": "nothing: prepared loaders agree their order across processes themselves "
                              "(ember.utils.set_seed seeds every process)",
    "rich": "`import rich` (ember.callbacks.RichProgressBar draws with it)",
}

__all__ = ["Trainer", "TrainModule", "DataModule", "Accelerator", "Fabric", "seed_everything", "__version__"]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY) | set(_SUBPACKAGES))


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None and name in _SUBPACKAGES:
        import importlib
        return importlib.import_module(f"ember.{name}")   # the import binds it as an attribute
    if where is None:
        if name in _NOT_PORTED:
            from ember.errors import NotPortedError
            raise NotPortedError(f"ember has no {name!r} (an Accelerate name); use {_NOT_PORTED[name]}", name=name)
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    import importlib
    module = importlib.import_module(where)
    value = getattr(module, name)
    globals()[name] = value   # the next lookup is a plain attribute
    return value
