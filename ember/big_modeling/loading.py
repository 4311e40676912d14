"""Load safetensors checkpoints straight onto the devices of a device map.

Tensors are read one map entry at a time through ``safetensors.safe_open`` (memory-mapped,
opened and closed per entry), so the whole checkpoint is never in memory; weights mapped to
``"disk"`` are not read at all: the dispatched model reads them from the checkpoint file at
each forward.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from torch import nn

from ember.big_modeling.device_map import (_as_dtype, check_device_map, get_balanced_memory,
                                           infer_auto_device_map, init_empty_weights, owner_entry, torch_device)
from ember.big_modeling.hooks import DiskRef, _meta_like, dispatch_model
from ember.checkpoint.io import ALIAS_KEY, INDEX_NAME, WEIGHTS_NAME, read_index
from ember.errors import CheckpointError, MisconfigurationError

__all__ = ["load_checkpoint_in_model", "load_checkpoint_and_dispatch", "checkpoint_key_map", "load_pretrained"]


def _shards(checkpoint: str) -> tuple[list[str], str | None]:
    """(safetensors files, index file or None) of a file, an index JSON or a folder."""
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return _shards(os.path.join(path, INDEX_NAME))
        if os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
            return [os.path.join(path, WEIGHTS_NAME)], None
        what = "a DCP folder 'model/' (a sharded-strategy checkpoint; consolidate it first)" \
            if os.path.isdir(os.path.join(path, "model")) else f"{sorted(os.listdir(path))[:10]}"
        raise CheckpointError(f"no safetensors weights in {path}: expected {WEIGHTS_NAME} or {INDEX_NAME}, "
                              f"found {what}")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.endswith(".json"):
        return read_index(path)[1], path     # every shard inside the index's folder
    if path.endswith(".safetensors"):
        return [path], None
    raise CheckpointError(f"{path}: only safetensors checkpoints are loaded here (a .safetensors file, its "
                          "index .json or a folder holding them); pickled .bin/.pt files are refused")


def checkpoint_key_map(checkpoint: str | os.PathLike) -> dict[str, tuple[str, str]]:
    """Every tensor name of a safetensors checkpoint -> (file, key stored in that file), tied
    names recorded as ``ember.aliases`` included. Reads only the file headers."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from safetensors import safe_open
    files, index = _shards(os.fspath(checkpoint))
    out: dict[str, tuple[str, str]] = {}
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointError(f"{index} lists {os.path.basename(file)}, which is missing")
        try:
            with safe_open(file, framework="pt") as f:
                keys, md = list(f.keys()), dict(f.metadata() or {})
        except Exception as err:
            raise CheckpointError(f"{file} is truncated or corrupt ({type(err).__name__}: {err})") from err
        for k in keys:
            out[k] = (file, k)
        for alias, target in json.loads(md.get(ALIAS_KEY, "{}")).items():
            out.setdefault(alias, (file, target))
    return out


def _prefix_fn(names: list[str], keys: dict) -> Any:
    """How model names map to checkpoint names: as they are, with a prefix added (a module
    saved inside a TrainModule: ``model.``) or removed (a base model's: ``bert.``)."""
    best, best_hits = (lambda n: n), sum(n in keys for n in names)
    if best_hits == len(names) or not names:
        return best
    probe = names[0]
    for p in {k[: -len(probe)] for k in keys if k.endswith("." + probe)}:
        h = sum((p + n) in keys for n in names)
        if h > best_hits:
            best, best_hits = (lambda n, p=p: p + n), h
    for p in {n.split(".", 1)[0] + "." for n in names if "." in n}:
        h = sum(n[len(p):] in keys for n in names if n.startswith(p))
        if h > best_hits:
            best, best_hits = (lambda n, p=p: n[len(p):] if n.startswith(p) else n), h
    return best


