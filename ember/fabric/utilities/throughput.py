"""Throughput as Lightning Fabric measures it: :class:`Throughput` (rolling rates over the
last ``window_size`` updates), :class:`ThroughputMonitor` (the same, logged through a
``Fabric``), :func:`measure_flops` (``torch.utils.flop_counter``). The Trainer's callback
is :class:`ember.callbacks.ThroughputMonitor`."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch

__all__ = ["Throughput", "ThroughputMonitor", "measure_flops"]


class Throughput:
    """Rolling throughput over the last ``window_size`` calls of :meth:`update`.

    :meth:`compute` returns ``time``, ``batches``, ``samples`` (and ``lengths``) as last
    given, and once the window is full ``device/batches_per_sec``, ``device/samples_per_sec``,
    ``device/items_per_sec`` (with ``lengths``), ``device/flops_per_sec`` and
    ``device/mfu`` (with ``flops`` and ``available_flops``); with ``world_size > 1`` also
    the global rates (the device's times ``world_size``). Keys and values are Lightning
    Fabric's.

    Args:
        available_flops: peak FLOP/s of one device (for ``device/mfu``).
        world_size: devices in the run.
        window_size: updates the rates are averaged over (> 1).
        separator: between ``device`` and the metric name.
    """

    def __init__(self, available_flops: Optional[float] = None, world_size: int = 1, window_size: int = 100,
                 separator: str = "/") -> None:
        if world_size < 1:
            raise ValueError(f"Throughput(world_size={world_size}): use an int >= 1")
        if window_size < 2:
            raise ValueError(f"Throughput(window_size={window_size}): use an int >= 2")
        self.available_flops, self.world_size, self.separator = available_flops, int(world_size), separator
        self._time: deque = deque(maxlen=window_size)
        self._batches: deque = deque(maxlen=window_size)
        self._samples: deque = deque(maxlen=window_size)
        self._lengths: deque = deque(maxlen=window_size)
        self._flops: deque = deque(maxlen=window_size)

    @staticmethod
    def _rising(window: deque, value: Any, what: str) -> None:
        if window and value < window[-1]:
            raise ValueError(f"Throughput.update: {what} must not decrease (got {value} after {window[-1]})")
        window.append(value)

    def update(self, *, time: float, batches: int, samples: int, lengths: Optional[int] = None,
               flops: Optional[int] = None) -> None:
        """Record the totals so far: ``time`` (seconds since the start), ``batches`` and
        ``samples`` seen on this device, ``lengths`` (items, e.g. tokens, seen), and the
        ``flops`` of this device since the last update."""
        if samples < batches:
            raise ValueError(f"Expected samples ({samples}) to be greater or equal than batches ({batches})")
        self._rising(self._time, time, "time")
        self._rising(self._batches, batches, "batches")
        self._rising(self._samples, samples, "samples")
        if lengths is not None:
            if lengths < samples:
                raise ValueError(f"Expected lengths ({lengths}) to be greater or equal than samples ({samples})")
            self._rising(self._lengths, lengths, "lengths")
            if len(self._lengths) != len(self._samples):
                raise RuntimeError(f"If lengths are passed ({len(self._lengths)}), there needs to be the same number "
                                   f"of samples ({len(self._samples)})")
        if flops is not None:
            self._flops.append(flops * self.world_size)

    def compute(self) -> dict[str, float | int]:
        """The metrics (see the class)."""
        dev = f"device{self.separator}"
        out: dict[str, float | int] = {"time": self._time[-1], "batches": self._batches[-1],
                                       "samples": self._samples[-1]}
        if self._lengths:
            out["lengths"] = self._lengths[-1]
        many = self.world_size > 1
        full = len(self._time) == self._time.maxlen
        if full:
            elapsed = self._time[-1] - self._time[0]
            batches = (self._batches[-1] - self._batches[0]) / elapsed
            samples = (self._samples[-1] - self._samples[0]) / elapsed
            out[f"{dev}batches_per_sec"], out[f"{dev}samples_per_sec"] = batches, samples
            if many:
                out["batches_per_sec"], out["samples_per_sec"] = batches * self.world_size, samples * self.world_size
            if len(self._lengths) == self._lengths.maxlen:
                items = (self._lengths[-1] - self._lengths[0]) / elapsed
                out[f"{dev}items_per_sec"] = items
                if many:
                    out["items_per_sec"] = items * self.world_size
        if len(self._flops) == self._flops.maxlen:
            elapsed = self._time[-1] - self._time[0]
            flops = (sum(self._flops) - self._flops[0]) / elapsed   # the first update's flops precede the window
            if many:
                out["flops_per_sec"] = flops
            out[f"{dev}flops_per_sec"] = flops / self.world_size
            if self.available_flops:
                out[f"{dev}mfu"] = flops / self.world_size / self.available_flops
        return out

    def reset(self) -> None:
        """Forget every update."""
        for w in (self._time, self._batches, self._samples, self._lengths, self._flops):
            w.clear()


class ThroughputMonitor(Throughput):
    """:class:`Throughput` for a Fabric loop (Lightning Fabric's ``ThroughputMonitor(fabric)``):
    the world size and the device's peak FLOP/s come from ``fabric``, and
    :meth:`compute_and_log` logs the metrics through ``fabric.log_dict`` (global rank 0).
    Updates and computes run on global rank 0 only (elsewhere they do nothing and return ``{}``).
    Keyword arguments are :class:`Throughput`'s (``window_size``, ``separator``)."""

    def __init__(self, fabric: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - {"window_size", "separator"})
        if unknown:
            raise TypeError(f"ThroughputMonitor: unexpected keyword argument(s) {unknown}; "
                            "it takes window_size= and separator=")
        from ember.callbacks.throughput import compute_dtype, peak_flops_for
        device = fabric.device
        flops = None
        if device.type == "cuda":
            flops = peak_flops_for(torch.cuda.get_device_name(device), compute_dtype(fabric._acc.precision))
        super().__init__(available_flops=flops, world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        self._zero = bool(fabric.is_global_zero)
        self.step = -1

    def update(self, **kwargs: Any) -> None:   # noqa: D102 - Throughput.update, on global rank 0
        if self._zero:
            super().update(**kwargs)

    def compute(self) -> dict[str, float | int]:   # noqa: D102
        return super().compute() if self._zero else {}

    def reset(self) -> None:   # noqa: D102
        if self._zero:
            super().reset()

    def compute_and_log(self, step: Optional[int] = None) -> dict[str, float | int]:
        """Compute the metrics and log them with ``fabric.log_dict`` at ``step`` (default:
        one more than the last call's)."""
        if not self._zero:
            return {}
        self.step = self.step + 1 if step is None else int(step)
        metrics = self.compute()
        self._fabric.log_dict(metrics, step=self.step)
        return metrics


def measure_flops(model: torch.nn.Module, forward_fn: Callable[[], torch.Tensor],
                  loss_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> int:
    """FLOPs of ``forward_fn()`` (and of ``loss_fn(output).backward()`` with ``loss_fn``),
    counted by ``torch.utils.flop_counter.FlopCounterMode``; build the model on the meta
    device (``fabric.init_module(empty_init=True)`` / ``torch.device("meta")``) to count
    without computing."""
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        out = forward_fn()
        if loss_fn is not None:
            loss_fn(out).backward()
    return counter.get_total_flops()
