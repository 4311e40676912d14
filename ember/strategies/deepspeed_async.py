"""Background writes of DeepSpeed's checkpoint files: ``DeepSpeedStrategy(async_save=True)``.

DeepSpeed writes its files through the engine's checkpoint engine
(``engine.checkpoint_engine.save(state_dict, path)`` per file). ember replaces it with
:class:`BackgroundCheckpointEngine`: ``save`` copies every tensor of the state to CPU
memory of its own on the training thread (the optimizer changes the live tensors in
place at the next step) and hands the copy to this rank's writer thread, which
``torch.save``-s it. ``engine.save_checkpoint`` then returns once the copies are made.

The strategy takes the rank's writer after ``engine.save_checkpoint`` returned
(:meth:`BackgroundCheckpointEngine.take`), and at the next save, before a load, or at
teardown waits for it and commits the checkpoint with the synchronous rule (every rank
reports its files, rank 0 checks them and renames ``NAME.tmp`` into place). Imported only
when such a strategy sets up (it needs deepspeed).
"""
from __future__ import annotations

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


class BackgroundCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine whose ``save`` snapshots the state to CPU and queues
    the write on a background thread; reads, directories and writer ranks are those of
    the engine it replaces (``inner``, DeepSpeed's ``TorchCheckpointEngine``)."""

    def __init__(self, inner: CheckpointEngine) -> None:
        super().__init__()
        self.name = "EmberBackgroundCheckpointEngine"
        self.inner = inner
        self._writer: "RankWriter | None" = None

    def create(self, info: CheckpointCommitInfo):
        return self.inner.create(info)

    def makedirs(self, path, exist_ok=False):
        self.inner.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        snapshot = cpu_snapshot(state_dict)     # on the training thread: nothing aliases live tensors
        if self._writer is None:
            self._writer = RankWriter(self.inner.save)
        self._writer.put(snapshot, path)

    def take(self) -> "RankWriter | None":
        """The writer of the files saved since the last call (closed: it ends once they are
        written), or None when this rank saved none."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        return writer

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo):
        return True     # ember commits the checkpoint directory once every rank's writer has finished

    def is_data_parallel_writer(self, dp_rank):
        return self.inner.is_data_parallel_writer(dp_rank)

    def preserves_storage_sharing(self):
        return False    # save() copies every tensor already


def install(engine) -> BackgroundCheckpointEngine:
    """Give ``engine`` (a ``DeepSpeedEngine``) a :class:`BackgroundCheckpointEngine` around
    its own; only DeepSpeed's default ``TorchCheckpointEngine`` is wrapped."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from ember.errors import MisconfigurationError
    current = engine.checkpoint_engine
    if isinstance(current, BackgroundCheckpointEngine):
        return current
    if type(current) is not TorchCheckpointEngine:
        raise MisconfigurationError(
            f"DeepSpeedStrategy(async_save=True) writes DeepSpeed's files with ember's background writer, but "
            f"the DeepSpeed config selects the {type(current).__name__} checkpoint engine; remove the config's "
            f"'checkpoint' writer settings or pass async_save=False")
    engine.checkpoint_engine = BackgroundCheckpointEngine(current)
    return engine.checkpoint_engine


def drop(path: str, writer: "RankWriter | None", remove_tmp: bool, exc: BaseException) -> None:
    """After an exception in the run: let this rank's ``writer`` of the uncommitted
    checkpoint ``path`` finish (its errors no longer matter), remove ``NAME.tmp`` when
    ``remove_tmp`` (rank 0) and warn. No collective: a failed rank ends at once."""
    import contextlib
    import warnings
    from ember import checkpoint_io as cio
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.wait()
    if remove_tmp:
        cio._remove(cio.tmp_path(path))
    warnings.warn(f"the asynchronous save of {path} was not committed: the run failed ({type(exc).__name__})",
                  UserWarning, stacklevel=3)


def report(writer: "RankWriter | None", failed: "str | None", written) -> "dict[str, int] | str":
    """This rank's report for the commit: after its ``writer`` finished, ``written()``
    (``{name: bytes}``), or the error of the save (``failed``) or of a write, as text."""
    try:
        if writer is not None:
            writer.wait()
        return failed or written()
    except Exception as err:     # reported by rank 0 at the commit, so no rank waits for this one
        return failed or f"{type(err).__name__}: {err}"
