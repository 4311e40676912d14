"""Sharded checkpoints across ranks: loading a full (unsharded) checkpoint into a
sharded model without every rank reading it, and checking a sharded save (FSDP's DCP
files, DeepSpeed's ZeRO files) before it is committed.

The full load: rank 0 reads and checks ``model.safetensors`` and ``trainer_state.pt``,
then torch's ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``broadcast_from_rank0=True`` send each tensor to the other ranks, which keep only
their shard. Peak memory: one full model (+ optimizer states) on rank 0, a shard plus
one tensor in flight elsewhere.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch
from torch import nn

from ember.errors import CheckpointError

#: set on a module whose pretrained weights only rank 0 read (the others build it on the meta device)
FROM_RANK0_ATTR = "_weights_from_rank0"


def raise_rank0_error(strategy, error: "BaseException | None", what: str, complete: bool = False,
                      value: Any = None, kind: type = CheckpointError) -> Any:
    """Rank 0's outcome of a step only it ran (a read, a commit, a decision), on every rank:
    one broadcast, then rank 0 raises its own exception and the others a ``kind``
    (CheckpointError unless given) ``"<what>: <rank 0's error>"``; when rank 0 succeeded,
    returns rank 0's ``value`` on every rank. ``complete``: a CheckpointError of rank 0
    already says what failed (a commit's verdict), so the other ranks raise its message as
    it is. Every rank must call it (it replaces a closing barrier, so no rank waits for one
    that failed)."""
    verdict = None
    if error is not None:
        verdict = (str(error) if complete and isinstance(error, CheckpointError)
                   else f"{what}: {type(error).__name__}: {error}")
    value, verdict = strategy.broadcast((value, verdict))
    if verdict is not None:
        if error is not None:
            raise error
        raise kind(verdict)
    return value


def staging_on_rank0(strategy, path: str, what: str = "save_checkpoint") -> str:
    """The staging folder of a save that every rank writes into (a sharded save): rank 0
    checks the target and creates ``NAME.ember-tmp`` (``ember.checkpoint.io.make_staging``),
    and its outcome reaches every rank (:func:`raise_rank0_error`, in place of a barrier),
    so a refused target ends every rank with rank 0's error. Every rank must call it;
    returns the folder's path."""
    from ember.checkpoint import io as cio
    tmp = cio.tmp_path(path)
    error = None
    if strategy.is_global_zero:
        try:
            cio.make_staging(path, what)   # the target check, then an empty NAME.ember-tmp
        except Exception as err:     # reported to every rank (in place of a barrier), raised here as it is
            error = err
    raise_rank0_error(strategy, error, f"checkpoint {path} was not written: rank 0 could not create {tmp}")
    return tmp


def load_full_from_rank0(strategy, path: str, module: nn.Module, optimizers: list, strict: bool = True,
                         weights_only: bool = False) -> dict:
    """Load ``path`` (a checkpoint whose weights are ``model.safetensors``) into the
    sharded ``module``/``optimizers``; returns the trainer state (with ``"meta"``) on
    every rank. A checkpoint that rank 0 cannot read or that does not fit raises the
    same error on every rank (no rank waits in a broadcast)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from ember.checkpoint import io as cio
    rank0 = strategy.is_global_zero
    weights, state, meta, error = None, None, None, None
    if rank0:
        try:
            weights, state, meta = cio.read_checkpoint(path, load_state=not weights_only)
            state = state or {}
            cio.check_compatible(strategy.unwrap_module(module), weights, path, strict=strict)
            saved = state.get("optimizers", [])
            if optimizers and not weights_only and len(saved) != len(optimizers):
                raise CheckpointError(f"{path} has {len(saved)} optimizer state(s) but {len(optimizers)} "
                                      "optimizer(s) are set up")
        except Exception as err:     # reported to every rank below, raised here as it is
            error = err
    raise_rank0_error(strategy, error, f"rank 0 could not load {os.fspath(path)}")
    # the small part of the trainer state (loop position, RNG, callbacks) goes to every rank,
    # with the hyperparameters of optimizers that hold no state tensors (plain SGD): torch's
    # broadcast_from_rank0 needs at least one state tensor to know the device
    small = stateless = None
    if rank0:
        small = {k: v for k, v in state.items() if k != "optimizers"}
        stateless = [None if s.get("state") else s.get("param_groups", []) for s in state.get("optimizers", [])]
    small, meta, stateless = strategy.broadcast((small, meta, stateless))
    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(module, weights if rank0 else {}, options=full)
    del weights
    if optimizers and not weights_only:
        saved = state.get("optimizers", []) if rank0 else [None] * len(optimizers)
        for opt, s, groups in zip(optimizers, saved, stateless):
            if groups is not None:
                for live, g in zip(opt.param_groups, groups):
                    live.update({k: v for k, v in g.items() if k != "params"})
                continue
            osd = strategy._fqn_keyed(module, opt, s) if rank0 else {}
            set_optimizer_state_dict(module, opt, osd,
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # the optimizer states are in place already; the loop only counts them
    small["optimizers"] = [{"stored_in": "loaded by the strategy from rank 0"}] * len(stateless)
    small["meta"] = meta
    return small


_SHARD_RANK = re.compile(r"^__(\d+)_\d+\.distcp$")


def verify_shards(folder: str, path: str, need: dict[str, tuple[int, str]], prefix: str, where: str) -> dict[str, int]:
    """Check the files every rank wrote into ``folder`` before a commit: each name in
    ``need`` (``{name: (bytes at least, whose file, e.g. "rank 1's shard")}``) exists and
    holds its bytes. Returns ``{"<prefix>/<name>": size}`` for ``meta.json``; raises a
    CheckpointError naming whose file is missing or short. ``where`` names the listing."""
    from ember.checkpoint import trust as checks
    out: dict[str, int] = {}
    for name, (size, who) in sorted(need.items()):
        fp = checks.member(folder, name, where)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint {path} not committed: {who} {name} is missing from {folder}")
        have = os.path.getsize(fp)
        if have < size:
            raise CheckpointError(f"checkpoint {path} not committed: {who} {name} has {have} bytes, "
                                  f"{where} needs {size}")
        out[f"{prefix}/{name}"] = have
    return out


def verify_dcp_shards(folder: str, path: str) -> dict[str, int]:
    """Check a DCP folder that every rank has written: each file its ``.metadata``
    names exists and holds the bytes recorded for it. Returns ``{"model/<file>": size}``
    for ``meta.json``; raises CheckpointError naming the rank whose shard is missing or
    short (files are ``__<rank>_<n>.distcp``)."""
    from ember.checkpoint import trust as checks
    from ember.checkpoint import io as cio
    meta_file = os.path.join(folder, ".metadata")
    if not os.path.isfile(meta_file):
        raise CheckpointError(f"checkpoint {path}: the DCP metadata {meta_file} was not written")
    md = checks.dcp_reader(folder).read_metadata()
    need: dict[str, tuple[int, str]] = {}
    for info in (md.storage_data or {}).values():
        name = info.relative_path
        m = _SHARD_RANK.match(name)
        size = max(need.get(name, (0, ""))[0], int(info.offset) + int(info.length))
        need[name] = (size, f"rank {m.group(1)}'s shard" if m else "shard")
    out = {f"{cio.DCP_WEIGHTS_DIR}/.metadata": os.path.getsize(meta_file)}
    out.update(verify_shards(folder, path, need, cio.DCP_WEIGHTS_DIR, "the DCP metadata"))
    return out


def load_full_weights(path: str) -> dict[str, torch.Tensor]:
    """Full weights of a checkpoint written by :class:`FSDPStrategy`, in one process,
    without a process group (e.g. to build a plain module for inference)."""
    from ember.checkpoint import io as cio
    from ember.checkpoint.trust import dcp_planner, dcp_reader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    import torch.distributed.checkpoint as dcp
    weights, _, _ = cio.read_checkpoint(path, load_state=False)
    if weights is not None:
        return weights
    folder = os.path.join(os.fspath(path), cio.DCP_WEIGHTS_DIR)
    md = dcp_reader(folder).read_metadata().state_dict_metadata
    prefix = "model."     # FSDPStrategy saves {"model": ..., "optim": ...}
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
          if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=folder, no_dist=True, storage_reader=dcp_reader(folder), planner=dcp_planner())
    return {k[len(prefix):]: v for k, v in sd.items()}


def rank0_full_state(strategy, module: nn.Module) -> "dict | None":
    """Before sharding: the full state rank 0 will send when ``module`` is marked to take
    its weights from rank 0 (``ember.integrations.hf_load``); ``None`` otherwise."""
    if not getattr(module, FROM_RANK0_ATTR, False):
        return None
    return whole_state(module) if strategy.is_global_zero else {}


def whole_state(module: nn.Module) -> dict:
    """Every tensor of ``module``'s state dict, also where the module narrows its own
    ``state_dict()`` to what a checkpoint holds (a TransformersModule with adapters leaves
    out its frozen base, which every rank must still receive)."""
    return nn.Module.state_dict(module)


def shard_from_rank0(strategy, module: nn.Module, meta: set[str], full: dict,
                     rank0_buffers: "dict[str, torch.Tensor] | None" = None) -> None:
    """After sharding: allocate this rank's meta tensors (uninitialised: nothing is
    computed for them) and fill every shard with rank 0's ``full`` state
    (``set_model_state_dict`` with ``broadcast_from_rank0``); buffers outside the state
    dict (non-persistent: position ids, rotary frequencies) are sent by one broadcast,
    from ``rank0_buffers`` where rank 0 took them before it moved its module to meta."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    if meta:
        allocate_meta(module, meta, strategy.root_device)
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    keys = set(whole_state(module).keys())
    extra = [(n, b) for n, b in module.named_buffers() if n not in keys]
    mine = None
    if strategy.is_global_zero:
        mine = rank0_buffers if rank0_buffers is not None else {n: b.detach().cpu() for n, b in extra}
    sent = strategy.broadcast(mine)
    with torch.no_grad():
        for n, b in extra:
            b.copy_(sent[n])


def to_meta(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on the meta device, tied parameters
    still tied (``Module.to`` gives each module its own new Parameter when the device
    type changes, which unties shared weights such as tied embeddings)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    aliases = []
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                if id(p) in first:
                    aliases.append((mod, name, first[id(p)]))
                else:
                    first[id(p)] = (mod, name)
    module.to("meta")
    for mod, name, (owner, owner_name) in aliases:
        mod._parameters[name] = owner._parameters[owner_name]
    return module


def allocate_meta(module: nn.Module, meta: set[str], device: torch.device) -> None:
    """Give the (sharded) meta tensors ``meta`` of ``module`` uninitialised memory on
    ``device``; the other tensors keep their values."""
    from itertools import chain
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t
    keep = {n: local(t).detach().clone() for n, t in chain(module.named_parameters(), module.named_buffers())
            if n not in meta}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, t in chain(module.named_parameters(), module.named_buffers()):
            if n in keep:
                local(t).copy_(keep[n])
