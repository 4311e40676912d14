"""Hyperparameters shared by TrainModule and DataModule: ``save_hyperparameters``
records the ``__init__`` arguments in ``self.hparams``."""
from __future__ import annotations

import copy
import inspect

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

    def save_hyperparameters(self, *names: str, ignore: "list[str] | str | None" = None) -> None:
        """Record the ``__init__`` arguments of the caller in ``self.hparams`` (for a module
        also in every checkpoint's meta.json, so ``load_from_checkpoint`` can rebuild it);
        ``names``: only these; ``ignore``: not these. Modules are never hyperparameters."""
        frame = inspect.currentframe().f_back
        hparams = self.__dict__.get("hparams")
        if hparams is None:   # a subclass that did not call super().__init__()
            hparams = self.hparams = AttributeDict()
        init_args = {}
        # walk up through super().__init__ chains to the outermost subclass __init__
        while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is self:
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
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
        if names:
            init_args = {k: init_args[k] for k in names if k in init_args}
        for k in ignore:
            init_args.pop(k, None)
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
