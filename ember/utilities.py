"""``ember.utilities``: the rank-zero helpers Lightning users import from
``lightning.pytorch.utilities`` (``rank_zero_only``, ``rank_zero_info``,
``rank_zero_warn``, ``rank_zero_debug``), ``seed_everything``, and ``CombinedLoader``
(:class:`ember.data.combined.CombinedLoader`, imported on first use).

The rank comes from the environment the launcher sets (``RANK``, then
``LOCAL_RANK``, then ``SLURM_PROCID``; 0 when none is set), read when this module
is imported, as Lightning does. ``rank_zero_only.rank`` can be set by hand::

    from ember.utilities import rank_zero_only, rank_zero_info

    @rank_zero_only
    def save_report(text):          # runs on global rank 0 only; returns None elsewhere
        print(text)

    rank_zero_info("printed once, on rank 0")
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Callable, Optional, TypeVar

__all__ = ["rank_zero_only", "rank_zero_info", "rank_zero_warn", "rank_zero_debug",
           "rank_zero_deprecation", "rank_prefixed_message", "seed_everything", "CombinedLoader"]


def __getattr__(name: str) -> Any:
    if name == "CombinedLoader":   # Lightning's lightning.pytorch.utilities.CombinedLoader (imports torch)
        from ember.data.combined import CombinedLoader
        return CombinedLoader
    raise AttributeError(f"module 'ember.utilities' has no attribute {name!r}")

T = TypeVar("T")
log = logging.getLogger("ember.utilities")


def _get_rank() -> int:
    """Global rank from the launcher's environment: RANK, LOCAL_RANK, SLURM_PROCID."""
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


rank_zero_only.rank = _get_rank()  # type: ignore[attr-defined]


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


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed python, numpy and torch (all devices). Returns the seed used.

    ``workers=True`` sets ``EMBER_SEED_WORKERS=1`` for the rest of the process (and the
    ranks it starts; ``EMBER_SEED_WORKERS=0`` turns it off): the workers of every
    DataLoader ember prepares then seed python, numpy and torch from (run seed, epoch,
    rank, worker) and re-seed them per batch, so their random draws differ across ranks
    and workers and repeat exactly after a mid-epoch resume (see ``ember.data.worker_seed``).
    Worker seeds differ per rank and worker in any case."""
    import os
    import random
    if seed is None:
        seed = os.environ.get("EMBER_GLOBAL_SEED", random.randint(0, 2**31 - 1))
    try:
        if isinstance(seed, (bool, float)):
            raise ValueError
        seed = int(seed)
    except (TypeError, ValueError):
        from ember.errors import MisconfigurationError
        raise MisconfigurationError(f"seed={seed!r} is not valid; use an integer (e.g. seed=42)") from None
    os.environ["EMBER_GLOBAL_SEED"] = str(seed)
    if workers:
        os.environ["EMBER_SEED_WORKERS"] = "1"
    from ember.data.worker_seed import seed_all
    seed_all(seed)
    return seed
