"""``BasePredictionWriter``: write predictions as ``trainer.predict`` makes them, as
in Lightning. Subclass it and implement ``write_on_batch_end`` and/or
``write_on_epoch_end``."""
from __future__ import annotations

import warnings
from typing import Any

import os
from typing import Sequence

from ember.callbacks.base import Callback
from ember.checkpoint.trust import check_output_path
from ember.errors import MisconfigurationError, invalid_choice

_INTERVALS = ("batch", "epoch", "batch_and_epoch")


def save_predictions(obj: Any, path: str | os.PathLike, overwrite: bool = False, inputs: Sequence = (),
                     what: str = "output") -> str:
    """``torch.save(obj)`` to ``path`` atomically (a temporary file in the same folder,
    then a rename: a reader sees the old file or the new one, never a part), after the
    checks of :func:`check_output_path`. Returns the path written."""
    import torch

    from ember.checkpoint.io import replace_file
    path = check_output_path(path, overwrite, inputs, what)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replace_file(path, lambda tmp: torch.save(obj, tmp))
    return path


def _batch_indices(loader) -> list | None:
    """The dataset indices of each batch this process reads, when the order is fixed."""
    from torch.utils.data import RandomSampler
    bs = getattr(loader, "batch_sampler", None)
    sampler = getattr(bs, "sampler", None)
    if bs is None or isinstance(sampler, RandomSampler) or getattr(sampler, "shuffle", False):
        return None
    try:
        return [list(b) for b in bs]
    except TypeError:
        return None


class BasePredictionWriter(Callback):
    """Writes predictions during ``trainer.predict``.

    Args:
        write_interval: ``"batch"`` (``write_on_batch_end`` after every batch),
            ``"epoch"`` (``write_on_epoch_end`` once with all of this process's
            predictions) or ``"batch_and_epoch"`` (both).

        output: a file the writer writes (optional): checked before anything is
            predicted with the rules of :func:`check_output_path` (never an existing file
            unless ``overwrite``, never inside a checkpoint or over the weights loaded).
        overwrite: allow :meth:`save` to replace an existing file.

    Under several processes each rank sees its own share: write one file per rank
    (``trainer.global_rank``). ``batch_indices`` are the dataset indices of the
    batch's samples on this rank (``None`` when the loader shuffles). Write with
    :meth:`save`: atomically, with the same rules as ``ember predict --output``.

    Example::

        class TorchWriter(BasePredictionWriter):
            def __init__(self, path):
                super().__init__("epoch")
                self.path = path

            def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
                self.save(trainer, {"predictions": predictions, "indices": batch_indices},
                          f"{self.path}.rank{trainer.global_rank}.pt")
    """

    state_key = "BasePredictionWriter"

    def __init__(self, write_interval: str = "batch", output: "str | os.PathLike | None" = None,
                 overwrite: bool = False):
        if write_interval not in _INTERVALS:
            raise invalid_choice("write_interval", write_interval, list(_INTERVALS))
        self.write_interval = write_interval
        self.output = os.fspath(output) if output is not None else None
        self.overwrite = bool(overwrite)
        self._on_batch = write_interval in ("batch", "batch_and_epoch")
        self._on_epoch = write_interval in ("epoch", "batch_and_epoch")
        self._predictions: list[list] = []
        self._indices: list[list] = []
        self._loader = None
        self._loader_indices: list | None = None
        self._warned = False

    def write_on_batch_end(self, trainer, module, prediction: Any, batch_indices: list | None, batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        """Write one batch's prediction (``write_interval`` "batch" / "batch_and_epoch")."""
        raise NotImplementedError(f"{type(self).__name__}(write_interval={self.write_interval!r}) must implement "
                                  "write_on_batch_end")

    def write_on_epoch_end(self, trainer, module, predictions: list, batch_indices: list) -> None:
        """Write all predictions of the pass: ``predictions[dataloader_idx][batch_idx]``
        and the matching ``batch_indices`` (``write_interval`` "epoch" / "batch_and_epoch")."""
        raise NotImplementedError(f"{type(self).__name__}(write_interval={self.write_interval!r}) must implement "
                                  "write_on_epoch_end")

    def save(self, trainer, obj: Any, path: "str | os.PathLike | None" = None) -> str:
        """Write ``obj`` (``torch.save``) to ``path`` (default: ``output``) atomically, after
        the checks of :func:`check_output_path` (the checkpoint being predicted from counts
        as an input). Returns the path written."""
        path = path if path is not None else self.output
        if path is None:
            raise MisconfigurationError(f"{type(self).__name__}.save(): give a path (or output= at init)")
        return save_predictions(obj, path, self.overwrite, [getattr(trainer, "ckpt_path", None)],
                                f"{type(self).__name__}: output")

    def on_predict_start(self, trainer, module):
        if self.output is not None:   # before anything is predicted (a checkpoint is restored by now)
            check_output_path(self.output, self.overwrite, [getattr(trainer, "ckpt_path", None)],
                              f"{type(self).__name__}(output=...)")

    def on_predict_epoch_start(self, trainer, module):
        self._predictions, self._indices, self._loader = [], [], None

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        loader = trainer.current_dataloader
        if loader is not self._loader:
            self._loader, self._loader_indices = loader, _batch_indices(loader)
            if self._loader_indices is None and not self._warned:
                self._warned = True
                warnings.warn(f"{type(self).__name__}: the predict dataloader shuffles or has no batch sampler; "
                              "batch_indices are None", stacklevel=2)
        idx = self._loader_indices
        indices = idx[batch_idx] if idx is not None and batch_idx < len(idx) else None
        if self._on_batch:
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)
        if self._on_epoch:
            while len(self._predictions) <= dataloader_idx:
                self._predictions.append([])
                self._indices.append([])
            self._predictions[dataloader_idx].append(outputs)
            self._indices[dataloader_idx].append(indices)

    def on_predict_epoch_end(self, trainer, module):
        if self._on_epoch:
            preds, idx = self._predictions, self._indices
            self._predictions, self._indices = [], []
            self.write_on_epoch_end(trainer, module, preds, idx)
