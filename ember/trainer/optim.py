"""Turning ``configure_optimizers`` output into optimizers + scheduler configs (the
scheduler step is ``ember/trainer/loops.py``'s, on the rules of ``ember/step.py``)."""
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
