"""Rank-zero helpers: print, log and warn on global rank 0 only (Lightning's
``rank_zero_only``, ``rank_zero_info``, ``rank_zero_warn``, ``rank_zero_debug``,
``rank_zero_deprecation``, ``rank_prefixed_message``; public as :mod:`ember.utilities`).

The rank comes from the environment the launcher sets (:func:`env_rank`), read when
this module is imported, as Lightning does; ``rank_zero_only.rank`` can be set by hand. The messages go to the
``ember.utilities`` logger. Imports no torch."""
from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Callable, Optional, TypeVar

__all__ = ["rank_zero_only", "rank_zero_info", "rank_zero_warn", "rank_zero_debug",
           "rank_zero_deprecation", "rank_prefixed_message", "env_rank"]

T = TypeVar("T")
log = logging.getLogger("ember.utilities")   # the name users configure (ember.utilities)


def env_rank() -> int:
    """Global rank from the launcher's environment: the first of RANK, LOCAL_RANK,
    SLURM_PROCID and JSM_NAMESPACE_RANK set to an integer; 0 when none is."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None:
            try:
                return int(value)
            except ValueError:   # not refused at import: finding the run's environment names it
                continue
    return 0


def rank_zero_only(fn: Callable[..., T], default: Optional[T] = None) -> Callable[..., Optional[T]]:
    """Decorator: call ``fn`` only on global rank 0 (``rank_zero_only.rank == 0``);
    other ranks get ``default`` (None unless given)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Optional[T]:
        rank = getattr(rank_zero_only, "rank", None)
        if rank is None:
            raise RuntimeError("rank_zero_only.rank is not set; set it to this process's global rank")
        if rank == 0:
            return fn(*args, **kwargs)
        return default

    return wrapped


rank_zero_only.rank = env_rank()  # type: ignore[attr-defined]


def rank_prefixed_message(message: str, rank: Optional[int]) -> str:
    """``"[rank: N] message"`` (the message unchanged when ``rank`` is None)."""
    return f"[rank: {rank}] {message}" if rank is not None else message


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.debug`` on the ``ember.utilities`` logger, on rank 0 only."""
    log.debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.info`` on the ``ember.utilities`` logger, on rank 0 only."""
    log.info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn(message)`` on rank 0 only (``category=`` as in :func:`warnings.warn`)."""
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_deprecation(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """:func:`rank_zero_warn` with ``DeprecationWarning`` as the category."""
    kwargs.setdefault("category", DeprecationWarning)
    warnings.warn(message, stacklevel=stacklevel, **kwargs)
