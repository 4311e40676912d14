"""A prepared model's ``forward`` under the precision: autocast (outputs optionally cast
back to float32) or the cast of floating inputs to a true low dtype."""
from __future__ import annotations

import types
from typing import Any

import torch
from torch.utils._pytree import tree_map_only


# -- forward under the precision -----------------------------------------------------------------
def _to_float32(x: Any, low: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype == low else t, x)


def wrap_forward(module: torch.nn.Module, precision: Any, outputs_to_fp32: bool = False) -> None:
    """Make ``module.forward`` run under the precision's autocast (outputs left in the
    autocast dtype, or cast to float32 with ``outputs_to_fp32``) or cast floating inputs
    to the precision's dtype ("16-true" ...). Bound to the module, so ``copy.deepcopy``
    rebinds it to the copy. No-op under 32-true and when the strategy casts by itself
    (FSDP's MixedPrecisionPolicy: no autocast)."""
    autocast = precision.autocast_dtype is not None
    if not (autocast or precision.needs_input_cast) or module.__dict__.get("_ember_forward_wrapped"):
        return
    bound = module.forward
    func = bound.__func__ if isinstance(bound, types.MethodType) and bound.__self__ is module else None
    if autocast:
        low = precision.autocast_dtype

        if outputs_to_fp32:
            def forward(self, *args, **kwargs):
                with precision.forward_context():
                    out = func(self, *args, **kwargs) if func is not None else bound(*args, **kwargs)
                return _to_float32(out, low)
        else:
            def forward(self, *args, **kwargs):
                with precision.forward_context():
                    return func(self, *args, **kwargs) if func is not None else bound(*args, **kwargs)
    else:
        def forward(self, *args, **kwargs):
            args, kwargs = precision.convert_input(args), precision.convert_input(kwargs)
            return func(self, *args, **kwargs) if func is not None else bound(*args, **kwargs)
    module.forward = types.MethodType(forward, module)
    module.__dict__["_ember_forward_wrapped"] = True


def unwrap_forward(module: torch.nn.Module) -> None:
    """Undo :func:`wrap_forward`."""
    if module.__dict__.pop("_ember_forward_wrapped", False):
        module.__dict__.pop("forward", None)
