"""The metrics of a run (``trainer.metrics``, owned by ``trainer.state``): what ``self.log`` recorded per stage, what
callbacks monitor (``callback_metrics``), what the loggers got (``logged_metrics``), and
their emission: step values at log points, evaluation step values per batch, epoch
values at epoch ends, each in one host transfer."""
from __future__ import annotations

from typing import Any

import torch

from ember.trainer.logging import Results, to_host

STAGES = ("train", "validate", "test", "sanity")


class Metrics:
    """The logged values and their emission for one Trainer.

    Attributes:
        results: the accumulators of each stage (``"train"``, ``"validate"``, ``"test"``,
            ``"sanity"``), into which ``self.log`` writes.
        emitted: every emitted value (``callback_metrics`` without the live step values).
        logged_metrics: what was sent to the loggers, as floats.
    """

    def __init__(self, trainer: Any, results_class: type = Results) -> None:
        self.trainer = trainer
        self.results = {s: results_class(s) for s in STAGES}
        self.emitted: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.unsynced_checked: set = set()

    # -- reading ------------------------------------------------------------------------
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """What callbacks monitor: every emitted value, and during fit the latest value of
        each training metric logged with ``on_step=True`` (on its device: read here, at
        the reader's own pace, not copied per step)."""
        t = self.trainer
        if t.state.fn == "fit" and t.state.status == "running":
            self.emitted.update(self.results["train"].latest_step_values(t.world_size > 1))
        return self.emitted

    def progress_bar_metrics(self) -> dict[str, float]:
        """What the progress bar shows, as floats: the latest value of each ``prog_bar``
        step metric and, for each ``prog_bar`` epoch metric, the value that was logged."""
        out = {}
        emitted = dict(self.emitted)   # (the progress bar's thread: no refresh here)
        for stage in ("train", "validate", "test"):
            for k, v in self.results[stage].prog_bar_values(emitted).items():
                out[k] = float(v) if not isinstance(v, torch.Tensor) else v.item()
        return out

    # -- emission -----------------------------------------------------------------------
    def emit_step(self, results: Results) -> None:
        """The step values of ``results`` to ``callback_metrics`` and the loggers (a log point)."""
        t = self.trainer
        vals = results.step_values()
        if not vals and t.world_size == 1:
            return
        host = to_host(vals, t.strategy)   # every rank: it takes part in the sync_dist names check
        if not vals:
            return
        self.publish(host, {n: vals[n][0] for n in vals})

    def emit_eval_step(self, results: Results, stage: str) -> None:
        """Step values logged in validation/test steps go to the loggers at every batch
        (as Lightning), at a step counting that stage's batches; this rank's values (no
        collective: the ranks' batch counts may differ)."""
        t = self.trainer
        vals = results.step_values()
        host = to_host(vals)
        steps = t.state.eval_log_steps
        n = steps[stage] = steps.get(stage, -1) + 1
        if n == 0 and t.world_size > 1:
            _warn_eval_step_sync(t, stage, {k: e.name for k, (e, _) in vals.items() if e.sync_dist and e.logger})
        to_log = {k: v for k, v in host.items() if vals[k][0].logger}
        self.logged_metrics.update(to_log)
        if to_log and t.is_global_zero:
            for lg in t.loggers:
                lg.log_metrics(to_log, step=n)

    def emit_epoch(self, results: Results, log: bool = True, names: Any = None) -> dict:
        """The epoch values of ``results`` (sync_dist reduced here); sent to the loggers with ``log``."""
        from ember.trainer.checks import warn_unsynced
        t = self.trainer
        vals = results.epoch_values(names)
        host = to_host(vals, t.strategy)
        if log and names is None and t.world_size > 1:
            # once per stage, on every rank (also one that logged nothing: it takes part in the gather)
            warn_unsynced(t, results.stage, vals, host)
        if not vals:
            return {}
        for e, _ in vals.values():
            if e.metric is not None:
                e.metric.reset()   # computed: start clean (the sanity check or another stage may reuse it)
        if log:
            self.publish(host, {n: vals[n][0] for n in vals})
        return host

    def publish(self, host: dict, entries: dict) -> None:
        t = self.trainer
        for k, v in host.items():
            self.emitted[k] = torch.tensor(v)
            e = entries[k]
            base = e.name
            if k != base and not k.endswith("_epoch"):
                continue
            if k.endswith("_epoch"):
                self.emitted[base] = torch.tensor(v)
        to_log = {k: v for k, v in host.items() if entries[k].logger}
        if not to_log:
            return
        self.logged_metrics.update(to_log)
        if t.is_global_zero:
            to_log = dict(to_log, epoch=float(t.current_epoch)) if t.state.fn == "fit" else to_log
            for lg in t.loggers:
                lg.log_metrics(to_log, step=t.global_step)

    def log_metric(self, name: str, value: Any, logger: bool = True) -> None:
        """Record an already-reduced value (used by callbacks such as GatherMetrics)."""
        t = self.trainer
        v = float(value)
        self.emitted[name] = torch.tensor(v)
        if logger:
            self.logged_metrics[name] = v
            if t.is_global_zero:
                for lg in t.loggers:
                    lg.log_metrics({name: v}, step=t.global_step)


def _warn_eval_step_sync(t: Any, stage: str, names: dict) -> None:
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
