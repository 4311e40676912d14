"""The repeated blocks of a model, and what is applied per block before a strategy
wraps it: activation checkpointing and ``torch.compile`` (both must come before
``fully_shard`` / DDP, as torchtitan orders them). FSDP's default wrapping units are
the same blocks.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ember.errors import MisconfigurationError

__all__ = ["find_blocks", "check_block_policy", "select_blocks", "apply_activation_checkpointing",
           "compile_blocks"]


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model, in ``module.modules()`` order: instances of the
    classes named in transformers' ``_no_split_modules`` (on the model or any submodule)
    when there are any, else the children of every ``nn.ModuleList`` / ``nn.Sequential``
    holding two or more parameterised modules of one class (the layer stack of a
    transformer, ResNet stages, ...). Used as the default FSDP wrapping units and for
    ``compile`` / activation checkpointing per block."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    if names:
        found = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        if found:
            return found
    blocks, seen = [], set()
    for m in module.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = [c for c in m.children() if any(True for _ in c.parameters())]
            if len(kids) >= 2 and len({type(c) for c in kids}) == 1:
                for c in kids:
                    if id(c) not in seen:
                        seen.add(id(c))
                        blocks.append(c)
    return blocks


def check_block_policy(arg: str, policy):
    """Validate a per-block policy: None, True (the blocks :func:`find_blocks` detects), a
    layer class, a set/list of layer classes, or a callable ``fn(module) -> bool``."""
    if policy is None or policy is False:
        return None
    if policy is True or callable(policy) and not isinstance(policy, type):
        return policy
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return classes
    raise MisconfigurationError(f"{arg}={policy!r} is not valid; use True (the model's repeated blocks), "
                                "a set of nn.Module classes (e.g. {MyBlock}) or a callable fn(module) -> bool")


def select_blocks(module: nn.Module, policy) -> list[nn.Module]:
    """The submodules a checked ``policy`` (see :func:`check_block_policy`) selects."""
    if policy is None:
        return []
    if policy is True:
        return find_blocks(module)
    check: Callable[[nn.Module], bool] = (lambda m: isinstance(m, policy)) if isinstance(policy, tuple) else policy
    return [m for m in module.modules() if m is not module and check(m)]


def apply_activation_checkpointing(module: nn.Module, policy) -> int:
    """Recompute the activations of each selected block in backward instead of keeping
    them (``torch.distributed._composable.checkpoint``, which works with and without
    FSDP/DDP). Call before the module is wrapped or compiled. Returns how many blocks."""
    blocks = select_blocks(module, policy)
    if not blocks:
        if policy is not None:
            raise MisconfigurationError(f"activation_checkpointing={policy!r} matched no submodule of "
                                        f"{type(module).__name__}; name the block classes explicitly")
        return 0
    from torch.distributed._composable import checkpoint
    for m in blocks:
        checkpoint(m)
    return len(blocks)


def compile_blocks(module: nn.Module, options: dict | None = None) -> int:
    """``torch.compile`` each repeated block in place (``nn.Module.compile``) before the
    strategy wraps the model; a model without repeated blocks compiles its children.
    torchmetrics ``Metric`` children are left alone (their update/compute are not
    forward code). Returns how many modules were compiled."""
    opts = dict(options or {})
    targets = find_blocks(module) or list(module.children())
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from torchmetrics import Metric
    except ImportError:     # pragma: no cover - torchmetrics is a dependency
        Metric = ()
    n = 0
    for m in targets:
        if isinstance(m, Metric) or not any(True for _ in m.parameters()):
            continue
        m.compile(**opts)
        n += 1
    return n
