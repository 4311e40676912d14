"""LearningRateMonitor: log the learning rate (and optionally momentum and weight
decay) of every optimizer's param groups, with Lightning's names:

- ``lr-{OptimizerClass}`` for an optimizer with one param group,
- ``lr-{OptimizerClass}/pg{i}`` (i from 1) with several, or ``lr-{OptimizerClass}/{name}``
  when the group has a ``"name"``,
- ``lr-{OptimizerClass}-{k}`` for the k-th further optimizer of the same class,
- the scheduler config's ``"name"`` replaces ``lr-{OptimizerClass}`` when set,
- ``...-momentum`` and ``...-weight_decay`` for the extra values.

The values are read from ``param_groups`` (Python floats): no device work, and for
``logging_interval="step"`` only at ``log_every_n_steps`` multiples.
"""
from __future__ import annotations

from ember.callbacks.base import Callback
from ember.errors import invalid_choice


class LearningRateMonitor(Callback):
    """
    Args:
        logging_interval: ``"step"`` (every ``log_every_n_steps`` optimizer steps, the
            rate used by that step), ``"epoch"`` (at every epoch start) or ``None``
            (each scheduler at its own interval; optimizers without one at steps).
        log_momentum: also log ``momentum`` (or ``betas[0]`` for Adam-like optimizers).
        log_weight_decay: also log ``weight_decay``.

    ``lrs`` holds every logged value per name (a list), as in Lightning.
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise invalid_choice("LearningRateMonitor(logging_interval)", logging_interval, [None, "step", "epoch"])
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self._groups: list = []        # (optimizer, base name, interval)
        self._pending: dict | None = None
        self._last_step = -1
        if logging_interval == "epoch":
            self.inactive_hooks = frozenset({"on_before_optimizer_step", "on_train_batch_end"})
        elif logging_interval == "step":
            self.inactive_hooks = frozenset({"on_train_epoch_start"})

    # -- names -----------------------------------------------------------------------------
    def on_train_start(self, trainer, module):
        scheduled = {}
        for cfg in trainer.lr_scheduler_configs:
            opt = getattr(cfg["scheduler"], "optimizer", None)
            if opt is not None:
                scheduled[id(opt)] = cfg
        seen: dict[str, int] = {}
        self._groups = []
        for opt in trainer.optimizers:
            inner = getattr(opt, "optimizer", opt)   # wrapped optimizers (DeepSpeed, manual)
            cls = type(inner).__name__
            cfg = scheduled.get(id(inner)) or scheduled.get(id(opt))
            base = cfg["name"] if cfg and cfg.get("name") else f"lr-{cls}"
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                base = f"{base}-{count}"
            interval = cfg["interval"] if cfg else "step"
            self._groups.append((inner, base, interval))
        for name in self._extract("any"):
            self.lrs.setdefault(name, [])

    def _names(self, opt, base):
        groups = opt.param_groups
        if len(groups) == 1:
            return [base]
        return [f"{base}/{g['name']}" if isinstance(g.get("name"), str) else f"{base}/pg{i + 1}"
                for i, g in enumerate(groups)]

    def _extract(self, when: str) -> dict[str, float]:
        """``when``: "step" / "epoch" (what is due at that point under logging_interval=None)
        or "any" (everything)."""
        out = {}
        for opt, base, interval in self._groups:
            if when != "any" and self.logging_interval is None and interval != when:
                continue
            betas = "betas" in getattr(opt, "defaults", {})
            for name, g in zip(self._names(opt, base), opt.param_groups):
                out[name] = float(g["lr"])
                if self.log_momentum:
                    out[f"{name}-momentum"] = float(g["betas"][0] if betas else g.get("momentum", 0.0))
                if self.log_weight_decay:
                    out[f"{name}-weight_decay"] = float(g.get("weight_decay", 0.0))
        return out

    def _log(self, trainer, values: dict) -> None:
        for k, v in values.items():
            trainer.log_metric(k, v)
            self.lrs.setdefault(k, []).append(v)

    # -- hooks ---------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer, module, optimizer):
        # the rates this step uses, logged with the step's other metrics at its batch end
        if (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self._pending = self._extract("step")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self._pending is not None:
            values, self._pending = self._pending, None
            self._last_step = trainer.global_step
            self._log(trainer, values)
        elif not module.automatic_optimization and trainer.global_step != self._last_step \
                and trainer.global_step and trainer.global_step % trainer.log_every_n_steps == 0:
            self._last_step = trainer.global_step
            self._log(trainer, self._extract("step"))

    def on_train_epoch_start(self, trainer, module):
        self._log(trainer, self._extract("any" if self.logging_interval == "epoch" else "epoch"))
