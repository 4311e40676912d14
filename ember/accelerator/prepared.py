"""The optimizer and scheduler wrappers :meth:`ember.Accelerator.prepare` hands back
(:class:`AcceleratedOptimizer`, :class:`AcceleratedScheduler`). Prepared dataloaders
are :class:`ember.data.loader.DataLoaderShard`."""
from __future__ import annotations

from typing import Any, Callable

import torch


# -- optimizer / scheduler ------------------------------------------------------------------
class AcceleratedOptimizer(torch.optim.Optimizer):
    """A prepared optimizer. ``step()`` goes through the strategy and precision (loss
    scaling: skipped on inf/NaN under 16-mixed) and, like ``zero_grad()``, does
    nothing on micro-batches where ``accelerator.sync_gradients`` is False.
    It is a ``torch.optim.Optimizer`` (schedulers can be built on it); its state lives
    in the wrapped :attr:`optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: Any) -> None:  # state is the inner one's
        self.optimizer, self._acc, self._strategy = optimizer, accelerator, accelerator.strategy

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v), doc="the wrapped optimizer's")
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v),
                     doc="the wrapped optimizer's")
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v),
                        doc="the wrapped optimizer's")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step through the strategy and precision; nothing while accumulating."""
        acc = self._acc
        if not acc.sync_gradients:
            return None
        if acc._plain_step:   # the strategy's step is the precision's (one call less per step)
            return self._strategy.precision.optimizer_step(self.optimizer, closure)
        return self._strategy.optimizer_step(self.optimizer, None, closure)

    @property
    def step_was_skipped(self) -> bool:
        """Under 16-mixed: the last step found inf/NaN gradients and was skipped."""
        return self._strategy.precision.step_skipped(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; nothing while accumulating."""
        if self._acc.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is an LR scheduler (torch's, or one with ``step``, ``optimizer``, ``state_dict``)."""
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return True
    return (callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")
            and not isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)))


class AcceleratedScheduler:
    """A prepared LR scheduler (Accelerate's rules, ``step_scheduler_with_optimizer=True``):
    it steps only when its optimizer stepped (not while accumulating, not after a
    16-mixed step skipped on inf), and ``num_processes`` times per step: each process
    sees ``1/num_processes`` of the batches, so a schedule written for the number of
    batches of one process keeps its length. ``ReduceLROnPlateau`` steps once."""

    def __init__(self, scheduler: Any, accelerator: Any) -> None:
        self.scheduler, self._acc = scheduler, accelerator
        self._opts: list | None = None
        self._once = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _optimizers(self) -> list:
        if not self._opts:
            target = getattr(self.scheduler, "optimizer", None)
            self._opts = [o for o in self._acc._optimizers if o is target or o.optimizer is target]
        return self._opts

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler by the rules above."""
        acc = self._acc
        sched = self.scheduler
        if not acc.step_scheduler_with_optimizer:
            sched.step(*args, **kwargs)
            return
        if not acc.sync_gradients:
            return
        for opt in self._optimizers():
            if opt.step_was_skipped:
                return
        n = 1 if self._once else acc.strategy.world_size
        total = getattr(sched, "total_steps", None)
        for _ in range(n):
            if total is not None and sched._step_count > total:
                break  # OneCycleLR raises past its end (a last partial window)
            sched.step(*args, **kwargs)

    def state_dict(self) -> dict:
        """The wrapped scheduler's state dict."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped scheduler."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
