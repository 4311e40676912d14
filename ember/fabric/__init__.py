"""``ember.fabric``: Lightning Fabric's namespace, so Fabric code that writes
``import lightning as L; L.fabric.Fabric(...)`` or ``from lightning.fabric.loggers import
CSVLogger`` runs with ``import ember as L`` / ``from ember.fabric.loggers import CSVLogger``::

    import ember as L
    fabric = L.fabric.Fabric(accelerator="cpu", loggers=L.fabric.loggers.CSVLogger(root_dir="logs"))
    L.fabric.seed_everything(42)

See docs/porting.md.
"""
from __future__ import annotations

from ember.compat.fabric import Fabric, FabricModule
from ember.fabric import accelerators, loggers, strategies, utilities, wrappers
from ember.fabric.utilities import is_overridden
from ember.data.worker_seed import seed_everything

__all__ = ["Fabric", "FabricModule", "seed_everything", "is_overridden", "accelerators", "loggers", "strategies",
           "utilities", "wrappers"]
