"""The optimizer and scheduler wrappers :meth:`ember.Accelerator.prepare` hands back.
Prepared dataloaders are :class:`ember.data.loader.DataLoaderShard`."""
from __future__ import annotations

from typing import Any

import torch

from ember.step import StepOptimizer, step_scheduler


class AcceleratedOptimizer(StepOptimizer):
    """A prepared optimizer (:class:`ember.step.StepOptimizer` under Accelerate's name):
    ``step()`` goes through the strategy and precision (skipped on inf/NaN gradients
    under 16-mixed) and, like ``zero_grad()``, does nothing on micro-batches where
    ``accelerator.sync_gradients`` is False."""


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is an LR scheduler (torch's, or one with ``step``, ``optimizer``, ``state_dict``)."""
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return True
    return (callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")
            and not isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)))


class AcceleratedScheduler:
    """A prepared LR scheduler (Accelerate's rules, ``step_scheduler_with_optimizer=True``):
    it steps only when its optimizer stepped (not while accumulating, not after a
    16-mixed step skipped on inf: :meth:`ember.step.StepRules.scheduler_step`, which reads
    the skip flag without a host sync), and ``num_processes`` times per step: each process
    sees ``1/num_processes`` of the batches, so a schedule written for the number of
    batches of one process keeps its length. ``ReduceLROnPlateau`` steps once. Reading
    the scheduler (``get_last_lr()``, any attribute, ``state_dict()``) applies a step
    still waiting for its flag first."""

    def __init__(self, scheduler: Any, accelerator: Any) -> None:
        self.scheduler, self._acc = scheduler, accelerator
        self._opts: list | None = None
        self._once = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _optimizers(self) -> list:
        """The raw optimizers this scheduler follows (prepared ones, or none)."""
        if not self._opts:
            target = getattr(self.scheduler, "optimizer", None)
            self._opts = [o.optimizer for o in self._acc._optimizers if o is target or o.optimizer is target]
        return self._opts

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler by the rules above."""
        acc = self._acc
        sched = self.scheduler
        if not acc.step_scheduler_with_optimizer:
            sched.step(*args, **kwargs)
            return
        rules = acc.step_rules
        if not rules.sync_gradients:
            return
        n = 1 if self._once else acc.strategy.world_size

        def apply() -> None:
            for _ in range(n):
                if not step_scheduler(sched, *args, **kwargs):   # a last partial window past OneCycleLR's end
                    break
        rules.scheduler_step(self._optimizers(), apply)

    def _flushed(self) -> Any:
        rules = self._acc.step_rules
        if rules.scheduler_step_pending:
            rules.flush()
        return self.scheduler

    def state_dict(self) -> dict:
        """The wrapped scheduler's state dict."""
        return self._flushed().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped scheduler."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_acc"):
            raise AttributeError(name)
        return getattr(self._flushed(), name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
