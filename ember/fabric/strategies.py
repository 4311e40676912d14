"""``lightning.fabric.strategies`` under ember: the strategy classes ``Fabric(strategy=...)`` takes."""
from __future__ import annotations

from ember.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy,
                              SingleDeviceStrategy, Strategy)

__all__ = ["Strategy", "SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy",
           "ModelParallelStrategy"]
