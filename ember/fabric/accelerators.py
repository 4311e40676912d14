"""``lightning.fabric.accelerators`` under ember: the device kinds, for annotations and checks
(``isinstance(x, Accelerator)``, ``CUDAAccelerator.is_available()``). ``Fabric(accelerator=)``
takes their names (``"cpu"``, ``"cuda"``, ``"mps"``) or an instance of them."""
from __future__ import annotations

import torch

__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator"]


class Accelerator:
    """A kind of device (Lightning Fabric's ``Accelerator`` base class). ``name`` is what
    ``Fabric(accelerator=...)`` reads from an instance."""

    name = "auto"

    @staticmethod
    def is_available() -> bool:
        """Whether this kind of device is present."""
        return True

    @staticmethod
    def auto_device_count() -> int:
        """Devices ``devices="auto"`` would use."""
        return 1


class CPUAccelerator(Accelerator):
    """The CPU."""

    name = "cpu"


class CUDAAccelerator(Accelerator):
    """NVIDIA GPUs (``torch.cuda``)."""

    name = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()


class MPSAccelerator(Accelerator):
    """Apple GPUs (``torch.backends.mps``)."""

    name = "mps"

    @staticmethod
    def is_available() -> bool:
        return torch.backends.mps.is_available()
