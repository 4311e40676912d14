"""Ray Train: an ember ``Trainer`` or ``Accelerator`` inside ``ray.train.torch.TorchTrainer``.

Ray Train starts the workers and their process group (``torch.distributed``, gloo or
NCCL); ember's default strategy finds that group and trains on it, so a training
function is an ordinary ember script. This module adds the two things Ray needs from it:

- :class:`RayTrainReport`, a Trainer callback that reports every checkpoint ember has
  committed (a ``ModelCheckpoint`` folder) to Ray with ``ray.train.report``, with the
  Trainer's metrics; :func:`report` does the same by hand (``Accelerator.save_state``);
- :func:`resume_path`, the checkpoint to resume from: the one given through
  ``train_loop_config`` (Ray Train V2 refuses ``TorchTrainer(resume_from_checkpoint=...)``;
  its replacement is to pass the checkpoint to the training function and load it there),
  else the run's latest reported checkpoint (``ray.train.get_checkpoint()``: after a
  worker failure with ``FailureConfig(max_failures=...)``, or in a new job with the same
  ``RunConfig(name=..., storage_path=...)``), else None.

Ray is imported only when these are used; install it with ``pip install "ray[train]"``
(the ``ray`` extra of ember). See docs/distributed.md, "Ray Train".
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError


def _ray_train():
    from ember.checkpoint.rng import keep_rng_states
    try:
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import ray.train as ray_train
    except ImportError as err:   # pragma: no cover - depends on the environment
        raise MisconfigurationError("ember.integrations.ray needs Ray Train: pip install \"ray[train]\" "
                                    "(or ember's extra: pip install \"ember[ray]\")") from err
    return ray_train


def _plain(metrics: "dict | None") -> dict:
    out = {}
    for key, value in (metrics or {}).items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out[str(key)] = value
    return out


def report(metrics: "dict | None" = None, checkpoint_dir: "str | None" = None) -> None:
    """``ray.train.report`` from every worker at the same point (Ray's report is a barrier):
    ``metrics`` (numbers; rank 0's are kept by Ray) and, from rank 0 only, the committed
    checkpoint folder ``checkpoint_dir`` (for example the one ``Accelerator.save_state()``
    just wrote), which Ray copies to its storage under the folder's own name."""
    ray_train = _ray_train()
    checkpoint = None
    if checkpoint_dir is not None:
        if not os.path.isdir(checkpoint_dir) and ray_train.get_context().get_world_rank() == 0:
            raise MisconfigurationError(f"report(checkpoint_dir={checkpoint_dir!r}): not a folder")
        if ray_train.get_context().get_world_rank() == 0:
            checkpoint = ray_train.Checkpoint.from_directory(checkpoint_dir)
    name = os.path.basename(os.path.normpath(checkpoint_dir)) if checkpoint_dir is not None else None
    ray_train.report(_plain(metrics), checkpoint=checkpoint, checkpoint_dir_name=name)


def resume_path(checkpoint: Any = None) -> "str | None":
    """The folder to resume from, for ``trainer.fit(..., ckpt_path=resume_path(...))`` or
    ``accelerator.load_state(...)``, in a Ray Train worker.

    ``checkpoint``: a ``ray.train.Checkpoint`` or a folder path passed to the training
    function through ``train_loop_config`` (Train V2's way to start from a given
    checkpoint). Without it: the latest checkpoint this run reported
    (``ray.train.get_checkpoint()``), or None for a fresh start. A checkpoint on a remote
    filesystem is downloaded to a local folder first."""
    if checkpoint is None:
        checkpoint = _ray_train().get_checkpoint()
        if checkpoint is None:
            return None
    if not hasattr(checkpoint, "to_directory"):          # a path (a Ray Checkpoint refuses os.fspath)
        return os.fspath(checkpoint)
    filesystem = getattr(checkpoint, "filesystem", None)
    if filesystem is None or getattr(filesystem, "type_name", "local") == "local":
        return checkpoint.path
    return checkpoint.to_directory()


class RayTrainReport(Callback):
    """Report each checkpoint that ember's ``ModelCheckpoint`` committed to Ray Train.

    Args:
        metrics: the names of ``trainer.callback_metrics`` to send (default: all numbers).

    After every save point (a training batch, a validation, an epoch end) and at the end of
    ``fit``, every rank looks at the checkpoint callback's kept checkpoints (the same on
    every rank: rank 0's view is broadcast at each save) and, for each folder not reported
    yet, calls ``ray.train.report(metrics, checkpoint=...)`` (rank 0 attaches the folder),
    so every rank makes the same calls. Weights-only files (``save_weights_only=True``)
    are not folders and are not reported.

    Use it with ``save_top_k=-1`` or a ``save_top_k`` that keeps each checkpoint until the
    next save point: a checkpoint deleted before the next point is not reported.

    A checkpoint is reported once it is committed: with a background save
    (``DDPStrategy(async_save=True)``) that is at the first save point after its write
    ended (the strategy's ``after_commit``, which every rank runs at the same point), and
    at the end of ``fit`` for the last one.
    """

    def __init__(self, metrics: "Iterable[str] | None" = None) -> None:
        _ray_train()   # fails at construction, not at the first save, without Ray
        self.metrics = None if metrics is None else list(metrics)
        self._reported: set[str] = set()
        self._waiting: set[str] = set()      # kept by a checkpoint callback, commit not seen yet
        self._committed: set[str] = set()

    def _pending(self, trainer) -> list[str]:
        paths: list[str] = []
        for cb in trainer.checkpoint_callbacks:
            for path in list(getattr(cb, "best_k_models", {}) or {}):
                if path in self._reported or path in paths or path.endswith(".safetensors"):
                    continue
                if path not in self._committed and path not in self._waiting:
                    # best_k_models holds a checkpoint before its background write commits
                    self._waiting.add(path)
                    trainer.strategy.after_commit(lambda p=path: self._committed.add(p))   # at once if none pending
                if path in self._committed:
                    paths.append(path)
        return paths

    def _report(self, trainer) -> None:
        pending = self._pending(trainer)
        if not pending:
            return
        metrics = dict(trainer.callback_metrics)
        if self.metrics is not None:
            metrics = {k: v for k, v in metrics.items() if k in self.metrics}
        metrics = {**_plain(metrics), "epoch": trainer.current_epoch, "step": trainer.global_step}
        for path in sorted(pending, key=lambda p: (_step_of(p), p)):
            report(metrics, path)
            self._reported.add(path)
            self._waiting.discard(path)
            self._committed.discard(path)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._report(trainer)

    def on_validation_end(self, trainer, module) -> None:
        self._report(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        self._report(trainer)

    def on_fit_end(self, trainer, module) -> None:
        if trainer.strategy.save_pending:     # the last background save: committed now (every rank)
            trainer.strategy.wait_for_checkpoint()
        self._report(trainer)

    def state_dict(self) -> dict:
        return {"reported": sorted(self._reported)}

    def load_state_dict(self, state: dict) -> None:
        self._reported = set(state.get("reported", []))


def _step_of(path: str) -> int:
    import re
    m = re.search(r"step=(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else -1
