"""Reading a :class:`~ember.integrations.transformers.TransformersModule`'s pretrained
weights: on every process (one device, DDP), or once per job under a sharded strategy.

Under :class:`~ember.strategies.fsdp.FSDPStrategy` (and so
:class:`~ember.strategies.model_parallel.ModelParallelStrategy`) with several processes,
:func:`build_model` reads the weight files on global rank 0 only (``from_pretrained``);
every other rank reads ``config.json`` and builds the same architecture on the meta
device (no weights read, no memory). The strategy shards both, then sends rank 0's
full state into the shards (torch's ``set_model_state_dict`` with
``broadcast_from_rank0=True``; see :func:`ember.strategies.full_load.shard_from_rank0`).
Peak memory: one full model on rank 0, a shard plus one tensor in flight elsewhere.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _dtype_kwarg() -> str:
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def pretrained_config(module: Any, name: str) -> tuple[Any, bool]:
    """``(config, mismatched)``: the folder's config with the module's labels applied;
    ``mismatched`` when the labels change the size of the head."""
    from ember.checkpoint.rng import keep_rng_states
    from ember.integrations.hf_io import _offline, not_found_error
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from transformers import AutoConfig
    local = module.local_files_only or _offline()
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=local)
    except (OSError, ValueError) as err:
        raise not_found_error("model", name, err, module.local_files_only) from err
    labels = module._label_kwargs()
    mismatched = bool(labels) and getattr(config, "num_labels", None) != labels["num_labels"]
    for k, v in labels.items():
        setattr(config, k, v)
    return config, mismatched


def load_pretrained(module: Any, name: str) -> nn.Module:
    """``from_pretrained`` of ``name`` (float32, the module's ``model_kwargs``) on this process."""
    from ember.integrations.hf_io import _offline, not_found_error
    config, mismatched = pretrained_config(module, name)
    kwargs = {_dtype_kwarg(): torch.float32, **module.model_kwargs}
    if mismatched:
        kwargs.setdefault("ignore_mismatched_sizes", True)
    try:
        return module._auto_cls.from_pretrained(name, config=config, local_files_only=module.local_files_only
                                                or _offline(), **kwargs)
    except (OSError, ValueError) as err:
        raise not_found_error("model", name, err, module.local_files_only) from err


def model_from_config(module: Any, cfg: dict) -> nn.Module:
    """An untrained model from a config dict (``model_config``), with the module's labels."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from transformers import AutoConfig
    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    for k, v in module._label_kwargs().items():
        setattr(config, k, v)
    return module._auto_cls.from_config(config)


def loads_once(strategy: Any) -> bool:
    """True when ``strategy`` shards the model over several processes that can take
    rank 0's weights by broadcast (FSDP, ModelParallel)."""
    import torch.distributed as dist
    from ember.strategies.fsdp import FSDPStrategy
    return isinstance(strategy, FSDPStrategy) and dist.is_available() and dist.is_initialized() \
        and dist.get_world_size() > 1


def build_model(module: Any, name: str, strategy: Any = None) -> nn.Module:
    """The pretrained model for ``module``: read on this process, or, when
    :func:`loads_once` (``strategy``), read on global rank 0 and built on the meta device
    elsewhere; then ``module`` is marked so the strategy fills the shards from rank 0."""
    if strategy is None or not loads_once(strategy):
        with torch.device("cpu"):   # real weights even inside a meta-device init context
            return load_pretrained(module, name)
    from ember.strategies.full_load import FROM_RANK0_ATTR, raise_rank0_error
    model, error = None, None
    if strategy.is_global_zero:
        try:
            with torch.device("cpu"):
                model = load_pretrained(module, name)
        except Exception as err:     # reported to every rank below, raised here as it is
            error = err
    raise_rank0_error(strategy, error, f"rank 0 could not load the pretrained model {name}")
    if model is None:
        config, _ = pretrained_config(module, name)
        # the same dtype as rank 0's from_pretrained (a user's dtype/torch_dtype wins there too)
        dtype = module.model_kwargs.get("dtype", module.model_kwargs.get("torch_dtype", torch.float32))
        kwargs = {k: v for k, v in module.model_kwargs.items() if k == "attn_implementation"}
        with torch.device("meta"):
            model = module._auto_cls.from_config(config, **{_dtype_kwarg(): dtype}, **kwargs)
    setattr(module, FROM_RANK0_ATTR, True)
    return model
