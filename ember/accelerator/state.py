"""The process layout under Accelerate's names: ``PartialState`` (no Accelerator
needed), ``accelerator.state`` (:class:`AcceleratorState`) and
``accelerator.gradient_state`` (:class:`GradientState`)."""
from __future__ import annotations

from typing import Any, Callable, ContextManager

from ember.accelerator.config import distributed_type_of
from ember.distributed.processes import Topology, _Yield, share_strategy, shared_strategy, split_inputs

__all__ = ["PartialState", "AcceleratorState", "GradientState"]


class PartialState(Topology):
    """The process layout without an Accelerator (Accelerate's ``PartialState``):
    ``num_processes``, ``process_index``, ``local_process_index``, ``device``,
    ``is_main_process``, ``distributed_type``, ``wait_for_everyone()``,
    ``main_process_first()``, ``split_between_processes()``, ``print()``. All instances
    share one state: the Accelerator's once one exists, else one set up from the
    launcher's environment (``cpu=True``: the CPU)."""

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        strategy = shared_strategy()
        if strategy is None:
            from ember.strategies import build_strategy
            strategy = build_strategy("auto", "cpu" if cpu else "auto")
            strategy.setup_environment()
            share_strategy(strategy)
        self._strategy = strategy

    @property
    def strategy(self) -> Any:
        """The shared Strategy."""
        shared = shared_strategy()
        return self._strategy if shared is None else shared

    distributed_type = property(lambda self: distributed_type_of(self.strategy), doc=":class:`DistributedType`")
    initialized = property(lambda self: True, doc="always True (the state is set up on construction)")

    @property
    def backend(self) -> str | None:
        """The process group backend (``"nccl"``, ``"gloo"``), None on one process."""
        return getattr(self.strategy, "_backend", None) if self.num_processes > 1 else None

    def wait_for_everyone(self) -> None:
        """Barrier: wait until every process arrives."""
        self.strategy.barrier("wait_for_everyone")

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """Context manager yielding this process's part of ``inputs`` (list, tuple, dict, tensor)."""
        return _Yield(split_inputs(inputs, self.num_processes, self.process_index, apply_padding))

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on the main process only (elsewhere it returns None)."""
        import functools

        @functools.wraps(function)
        def wrapper(*a, **k):
            return function(*a, **k) if self.is_main_process else None
        return wrapper

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type.value}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")


class AcceleratorState(PartialState):
    """``accelerator.state``: the process layout plus ``mixed_precision``."""

    def __init__(self, accelerator: Any = None, **kwargs: Any) -> None:
        self._acc = accelerator
        super().__init__(**kwargs)

    mixed_precision = property(lambda self: self._acc.mixed_precision if self._acc is not None else "no",
                               doc='str: "no", "fp16", "bf16" (or the ember precision string)')
    num_steps = property(lambda self: self._acc.gradient_accumulation_steps if self._acc is not None else 1,
                         doc="int: gradient accumulation steps")


class GradientState:
    """``accelerator.gradient_state``: ``sync_gradients``, ``num_steps``,
    ``end_of_dataloader``, ``active_dataloader``."""

    def __init__(self, accelerator: Any) -> None:
        self._acc = accelerator

    sync_gradients = property(lambda self: self._acc.sync_gradients, doc="bool: this micro-batch steps")
    num_steps = property(lambda self: self._acc.gradient_accumulation_steps, doc="int: accumulation steps")
    active_dataloader = property(lambda self: self._acc._active_loader, doc="the prepared loader being iterated")
    in_dataloader = property(lambda self: self._acc._active_loader is not None, doc="bool: inside a prepared loader")

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the active prepared loader gave its last batch."""
        loader = self._acc._active_loader
        return bool(loader is not None and loader.end_of_dataloader)

