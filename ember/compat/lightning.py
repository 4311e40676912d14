"""Moving existing Lightning runs over: :func:`convert_lightning_checkpoint` turns a
Lightning ``.ckpt`` file into an ember checkpoint directory (weights only) that
``TrainModule.load_from_checkpoint`` reads. Re-exported as
``ember.utils.convert_lightning_checkpoint``. How ``Trainer(accelerator=...)`` maps onto
``devices=`` is :func:`ember.strategies.resolve_accelerator`."""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch

from ember.errors import CheckpointError
from ember.strategies import resolve_accelerator  # noqa: F401  (Lightning's accelerator=; the strategies' own)

__all__ = ["convert_lightning_checkpoint", "resolve_accelerator"]


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


#: values of a Lightning checkpoint's ``hyper_parameters`` visited (a shared reference counted each
#: time it appears) before its conversion is refused: a small file can hold a huge tree by reference
MAX_HPARAM_VALUES = 100_000


def _storable_hparams(hparams: Any, path: str) -> tuple[dict, list[str]]:
    """(the ``hyper_parameters`` of the Lightning checkpoint ``path``, the names of those that
    ``meta.json`` cannot hold). Walked without recursion before anything is converted,
    counting every value each time a reference reaches it: more than
    :data:`MAX_HPARAM_VALUES` (shared references expanding, a structure holding itself) is a
    :class:`~ember.errors.CheckpointError`. A value nested deeper than ``meta.json`` may be
    (:data:`ember.checkpoint.trust.MAX_META_DEPTH`) is left out, like one JSON cannot hold."""
    from ember.checkpoint.trust import MAX_META_DEPTH
    if hparams is None or hparams == {}:
        return {}, []
    if not isinstance(hparams, dict):
        raise CheckpointError(f"convert_lightning_checkpoint: hyper_parameters in {path} is a "
                              f"{type(hparams).__name__}, not a mapping")
    deepest = MAX_META_DEPTH - 2          # meta.json's own level and its "hparams" mapping
    seen, too_deep = 0, set()
    for key, value in hparams.items():
        stack = [(value, 1)]
        while stack:
            v, depth = stack.pop()
            children: Any = ()
            if isinstance(v, dict):
                children = [x for item in v.items() for x in item]
            elif isinstance(v, (list, tuple, set, frozenset)):
                children = v
            seen += 1 + len(children)
            if seen > MAX_HPARAM_VALUES:
                raise CheckpointError(
                    f"convert_lightning_checkpoint: the hyper_parameters in {path} hold more than "
                    f"{MAX_HPARAM_VALUES} values (counting each shared reference every time it appears; "
                    f"{key!r} reaches the bound), more than ember converts; the file is refused")
            if children and depth > deepest:
                too_deep.add(key)
                break
            stack.extend((x, depth + 1) for x in children)
    return dict(hparams), sorted((k for k in hparams if not isinstance(k, str) or k in too_deep
                                  or not _json_ok(hparams[k])), key=str)


def convert_lightning_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Convert the Lightning checkpoint file ``path`` into the ember checkpoint
    directory ``out_dir`` and return its path.

    The file is read with ``torch.load(weights_only=True)``: nothing is unpickled
    beyond tensors and plain containers, and a file that needs more is refused with
    a :class:`~ember.errors.CheckpointError`. ``state_dict`` becomes
    ``model.safetensors``; ``hyper_parameters`` become the ``hparams`` in
    ``meta.json`` (with ``epoch`` and ``global_step``). Hyperparameters that JSON
    cannot hold are left out with a warning naming them: pass them as keywords to
    ``load_from_checkpoint``. Optimizer, scheduler and loop states are not carried
    over (continue with a fresh optimizer)::

        from ember.utils import convert_lightning_checkpoint
        convert_lightning_checkpoint("epoch=9-step=1000.ckpt", "converted")
        model = MyModel.load_from_checkpoint("converted")
    """
    from ember.checkpoint import io as cio
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"convert_lightning_checkpoint: {path} is not a file (expected a Lightning .ckpt)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError... by cause
        raise CheckpointError(
            f"convert_lightning_checkpoint: {path} cannot be read with torch.load(weights_only=True), so it "
            f"is refused (reading it otherwise would run arbitrary code from the file): {err}") from err
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"convert_lightning_checkpoint: {path} is not a Lightning checkpoint "
                              f"(no 'state_dict' dict; keys: {sorted(ckpt)[:10] if isinstance(ckpt, dict) else type(ckpt).__name__})")
    weights = {}
    for k, v in ckpt["state_dict"].items():
        if not isinstance(v, torch.Tensor):
            raise CheckpointError(f"convert_lightning_checkpoint: state_dict[{k!r}] in {path} is a "
                                  f"{type(v).__name__}, not a tensor")
        weights[k] = v
    hparams, dropped = _storable_hparams(ckpt.get("hyper_parameters"), path)
    if dropped:
        warnings.warn(f"convert_lightning_checkpoint: hyperparameters {dropped} of {path} cannot be stored in "
                      f"meta.json and were left out; pass them to load_from_checkpoint(..., name=value)",
                      stacklevel=2)
    meta = {"hparams": {k: v for k, v in hparams.items() if k not in dropped},
            "epoch": ckpt.get("epoch"), "global_step": ckpt.get("global_step"),
            "converted_from": {"format": "lightning", "file": os.path.basename(path),
                               "version": ckpt.get("pytorch-lightning_version")}}
    return cio.write_checkpoint(out_dir, weights, None, meta, what="convert_lightning_checkpoint")
