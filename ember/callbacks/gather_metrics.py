"""``GatherMetrics``: epoch metrics computed once, on exactly the dataset.

Each evaluation step returns a dict holding ``keys`` (``"preds"``, ``"target"``
by default). The callback keeps those tensors on the device (detached, no host
sync), and at epoch end concatenates them, gathers them from every rank with
:func:`ember.distributed.gather_for_metrics` (dataset order, the samples that
the distributed sampler duplicated dropped), calls each metric function once on
the result and logs it under its name. The numbers equal a single-process
evaluation of the same data::

    from torchmetrics.functional import accuracy
    GatherMetrics({"val/acc": lambda p, t: accuracy(p, t, task="multiclass", num_classes=10)})

For ``"predict"`` the gathered outputs are stored in :attr:`GatherMetrics.predictions`
(one entry per dataloader) instead.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError, invalid_choice

STAGES = ("validate", "test", "predict")


class GatherMetrics(Callback):
    """Gather step outputs from every rank and compute epoch metrics exactly once.

    Args:
        metrics: ``{name: fn}``; ``fn(*[gathered[k] for k in keys])`` returns a number
            (or a 0-d tensor, or a dict of them, logged as ``name/key``).
        keys: the keys of the step's output dict passed, in order, to each metric.
        stages: any of ``"validate"``, ``"test"``, ``"predict"``.
        prog_bar: also show the values on the progress bar.
    """

    def __init__(self, metrics: dict[str, Callable] | None = None, keys: tuple[str, ...] = ("preds", "target"),
                 stages: tuple[str, ...] | str = ("validate", "test"), prog_bar: bool = False) -> None:
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not isinstance(name, str) or not callable(fn):
                raise MisconfigurationError(f"GatherMetrics(metrics=...): {name!r} must map a name to a "
                                            f"callable, got {type(fn).__name__}")
        if isinstance(keys, str):
            keys = (keys,)
        if isinstance(stages, str):
            stages = (stages,)
        for s in stages:
            if s not in STAGES:
                raise invalid_choice("GatherMetrics(stages)", s, STAGES)
        if not keys:
            raise MisconfigurationError("GatherMetrics(keys=()): name at least one key of the step output")
        self.metrics = metrics
        self.keys = tuple(keys)
        self.stages = tuple(stages)
        self.prog_bar = prog_bar
        #: last computed values, {name: float}
        self.results: dict[str, float] = {}
        #: predict stage: gathered outputs in dataset order, one entry per dataloader
        self.predictions: list = []
        self._buf: dict[int, list] = {}
        self._loaders: dict[int, Any] = {}
        self._batches: dict[int, int] = {}
        self._in_validation = False
        inactive = set()
        for stage, hook in (("validate", "validation"), ("test", "test"), ("predict", "predict")):
            if stage not in self.stages:
                inactive |= {f"on_{hook}_start", f"on_{hook}_end", f"on_{hook}_epoch_start",
                             f"on_{hook}_epoch_end", f"on_{hook}_batch_end"}
        self.inactive_hooks = frozenset(inactive)

    # -- collection ----------------------------------------------------------------
    def _reset(self) -> None:
        self._buf, self._loaders, self._batches = {}, {}, {}

    def _collect(self, trainer, outputs, stage: str, dataloader_idx: int) -> None:
        if stage == "predict":
            value = tree_map_only(torch.Tensor, torch.Tensor.detach, outputs)
        else:
            if not isinstance(outputs, dict) or any(k not in outputs for k in self.keys):
                have = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
                hook = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
                raise MisconfigurationError(
                    f"GatherMetrics(keys={self.keys!r}): {hook} must return a dict holding those keys; "
                    f"it returned {have}")
            value = tuple(tree_map_only(torch.Tensor, torch.Tensor.detach, outputs[k]) for k in self.keys)
        if dataloader_idx not in self._buf:
            self._buf[dataloader_idx] = []
            self._loaders[dataloader_idx] = getattr(trainer, "current_dataloader", None)
            self._batches[dataloader_idx] = 0
        self._buf[dataloader_idx].append(value)
        self._batches[dataloader_idx] += 1

    def _gathered(self, trainer, idx: int) -> Any:
        from ember.data.sampling import num_padded
        from ember.distributed.collectives import concat_outputs, gather_for_metrics
        parts = self._buf.get(idx, [])
        loader = self._loaders.get(idx)
        padding = num_padded(loader, self._batches.get(idx, 0)) if loader is not None else 0   # full passes only
        strategy = getattr(trainer, "strategy", None)
        local = concat_outputs(parts) if parts else None
        counts = strategy.all_gather_object(local is None) if strategy is not None else [local is None]
        if any(counts):
            if all(counts):
                return None
            raise MisconfigurationError(f"GatherMetrics: some ranks saw no batches in dataloader {idx}; "
                                        "every rank must run the same number of evaluation steps")
        return gather_for_metrics(local, num_padded=padding, strategy=strategy)

    def _finish(self, trainer, module, stage: str) -> None:
        if self._sanity(trainer, stage):
            self._reset()
            return
        indices = sorted(self._buf) or []
        world = getattr(getattr(trainer, "strategy", None), "world_size", 1)
        if world > 1:  # every rank must agree on the loaders it saw
            indices = sorted(set().union(*map(set, trainer.strategy.all_gather_object(indices))))
        if stage == "predict":
            self.predictions = [self._gathered(trainer, i) for i in indices]
            self._reset()
            return
        multi = len(indices) > 1
        for idx in indices:
            data = self._gathered(trainer, idx)
            if data is None:
                continue
            for name, fn in self.metrics.items():
                value = fn(*data)
                key = f"{name}/dataloader_idx_{idx}" if multi else name
                self._log(trainer, module, key, value)
        self._reset()

    def _log(self, trainer, module, name: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                self._log(trainer, module, f"{name}/{k}", v)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise MisconfigurationError(f"GatherMetrics: metric {name!r} returned a tensor of shape "
                                            f"{tuple(value.shape)}; return a number or a 0-d tensor")
            value = value.item()
        value = float(value)
        self.results[name] = value
        if getattr(getattr(trainer, "state", None), "results", None) is not None:
            # inside the evaluation loop: emitted with the epoch's other values (loggers,
            # callback_metrics and the dicts validate()/test() return)
            module.log(name, torch.tensor(value), on_step=False, on_epoch=True, batch_size=1,
                       prog_bar=self.prog_bar, sync_dist=False)
        elif hasattr(trainer, "log_metric"):
            trainer.log_metric(name, value)
        else:
            trainer.callback_metrics[name] = torch.tensor(value)

    def _sanity(self, trainer, stage: str) -> bool:
        flag = getattr(trainer, "sanity_checking", None)
        if flag is not None:
            return bool(flag)
        # the sanity check runs the validation epoch hooks without on_validation_start
        return stage == "validate" and not self._in_validation

    # -- hooks -----------------------------------------------------------------------
    def on_validation_start(self, trainer, module) -> None:
        self._in_validation = True

    def on_validation_end(self, trainer, module) -> None:
        self._in_validation = False

    def on_validation_epoch_start(self, trainer, module) -> None:
        self._reset()

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, "validate", dataloader_idx)

    def on_validation_epoch_end(self, trainer, module) -> None:
        self._finish(trainer, module, "validate")

    def on_test_epoch_start(self, trainer, module) -> None:
        self._reset()

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, "test", dataloader_idx)

    def on_test_epoch_end(self, trainer, module) -> None:
        self._finish(trainer, module, "test")

    def on_predict_epoch_start(self, trainer, module) -> None:
        self._reset()

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._collect(trainer, outputs, "predict", dataloader_idx)

    def on_predict_epoch_end(self, trainer, module) -> None:
        self._finish(trainer, module, "predict")
