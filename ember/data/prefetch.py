"""Batches moved to the device one step ahead: while step ``i`` runs, batch ``i + 1``
is already pinned and its host-to-device copy issued (``non_blocking``, on a side CUDA
stream), so the copy overlaps step ``i``'s compute instead of stalling step ``i + 1``.
The batches, their order and their number are the loader's. When the training loop
uses it: :func:`prefetch_enabled`.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch

from ember.distributed.collectives import map_tensors, tensor_leaves


def prefetch_enabled(device: torch.device) -> bool:
    """Whether the loop prefetches batches to ``device``: on CUDA by default;
    ``$EMBER_PREFETCH`` ``"0"``/``"1"`` turns it off/on anywhere."""
    env = os.environ.get("EMBER_PREFETCH", "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    return device.type == "cuda"


def _pin(batch: Any) -> Any:
    return map_tensors(lambda t: t.pin_memory() if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                       and not t.is_pinned() else t, batch)


def _record(batch: Any, stream) -> None:
    """Tell the caching allocator that ``stream`` uses the batch's device memory."""
    for t in tensor_leaves(batch):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


class DevicePrefetch:
    """Iterate ``loader`` one batch ahead, moving each batch with ``to_device`` before
    the previous one is handed out (off CUDA, ``to_device`` simply runs one batch early).
    Attributes other than iteration are the loader's."""

    def __init__(self, loader, to_device: Callable[[Any], Any], device: torch.device):
        self.loader, self.to_device = loader, to_device
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    def _send(self, batch: Any) -> Any:
        if self._stream is None:
            return self.to_device(batch)
        batch = _pin(batch)
        with torch.cuda.stream(self._stream):
            return self.to_device(batch)

    def _ready(self, batch: Any) -> Any:
        if self._stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self._stream)
            _record(batch, current)
        return batch

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        try:
            ahead = self._send(next(it))
        except StopIteration:
            return
        for batch in it:
            current, ahead = ahead, self._send(batch)    # batch i + 1 issued before step i runs
            yield self._ready(current)
        yield self._ready(ahead)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)
