"""Collectives and process helpers.

The functions below (:mod:`~ember.distributed.collectives`) work on the current
strategy's process group, or on one process as no-ops: ``gather``,
``gather_for_metrics``, ``reduce``, ``broadcast``, ``pad_across_processes`` ...
:mod:`~ember.distributed.processes` holds the process topology and the helpers of
the process verbs; :mod:`~ember.distributed.debug` the debug-mode collective check."""
from ember.distributed.collectives import (REDUCE_OPS, ProcessGroupOps, all_gather, all_gather_object,  # noqa: F401
                                           barrier, broadcast, destroy, first_rows, gather, gather_for_metrics,
                                           get_rank, get_world_size, is_initialized, is_sample_list,
                                           mark_arrival, missing_ranks, pad_across_processes, reduce)
