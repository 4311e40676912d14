"""Background checkpoint writes for the unsharded strategies (single device, DDP):
``Strategy(async_save=True)``, the switch ``FSDPStrategy`` has for DCP's ``async_save``.

The training thread copies the state to CPU memory (so training may go on and change
the parameters at once) and hands it to one writer thread, which writes ``NAME.ember-tmp``
and commits it with the same rules as a synchronous save (``meta.json`` with the file
list last, rename into place, the ENOSPC message). At most one write is in flight.
"""
from __future__ import annotations

import copy
import threading
from typing import Any

import torch


def cpu_snapshot(obj: Any, reuse: Any = None) -> Any:
    """A copy of ``obj`` whose tensors are CPU tensors of their own (dicts, lists and tuples
    are rebuilt; anything else is deep-copied): nothing in it aliases live training state.

    ``reuse``: an earlier snapshot of the same structure whose write has finished; its
    tensors of matching shape and dtype are overwritten instead of allocated again (no new
    pages to fault in: the copy runs at memory speed). CUDA tensors are copied into pinned
    buffers without blocking, then synchronised once."""
    cuda: list = []
    out = _snap(obj, reuse, cuda, {})
    if cuda:
        torch.cuda.synchronize()
    return out


def _snap(obj: Any, reuse: Any, cuda: list, memo: dict) -> Any:
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:   # one tensor held twice (tied weights) stays one copy
            return memo[id(obj)]
        src = obj.detach()
        if isinstance(reuse, torch.Tensor) and reuse.shape == src.shape and reuse.dtype == src.dtype \
                and reuse.layout == src.layout == torch.strided:
            dst = reuse
        else:
            dst = torch.empty_like(src, device="cpu", pin_memory=src.is_cuda)
        if src.is_cuda:
            cuda.append(True)
        memo[id(obj)] = dst.copy_(src, non_blocking=src.is_cuda)
        return memo[id(obj)]
    if isinstance(obj, dict):
        r = reuse if isinstance(reuse, dict) else {}
        items = [(k, _snap(v, r.get(k), cuda, memo)) for k, v in obj.items()]
        if type(obj) is dict:
            return dict(items)
        out = copy.copy(obj)   # a dict subclass (defaultdict, OrderedDict) keeps its type and factory
        out.clear()
        out.update(items)
        return out
    if isinstance(obj, (list, tuple)):
        r = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        out = [_snap(v, rv, cuda, memo) for v, rv in zip(obj, r)]
        if isinstance(obj, list):
            return out
        return type(obj)(*out) if hasattr(obj, "_fields") else type(obj)(out)
    return copy.deepcopy(obj)


class PendingWrite:
    """One checkpoint being written by a background thread (``write_checkpoint`` of a
    CPU snapshot into ``NAME.ember-tmp``, committed by that thread when complete).
    :meth:`result` waits for it and raises the writer's exception; :meth:`drop` makes
    sure it is not committed if it has not been yet (its ``NAME.ember-tmp`` is removed)."""

    def __init__(self, path: str, weights: dict, state: "dict | None", meta: dict):
        from ember.checkpoint import io as cio
        self.path = path
        self.committed = False
        self._dropped = False
        self._error: "BaseException | None" = None
        self._lock = threading.Lock()

        def commit(tmp: str, target: str) -> None:
            with self._lock:       # drop() and the commit exclude each other
                if self._dropped:
                    cio._remove(tmp)
                    return
                cio.commit_directory(tmp, target)
                self.committed = True

        def write():
            try:
                cio.write_checkpoint(path, weights, state, meta, commit=commit)
            except BaseException as err:    # raised on the training thread by result()
                self._error = err

        self._thread = threading.Thread(target=write, name=f"ember-save:{path}", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def drop(self) -> bool:
        """Cancel the commit unless it happened, then wait for the writer to end (it removes
        its ``NAME.ember-tmp``; its buffers are free again). True when this save was not committed."""
        with self._lock:
            self._dropped = not self.committed
        self._thread.join()
        return self._dropped
