"""The optimizer-step rules, written once for the Trainer and the Accelerator.

(Being consolidated: the accumulation window lives here; see docs/architecture.md.)
"""
from __future__ import annotations

from typing import Any

import torch


# -- the accumulation rule (Trainer and Accelerator) -----------------------------------------
def accumulation_window(index: int, total: int | None, steps: int) -> tuple[bool, int]:
    """The accumulation rule of the Trainer and the Accelerator (docs/accelerator.md,
    "The optimizer step"): for micro-batch ``index`` (0-based, counted from the start
    of the epoch) of ``total`` (None: unknown length), return whether the optimizer
    steps after it and the size of its window. Windows hold ``steps`` micro-batches;
    the last window of an epoch of known length may be shorter and its losses are
    divided by its own size, so every step equals one big batch of its samples."""
    if total is not None:
        last = total - total % steps   # where a short last window starts
        if index >= last:
            return index + 1 == total, total - last
    return (index + 1) % steps == 0, steps


def partial_grad_norm(precision: Any, device: Any, parameters: Any, norm_type: float) -> torch.Tensor:
    """``clip_grad_norm_`` on a micro-batch that does not sync: the norm of the
    gradients accumulated so far (divided by the loss scale under 16-mixed), as a
    0-d tensor, without clipping and without a host sync."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    scaler = precision.scaler
    scale = getattr(scaler, "_scale", None) if scaler is not None else None
    return norm / scale.to(norm.device).reshape(()) if scale is not None else norm
