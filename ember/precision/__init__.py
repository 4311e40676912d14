"""Number formats. A ``Precision`` answers five questions for the loop: the
autocast context for forward, how to convert the module and the inputs, how to
run backward (loss scaling), and how to step an optimizer (skip on inf).

Build one from a string with :func:`Precision.from_string` (the Trainer and the
Accelerator accept the strings directly)::

    "64-true" "32-true" "16-mixed" "bf16-mixed" "16-true" "bf16-true"
"""
from __future__ import annotations

import os

import contextlib
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map_only
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ember.errors import invalid_choice

NULL_CONTEXT = contextlib.nullcontext()   # one shared no-op context (no allocation per use)

PRECISIONS = ("64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_ALIASES = {"64": "64-true", 64: "64-true", "32": "32-true", 32: "32-true",
            "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed",
            "fp32": "32-true", "fp16": "16-mixed", "no": "32-true"}

_profiler_on = torch._C._autograd._profiler_enabled
_BASE_ZERO_GRAD = torch.optim.Optimizer.zero_grad
#: the code of the wrapper torch puts around an optimizer class's ``step`` (every such wrapper
#: shares it): a class ``step`` with other code, a user's own wrapper, is always called
_TORCH_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def step_optimizer(optimizer: Any, closure: Any = None) -> Any:
    """``optimizer.step(closure)``, without the wrapper torch puts around every optimizer
    class's ``step`` where that wrapper would do nothing but cost time.

    The wrapper (``Optimizer.profile_hook_step``) opens a ``record_function`` (about 5 µs
    on a CPU even with no profiler running) and runs the step hooks. It is skipped only
    when it has nothing to do: no profiler is running, no step pre/post hook is
    registered (globally or on this optimizer), and nothing else replaced this
    optimizer's ``step`` (a learning-rate scheduler's call counter is kept: it sets
    ``_opt_called`` as it would). Anything else goes through ``optimizer.step`` as is."""
    cls_step = type(optimizer).step
    inner = cls_step.__wrapped__ if getattr(cls_step, "__code__", None) is _TORCH_STEP_WRAPPER else None
    own = optimizer.__dict__.get("step")
    if (inner is None or _profiler_on() or _global_optimizer_pre_hooks or _global_optimizer_post_hooks
            or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
            or (own is not None and not (getattr(own, "_wrapped_by_lr_sched", False)
                                         and getattr(own, "__wrapped__", None) is cls_step))):
        return optimizer.step() if closure is None else optimizer.step(closure)
    if own is not None:
        optimizer._opt_called = True   # what the scheduler's counter records
    return inner(optimizer) if closure is None else inner(optimizer, closure)