def load_checkpoint_in_model(model: nn.Module, checkpoint: str | os.PathLike, device_map: dict | None = None,
                             offload_folder: str | os.PathLike | None = None, dtype: Any = None,
                             offload_state_dict: bool = False, offload_buffers: bool = False,
                             keep_in_fp32_modules: list[str] | None = None,
                             strict: bool = False) -> dict[str, DiskRef]:
    """Load a safetensors checkpoint into ``model`` (built with :func:`init_empty_weights` or not),
    each tensor straight onto the device ``device_map`` gives it (CPU without a map).

    Weights mapped to ``"disk"`` are not read: they are returned as name -> :class:`DiskRef`
    into the checkpoint's own files (pass that to ``dispatch_model(offload_index=...)``).
    Tied parameters stay one tensor. ``dtype`` casts floating-point weights (not those under
    ``keep_in_fp32_modules``). Parameters the checkpoint lacks raise a :class:`CheckpointError`
    (listed) when they have no weights yet, else a warning (``strict=True``: an error); unused
    checkpoint tensors warn (``strict``: error). ``offload_folder`` and ``offload_state_dict``
    are accepted for Accelerate compatibility: reading is per entry anyway, so no state dict
    is ever held whole.
    """
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from safetensors import safe_open
    dtype = _as_dtype(dtype)
    dmap = check_device_map(model, device_map) if device_map is not None else {"": "cpu"}
    entries = list(dmap)
    keys = checkpoint_key_map(checkpoint)
    slots = []
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, t in m._parameters.items():
            if t is not None:
                slots.append(((f"{mname}.{attr}" if mname else attr), m, attr, True, t))
        persistent = set(m._buffers) - getattr(m, "_non_persistent_buffers_set", set())
        for attr, t in m._buffers.items():
            if t is not None and (attr in persistent or t.device.type == "meta"):
                slots.append(((f"{mname}.{attr}" if mname else attr), m, attr, False, t))
    to_ckpt = _prefix_fn([s[0] for s in slots if s[3]], keys)
    groups: dict[int, list] = {}
    for s in slots:
        groups.setdefault(id(s[4]), []).append(s)

    used: set[str] = set()
    missing: list[str] = []
    index: dict[str, DiskRef] = {}
    reads: dict[tuple[str, str], list] = {}    # (entry, file) -> [(stored key, group)]
    for members in groups.values():
        src = next((keys[to_ckpt(s[0])] for s in members if to_ckpt(s[0]) in keys), None)
        if src is None:
            if members[0][3] or members[0][4].device.type == "meta":
                missing.append(members[0][0])
            continue
        used.update(to_ckpt(s[0]) for s in members)
        entry = owner_entry(members[0][0], entries)
        cast = dtype if dtype is not None and not any(
            any(part in (keep_in_fp32_modules or ()) for part in s[0].split(".")) for s in members) else None
        if dmap[entry] == "disk" and members[0][3]:
            for s in members:
                index[s[0]] = DiskRef(src[0], src[1], cast)
            for s in members:       # no weights in memory for them
                if s[4].device.type != "meta":
                    s[1]._parameters[s[2]] = nn.Parameter(_meta_like(s[4]),
                                                          requires_grad=s[4].requires_grad)
            continue
        reads.setdefault((entry, src[0]), []).append((src[1], members, cast))
    if missing:
        have_none = [n for n in missing if _tensor(model, n).device.type == "meta"]
        msg = (f"{os.fspath(checkpoint)} has no weights for {len(missing)} tensor(s) of {type(model).__name__}: "
               f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
        if have_none or strict:
            raise CheckpointError(msg + ("; they have no values yet (meta device), so the model cannot run"
                                         if have_none else ""))
        warnings.warn(msg + "; they keep their current values", stacklevel=2)
    computed = {f"{mn}.{b}" if mn else b for mn, m in model.named_modules()
                for b in getattr(m, "_non_persistent_buffers_set", ())}   # e.g. position_ids
    unused = sorted(k for k in set(keys) - used if not any(to_ckpt(c) == k for c in computed))
    if unused:
        msg = (f"{len(unused)} tensor(s) of {os.fspath(checkpoint)} match nothing in "
               f"{type(model).__name__}: {unused[:10]}")
        if strict:
            raise CheckpointError(msg)
        warnings.warn(msg, stacklevel=2)

    for (entry, file), items in reads.items():
        dev = dmap[entry]
        target = torch.device("cpu") if dev in ("cpu", "disk") else torch_device(dev)
        # one open per (entry, file): the mapping and its pages go away after each block
        with safe_open(file, framework="pt", device="cpu") as f:
            for key, members, cast in items:
                value = f.get_tensor(key)
                ref = members[0][4]
                if tuple(value.shape) != tuple(ref.shape):
                    raise CheckpointError(f"{members[0][0]}: the checkpoint holds shape {tuple(value.shape)}, "
                                          f"the model {tuple(ref.shape)}")
                if cast is not None and value.is_floating_point():
                    value = value.to(cast)
                value = value.to(target)
                new = type(ref)(value, requires_grad=ref.requires_grad) if members[0][3] else value
                for _, m, attr, is_param, _t in members:
                    (m._parameters if is_param else m._buffers)[attr] = new
    return index


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    mod, _, attr = name.rpartition(".")
    m = model.get_submodule(mod) if mod else model
    return getattr(m, attr)


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: str | os.PathLike, device_map: Any = None,
                                 max_memory: dict | None = None, no_split_module_classes: list[str] | None = None,
                                 offload_folder: str | os.PathLike | None = None, offload_buffers: bool = False,
                                 dtype: Any = None, offload_state_dict: bool | None = None,
                                 skip_keys: Any = None, preload_module_classes: list[str] | None = None,
                                 force_hooks: bool = False, strict: bool = False) -> nn.Module:
    """Load ``checkpoint`` into ``model`` (usually built with :func:`init_empty_weights`) and
    dispatch it, never holding the whole model in memory.

    Args:
        checkpoint: a ``.safetensors`` file, a sharded checkpoint's index JSON, or a folder
            holding either (a transformers model folder, ``save_pretrained`` output, or an
            ember checkpoint directory with ``model.safetensors``).
        device_map: ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"``
            (computed by :func:`infer_auto_device_map` from ``max_memory``,
            ``no_split_module_classes`` and ``dtype``), a dict, or None (load on CPU, no hooks).
        offload_folder: where ``"disk"`` weights would be written; safetensors checkpoints
            are read in place, so nothing is copied there (called ``offload_dir`` in
            :func:`dispatch_model`, as in Accelerate).
        dtype: cast floating-point weights to this dtype as they are loaded.

    Disk-offloaded weights are read from the checkpoint files at each forward: keep them
    in place while the model is used.
    """
    dtype = _as_dtype(dtype)
    if isinstance(device_map, str):
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise MisconfigurationError(f"device_map={device_map!r}: use 'auto', 'balanced', 'balanced_low_0', "
                                        "'sequential', a dict or None")
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory, no_split_module_classes, dtype,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=no_split_module_classes, dtype=dtype)
    index = load_checkpoint_in_model(model, checkpoint, device_map, offload_folder=offload_folder, dtype=dtype,
                                     offload_state_dict=bool(offload_state_dict), strict=strict)
    if device_map is None:
        return model
    return dispatch_model(model, device_map, offload_dir=offload_folder, offload_index=index,
                          offload_buffers=offload_buffers, skip_keys=skip_keys,
                          preload_module_classes=preload_module_classes, force_hooks=force_hooks)


