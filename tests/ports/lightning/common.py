"""What the ports share beyond the originals: the device count and output file
the test asks for (``PORT_DEVICES``, ``PORT_OUT``) and the numbers written for
the comparison. Plain torch and names common to ember and Lightning only."""
from __future__ import annotations

import inspect
import os
import sys
from datetime import timedelta
from typing import Any, Optional

import torch

from ember import Trainer  # (from lightning.pytorch import Trainer)
from ember.strategies import DDPStrategy  # (from lightning.pytorch.strategies import DDPStrategy)

# tests/ports/ on the path (after everything else): the stand-ins for lightning.pytorch.demos
# (demos.py) and the results every port writes (port_output.py)
PORTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if PORTS not in sys.path:
    sys.path.append(PORTS)
from port_output import write  # noqa: E402,F401  (rank 0 writes the results: port_output.py)

DEVICES = int(os.environ.get("PORT_DEVICES", "1"))
# Under DDP, Lightning replaces a training DataLoader's sampler by
# DistributedSampler(shuffle=True, seed=<seed_everything's seed>) whatever the
# DataLoader asked for; ember keeps the DataLoader's own ``shuffle``. The ports
# pass ``shuffle=SHUFFLE_TRAIN`` (False on one process, as the originals) so that
# both libraries shuffle under DDP, with the same seed (``trainer_kwargs``).
SHUFFLE_TRAIN = DEVICES > 1


def trainer_kwargs(**ddp: Any) -> dict[str, Any]:
    """``devices``/``strategy`` for the run: one CPU process, or DDP on ``PORT_DEVICES``
    CPU processes with a 60 s process-group timeout (a hang fails fast) and the
    ``DDPStrategy`` keywords ``ddp``. Under DDP on
    ember, ``seed=`` the seed_everything seed: the data order Lightning's sampler uses
    (ember's Trainer re-seeds every RNG with it; Lightning's has no such argument)."""
    if DEVICES == 1:
        return {"accelerator": "cpu", "devices": 1}
    kwargs = {"accelerator": "cpu", "devices": DEVICES, "strategy": DDPStrategy(timeout=timedelta(seconds=60), **ddp)}
    if "seed" in inspect.signature(Trainer.__init__).parameters:
        kwargs["seed"] = int(os.environ["EMBER_GLOBAL_SEED"])
    return kwargs


def param_sums(module: torch.nn.Module) -> dict[str, float]:
    """Sum of every parameter tensor (float64), by name: equal weights, equal sums."""
    return {k: p.detach().double().sum().item() for k, p in module.named_parameters()}


def make_grid(images: torch.Tensor, nrow: int = 8, padding: int = 2, normalize: bool = False,
              value_range: Optional[tuple] = None, scale_each: bool = False, pad_value: float = 0) -> torch.Tensor:
    """A small ``torchvision.utils.make_grid`` (N, C, H, W) -> (C, rows*H', nrow*W')."""
    images = images.clone()
    if normalize:
        parts = images if scale_each else [images]
        for t in parts:
            lo, hi = value_range if value_range is not None else (float(t.min()), float(t.max()))
            t.clamp_(min=lo, max=hi).sub_(lo).div_(max(hi - lo, 1e-5))
    n, c, h, w = images.shape
    ncol = min(nrow, n)
    rows = (n + ncol - 1) // ncol
    hp, wp = h + padding, w + padding
    grid = images.new_full((c, rows * hp + padding, ncol * wp + padding), pad_value)
    for k in range(n):
        r, col = divmod(k, ncol)
        grid[:, r * hp + padding:r * hp + padding + h, col * wp + padding:col * wp + padding + w] = images[k]
    return grid
