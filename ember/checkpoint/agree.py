"""One verdict for every rank on whether a checkpoint may be loaded.

The checks made when a run resumes read inputs that can differ between ranks: the
files as one node sees them (a copy corrupted or replaced on one node's disk, a
digest package importable on some nodes only), each rank's own train dataloader, each
process's environment. A rank that refused alone would leave the others waiting in
the next collective until the process-group timeout, with no common error. So the
ranks exchange their outcomes (:func:`agree_outcome`), at resume time only, before the
load (the files) and after it (what was loaded): ``Trainer.fit(ckpt_path=...)``
(ember/trainer/checkpoint.py) and ``Accelerator.load_state`` (ember/accelerator/checkpoint.py).
"""
from __future__ import annotations

import os
from typing import Any

from ember.errors import CheckpointError, DistributedOperationError


def describe(error: BaseException) -> str:
    """The text another rank shows for ``error``: a CheckpointError's message, else
    ``"<Type>: <message>"``."""
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def agree_outcome(strategy: Any, error: BaseException | None, rank0_value: Any = None) -> Any:
    """Every rank's outcome of its checks, on every rank: returns rank 0's
    ``rank0_value`` when no rank failed (a setting rank 0 decides, sent with the
    verdict); else raises on every rank the CheckpointError ``"rank R: <message>"`` of
    the first failing rank R, chained on that rank from its own error so that its
    traceback is shown. Every rank must call it at the same point (one
    ``all_gather_object``). On one process it raises ``error`` itself, unchanged."""
    if strategy.world_size == 1:
        if error is not None:
            raise error
        return rank0_value
    mine = None if error is None else describe(error)
    gathered = strategy.all_gather_object((mine, rank0_value if strategy.is_global_zero else None))
    failed = [(rank, msg) for rank, (msg, _) in enumerate(gathered) if msg is not None]
    if not failed:
        return gathered[0][1]
    rank, msg = failed[0]
    also = [str(r) for r, _ in failed[1:]]
    more = f" (rank(s) {', '.join(also)} refused it as well)" if also else ""
    raise CheckpointError(f"rank {rank}: {msg}{more}") from error


def collective_failed(error: BaseException) -> bool:
    """True for an error out of a collective (a peer that did not arrive, a timeout),
    itself or as the cause of a wrapping error: the ranks cannot agree on it with
    another collective, so it is raised as it is."""
    from ember.distributed.failures import is_comm_error
    cause: BaseException | None = error
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, DistributedOperationError) or is_comm_error(cause):
            return True
        cause = cause.__cause__
    return False


def check_files(path: str | os.PathLike) -> None:
    """The checks on a checkpoint's files that need no tensor loaded: ``path`` exists,
    and a checkpoint directory's ``meta.json`` lists files inside it with the recorded
    sizes and content digests. The files are what each node sees: agree on the
    outcome (:func:`agree_outcome`)."""
    from ember.checkpoint import io as cio
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(cio._missing_message(path))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, cio.META_NAME)):
        cio.read_meta_checked(path)
