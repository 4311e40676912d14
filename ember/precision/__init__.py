"""Number formats. A ``Precision`` answers five questions for the loop: the
autocast context for forward, how to convert the module and the inputs, how to
run backward (loss scaling), and how to step an optimizer (skip on inf).

Build one from a string with :func:`Precision.from_string` (the Trainer and the
Accelerator accept the strings directly)::

    "64-true" "32-true" "16-mixed" "bf16-mixed" "16-true" "bf16-true"
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ember.errors import invalid_choice

_NULL = contextlib.nullcontext()

PRECISIONS = ("64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_ALIASES = {"64": "64-true", 64: "64-true", "32": "32-true", 32: "32-true",
            "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed",
            "fp32": "32-true", "fp16": "16-mixed", "no": "32-true"}


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, dict):
        return type(data)((k, _cast_floats(v, dtype)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        out = [_cast_floats(v, dtype) for v in data]
        return type(data)(*out) if hasattr(data, "_fields") else type(data)(out)
    return data


class Precision:
    """Full fp32: every method is a no-op. Subclasses override what differs."""

    name = "32-true"
    #: dtype the parameters are held in (None: leave as they are)
    param_dtype: torch.dtype | None = None
    #: dtype autocast computes in (None: no autocast)
    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    @staticmethod
    def from_string(value: "str | int | Precision") -> "Precision":
        if isinstance(value, Precision):
            return value
        if not isinstance(value, (str, int)):
            raise invalid_choice("precision", value, PRECISIONS)
        key = _ALIASES.get(value, value)
        cls = {"64-true": TruePrecision, "32-true": Precision, "16-true": TruePrecision,
               "bf16-true": TruePrecision, "16-mixed": MixedPrecision,
               "bf16-mixed": MixedPrecision}.get(key)
        if cls is None:
            raise invalid_choice("precision", value, PRECISIONS)
        return cls() if cls is Precision else cls(key)

    def setup(self, device: torch.device) -> None:
        """Called once the strategy knows its root device."""
        self.device_type = device.type

    # -- forward -------------------------------------------------------------
    def forward_context(self):
        return _NULL

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        return data

    @property
    def needs_input_cast(self) -> bool:
        return False

    # -- backward / step -----------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale (before clipping)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure=None) -> None:
        """Step the optimizer (under loss scaling: skipped when gradients hold inf/NaN)."""
        optimizer.step() if closure is None else optimizer.step(closure)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"


class TruePrecision(Precision):
    """Parameters and inputs held in one dtype: "64-true", "16-true", "bf16-true"."""

    _DTYPES = {"64-true": torch.float64, "16-true": torch.float16, "bf16-true": torch.bfloat16}

    def __init__(self, name: str):
        self.name = name
        self.param_dtype = self._DTYPES[name]

    def convert_module(self, module):
        return module.to(dtype=self.param_dtype)

    def convert_input(self, data):
        return _cast_floats(data, self.param_dtype)

    @property
    def needs_input_cast(self) -> bool:
        return True

    @contextlib.contextmanager
    def module_init_context(self):
        """Create parameters directly in the target dtype (used for configure_model)."""
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(old)


class MixedPrecision(Precision):
    """Autocast for forward; fp32 master weights. "16-mixed" adds a GradScaler
    (steps with inf/NaN gradients are skipped and the scale lowered)."""

    def __init__(self, name: str):
        self.name = name
        self.autocast_dtype = torch.float16 if name == "16-mixed" else torch.bfloat16
        self.device_type = "cpu"
        self._ctx = None

    def setup(self, device):
        self.device_type = device.type if device.type in ("cuda", "cpu", "mps", "xpu") else "cpu"
        if self.name == "16-mixed" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device_type)

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss, **kwargs):
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer):
        """Unscale once per step: a second call before the step (hook, then clipping)
        is a no-op instead of GradScaler's error."""
        scaler = self.scaler
        if scaler is None:
            return
        from torch.amp.grad_scaler import OptState
        state = scaler._per_optimizer_states.get(id(optimizer))
        if state is not None and state["stage"] is OptState.UNSCALED:
            return
        scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, closure=None) -> None:
        scaler = self.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            closure()
        scaler.step(optimizer)   # skips the step on inf/NaN gradients, no host sync
        scaler.update()

    def state_dict(self):
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state):
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
