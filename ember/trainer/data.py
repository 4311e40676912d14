"""The data of a run: which dataloaders fit / validate / test / predict use (given to
the entry point, from the datamodule, or from the module's dataloader hooks), prepared
for the strategy (sharded, resumable) into ``trainer.state``, how many batches each pass
runs, and the batch transfer.

A prepared loader's order comes from (data seed, epoch), never from the global RNG; each
pass still takes from the global torch RNG what the user's own DataLoader would have
taken (its workers' base seed, a RandomSampler's seed: :func:`start_pass`), so dropout and
any ``torch.rand`` in the loop see the stream of a loop written by hand."""
from __future__ import annotations

import math
import warnings
from typing import Any

from ember.data import sampling as edata
from ember.errors import MisconfigurationError
from ember.module import DataModule, TrainModule, overrides
from ember.trainer import checks


def limit_batches(num: int | float, limit: Any, name: str = "limit") -> int | float:
    """``num`` batches after a ``limit_*_batches`` value (None: all; a float: a fraction; an int: at most)."""
    if limit is None:
        return num
    if isinstance(limit, float):
        return num if math.isinf(num) else int(num * limit) if limit < 1.0 else num
    return min(num, limit)


def count_batches(loader: Any, limit: Any) -> int | float:
    """The batches a pass over ``loader`` runs under ``limit`` (``inf``: no length)."""
    try:
        n = len(loader)
    except TypeError:   # a stream: its length when its shards say it (a Hugging Face stream split over ranks)
        from ember.data.stateful import hf_rank_batches
        known = hf_rank_batches(getattr(loader, "dataset", None), getattr(loader, "batch_size", None),
                                bool(getattr(loader, "drop_last", False)), getattr(loader, "num_workers", 0))
        n = float("inf") if known is None else known
    n = limit_batches(n, limit)
    return n if n == float("inf") else int(n)


def _as_list(x: Any) -> list:
    if isinstance(x, dict):   # evaluation loaders by name: in their order, as Lightning's sequential mode
        return list(x.values())
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _loader_like(v: Any) -> bool:
    """A loader (anything iterable that is not a batch: a container, a tensor, a string)."""
    return hasattr(v, "__iter__") and not isinstance(v, (str, bytes, list, tuple, dict)) and not hasattr(v, "shape")


def _several(x: Any) -> bool:
    """A dict, list or tuple of train loaders (not one loader that is a list of batches)."""
    values = list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, (list, tuple)) else []
    return bool(values) and all(_loader_like(v) for v in values)


