"""Turning ``configure_optimizers`` output into optimizers + scheduler configs,
stepping schedulers, and the optimizer wrapper for manual optimization."""
from __future__ import annotations

import torch

from ember.errors import MisconfigurationError, invalid_choice

_SCHED_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")


def _sched_config(s) -> dict:
    if isinstance(s, dict):
        if "scheduler" not in s:
            raise MisconfigurationError(f"lr_scheduler dict needs a 'scheduler' key; got keys {sorted(s)}")
        unknown = set(s) - set(_SCHED_KEYS)
        if unknown:
            raise MisconfigurationError(f"lr_scheduler: unknown keys {sorted(unknown)}; valid keys: {list(_SCHED_KEYS)}")
        cfg = {"interval": "epoch", "frequency": 1, "monitor": None, "strict": True, "name": None, **s}
    else:
        cfg = {"scheduler": s, "interval": "epoch", "frequency": 1, "monitor": None, "strict": True, "name": None}
    if cfg["interval"] not in ("step", "epoch"):
        raise invalid_choice("lr_scheduler interval", cfg["interval"], ["step", "epoch"])
    if not isinstance(cfg["frequency"], int) or cfg["frequency"] < 1:
        raise MisconfigurationError(f"lr_scheduler frequency={cfg['frequency']!r}: use an int >= 1")
    if isinstance(cfg["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau) and not cfg["monitor"]:
        raise MisconfigurationError("ReduceLROnPlateau needs a metric: return {'optimizer': opt, 'lr_scheduler': "
                                    "{'scheduler': s, 'monitor': 'val/loss'}} from configure_optimizers")
    return cfg


def configure_optimizers(module) -> tuple[list, list[dict]]:
    out = module.configure_optimizers()
    optimizers, scheds = [], []

    def add(item):
        if isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        elif isinstance(item, dict) and "optimizer" in item:
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                cfg = item["lr_scheduler"]
                cfg = dict(cfg) if isinstance(cfg, dict) else {"scheduler": cfg}
                if "monitor" in item and "monitor" not in cfg:
                    cfg["monitor"] = item["monitor"]
                scheds.append(_sched_config(cfg))
        elif hasattr(item, "step") and hasattr(item, "param_groups"):
            optimizers.append(item)
        else:
            raise MisconfigurationError(
                f"configure_optimizers returned {type(item).__name__}; return an optimizer, a list of optimizers, "
                "a (optimizers, schedulers) tuple, or {'optimizer': opt, 'lr_scheduler': ...}")

    if out is None:
        raise MisconfigurationError("configure_optimizers returned None; return an optimizer "
                                    "(or set automatic_optimization = False and return your optimizers)")
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple)) and isinstance(out[1], (list, tuple)):
        for o in out[0]:
            add(o)
        scheds = [_sched_config(s) for s in out[1]]
    elif isinstance(out, (list, tuple)):
        for o in out:
            add(o)
    else:
        add(out)
    if not optimizers:
        raise MisconfigurationError("configure_optimizers returned no optimizer")
    return optimizers, scheds


def step_schedulers(trainer, interval: str) -> None:
    """Step the ``interval`` schedulers. Under loss scaling ("16-mixed") a step-interval
    scheduler does not step after a skipped optimizer step; that decision reads the
    step's inf/NaN flag, so it is deferred (no host sync at the step): applied before
    the next optimizer step's unscale (so before ``on_before_optimizer_step``), before a
    checkpoint is written, at the epoch end and the end of fit (:func:`flush_scheduler_steps`)."""
    if not trainer.module.automatic_optimization:
        return   # manual optimization: the module steps its schedulers itself (as Lightning)
    flush_scheduler_steps(trainer)
    precision = trainer.strategy.precision
    if interval == "step" and precision.scaler is not None:
        flags = [precision.skip_flag(o.optimizer) for o in trainer._acc._optimizers]
        flags = [f for f in flags if f is not None]
        if flags and not any(c["monitor"] for c in trainer.lr_scheduler_configs if c["interval"] == "step"):
            trainer._deferred_sched = (flags, trainer.global_step)
            precision.defer(lambda: flush_scheduler_steps(trainer))
            return
        if flags and any(f.value() for f in flags):
            return   # as a prepared scheduler: not after a step skipped for inf/NaN gradients (16-mixed)
    _step(trainer, interval, trainer.global_step if interval == "step" else trainer.current_epoch + 1)


def flush_scheduler_steps(trainer) -> None:
    """Apply a deferred step-interval scheduler step: unless its optimizer step was skipped."""
    pending = trainer.__dict__.pop("_deferred_sched", None)
    if pending is None:
        return
    flags, count = pending
    if not any(f.value() for f in flags):
        _step(trainer, "step", count)


def _step(trainer, interval: str, count: int) -> None:
    for cfg in trainer.lr_scheduler_configs:
        if cfg["interval"] != interval:
            continue
        if count % cfg["frequency"]:
            continue
        s = cfg["scheduler"]
        custom = trainer._lr_scheduler_step   # the module's lr_scheduler_step override (resolved at setup)
        if cfg["monitor"]:
            value = trainer.callback_metrics.get(cfg["monitor"])
            if value is None:
                if cfg["strict"]:
                    raise MisconfigurationError(
                        f"lr_scheduler monitor {cfg['monitor']!r} was never logged; logged metrics: "
                        f"{sorted(trainer.callback_metrics)}")
                continue
            s.step(float(value)) if custom is None else custom(s, float(value))
        else:
            s.step() if custom is None else custom(s, None)


class ManualOptimizer:
    """What ``self.optimizers()`` returns under manual optimization: ``step`` goes
    through the strategy and precision (loss scaling, DeepSpeed) and counts
    ``global_step``; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, trainer):
        self.optimizer = optimizer
        self._trainer = trainer

    def step(self, closure=None):
        t = self._trainer
        t.strategy.optimizer_step(self.optimizer, t.model, closure)
        t.global_step += 1
        t._manual_steps_since_log += 1

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)
