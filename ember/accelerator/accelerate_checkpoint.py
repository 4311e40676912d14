"""``Accelerator.load_state`` of a folder written by Accelerate's ``save_state``, so a
running Accelerate project moves over without losing its state. Every file is read
without unpickling arbitrary objects: weights from safetensors (or
``pytorch_model.bin`` with ``torch.load(weights_only=True)``), optimizer / scheduler /
scaler / registered-object states with ``weights_only=True``, the RNG files
(``random_states_<rank>.pkl``, which hold numpy arrays) with ``weights_only=True``
plus numpy's array reconstruction allowed; what cannot be read that way (a pickled
sampler object, a stateful-dataloader state) is skipped with a warning naming it.
"""
from __future__ import annotations

import os
import random
import warnings

import torch

from ember.checkpoint import io as cio
from ember.errors import CheckpointError

__all__ = ["is_accelerate_checkpoint", "load_accelerate_state"]


def _name(base: str, i: int, ext: str) -> str:
    return f"{base}{'' if i == 0 else f'_{i}'}.{ext}"


def is_accelerate_checkpoint(path: str) -> bool:
    """A folder Accelerate's ``save_state`` wrote (no ember ``meta.json``)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, cio.META_NAME)):
        return False
    names = set(os.listdir(path))
    return bool(names & {"optimizer.bin", "random_states_0.pkl", "scheduler.bin"}) or (
        "pytorch_model.bin" in names)


def _weights(path: str, i: int) -> dict:
    st = os.path.join(path, _name("model", i, "safetensors"))
    if os.path.isfile(st):
        return cio.load_safetensors(st)
    pt = os.path.join(path, _name("pytorch_model", i, "bin"))
    if os.path.isfile(pt):
        return cio.load_torch(pt)
    if os.path.isfile(os.path.join(path, _name("model", i, "safetensors") + ".index.json")):
        raise CheckpointError(f"{path}: sharded Accelerate weights ({_name('model', i, 'safetensors')}.index.json) "
                              "are not read by load_state; load them with ember.big_modeling")
    raise CheckpointError(f"{path} holds no {_name('model', i, 'safetensors')} / {_name('pytorch_model', i, 'bin')} "
                          f"for prepared model {i}")


def _safe_rng(fp: str):
    """Accelerate's RNG file: a ``torch.save`` of python/numpy/torch states; numpy's
    ``_reconstruct``/``ndarray``/``dtype`` are the only extra globals allowed."""
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    import codecs
    allowed.append(codecs.encode)
    with torch.serialization.safe_globals(allowed):
        return torch.load(fp, map_location="cpu", weights_only=True)


def _restore_rng(states: dict) -> None:
    if "random_state" in states:
        version, internal, gauss = states["random_state"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy_random_seed" in states:
        import numpy as np
        kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
        if getattr(keys, "dtype", None) is None or keys.dtype == object:
            raise CheckpointError("numpy RNG state is not an integer array")
        np.random.set_state((kind, keys, pos, has_gauss, cached))
    if "torch_manual_seed" in states:
        torch.set_rng_state(states["torch_manual_seed"].to("cpu", torch.uint8))
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to("cpu", torch.uint8) for s in states["torch_cuda_manual_seed"]])


def _required(path: str, name: str, what: str) -> str:
    fp = cio.checks.member(path, name)     # inside the folder: no symlink out of it
    if not os.path.isfile(fp):
        raise CheckpointError(f"{path}: {name} is missing for {what}")
    return fp


def load_accelerate_state(acc, path: str, strict: bool = True) -> dict:
    """Read every file first and check it against what is prepared (weights against each
    model, optimizer states against each optimizer's class, groups and options), then
    load: a refused file (one that would need unpickling arbitrary objects, a mismatch)
    leaves every model, optimizer and scheduler as it was."""
    from ember.checkpoint.trust import check_optimizers
    strategy = acc.strategy
    if strategy.is_sharded or strategy.owns_optimizer_step:
        raise CheckpointError(f"{path} was written by Accelerate; ember reads Accelerate checkpoints under the "
                              f"single and DDP strategies only, not {strategy.name}")
    # -- read and check everything; nothing is loaded yet --------------------------------
    weights = []
    for i, m in enumerate(acc._models):
        w = _weights(path, i)
        cio.check_compatible(strategy.unwrap_module(m), w, path, strict=strict)
        weights.append(w)
    opt_states = [cio.load_torch(_required(path, _name("optimizer", i, "bin"), f"prepared optimizer {i}"))
                  for i in range(len(acc._optimizers))]
    check_optimizers([o.optimizer for o in acc._optimizers], opt_states, {}, path)
    sched_states = [cio.load_torch(_required(path, _name("scheduler", i, "bin"), f"prepared scheduler {i}"))
                    for i in range(len(acc._schedulers))]
    scaler = os.path.join(path, "scaler.pt")
    scaler_state = cio.load_torch(cio.checks.member(path, "scaler.pt")) if os.path.isfile(scaler) else None
    custom = [cio.load_torch(_required(path, f"custom_checkpoint_{i}.pkl", f"registered object {i}"))
              for i in range(len(acc._custom_objects))]
    rng = os.path.join(path, f"random_states_{strategy.global_rank}.pkl")
    states, rng_error = None, None
    if os.path.isfile(rng):
        try:
            states = _safe_rng(cio.checks.member(path, os.path.basename(rng)))
        except Exception as err:   # noqa: BLE001 - an unreadable RNG file is skipped, not fatal
            rng_error = err
    # -- load ----------------------------------------------------------------------------
    for m, w in zip(acc._models, weights):
        strategy.load_module_state_dict(m, w, strict=strict)
    model0 = acc._models[0] if acc._models else None
    for o, st in zip(acc._optimizers, opt_states):
        strategy.load_optimizer_state_dict(o.optimizer, st, model0)
    for s, st in zip(acc._schedulers, sched_states):
        s.scheduler.load_state_dict(st)
    if scaler_state is not None:
        strategy.precision.load_state_dict({"scaler": scaler_state})
    for o, st in zip(acc._custom_objects, custom):
        o.load_state_dict(st)
    skipped = sorted(n for n in os.listdir(path) if n.startswith(("sampler", "dl_state_dict")))
    if skipped:
        warnings.warn(f"load_state({path!r}): {', '.join(skipped)} not read (Accelerate pickles sampler objects; "
                      "ember does not unpickle objects): the prepared dataloaders start their pass from the "
                      "beginning; skip the batches already seen with accelerator.skip_first_batches",
                      UserWarning, stacklevel=3)
    step = 0
    if states is not None:
        try:
            _restore_rng(states)
            step = int(states.get("step", 0))
        except Exception as err:   # noqa: BLE001 - an unreadable RNG file is skipped, not fatal
            rng_error = err
    if rng_error is not None:
        warnings.warn(f"load_state({path!r}): {os.path.basename(rng)} skipped: it cannot be read without "
                      f"unpickling arbitrary objects ({type(rng_error).__name__}); the RNG streams continue from "
                      "the current state", UserWarning, stacklevel=3)
    acc._step = step % max(1, acc.gradient_accumulation_steps)
    return {"kind": "accelerate", "path": path}
