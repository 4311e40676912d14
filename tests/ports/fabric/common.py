"""What the Fabric ports share beyond the originals: the process count and output file
the test asks for (``PORT_DEVICES``, ``PORT_OUT``), the Fabric arguments for them, the
local stand-in for MNIST, and the numbers written for the comparison. Plain torch and
names common to ember and Lightning Fabric only (``run_with_fabric.py`` maps them)."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import Dataset

from ember.strategies import DDPStrategy  # (from lightning.fabric.strategies import DDPStrategy)

# tests/ports/ on the path (after everything else): the stand-ins for lightning.pytorch.demos
# (demos.py) and the results every port writes (port_output.py)
PORTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PORTS not in sys.path:
    sys.path.append(PORTS)
from port_output import write  # noqa: E402,F401  (rank 0 writes the results: port_output.py)

DEVICES = int(os.environ.get("PORT_DEVICES", "1"))
# the training loaders shuffle as the originals do: ember's order (and the global random stream
# after it) equals Lightning Fabric's on one process and under DDP (docs/porting.md, "Data order")
SHUFFLE_TRAIN = True


def fabric_kwargs() -> dict[str, Any]:
    """``accelerator``/``devices``/``strategy`` for the run: one CPU process, or DDP on
    ``PORT_DEVICES`` CPU processes with a 60 s process-group timeout (a hang fails fast)."""
    if DEVICES == 1:
        return {"accelerator": "cpu", "devices": 1}
    return {"accelerator": "cpu", "devices": DEVICES, "strategy": DDPStrategy(timeout=timedelta(seconds=60))}


class Digits(Dataset):
    """Stand-in for ``torchvision.datasets.MNIST`` with ``ToTensor`` and ``Normalize((0.1307,),
    (0.3081,))``: scikit-learn's bundled 8x8 digits (1,797 images, no download) as
    ``(image[1, 8, 8], label)``; the first 1,500 are the "train" file, the last 297 "test"."""

    def __init__(self, train: bool = True) -> None:
        from sklearn.datasets import load_digits
        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32).div_(16.0).view(-1, 1, 8, 8)
        x = (x - 0.1307) / 0.3081
        y = torch.tensor(d.target, dtype=torch.long)
        sl = slice(0, 1500) if train else slice(1500, None)
        self.data, self.targets = x[sl], y[sl]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int):
        return self.data[idx], self.targets[idx]


def param_sums(module: torch.nn.Module) -> dict[str, float]:
    """Sum of every parameter tensor (float64), by name: equal weights, equal sums."""
    return {k: p.detach().double().sum().item() for k, p in module.state_dict().items()}