def clear_grads(optimizer: Any) -> None:
    """``optimizer.zero_grad(set_to_none=True)``; for an optimizer that keeps torch's own
    ``zero_grad``, the same loop without its ``record_function`` (skipped only while no
    profiler runs)."""
    if type(optimizer).zero_grad is not _BASE_ZERO_GRAD or "zero_grad" in optimizer.__dict__ or _profiler_on():
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, data)


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

    def setup(self, device: torch.device, loss_scaler: str | None = "torch") -> None:
        """Called once the strategy knows its root device; ``loss_scaler`` is the
        strategy's choice of loss scaler for "16-mixed" (see :class:`MixedPrecision`).
        "32-true" on an Ampere or newer GPU turns TF32 matmuls on (see :func:`tf32_default`)."""
        self.device_type = device.type
        if self.name == "32-true" and device.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(device)
            if tf32_default(cap, torch.get_float32_matmul_precision(), os.environ.get("EMBER_TF32")):
                torch.set_float32_matmul_precision("high")

    # -- forward -------------------------------------------------------------
    def forward_context(self):
        return NULL_CONTEXT

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
        step_optimizer(optimizer, closure)

    def loss_scale(self) -> torch.Tensor | None:
        """The current loss scale as a device tensor, read without a host sync (None: no
        scaler, or nothing was scaled yet)."""
        return None if self.scaler is None else self.scaler._scale

    def configure_scaler(self, init_scale: float, growth_factor: float, backoff_factor: float,
                         growth_interval: int) -> None:
        """Set the loss scaler's parameters (``GradScalerKwargs``); a no-op without a scaler."""
        scaler = self.scaler
        if scaler is None:
            return
        scaler._init_scale, scaler._growth_factor = init_scale, growth_factor
        scaler._backoff_factor, scaler._growth_interval = backoff_factor, growth_interval
        if scaler._scale is not None:
            scaler._scale.fill_(init_scale)

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last step of ``optimizer`` was skipped (inf/NaN under loss scaling)."""
        return False

    def update(self) -> None:
        """End of an optimizer step (every optimizer stepped): update the loss scale."""

    def skip_flag(self, optimizer: torch.optim.Optimizer) -> "SkipFlag | None":
        """Whether the last step of ``optimizer`` was skipped, to be read later without a
        host sync now (None: steps are never skipped under this precision)."""
        return None

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
    """Autocast for forward; fp32 master weights. "16-mixed" adds a loss scaler
    (a GradScaler; steps with inf/NaN gradients are skipped and the scale lowered).

    The loss-scaling rules, in one place for the Trainer and the Accelerator:

    - ``backward`` multiplies the loss by the current scale.
    - ``unscale_gradients(opt)`` divides ``opt``'s gradients by it once per step
      (a second call before the step is a no-op).
    - ``optimizer_step(opt)`` unscales (if not done yet) and steps unless a
      gradient is inf/NaN; :meth:`step_skipped` tells which.
    - The scale is updated once per optimizer step, after *every* optimizer
      stepped: at the next ``backward``, or when the scale is read (``state_dict``,
      ``Accelerator.scaler``) through :meth:`update`. So several optimizers stepping
      one after the other all unscale with the scale their gradients were scaled
      with. (The order of the whole step: ``ember/step.py``.)
    - An optimizer that does not step through this precision (e.g. one not passed
      to ``Accelerator.prepare``) is unscaled just before its own ``step()`` when it
      holds parameters of a module this precision set up, and its step is skipped
      on inf/NaN: its update is the one an unscaled loss would give.
    """

    def __init__(self, name: str):
        self.name = name
        self.autocast_dtype = torch.float16 if name == "16-mixed" else torch.bfloat16
        self.device_type = "cpu"
        self._ctx = None
        self._update_pending = False   # an optimizer stepped since the last scale update
        self._scaled = False           # a scaled backward ran since the last scale update
        self._stepping = None          # the optimizer inside optimizer_step (not guarded)
        self._found: dict[int, torch.Tensor] = {}   # id(optimizer) -> inf/NaN count of its last step
        self._params: dict[int, weakref.ref] = {}   # parameters of the modules set up here

    def setup(self, device, loss_scaler: str | None = "torch"):
        """``loss_scaler`` (the strategy's choice): ``"torch"`` (``torch.amp.GradScaler``),
        ``"sharded"`` (FSDP's ``ShardedGradScaler``) or None (the strategy scales itself)."""
        self.device_type = device.type if device.type in ("cuda", "cpu", "mps", "xpu") else "cpu"
        if self.name != "16-mixed" or loss_scaler is None:
            self.scaler = None
            return
        if loss_scaler == "sharded":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            if not isinstance(self.scaler, ShardedGradScaler):
                self.scaler = ShardedGradScaler(device=self.device_type)
        elif self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device_type)
        _guard(self)

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def convert_module(self, module):
        self._params.update((id(p), weakref.ref(p)) for p in module.parameters())
        return module

    def backward(self, loss, **kwargs):
        scaler = self.scaler
        if scaler is not None:
            if self._update_pending:
                self.update()
            loss = scaler.scale(loss)
            self._scaled = True
        loss.backward(**kwargs)

    def unscale_gradients(self, optimizer):
        """Unscale once per step: a second call before the step (hook, then clipping)
        is a no-op instead of GradScaler's error."""
        scaler = self.scaler
        if scaler is None:
            return
        from torch.amp.grad_scaler import OptState
        state = scaler._per_optimizer_states.get(id(optimizer))
        if state is not None and state["stage"] is not OptState.READY:
            return
        scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, closure=None) -> None:
        scaler = self.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            closure()
        self._stepping = optimizer
        try:
            scaler.step(optimizer)   # skips the step on inf/NaN gradients
        finally:
            self._stepping = None
        self._found[id(optimizer)] = sum(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        self._update_pending = True

    def step_skipped(self, optimizer) -> bool:
        """True when the last :meth:`optimizer_step` of ``optimizer`` found inf/NaN
        gradients and did not step (one host sync)."""
        found = self._found.get(id(optimizer))
        return found is not None and bool(found.item())

    def skip_flag(self, optimizer) -> "SkipFlag | None":
        """The skip flag of ``optimizer``'s last :meth:`optimizer_step`, kept on the device
        (on CUDA copied to pinned host memory without blocking): no host sync until read."""
        found = self._found.get(id(optimizer))
        return None if found is None else SkipFlag(found)

    def update(self) -> None:
        """Update the loss scale once every optimizer of this step has stepped (no-op
        when none has since the last update)."""
        if self._update_pending:
            self._update_pending = self._scaled = False
            self.scaler.update()

    def _guard_step(self, optimizer) -> None:
        """An optimizer stepping outside :meth:`optimizer_step` after a scaled backward:
        unscale its gradients and skip its step on inf/NaN, as a prepared one."""
        if not self._scaled or optimizer is self._stepping:
            return
        params = self._params
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if not any((r := params.get(id(p))) is not None and r() is p for p in held):
            return
        if not any(p.grad is not None for p in held):
            return
        self.unscale_gradients(optimizer)
        state = self.scaler._per_optimizer_states[id(optimizer)]
        found = sum(state["found_inf_per_device"].values())
        self._found[id(optimizer)] = found
        if found.item():    # skipped as GradScaler skips: no gradient, no update
            for p in held:
                p.grad = None
        self._update_pending = True

    def for_sharding(self) -> "ShardedMixedPrecision":
        """This precision as run by a strategy whose sharding engine casts by itself
        (FSDP2): a new :class:`ShardedMixedPrecision` of the same name, without autocast.
        This object is left as it is; a loss scaler it already holds is carried over."""
        out = ShardedMixedPrecision(self.name)
        out.scaler = self.scaler
        return out

    def state_dict(self):
        if self.scaler is None:
            return {}
        self.update()
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state):
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._update_pending = self._scaled = False


