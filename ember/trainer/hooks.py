"""The module hooks that change how a batch is moved or a training step runs
(Lightning's ``on_before/after_backward``, ``optimizer_step``, ``optimizer_zero_grad``,
``configure_gradient_clipping``, ``on_before_zero_grad``, the batch-transfer hooks),
``configure_callbacks`` and the step call shapes. Each is resolved once per epoch or
pass: when nobody overrides a hook, the loop keeps its plain path and the hook costs
nothing per step (see loops.py for the order of events)."""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

from ember.errors import MisconfigurationError

#: module hooks that replace part of the automatic optimizer step
STEP_OVERRIDES = ("optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping")

#: Lightning hooks ember does not call, and what to use instead (warned at setup)
UNSUPPORTED = {
    "backward": "ember runs backward through the strategy (loss scaling, DDP); put code that must run "
                "around it in on_before_backward(loss) / on_after_backward()",
    "configure_sharded_model": "rename it configure_model (Lightning's current name, which ember calls)",
    "on_after_zero_grad": "put the code in on_before_zero_grad(optimizer) or optimizer_zero_grad",
}


def check_module_hooks(t, module) -> None:
    """At setup: a Lightning hook ember does not call is warned about (never ignored
    silently); a step override a strategy cannot honour is an error."""
    from ember.module import TrainModule
    for name, fix in UNSUPPORTED.items():
        if callable(getattr(type(module), name, None)) and not hasattr(TrainModule, name):
            warnings.warn(f"{type(module).__name__}.{name}() is never called by ember's Trainer: {fix}",
                          UserWarning, stacklevel=4)
    if t.strategy.owns_optimizer_step and module.automatic_optimization:
        bad = [n for n in STEP_OVERRIDES if t._module_hook(n) is not None]
        if bad:
            raise MisconfigurationError(
                f"{type(module).__name__} overrides {', '.join(bad)}, but under the {t.strategy.name} strategy "
                "the engine steps, clips and zeroes gradients itself; remove the override (configure "
                "clipping and the optimizer in the engine's config) or use another strategy")


def configure_callbacks(t, module) -> None:
    """``module.configure_callbacks()``: each returned callback replaces the Trainer's
    callbacks of the same type, else is added (checkpoint callbacks stay last), as Lightning."""
    from ember.module import TrainModule, overrides
    if not overrides(module, TrainModule, "configure_callbacks"):
        return
    from ember.callbacks.base import Callback
    from ember.callbacks.checkpoint import ModelCheckpoint
    extra = module.configure_callbacks()
    extra = [] if extra is None else list(extra) if isinstance(extra, (list, tuple)) else [extra]
    for cb in extra:
        if not isinstance(cb, Callback):
            raise MisconfigurationError(f"{type(module).__name__}.configure_callbacks() returned "
                                        f"{type(cb).__name__}; return Callback instances")
    if not extra:
        return
    types = {type(cb) for cb in extra}
    kept = [cb for cb in t.callbacks if type(cb) not in types and cb not in extra]
    merged = kept + extra
    t.callbacks[:] = [c for c in merged if not isinstance(c, ModelCheckpoint)] + \
        [c for c in merged if isinstance(c, ModelCheckpoint)]


def backward_hooks(t) -> tuple | None:
    """(before(loss), after()) calling the callbacks' then the module's
    ``on_before_backward`` / ``on_after_backward``; None when nobody overrides them."""
    cb_b, cb_a = t._hooks["on_before_backward"], t._hooks["on_after_backward"]
    m_b, m_a = t._module_hook("on_before_backward"), t._module_hook("on_after_backward")
    if not (cb_b or cb_a or m_b or m_a):
        return None
    module = t.module

    def before(loss):
        for h in cb_b:
            h(t, module, loss)
        if m_b is not None:
            m_b(loss)

    def after():
        for h in cb_a:
            h(t, module)
        if m_a is not None:
            m_a()
    return before, after


def with_backward_hooks(t, backward: Callable, acc) -> Callable:
    """The loop's ``backward(loss)`` with the backward hooks around it, or ``backward``
    itself when nobody overrides them. The hooks see the loss divided by the
    accumulation window's size, as the backward does."""
    hooks = backward_hooks(t)
    if hooks is None:
        return backward
    before, after = hooks

    def run(loss):
        div = acc._loss_div
        before(loss / div if div != 1 else loss)
        backward(loss)
        after()
    return run


