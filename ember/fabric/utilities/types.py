"""``lightning.fabric.utilities.types`` under ember: the protocols Fabric code annotates with."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

__all__ = ["Optimizable", "LRScheduler", "ReduceLROnPlateau", "Steppable"]


@runtime_checkable
class Steppable(Protocol):
    """Anything with ``step(closure)``."""

    def step(self, closure: Optional[Callable[[], Any]] = ...) -> Any: ...


@runtime_checkable
class Optimizable(Steppable, Protocol):
    """An optimizer: ``step``, ``zero_grad``, ``param_groups``, ``state_dict``."""

    param_groups: list[dict[Any, Any]]
    defaults: dict[Any, Any]
    state: Any

    def state_dict(self) -> dict[str, dict[Any, Any]]: ...

    def load_state_dict(self, state_dict: dict[str, dict[Any, Any]]) -> None: ...