class SkipFlag:
    """Whether one optimizer step was skipped (inf/NaN gradients under loss scaling),
    taken without a host sync: the count stays on its device; on CUDA its copy into
    pinned host memory is issued at once and waited for (an event, not the stream)
    only when :meth:`value` is read, normally a step later, when it has long landed."""

    def __init__(self, found: torch.Tensor):
        self._event = None
        if found.is_cuda:
            host = torch.empty(found.shape, dtype=found.dtype, pin_memory=True)
            host.copy_(found, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            found = host
        self._host = found

    def value(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.item())


class ShardedMixedPrecision(MixedPrecision):
    """"bf16-mixed" / "16-mixed" under a strategy whose sharding engine casts itself
    (FSDP2's ``MixedPrecisionPolicy``: parameters all-gathered in the low dtype, gradients
    reduced in fp32, fp32 master shards). One precision path: no autocast from the loop
    (:meth:`forward_context` is a no-op, :attr:`autocast_dtype` is None); the loss
    scaling of "16-mixed" is :class:`MixedPrecision`'s. :attr:`compute_dtype` is the
    dtype the strategy computes in. Build one with :meth:`MixedPrecision.for_sharding`."""

    def __init__(self, name: str):
        super().__init__(name)
        self.compute_dtype = self.autocast_dtype
        self.autocast_dtype = None

    def forward_context(self):
        return NULL_CONTEXT

    def for_sharding(self) -> "ShardedMixedPrecision":
        return self


_GUARDED: "weakref.WeakSet[MixedPrecision]" = weakref.WeakSet()
_HOOK = None


def _guard(precision: MixedPrecision) -> None:
    """Watch every optimizer step in the process while a loss scaler exists (one
    global step pre-hook; processes without 16-mixed never install it). The hook is
    removed once no such precision is left: a global hook sends every optimizer step of
    the process through torch's step wrapper (see :func:`step_optimizer`)."""
    global _HOOK
    if precision not in _GUARDED:
        _GUARDED.add(precision)
        weakref.finalize(precision, _unhook_when_unused)
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HOOK = register_optimizer_step_pre_hook(_unscale_unmanaged)


def _unhook_when_unused() -> None:
    global _HOOK
    if _HOOK is not None and not list(_GUARDED):   # (a WeakSet yields live precisions only)
        _HOOK.remove()
        _HOOK = None


def _unscale_unmanaged(optimizer, args, kwargs):
    for precision in list(_GUARDED):
        if precision.scaler is not None:
            precision._guard_step(optimizer)
    return None


def tf32_default(capability: "tuple[int, int]", current: str, env: "str | None") -> bool:
    """Whether "32-true" turns TF32 matmuls on (``torch.set_float32_matmul_precision("high")``):
    on GPUs of compute capability 8.0 or newer (Ampere, Hopper, ...), unless the process
    already chose a matmul precision other than torch's default ``"highest"`` or
    ``EMBER_TF32=0`` is set (``EMBER_TF32=1`` forces it on). TF32 keeps fp32's range with
    a 10-bit mantissa in matmul inputs: several times the fp32 matmul throughput, and
    the default of JAX and of TensorFlow on these GPUs; set ``EMBER_TF32=0`` for
    bit-for-bit fp32 matmuls."""
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return capability >= (8, 0) and current == "highest"