def optimizer_step_with_overrides(t, optimizers: list, clip_fn, before_step: bool,
                                  update_scale) -> Callable | None:
    """The automatic optimizer step when the module overrides ``optimizer_step``,
    ``optimizer_zero_grad`` or ``configure_gradient_clipping``, or anyone overrides
    ``on_before_zero_grad``: ``step(batch_idx, loss)``. None otherwise (the loop's
    inline step runs). Order: on_before_optimizer_step, configure_gradient_clipping,
    optimizer_step, then per optimizer on_before_zero_grad and optimizer_zero_grad."""
    m_step, m_zero = t._module_hook("optimizer_step"), t._module_hook("optimizer_zero_grad")
    m_clip, m_bz = t._module_hook("configure_gradient_clipping"), t._module_hook("on_before_zero_grad")
    cb_bz = t._hooks["on_before_zero_grad"]
    if m_step is None and m_zero is None and m_clip is None and m_bz is None and not cb_bz:
        return None
    module, acc = t.module, t._acc
    clip = t.gradient_clip_val
    zero = not t.strategy.owns_optimizer_step   # an engine (DeepSpeed) zeroes its own gradients

    def step(batch_idx: int, loss: Any) -> None:
        if before_step:
            t._before_optimizer_step(optimizers[0].optimizer)   # unscales first under 16-mixed
        if m_clip is not None:
            acc.unscale_gradients()
            for o in optimizers:
                m_clip(o, clip, t.gradient_clip_algorithm)
        elif clip_fn is not None:
            for o in optimizers:
                clip_fn([p for g in o.param_groups for p in g["params"]], clip)
        epoch = t.loop_state.epoch
        for o in optimizers:
            if m_step is not None:
                m_step(epoch, batch_idx, o, lambda: loss)   # forward and backward already ran
            else:
                o.step()
        for o in optimizers:
            for h in cb_bz:
                h(t, module, o)
            if m_bz is not None:
                m_bz(o)
            if m_zero is not None:
                m_zero(epoch, batch_idx, o)
            elif zero:
                o.optimizer.zero_grad(set_to_none=True)
        if update_scale is not None:
            update_scale()
    return step


def batch_transfer(t, dataloader_idx: int = 0) -> Callable | None:
    """``batch -> batch`` through the module's ``on_before_batch_transfer``,
    ``transfer_batch_to_device`` (else the strategy's move, when the device is not the
    CPU) and ``on_after_batch_transfer``; None when the module overrides none of them."""
    m_before = t._module_hook("on_before_batch_transfer")
    m_move = t._module_hook("transfer_batch_to_device")
    m_after = t._module_hook("on_after_batch_transfer")
    if m_before is None and m_move is None and m_after is None:
        return None
    default = t.strategy.batch_to_device if t._needs_transfer else None
    device = t.strategy.root_device

    def run(batch):
        if m_before is not None:
            batch = m_before(batch, dataloader_idx)
        if m_move is not None:
            batch = m_move(batch, device, dataloader_idx)
        elif default is not None:
            batch = default(batch)
        if m_after is not None:
            batch = m_after(batch, dataloader_idx)
        return batch
    return run


def takes_batch_idx(fn: Callable) -> bool:
    """Whether a ``*_step`` accepts ``batch_idx`` (Lightning allows ``training_step(self,
    batch)``): inspected once per epoch or pass, never per step."""
    # read the function under any functools.wraps layers: FSDP's register_fsdp_forward_method
    # re-binds a wrapper of the *bound* method, whose own signature would lose ``batch`` as if
    # it were ``self``; a decorator inside the class wraps the plain function, which still
    # lists ``self``
    target = inspect.unwrap(fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return True
    n = len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    if inspect.ismethod(fn) and not inspect.ismethod(target):
        n -= 1   # the unwrapped plain function's ``self``
    return n >= 2


def step_call(fn: Callable) -> Callable:
    """``fn`` itself when it takes ``(batch, batch_idx, ...)``; else an adapter that drops
    ``batch_idx`` (one extra call per step only for the short form)."""
    if takes_batch_idx(fn):
        return fn

    def short(batch, batch_idx, **kwargs):
        return fn(batch, **kwargs)
    return short
