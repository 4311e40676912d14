"""A prepared model's ``forward`` under the precision: autocast (outputs optionally cast
back to float32) or the cast of floating inputs to a true low dtype."""
from __future__ import annotations

import types
from typing import Any

import torch


# -- forward under the precision -----------------------------------------------------------------
def _to_float32(x: Any, low: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype == low else x
    if isinstance(x, dict):
        if type(x) is dict:
            return {k: _to_float32(v, low) for k, v in x.items()}
        for k in list(x.keys()):  # OrderedDict subclasses such as transformers' ModelOutput
            x[k] = _to_float32(x[k], low)
        return x
    if isinstance(x, (list, tuple)):
        out = [_to_float32(v, low) for v in x]
        return type(x)(*out) if hasattr(x, "_fields") else type(x)(out)
    return x


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