def load_pretrained(auto_cls: Any, name: str | os.PathLike, device_map: Any = "auto", max_memory: dict | None = None,
                    offload_folder: str | os.PathLike | None = None,
                    no_split_module_classes: list[str] | None = None, dtype: Any = None,
                    local_files_only: bool = True, **config_kwargs) -> nn.Module:
    """A transformers model (``auto_cls``, e.g. ``AutoModelForCausalLM``) from a local folder or
    cached Hub name, built with :func:`init_empty_weights` and loaded by
    :func:`load_checkpoint_and_dispatch`; ``no_split_module_classes`` defaults to the model
    class's ``_no_split_modules``. Returned in eval mode, like ``from_pretrained``."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from transformers import AutoConfig
    folder = os.fspath(name)
    if not os.path.isdir(folder):
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from huggingface_hub import snapshot_download
        try:
            folder = snapshot_download(folder, local_files_only=local_files_only)
        except Exception as err:
            raise CheckpointError(f"model {os.fspath(name)!r} is no local folder and is not in the Hugging Face "
                                  f"cache ({type(err).__name__}); download it first") from err
    config = AutoConfig.from_pretrained(folder, **config_kwargs)
    with init_empty_weights():
        model = auto_cls.from_config(config)
    if no_split_module_classes is None:
        no_split_module_classes = list(getattr(model, "_no_split_modules", None) or [])
    model = load_checkpoint_and_dispatch(model, folder, device_map=device_map, max_memory=max_memory,
                                         no_split_module_classes=no_split_module_classes,
                                         offload_folder=offload_folder, dtype=dtype)
    return model.eval()
