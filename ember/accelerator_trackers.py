"""The Accelerator's trackers (``log_with=``): :class:`AcceleratorTrackers`, a base of
:class:`ember.accelerator.Accelerator`. Guide: ``docs/accelerator.md``."""
from __future__ import annotations

from typing import Any

import torch


class AcceleratorTrackers:
    """``init_trackers`` / ``log`` / ``get_tracker`` / ``end_training`` of the Accelerator."""

    trackers: list
    _log_step: int
    strategy: Any

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Create the ``log_with`` trackers (main process only) under ``project_dir``
        with ``project_name`` as experiment name / W&B project, and log ``config`` as
        hyperparameters. ``init_kwargs={"wandb": {...}}`` go to that tracker."""
        from ember.accelerator_state import init_trackers
        init_trackers(self, project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log scalar ``values`` (numbers or 0-d tensors, fetched in one transfer) to every
        tracker at ``step`` (default: the number of earlier ``log`` calls). Main process only."""
        if not self.trackers:
            return
        if step is None:
            step = self._log_step
        self._log_step = step + 1
        metrics = dict(values)
        keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
        if keys:  # one device-to-host transfer for all tensors
            metrics.update(zip(keys, torch.stack([metrics[k].detach().reshape(()).double() for k in keys]).tolist()))
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step=step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker named ``"tensorboard"``, ``"csv"``, ``"wandb"`` (or a custom
        Logger's name); ``unwrap=True``: its writer / run. Other processes get a
        tracker whose methods do nothing."""
        from ember.accelerator_state import get_tracker
        return get_tracker(self, name, unwrap)

    def end_training(self) -> None:
        """Finish every tracker (flush, close)."""
        for tr in self.trackers:
            tr.finalize("success")
        self.trackers = []
        self.strategy.teardown()
