"""Collectives and process helpers (see :mod:`~ember.distributed.collectives`)."""
from ember.distributed.collectives import (REDUCE_OPS, ProcessGroupOps, all_gather, all_gather_object,  # noqa: F401
                                           barrier, broadcast, destroy, first_rows, gather, gather_for_metrics,
                                           get_rank, get_world_size, is_initialized, is_sample_list,
                                           mark_arrival, missing_ranks, pad_across_processes, reduce)