def setup_data(t: Any, stage: str, loaders: dict) -> None:
    """Pick, check and prepare the dataloaders of ``stage`` (``loaders``: what the entry
    point was given) into ``t.state``; for fit also the number of training batches
    (agreed across ranks) and the validation interval in batches."""
    dm, module, st = t.datamodule, t.module, t.state

    def pick(given: Any, name: str, arg: str) -> Any:
        ev = name != "train_dataloader"   # an evaluation loader with no batches is warned about
        if given is not None:
            return checks.check_loader(given, arg, warn_empty=ev)
        if dm is not None and overrides(dm, DataModule, name):
            return checks.check_loader(getattr(dm, name)(), f"{type(dm).__name__}.{name}()", returned=True,
                                       warn_empty=ev)
        if dm is None and overrides(module, TrainModule, name) if hasattr(TrainModule, name) else \
                (dm is None and hasattr(module, name)):
            return checks.check_loader(getattr(module, name)(), f"{type(module).__name__}.{name}()",
                                       returned=True, warn_empty=ev)
        return None

    draws: dict[int, int] = {}   # id(prepared loader) -> what the user's loader takes from the global RNG per pass

    def prep(dl: Any, **kw: Any) -> Any:
        if getattr(dl, "ember_combined", False):   # each of its loaders is prepared (sharded, resumable)
            def inner(x: Any) -> tuple[Any, int]:
                out = edata.prepare_for(t.strategy, x, seed=st.data_seed, **kw) if t.use_distributed_sampler else x
                return out, (edata.global_rng_draws(x) if out is not x else 0)
            out = dl.ember_prepared(inner)
            draws[id(out)] = 0   # its passes draw per loader, restarts included
            return out
        out = edata.prepare_for(t.strategy, dl, seed=st.data_seed, **kw) if t.use_distributed_sampler else dl
        draws[id(out)] = edata.global_rng_draws(dl) if out is not dl else 0
        return out
    if stage == "fit":
        st.fit_dataloaders = loaders
        train = pick(loaders.get("train"), "train_dataloader", "train_dataloaders")
        if train is None:
            raise MisconfigurationError("trainer.fit() needs training data: pass train_dataloaders=, a datamodule, "
                                        "or define train_dataloader() on the module")
        if _several(train):   # a dict or list of loaders: a dict or list of batches per step, as Lightning
            from ember.data.combined import CombinedLoader
            train = CombinedLoader(train, "max_size_cycle")
        if t.overfit_batches:   # the same first batches for training and validation, in order
            st.train_dataloader = prep(train, shuffle=False)
            st.rng_draws = draws
            if callable(getattr(module, "validation_step", None)):
                loaders = {**loaders, "val": [st.train_dataloader]}
        else:
            st.train_dataloader = prep(train)
        st.rng_draws = draws
        n = count_batches(st.train_dataloader, t.limit_train_batches)
        if t.world_size > 1:   # the epoch's length, validation points: the same on every rank
            n = checks.agree_train_batches(t, n)
        if n == 0:
            raise MisconfigurationError("the train dataloader has no batches (limit_train_batches or an empty dataset)")
        st.num_training_batches = n
        vals = [prep(v, shuffle=False, even=False)
                for v in _as_list(pick(loaders.get("val"), "val_dataloader", "val_dataloaders"))]
        if t.limit_val_batches == 0:
            vals = []
        elif vals and not callable(getattr(module, "validation_step", None)):
            # as Lightning: validation data without a validation_step skips validation
            warnings.warn(f"fit() was given validation data but {type(module).__name__} has no "
                          "validation_step: validation is skipped (define validation_step to run it)", stacklevel=4)
            vals = []
        st.val_dataloaders = vals
        vci = t.val_check_interval
        if isinstance(vci, float):
            st.val_every_n_batches = None if vci >= 1.0 or n == float("inf") else max(1, int(n * vci))
        else:
            st.val_every_n_batches = vci
        return
    if stage in ("validate", "test"):
        name = "val_dataloader" if stage == "validate" else "test_dataloader"
        given = loaders.get("val") if stage == "validate" else loaders.get("test")
        ls = _as_list(pick(given, name, "dataloaders"))
        if not ls:
            raise MisconfigurationError(f"trainer.{stage}() needs data: pass dataloaders=, a datamodule, or define {name}()")
    else:
        ls = _as_list(pick(loaders.get("predict"), "predict_dataloader", "dataloaders"))
        if not ls:
            raise MisconfigurationError("trainer.predict() needs data: pass dataloaders=, a datamodule, or define "
                                        "predict_dataloader()")
    st.eval_dataloaders = st.run_dataloaders[stage] = [prep(v, shuffle=False, even=False) for v in ls]
    st.rng_draws = {**st.rng_draws, **draws}


def maybe_reload(t: Any) -> None:
    """At the start of an epoch (not a resumed one): every
    ``reload_dataloaders_every_n_epochs`` epochs, call the dataloader hooks again."""
    n, st = t.reload_dataloaders_every_n_epochs, t.state
    if n and st.epoch > 0 and st.epoch % n == 0 and not st.batches_done:
        setup_data(t, "fit", st.fit_dataloaders)


def batch_transfer(t: Any, dataloader_idx: int = 0) -> Any:
    """``batch -> batch`` through the module's ``on_before_batch_transfer``,
    ``transfer_batch_to_device`` (else the strategy's move, when the device is not the
    CPU) and ``on_after_batch_transfer``; None when there is nothing to do (a module
    without those hooks on the CPU). The precision's input cast is the caller's."""
    ev, strategy = t.events, t.strategy
    m_before = ev.module_override("on_before_batch_transfer")
    m_move = ev.module_override("transfer_batch_to_device")
    m_after = ev.module_override("on_after_batch_transfer")
    move = strategy.batch_to_device if strategy.root_device.type != "cpu" else None
    if m_before is None and m_move is None and m_after is None:
        return move
    device = strategy.root_device

    def run(batch: Any) -> Any:
        if m_before is not None:
            batch = m_before(batch, dataloader_idx)
        if m_move is not None:
            batch = m_move(batch, device, dataloader_idx)
        elif move is not None:
            batch = move(batch)
        if m_after is not None:
            batch = m_after(batch, dataloader_idx)
        return batch
    return run


def prepare_batch(t: Any, batch: Any, transfer: Any) -> Any:
    """An evaluation batch moved (``transfer``: :func:`batch_transfer`) and cast for the precision."""
    if transfer is not None:
        batch = transfer(batch)
    p = t.strategy.precision
    return p.convert_input(batch) if p.needs_input_cast else batch


def start_pass(t: Any, loader: Any) -> None:
    """A pass over a prepared ``loader`` starts: take from the global RNG what the user's
    DataLoader takes per pass (a resumed mid-epoch pass takes nothing: the saved RNG state
    is already past its start)."""
    n = t.state.rng_draws.get(id(loader), 0)
    if n:
        edata.draw_like_a_dataloader(n)
