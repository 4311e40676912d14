"""Where a process stands (:class:`Topology`), the process's shared strategy, and the
small helpers of the process verbs."""
from __future__ import annotations

import functools
import itertools
from typing import Any, ContextManager

import torch

from ember.errors import MisconfigurationError


class Topology:
    """Where this process stands, read from ``self.strategy``: the properties
    :class:`~ember.accelerator.state.PartialState` and the Accelerator share."""
    device = property(lambda self: self.strategy.root_device, doc="torch.device: this process's device")
    num_processes = property(lambda self: self.strategy.world_size, doc="int: processes in the run")
    process_index = property(lambda self: self.strategy.global_rank, doc="int: this process's global rank")
    local_process_index = property(lambda self: self.strategy.local_rank, doc="int: its rank on this machine")
    is_main_process = property(lambda self: self.strategy.is_global_zero, doc="bool: global rank 0")
    is_local_main_process = property(lambda self: self.strategy.is_local_zero, doc="bool: local rank 0")
    is_last_process = property(lambda self: self.process_index == self.num_processes - 1,
                               doc="bool: the highest global rank")
    use_distributed = property(lambda self: self.num_processes > 1, doc="bool: more than one process")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def main_process_first(self) -> ContextManager[None]:
        """Context manager: the main process runs the block first, then the others."""
        return _InOrder(self, self.is_main_process)

    def local_main_process_first(self) -> ContextManager[None]:
        """Context manager: each machine's local main process runs the block first."""
        return _InOrder(self, self.is_local_main_process)


# -- the process's shared strategy ----------------------------------------------------------------
_SHARED: dict = {}


def shared_strategy() -> Any:
    """The strategy every ``PartialState()`` and the Accelerate-style helpers
    (``ember.utils.gather``, ``ember.logging.get_logger``) see: the last Accelerator's, or
    the one a first ``PartialState()`` set up; None before either."""
    return _SHARED.get("strategy")


def share_strategy(strategy: Any) -> None:
    """Make ``strategy`` the process's shared strategy (:func:`shared_strategy`)."""
    _SHARED["strategy"] = strategy


def forget_shared_strategy() -> None:
    """Drop the shared strategy (a process forked after its parent set one up has none of its own)."""
    _SHARED.clear()


# -- split_between_processes ---------------------------------------------------------------------
def split_inputs(inputs: Any, num_processes: int, rank: int, apply_padding: bool) -> Any:
    """Rank ``rank``'s contiguous part of ``inputs`` (list, tuple, dict of them, tensor)."""
    if isinstance(inputs, dict):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise MisconfigurationError(f"split_between_processes: every value of the dict must have the "
                                        f"same length; got {lengths}")
        return type(inputs)((k, split_inputs(v, num_processes, rank, apply_padding)) for k, v in inputs.items())
    if not (hasattr(inputs, "__len__") and hasattr(inputs, "__getitem__")):
        raise MisconfigurationError(f"split_between_processes: inputs must be a list, tuple, tensor or dict "
                                    f"of them; got {type(inputs).__name__}")
    if num_processes == 1:
        return inputs
    per, extra = divmod(len(inputs), num_processes)
    start = rank * per + min(rank, extra)
    part = inputs[start: start + per + (1 if rank < extra else 0)]
    target = per + (1 if extra else 0)
    if apply_padding and len(part) < target and len(inputs):
        k = target - len(part)
        if isinstance(inputs, torch.Tensor):
            last = part[-1:] if len(part) else inputs[-1:]
            part = torch.cat([part, last.expand((k,) + tuple(last.shape[1:]))])
        else:
            last = part[-1] if len(part) else inputs[-1]
            part = type(part)(list(part) + [last] * k) if isinstance(part, (list, tuple)) else part + [last] * k
    return part


# -- small helpers of the Accelerator's process verbs ---------------------------------------

def _only(acc, function, attr: str, index: int):
    if function is None:
        return functools.partial(_only, acc, attr=attr, index=index)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if getattr(acc, attr) == index else None
    return wrapper


class _InOrder:
    """``first`` processes run the body, then meet the others at a barrier; the others
    wait at that barrier before running it. On an exception in the body no barrier is
    entered (the process fails and the launcher ends the others)."""
    __slots__ = ("acc", "first")

    def __init__(self, acc, first: bool):
        self.acc, self.first = acc, first

    def __enter__(self):
        if not self.first:
            self.acc.wait_for_everyone()

    def __exit__(self, exc_type, exc, tb):
        if self.first and exc_type is None:
            self.acc.wait_for_everyone()
        return False


class _Yield:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


class _Islice:
    def __init__(self, iterable, n: int):
        self.iterable, self.n = iterable, n

    def __iter__(self):
        return itertools.islice(iter(self.iterable), self.n, None)

    def __len__(self):
        return max(0, len(self.iterable) - self.n)
