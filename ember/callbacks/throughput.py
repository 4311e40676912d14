"""``ThroughputMonitor``: samples/s, batches/s, tokens/s, FLOPs and MFU of training.

Per step it only adds host integers (the batch size read from tensor shapes) and
reads no device value; rates are computed at log points (every
``log_every_n_steps`` optimizer steps), where it synchronizes CUDA once so the
time covers the work queued so far.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable

import torch

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError

# Dense peak FLOP/s per device from the vendors' data sheets: {name fragment: {dtype: FLOP/s}}.
# Checked in order (the first fragment found in torch.cuda.get_device_name() wins).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12},
    "H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "GH200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "L40S": {"bf16": 362.1e12, "fp16": 362.1e12, "tf32": 183.2e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
}


def compute_dtype(precision: str) -> str:
    """The matmul dtype of a precision name: ``bf16``, ``fp16``, ``tf32`` or ``fp32``."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return precision


def peak_flops_for(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a device for ``dtype`` from :data:`PEAK_FLOPS`, or None."""
    for frag, table in PEAK_FLOPS.items():
        if frag.lower() in device_name.lower():
            return table.get(dtype)
    return None


def _batch_size(batch) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else None
    if isinstance(batch, Mapping):
        for v in batch.values():
            n = _batch_size(v)
            if n is not None:
                return n
        return None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    return None


class ThroughputMonitor(Callback):
    """Logs training throughput at every log point under ``throughput/``:

    - ``samples_per_sec``: samples of all processes per second (this process's count
      times the world size: DDP ranks see equal batches);
    - ``batches_per_sec``: training batches per second (per process);
    - ``tokens_per_sec`` (all processes): when ``length_fn(batch)`` is given, the
      module defines ``tokens_in_batch(batch)``, or the batch is a mapping with an
      ``input_ids`` tensor (its ``numel()``);
    - ``flops_per_sec`` (per device): FLOPs of one training batch, forward and backward,
      measured once on the first batch with ``FlopCounterMode``, times batches/s;
    - ``mfu``: ``flops_per_sec`` over the device's peak: ``peak_flops`` if given, else
      the :data:`PEAK_FLOPS` entry of the CUDA device and the run's precision.

    Each value covers the steps since the previous log point (the first window starts
    after the first batch, whose FLOP counting makes it slow). ``history`` keeps every
    logged dict; ``flops_per_batch`` the measured count.

    Args:
        batch_size_fn: ``batch -> int`` (default: the first dimension of the first tensor).
        length_fn: ``batch -> int`` tokens in a batch.
        log_every_n_steps: log the throughput every N optimizer steps, each value covering the
            steps since the last log point (default None: the trainer's ``log_every_n_steps``).
        peak_flops: the device's peak FLOP/s for MFU.
        measure_flops: count FLOPs on the first batch (default True).
    """

    def __init__(self, batch_size_fn: Callable[[Any], int] | None = None,
                 length_fn: Callable[[Any], int] | None = None, log_every_n_steps: int | None = None,
                 peak_flops: float | None = None, measure_flops: bool = True):
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise MisconfigurationError(f"ThroughputMonitor(log_every_n_steps={log_every_n_steps!r}): use an int >= 1")
        if peak_flops is not None and not peak_flops > 0:
            raise MisconfigurationError(f"ThroughputMonitor(peak_flops={peak_flops!r}): use a positive FLOP/s value")
        self.batch_size_fn, self.length_fn = batch_size_fn, length_fn
        self.log_every_n_steps, self.peak_flops, self.measure_flops = log_every_n_steps, peak_flops, measure_flops
        self.flops_per_batch: int | None = None
        self.history: list[dict] = []
        self._counter = None

    def on_train_start(self, trainer, module):
        self._every = self.log_every_n_steps or trainer.log_every_n_steps
        self._world = trainer.world_size
        self._cuda = trainer.strategy.root_device.type == "cuda"
        self._tokens_fn = self.length_fn or (getattr(module, "tokens_in_batch", None))
        self._peak = self.peak_flops
        if self._peak is None and self._cuda:
            name = torch.cuda.get_device_name(trainer.strategy.root_device)
            self._peak = peak_flops_for(name, compute_dtype(trainer.precision))
        self._samples = self._batches = self._tokens = 0
        self._has_tokens = False
        self._t0 = time.perf_counter()
        self._last_step = trainer.global_step
        self._first = True

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self._first and self.measure_flops and self.flops_per_batch is None:
            from torch.utils.flop_counter import FlopCounterMode
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self._first:
            self._first = False
            if self._counter is not None:
                self._counter.__exit__(None, None, None)
                self.flops_per_batch = int(self._counter.get_total_flops())
                self._counter = None
            self._drop_batch_start_hook(trainer)
            if self._cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()   # the window starts after the (slow) first batch
            return
        self._batches += 1
        n = self.batch_size_fn(batch) if self.batch_size_fn is not None else _batch_size(batch)
        self._samples += n or 0
        if self._tokens_fn is not None:
            self._tokens += int(self._tokens_fn(batch))
            self._has_tokens = True
        elif isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            self._tokens += batch["input_ids"].numel()
            self._has_tokens = True
        step = trainer.global_step
        if step != self._last_step and step % self._every == 0:
            self._log(trainer, step)

    def on_exception(self, trainer, module, exception):
        if self._counter is not None:   # the first batch failed while FLOPs were counted
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _drop_batch_start_hook(self, trainer) -> None:
        """After the FLOP count, this callback's on_train_batch_start has nothing to do: take it off
        the trainer's hook list so it costs no call per step."""
        trainer.events.retire(self, "on_train_batch_start")

    def _log(self, trainer, step: int) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt = now - self._t0
        if dt <= 0 or self._batches == 0:
            return
        bps = self._batches / dt
        out = {"throughput/samples_per_sec": self._samples * self._world / dt, "throughput/batches_per_sec": bps}
        if self._has_tokens:
            out["throughput/tokens_per_sec"] = self._tokens * self._world / dt
        if self.flops_per_batch:
            fps = self.flops_per_batch * bps
            out["throughput/flops_per_sec"] = fps
            if self._peak:
                out["throughput/mfu"] = fps / self._peak
        self.history.append(dict(out, step=step))
        for k, v in out.items():
            trainer.callback_metrics[k] = torch.tensor(v)
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics(out, step=step)
        self._samples = self._batches = self._tokens = 0
        self._t0, self._last_step = now, step
