"""How ember has DeepSpeed write its checkpoint files (:class:`EmberCheckpointEngine`).

DeepSpeed writes its files through the engine's checkpoint engine
(``engine.checkpoint_engine.save(state_dict, path)`` per file) inside
``engine.save_checkpoint``, which ends with a ``dist.barrier()``. ember wraps
DeepSpeed's default ``TorchCheckpointEngine`` for two reasons:

- **A failed write does not strand the other ranks.** While ember saves, a write (or a
  directory creation) that fails on this rank (a full disk, a quota) is recorded instead
  of raised, so this rank still reaches ``save_checkpoint``'s closing barrier with the
  others; its error then travels in this rank's report to ember's commit, and every rank
  raises a CheckpointError naming it (an exception raised out of ``save_checkpoint`` on
  one rank would leave the others waiting in that barrier until the process-group
  timeout). The files after a failed one are skipped.
- **Background writes** (``DeepSpeedStrategy(async_save=True)``): ``save`` copies every
  tensor of the state to CPU memory of its own on the training thread (the optimizer
  changes the live tensors in place at the next step) and hands the copy to this rank's
  writer thread, which ``torch.save``-s it. ``engine.save_checkpoint`` then returns once
  the copies are made.

The strategy takes this rank's outcome after ``engine.save_checkpoint`` returned
(:meth:`EmberCheckpointEngine.take`: the writer, the recorded error) and commits the
checkpoint with one rule (every rank reports its files or its error, rank 0 checks them
and renames ``NAME.ember-tmp`` into place): at once for a synchronous save; at the next save,
before a load, or at teardown for a background one. Outside ember's saves (e.g. the
user calling ``engine.save_16bit_model``) the wrapper writes as DeepSpeed does.
Imported only when a DeepSpeed strategy sets up (it needs deepspeed).
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ember.strategies.async_save import cpu_snapshot


class RankWriter:
    """This rank's writer thread for one checkpoint: writes the queued CPU snapshots in
    order with ``write(state, path)``; after a failed write the rest are skipped."""

    def __init__(self, write) -> None:
        self._write = write
        self._queue: "queue.SimpleQueue[tuple[Any, str] | None]" = queue.SimpleQueue()
        self.error: "BaseException | None" = None
        self._thread = threading.Thread(target=self._run, name="ember-deepspeed-save", daemon=False)
        self._thread.start()

    def put(self, state: Any, path: str) -> None:
        self._queue.put((state, path))

    def close(self) -> None:
        """No more files for this checkpoint: the thread ends after writing the queued ones."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is None:
                try:
                    self._write(*item)
                except BaseException as err:    # reported by wait() on the training thread
                    self.error = err

    def wait(self) -> None:
        """Block until every queued file is written; raise the first write error."""
        self._thread.join()
        if self.error is not None:
            raise self.error


class EmberCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine around ``inner`` (DeepSpeed's ``TorchCheckpointEngine``):
    between :meth:`begin` and :meth:`take` a failed write is recorded, not raised, and with
    ``background=True`` each file is snapshot to CPU and written by this rank's writer
    thread. Reads, directories and writer ranks are those of ``inner``."""

    def __init__(self, inner: CheckpointEngine, background: bool = False) -> None:
        super().__init__()
        self.name = "EmberCheckpointEngine"
        self.inner = inner
        self.background = background
        self._saving = False
        self._writer: "RankWriter | None" = None
        self._error: "BaseException | None" = None

    def begin(self) -> None:
        """ember's save starts: record this rank's write errors from here on."""
        self._saving, self._error = True, None

    def take(self) -> "tuple[RankWriter | None, BaseException | None]":
        """ember's save ended: the writer of the files queued since :meth:`begin` (closed:
        it ends once they are written; None for a synchronous save or when this rank wrote
        none) and the first write error recorded on this rank (None: none)."""
        writer, self._writer = self._writer, None
        error, self._error = self._error, None
        self._saving = False
        if writer is not None:
            writer.close()
        return writer, error

    def create(self, info: CheckpointCommitInfo):
        return self.inner.create(info)

    def makedirs(self, path, exist_ok=False):
        if not self._saving:
            return self.inner.makedirs(path, exist_ok=exist_ok)
        try:
            self.inner.makedirs(path, exist_ok=exist_ok)
        except Exception as err:    # reported at ember's commit, so no rank waits for this one
            self._error = self._error or err

    def save(self, state_dict, path: str) -> None:
        if not self._saving:
            return self.inner.save(state_dict, path)
        if self._error is not None:     # after a failed write the rest of this rank's files are skipped
            return
        try:
            if not self.background:
                self.inner.save(state_dict, path)
                return
            snapshot = cpu_snapshot(state_dict)     # on the training thread: nothing aliases live tensors
            if self._writer is None:
                self._writer = RankWriter(self.inner.save)
            self._writer.put(snapshot, path)
        except Exception as err:    # reported at ember's commit, so no rank waits for this one
            self._error = err

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo):
        if not self._saving:
            return self.inner.commit(info)
        return True     # ember commits the checkpoint directory once every rank's files are there

    def is_data_parallel_writer(self, dp_rank):
        return self.inner.is_data_parallel_writer(dp_rank)

    def preserves_storage_sharing(self):
        return self.inner.preserves_storage_sharing() if not self.background else False   # save() copied already


def install(engine, background: bool) -> "EmberCheckpointEngine | None":
    """Give ``engine`` (a ``DeepSpeedEngine``) an :class:`EmberCheckpointEngine` around its
    own; only DeepSpeed's default ``TorchCheckpointEngine`` is wrapped. Another engine
    chosen in the DeepSpeed config is kept as it is for synchronous saves (None is
    returned: its write errors are raised by DeepSpeed on the failing rank alone) and
    refused for ``background``."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from ember.errors import MisconfigurationError
    current = engine.checkpoint_engine
    if isinstance(current, EmberCheckpointEngine):
        current.background = background
        return current
    if type(current) is not TorchCheckpointEngine:
        if not background:
            return None
        raise MisconfigurationError(
            f"DeepSpeedStrategy(async_save=True) writes DeepSpeed's files with ember's background writer, but "
            f"the DeepSpeed config selects the {type(current).__name__} checkpoint engine; remove the config's "
            f"'checkpoint' writer settings or pass async_save=False")
    engine.checkpoint_engine = EmberCheckpointEngine(current, background)
    return engine.checkpoint_engine


def drop(path: str, writer: "RankWriter | None", remove_tmp: bool, exc: BaseException) -> None:
    """After an exception in the run: let this rank's ``writer`` of the uncommitted
    checkpoint ``path`` finish (its errors no longer matter), remove ``NAME.ember-tmp`` when
    ``remove_tmp`` (rank 0) and warn. No collective: a failed rank ends at once."""
    import contextlib
    import warnings
    from ember.checkpoint import io as cio
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.wait()
    if remove_tmp:
        cio.remove_staging(path)
    warnings.warn(f"the asynchronous save of {path} was not committed: the run failed ({type(exc).__name__})",
                  UserWarning, stacklevel=3)


def report(writer: "RankWriter | None", failed: "BaseException | None", written
           ) -> "tuple[dict[str, int] | str, BaseException | None]":
    """This rank's report for the commit, after its ``writer`` finished: ``written()``
    (``{name: bytes}``), or the error of the save (``failed``) or of a background write as
    text; and that error itself (None when this rank's files were written)."""
    try:
        if writer is not None:
            writer.wait()
        if failed is None:
            return written(), None
    except Exception as err:     # reported by rank 0 at the commit, so no rank waits for this one
        failed = failed or err
    return f"{type(failed).__name__}: {failed}", failed


def written_by(engine, folder: str, tag: str) -> dict[str, int]:
    """``{name: bytes}`` of the files this rank's ``engine.save_checkpoint(folder, tag=tag)``
    wrote into ``folder/tag`` (its ZeRO partition; the model states where it saves them)."""
    names = []
    if getattr(engine, "save_zero_checkpoint", False):
        names.append(engine._get_zero_ckpt_name(folder, tag))
    if getattr(engine, "save_non_zero_checkpoint", False):
        names.append(engine._get_ckpt_name(folder, tag))
    return {os.path.basename(n): os.path.getsize(n) for n in names}
