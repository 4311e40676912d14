"""``get_logger`` behind :mod:`ember.logging` (Accelerate's ``accelerate.logging``): a
standard :mod:`logging` logger whose calls take ``main_process_only=True`` (default:
only the main process emits) and ``in_order=True`` (every process emits, one after
the other)."""
from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "MultiProcessAdapter"]


def _layout() -> tuple[int, int, bool]:
    """(process index, number of processes, local main) without starting anything."""
    from ember.distributed.processes import shared_strategy
    s = shared_strategy()
    if s is not None:
        return s.global_rank, s.world_size, s.is_local_zero
    rank = int(os.environ.get("RANK", 0))
    return rank, int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)) == 0


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logger adapter: ``main_process_only`` (default True) and ``in_order`` keywords."""

    def log(self, level, msg, *args, **kwargs):
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank, world, _ = _layout()
        if main_process_only and not in_order:
            if rank == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        if in_order and world > 1:
            from ember.accelerator.state import PartialState
            state = PartialState()
            for i in range(world):
                if i == rank:
                    m, kw = self.process(msg, dict(kwargs))
                    self.logger.log(level, m, *args, **kw)
                state.wait_for_everyone()
            return
        msg, kwargs = self.process(msg, kwargs)
        self.logger.log(level, msg, *args, **kwargs)

    def warning_once(self, *args, **kwargs):
        """``warning`` the first time this message is logged only."""
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_seen", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` wrapped so ``logger.info(..., main_process_only=True)``
    works; ``log_level`` (or ``$ACCELERATE_LOG_LEVEL``) sets the level."""
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
