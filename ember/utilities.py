"""``ember.utilities``: what Lightning users import from ``lightning.pytorch.utilities``:
the rank-zero helpers (``rank_zero_only``, ``rank_zero_info``, ``rank_zero_warn``,
``rank_zero_debug``, ``rank_zero_deprecation``, ``rank_prefixed_message``),
``seed_everything`` and ``CombinedLoader``. The last two are imported on first use
(they import torch; this module does not).

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

from typing import TYPE_CHECKING, Any

from ember.loggers.rank_zero import (rank_prefixed_message, rank_zero_debug, rank_zero_deprecation,  # noqa: F401
                                     rank_zero_info, rank_zero_only, rank_zero_warn)

if TYPE_CHECKING:
    from ember.data.combined import CombinedLoader
    from ember.data.worker_seed import seed_everything

__all__ = ["rank_zero_only", "rank_zero_info", "rank_zero_warn", "rank_zero_debug",
           "rank_zero_deprecation", "rank_prefixed_message", "seed_everything", "CombinedLoader"]


def __getattr__(name: str) -> Any:
    if name == "seed_everything":
        from ember.data.worker_seed import seed_everything
        return seed_everything
    if name == "CombinedLoader":   # Lightning's lightning.pytorch.utilities.CombinedLoader
        from ember.data.combined import CombinedLoader
        return CombinedLoader
    raise AttributeError(f"module 'ember.utilities' has no attribute {name!r}")
