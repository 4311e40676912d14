"""Hyperparameters shared by TrainModule and DataModule: ``save_hyperparameters``
records the ``__init__`` arguments in ``self.hparams``. The loggers get the datamodule's
and the module's together (:func:`merged_hparams`); checkpoints keep the datamodule's
JSON-safe ones in ``meta.json`` (:func:`datamodule_meta`)."""
from __future__ import annotations

import copy
import inspect
import json
import types
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn


class AttributeDict(dict):
    """A dict whose keys are also attributes (``self.hparams.lr``)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e

    def __setattr__(self, key, value):
        self[key] = value


def _copy_hparams(h: dict) -> "AttributeDict":
    try:
        return AttributeDict(copy.deepcopy(dict(h)))
    except Exception:   # objects that cannot be deep-copied are shared
        return AttributeDict(dict(h))


class HyperparametersMixin:
    """``save_hyperparameters`` and ``hparams_initial`` (as Lightning's mixin)."""

    def save_hyperparameters(self, *args: Any, ignore: "Sequence[str] | str | None" = None,
                             frame: "types.FrameType | None" = None, logger: bool = True) -> None:
        """Record the ``__init__`` arguments of the caller in ``self.hparams`` (for a module
        also in every checkpoint's meta.json, so ``load_from_checkpoint`` can rebuild it).
        Lightning's signature:

        Args:
            args: nothing (every ``__init__`` argument), argument names (only these), or one
                dict / ``argparse.Namespace`` (its items are the hyperparameters).
            ignore: an argument name or a list of names left out.
            frame: the frame whose ``__init__`` arguments are read (default: the caller's).
            logger: False: the hyperparameters are kept (hparams, checkpoints) but not sent
                to the loggers at the start of fit (Lightning's ``logger=False``).

        Modules are never hyperparameters (they are saved with the weights)."""
        self._log_hyperparams = bool(logger)
        if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
            return   # an empty dict / Namespace: nothing to save (as Lightning)
        if frame is None:
            frame = inspect.currentframe().f_back
        elif not isinstance(frame, types.FrameType):
            from ember.errors import MisconfigurationError
            raise MisconfigurationError(f"save_hyperparameters(frame={frame!r}): pass a frame object "
                                        "(inspect.currentframe()) or leave it out")
        hparams = self.__dict__.get("hparams")
        if hparams is None:   # a subclass that did not call super().__init__()
            hparams = self.hparams = AttributeDict()
        init_args = _init_args(self, frame)
        ignore = [ignore] if isinstance(ignore, str) else [k for k in (ignore or []) if isinstance(k, str)]
        given = [a for a in args if not isinstance(a, str)]
        if len(given) == 1:   # one dict / Namespace: its items
            obj = given[0]
            init_args = dict(obj) if isinstance(obj, Mapping) else dict(vars(obj))
        elif args:
            init_args = {k: init_args[k] for k in args if isinstance(k, str) and k in init_args}
        for k in ignore:
            init_args.pop(k, None)
            hparams.pop(k, None)   # a subclass may drop what a base class saved (as Lightning)
        for k, v in init_args.items():
            if isinstance(v, nn.Module):
                continue  # modules are not hyperparameters
            hparams[k] = v
        self._hparams_initial = _copy_hparams(self.hparams)   # hparams_initial: as first saved

    @property
    def hparams_initial(self) -> AttributeDict:
        """A copy of ``hparams`` as :meth:`save_hyperparameters` recorded them (later
        changes to ``self.hparams`` do not show here)."""
        return _copy_hparams(self.__dict__.get("_hparams_initial") or AttributeDict())


def _init_args(obj: Any, frame: "types.FrameType | None") -> dict:
    """The ``__init__`` arguments of ``obj`` seen from ``frame``, walking up through
    ``super().__init__()`` chains to the outermost subclass ``__init__``."""
    init_args: dict = {}
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is obj:
        code = frame.f_code
        params = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
        for p in params:
            if p in frame.f_locals and p not in init_args:
                init_args[p] = frame.f_locals[p]
        if code.co_flags & inspect.CO_VARKEYWORDS:
            kw = code.co_varnames[code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)]
            for k, v in frame.f_locals.get(kw, {}).items():
                init_args.setdefault(k, v)
        frame = frame.f_back
    return init_args


def merged_hparams(module: Any, datamodule: Any) -> dict:
    """The hparams sent to the loggers at setup: the datamodule's and the module's together
    (as Lightning), leaving out those of a side that called ``save_hyperparameters(logger=False)``. A name both hold with different values is a
    :class:`~ember.errors.MisconfigurationError`, as in Lightning."""
    hparams = dict(module.hparams) if getattr(module, "_log_hyperparams", True) else {}
    dm_hp = getattr(datamodule, "hparams", None) if datamodule is not None else None
    if not dm_hp or not getattr(datamodule, "_log_hyperparams", True):   # save_hyperparameters(logger=False)
        return hparams
    clash = sorted(k for k, v in dm_hp.items() if k in hparams and not _same(hparams[k], v))
    if clash:
        from ember.errors import MisconfigurationError
        raise MisconfigurationError(
            f"the hyperparameters {clash} are saved by both {type(module).__name__} and "
            f"{type(datamodule).__name__} (save_hyperparameters) with different values; the loggers get one set "
            "of hparams, so rename them on one side or leave them out there with save_hyperparameters(ignore=...)")
    return {**dict(dm_hp), **hparams}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:   # tensors of several elements and the like: equal only when identical
        return a is b


def json_safe(hparams: dict) -> dict:
    """The hparams JSON holds as they are; other values are left out (no ``str()`` of objects)."""
    out = {}
    for k, v in hparams.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[str(k)] = v
    return out


def datamodule_meta(datamodule: Any) -> dict:
    """What a checkpoint's ``meta.json`` records of the datamodule: its class and the JSON-safe
    values of its ``save_hyperparameters()`` as ``datamodule_hparams`` (Lightning's
    ``datamodule_hyper_parameters``); nothing when it saved none."""
    hp = getattr(datamodule, "hparams", None) if datamodule is not None else None
    if not hp:
        return {}
    return {"datamodule_class": f"{type(datamodule).__module__}.{type(datamodule).__qualname__}",
            "datamodule_hparams": json_safe(hp)}
