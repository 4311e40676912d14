"""Module paths that moved, still importable.

Code that imports an old path (``ember.checkpoint_io``,
``ember.local_sgd``, ``ember.accelerator_compat`` ...) gets the module at its new
place, the very same module object, so ``import ember.local_sgd`` and
``from ember.accelerator.local_sgd import LocalSGD`` give one class. No file is left
behind at the old place: :class:`MovedPaths` (installed on ``sys.meta_path`` by
``import ember``) answers for the names in :data:`MOVED` and nothing else.
"""
from __future__ import annotations

import importlib
import sys

#: old dotted path -> the module that now holds it
MOVED = {
    "ember.accelerator_checkpoint": "ember.accelerator.checkpoint",
    "ember.accelerator_compat": "ember.compat.accelerate",
    "ember.accelerator_state": "ember.accelerator",
    "ember.accelerate_import": "ember.accelerator.accelerate_checkpoint",
    "ember.checkpoint_agree": "ember.checkpoint.agree",
    "ember.compat.accelerate_checkpoint": "ember.accelerator.accelerate_checkpoint",
    "ember.checkpoint_checks": "ember.checkpoint.trust",
    "ember.checkpoint_io": "ember.checkpoint.io",
    "ember.cli_types": "ember.cli.types",
    "ember.data_seed": "ember.data.worker_seed",
    "ember.launch_accelerate": "ember.launch.accelerate_flags",
    "ember.lightning_compat": "ember.compat.lightning",
    "ember.local_sgd": "ember.accelerator.local_sgd",
    "ember.notebook": "ember.launch.notebook",
    "ember.prefetch": "ember.data.prefetch",
    "ember.profiler": "ember.trainer.profiler",
    "ember.report": "ember.loggers.report",
    "ember.rng_state": "ember.checkpoint.rng",
    "ember.trainer.progress": "ember.trainer.state",
    "ember.trainer.run_state": "ember.trainer.state",
}


class MovedPaths:
    """A ``sys.meta_path`` finder for :data:`MOVED`: the old name is bound to the new
    module (``sys.modules[old] is sys.modules[new]``)."""

    @classmethod
    def find_spec(cls, name: str, path=None, target=None):
        if name not in MOVED:
            return None
        from importlib.machinery import ModuleSpec
        return ModuleSpec(name, cls, origin=MOVED[name])

    @staticmethod
    def create_module(spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__   # the import system sets __spec__ to this one next
        return module

    @staticmethod
    def exec_module(module) -> None:
        """Nothing to run (the module was imported at its new place); its own spec is put back."""
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put :class:`MovedPaths` on ``sys.meta_path`` once (``import ember`` does)."""
    if MovedPaths not in sys.meta_path:
        sys.meta_path.append(MovedPaths)
