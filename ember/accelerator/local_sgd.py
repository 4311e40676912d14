"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): under DDP, skip the
gradient all-reduce and average the parameters over processes every
``local_sgd_steps`` optimizer steps instead::

    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=8, enabled=True) as local_sgd:
        for batch in loader:
            with acc.accumulate(model):
                loss = model(batch).loss
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
"""
from __future__ import annotations

import torch

from ember.errors import MisconfigurationError

__all__ = ["LocalSGD"]


class LocalSGD:
    """Context manager; :meth:`step` after each optimizer step. ``enabled=False`` or
    one process: a no-op (the model syncs every step as usual). On exit the
    parameters are averaged once more, so every process leaves with the same model."""

    def __init__(self, accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        if accelerator.strategy.is_sharded or accelerator.strategy.owns_optimizer_step:
            raise MisconfigurationError(f"LocalSGD runs under the DDP strategy, not {accelerator.strategy.name}")
        if local_sgd_steps < 1:
            raise MisconfigurationError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): use an int >= 1")
        self.accelerator, self.model = accelerator, model
        self.local_sgd_steps = int(local_sgd_steps)
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        self.num_steps = 0
        self._ctx = None

    def __enter__(self):
        if self.enabled:
            self._ctx = self.accelerator.no_sync(self.model)
            self._ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.enabled:
            if exc_type is None:
                self._sync_and_avg_model_params()
            self._ctx.__exit__(exc_type, exc, tb)
        return False

    def step(self) -> None:
        """Count an optimizer step; every ``local_sgd_steps``-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for p in self.accelerator.unwrap_model(self.model).parameters():
                p.data = self.accelerator.reduce(p.data, reduction="mean")
