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


def load_accelerate_state(acc, path: str, strict: bool = True) -> dict:
    strategy = acc.strategy
    if strategy.is_sharded or strategy.owns_optimizer_step:
        raise CheckpointError(f"{path} was written by Accelerate; ember reads Accelerate checkpoints under the "
                              f"single and DDP strategies only, not {strategy.name}")
    for i, m in enumerate(acc._models):
        weights = _weights(path, i)
        cio.check_compatible(strategy.unwrap_module(m), weights, path, strict=strict)
        strategy.load_module_state_dict(m, weights, strict=strict)
    model0 = acc._models[0] if acc._models else None
    for i, o in enumerate(acc._optimizers):
        fp = os.path.join(path, _name("optimizer", i, "bin"))
        if not os.path.isfile(fp):
            raise CheckpointError(f"{path}: {os.path.basename(fp)} is missing for prepared optimizer {i}")
        strategy.load_optimizer_state_dict(o.optimizer, cio.load_torch(fp), model0)
    for i, s in enumerate(acc._schedulers):
        fp = os.path.join(path, _name("scheduler", i, "bin"))
        if not os.path.isfile(fp):
            raise CheckpointError(f"{path}: {os.path.basename(fp)} is missing for prepared scheduler {i}")
        s.scheduler.load_state_dict(cio.load_torch(fp))
    scaler = os.path.join(path, "scaler.pt")
    if os.path.isfile(scaler):
        strategy.precision.load_state_dict({"scaler": cio.load_torch(scaler)})
    for i, o in enumerate(acc._custom_objects):
        fp = os.path.join(path, f"custom_checkpoint_{i}.pkl")
        if not os.path.isfile(fp):
            raise CheckpointError(f"{path}: custom_checkpoint_{i}.pkl is missing for registered object {i}")
        o.load_state_dict(cio.load_torch(fp))
    skipped = sorted(n for n in os.listdir(path) if n.startswith(("sampler", "dl_state_dict")))
    if skipped:
        warnings.warn(f"load_state({path!r}): {', '.join(skipped)} not read (Accelerate pickles sampler objects; "
                      "ember does not unpickle objects): the prepared dataloaders start their pass from the "
                      "beginning; skip the batches already seen with accelerator.skip_first_batches",
                      UserWarning, stacklevel=3)
    rng = os.path.join(path, f"random_states_{strategy.global_rank}.pkl")
    step = 0
    if os.path.isfile(rng):
        try:
            states = _safe_rng(rng)
            _restore_rng(states)
            step = int(states.get("step", 0))
        except Exception as err:   # noqa: BLE001 - an unreadable RNG file is skipped, not fatal
            warnings.warn(f"load_state({path!r}): {os.path.basename(rng)} skipped: it cannot be read without "
                          f"unpickling arbitrary objects ({type(err).__name__}); the RNG streams continue from "
                          "the current state", UserWarning, stacklevel=3)
    acc._step = step % max(1, acc.gradient_accumulation_steps)
    return {"kind": "accelerate", "path": path}
