"""The Trainer's metrics: ``callback_metrics``, ``progress_bar_metrics`` and the
emission of logged values (step values at log points, evaluation step values per
batch, epoch values at epoch ends) to the loggers, in one host transfer each."""
from __future__ import annotations

from typing import Any

import torch

from ember.trainer import checks as _checks
from ember.trainer.logging import Results, to_host


class MetricsMixin:
    """Part of :class:`~ember.trainer.Trainer` (its metric state lives on the trainer)."""

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """What callbacks monitor: every emitted value, and during fit the latest value of
        each training metric logged with ``on_step=True`` (on its device: read here, at
        the reader's own pace, not copied per step)."""
        if self.stage == "fit":
            self._callback_metrics.update(self._results["train"].latest_step_values(self.world_size > 1))
        return self._callback_metrics

    @callback_metrics.setter
    def callback_metrics(self, value: dict) -> None:
        self._callback_metrics = dict(value)

    def describe_missing_metric(self, name: str) -> str:
        """Why ``name`` is not in :attr:`callback_metrics` (never logged, or logged but
        without a value yet), for callbacks' error messages."""
        return _checks.describe_missing_metric(self, name)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What the progress bar shows, as floats: the latest value of each ``prog_bar``
        step metric and, for each ``prog_bar`` epoch metric, the value that was logged
        (equal to ``callback_metrics[name]``); read by the progress bar on its timer."""
        out = {}
        emitted = dict(self._callback_metrics)   # (the progress bar's thread: no refresh here)
        for stage in ("train", "validate", "test"):
            for k, v in self._results[stage].prog_bar_values(emitted).items():
                out[k] = float(v) if not isinstance(v, torch.Tensor) else v.item()
        return out

    def _emit_step(self, results: Results) -> None:
        vals = results.step_values()
        if not vals and self.world_size == 1:
            return
        host = to_host(vals, self.strategy)   # every rank: it takes part in the sync_dist names check
        if not vals:
            return
        self._publish(host, {n: vals[n][0] for n in vals})

    def _emit_eval_step(self, results: Results, stage: str) -> None:
        """Step values logged in validation/test steps go to the loggers at every batch
        (as Lightning), at a step counting that stage's batches; this rank's values (no
        collective: the ranks' batch counts may differ)."""
        vals = results.step_values()
        host = to_host(vals)
        n = self._eval_log_steps[stage] = self._eval_log_steps.get(stage, -1) + 1
        if n == 0 and self.world_size > 1:
            _warn_eval_step_sync(self, stage, {k: e.name for k, (e, _) in vals.items() if e.sync_dist and e.logger})
        to_log = {k: v for k, v in host.items() if vals[k][0].logger}
        self.logged_metrics.update(to_log)
        if to_log and self.is_global_zero:
            for lg in self.loggers:
                lg.log_metrics(to_log, step=n)

    def _emit_epoch(self, results: Results, log: bool = True, names=None) -> dict:
        vals = results.epoch_values(names)
        host = to_host(vals, self.strategy)
        if log and names is None and self.world_size > 1:
            # once per stage, on every rank (also one that logged nothing: it takes part in the gather)
            _checks.warn_unsynced(self, results.stage, vals, host)
        if not vals:
            return {}
        for e, _ in vals.values():
            if e.metric is not None:
                e.metric.reset()   # computed: start clean (the sanity check or another stage may reuse it)
        if log:
            self._publish(host, {n: vals[n][0] for n in vals})
        return host

    def _publish(self, host: dict, entries: dict) -> None:
        for k, v in host.items():
            self._callback_metrics[k] = torch.tensor(v)
            e = entries[k]
            base = e.name
            if k != base and not k.endswith("_epoch"):
                continue
            if k.endswith("_epoch"):
                self._callback_metrics[base] = torch.tensor(v)
        to_log = {k: v for k, v in host.items() if entries[k].logger}
        if not to_log:
            return
        self.logged_metrics.update(to_log)
        if self.is_global_zero:
            to_log = dict(to_log, epoch=float(self.current_epoch)) if self.stage == "fit" else to_log
            for lg in self.loggers:
                lg.log_metrics(to_log, step=self.global_step)

    def log_metric(self, name: str, value: Any, logger: bool = True) -> None:
        """Record an already-reduced value (used by callbacks such as GatherMetrics)."""
        v = float(value)
        self._callback_metrics[name] = torch.tensor(v)
        if logger:
            self.logged_metrics[name] = v
            if self.is_global_zero:
                for lg in self.loggers:
                    lg.log_metrics({name: v}, step=self.global_step)


def _warn_eval_step_sync(t, stage: str, names: dict) -> None:
    """Once per run and stage: an ``on_step`` value logged with ``sync_dist=True`` in an
    evaluation step goes to the loggers as rank 0's own value at each batch (a per-batch
    collective would hang when the ranks' batch counts differ); say so instead of
    letting ``sync_dist`` look applied."""
    if not names or not t.is_global_zero:
        return
    import warnings
    hook = {"validate": "validation_step", "sanity": "validation_step"}.get(stage, f"{stage}_step")
    warnings.warn(
        f"self.log({next(iter(names.values()))!r}, ..., on_step=True, sync_dist=True) in {hook}: under several "
        f"processes the per-batch values sent to the loggers ({', '.join(list(names)[:5])}) are rank 0's own, not "
        "reduced over the ranks (a collective per evaluation batch would hang when the ranks' batch counts "
        "differ); the epoch value (on_epoch=True) is the reduced one. Log with on_step=False for the reduced "
        "value only", UserWarning, stacklevel=2)
