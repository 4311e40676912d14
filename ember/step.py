"""The optimizer step: every rule of it, written once, for the Trainer, the Accelerator and Fabric.

A :class:`StepRules` belongs to one strategy (and through it one precision). The
Trainer's automatic optimization runs each micro-batch in :meth:`StepRules.micro_batch`
and the step through :meth:`StepRules.make_step`; its manual optimization through
:class:`StepOptimizer` (``self.optimizers()``) and :meth:`StepRules.manual_backward`; the
Accelerator and Fabric through the same methods behind their verbs (``accumulate``,
``no_sync``, ``backward``, ``clip_grad_norm_``, a prepared optimizer's ``step``/``zero_grad``,
a prepared scheduler's ``step``). Nothing else in ember divides a loss, unscales, clips,
steps, defers a scheduler or zeroes gradients.

The sequence (walked in docs/architecture.md, "The one step"), each rule written at its
method: :meth:`StepRules.micro_batch` (the accumulation window and the loss divisor:
:func:`accumulation_window`, :meth:`StepRules.count_divisor`), :meth:`StepRules.no_sync`,
:meth:`StepRules.backward` between the backward hooks (:meth:`StepRules.hooked`),
:meth:`StepRules.unscale`, :meth:`StepRules.clip_grad_norm`, :meth:`StepRules.optimizer_step`,
:meth:`StepRules.end_step` (the scale update), :meth:`StepRules.scheduler_step` and
:func:`step_scheduler`, :meth:`StepRules.zero_grad` (:meth:`StepRules.discard` on an exception).

Where the Accelerator keeps a documented Accelerate semantic, it says so here, once:

- a prepared scheduler steps ``num_processes`` times per optimizer step (each process
  sees 1/n of the batches, so a schedule written for the batches of one process keeps
  its length; ``ReduceLROnPlateau`` steps once); the Trainer's step-interval schedulers
  step once per optimizer step, as Lightning's;
- ``Accelerator(mixed_precision="fp16")`` on a CPU runs in float32, as Accelerate does
  (``precision="16-mixed"`` asks for fp16 autocast with a loss scaler on the CPU);
- clipping on a micro-batch that does not step returns the norm of the gradients
  accumulated so far and leaves them alone (Accelerate clips them: clipping a partial
  sum changes what accumulation computes).

On one process, the same model, data, optimizer, scheduler, accumulation and precision
give bit-identical weights and learning rates through ``Trainer.fit`` and through an
Accelerator loop (tests/step/).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterable

import torch

from ember.errors import MisconfigurationError
from ember.precision import NULL_CONTEXT, clear_grads


def accumulation_window(index: int, total: int | None, steps: int) -> tuple[bool, int]:
    """For micro-batch ``index`` (0-based, counted from the start of the epoch) of
    ``total`` (None: not known yet), whether the optimizer steps after it and the size
    of its window. Windows hold ``steps`` micro-batches; the last window of an epoch of
    known length may be shorter, and its losses are divided by its own size."""
    if total is not None:
        last = total - total % steps   # where a short last window starts
        if index >= last:
            return index + 1 == total, total - last
    return (index + 1) % steps == 0, steps


def owning(optimizers: Iterable[Any], params: list) -> list:
    """The optimizers (of ``optimizers``) that hold any of ``params``."""
    ids = {id(p) for p in params}
    return [o for o in optimizers if any(id(p) in ids for g in o.param_groups for p in g["params"])]


def _by_mesh(tensors: list) -> list[list]:
    """``tensors`` grouped by DTensor device mesh (plain tensors form one group), in order."""
    groups: dict[int, list] = {}
    for t in tensors:
        mesh = getattr(t, "device_mesh", None)
        groups.setdefault(id(mesh) if mesh is not None else 0, []).append(t)
    return list(groups.values())


def total_norm(grads: list, norm_type: float = 2.0) -> torch.Tensor:
    """The total ``norm_type`` norm of ``grads`` as a plain tensor. Plain tensors form
    one group; DTensor gradients are grouped by device mesh and each group's norm is
    made whole (``full_tensor``) before the groups are combined, so parameters on
    different meshes (a 2-D tensor-parallel mesh beside FSDP-only ones) clip together.
    One group gives exactly ``torch.nn.utils.get_total_norm``."""
    norms = []
    for gs in _by_mesh(grads):
        n = torch.nn.utils.get_total_norm(gs, norm_type, foreach=True)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    if norm_type == float("inf"):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_by_norm(params: list, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` so their total norm (:func:`total_norm`) is at
    most ``max_norm``; return the norm before clipping. Each mesh's gradients are scaled
    by one call (a foreach op takes tensors of one mesh)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = total_norm([p.grad for p in params], norm_type)
    groups = _by_mesh(params) if any(hasattr(p.grad, "device_mesh") for p in params) else [params]
    if len(groups) == 1 and not hasattr(params[0].grad, "device_mesh"):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm
    # the coefficient is a plain 0-d tensor: let DTensor gradients take it as replicated
    from torch.distributed.tensor.experimental import implicit_replication
    with implicit_replication():
        for group in _by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


class StepRules:
    """The optimizer-step rules of one strategy (see the module docstring for the
    sequence). ``accumulation_steps``: micro-batches per optimizer step.

    Attributes:
        sync_gradients: the current micro-batch ends its accumulation window (the
            optimizer steps after it); set by :meth:`window`.
        loss_divisor: what :meth:`backward` divides the loss by (the window's size, or its item count).
        model: the (wrapped) model whose backward and step an engine needs (DeepSpeed).
    """

    def __init__(self, strategy: Any, accumulation_steps: int = 1) -> None:
        self.strategy = strategy
        self.accumulation_steps = int(accumulation_steps)
        self.sync_gradients = True
        self.loss_divisor = 1
        self.model: Any = None
        self._pending: list | None = None   # deferred scheduler steps: [(skip flags, apply)]
        from ember.strategies.base import Strategy
        st = type(strategy)
        # the precision directly when the strategy adds nothing (one call less per step)
        self._plain_backward = st.backward is Strategy.backward
        self._plain_step = st.optimizer_step is Strategy.optimizer_step

    # -- the accumulation window --------------------------------------------------------
    def window(self, index: int, total: int | None) -> bool:
        """Micro-batch ``index`` of ``total`` (None: unknown): set :attr:`sync_gradients`
        and :attr:`loss_divisor` by :func:`accumulation_window`; return ``sync_gradients``."""
        self.sync_gradients, self.loss_divisor = accumulation_window(index, total, self.accumulation_steps)
        return self.sync_gradients

    def reset_window(self) -> None:
        """Outside an accumulation window: the next step syncs, nothing is divided."""
        self.sync_gradients, self.loss_divisor = True, 1

    def micro_batch(self, index: int, total: int | None, models: Iterable[Any] = (),
                    divisor: Any = None) -> ContextManager[None]:
        """Micro-batch ``index`` of ``total`` (None: unknown) of an epoch or pass: set
        :attr:`sync_gradients` and :attr:`loss_divisor` (:func:`accumulation_window`;
        ``divisor``, a number or a device tensor such as a window's token count, replaces
        the window's size), and return the context its forward and backward run in: no
        gradient all-reduce of ``models`` unless it ends its window (:meth:`no_sync`)."""
        sync = self.window(index, total)
        if divisor is not None:
            self.loss_divisor = divisor
        return self.no_sync(*models, enabled=not sync)

    def count_divisor(self, counts: Iterable[Any]) -> torch.Tensor:
        """The loss divisor of a window whose losses are sums over items (target tokens):
        ``counts`` are this process's items per micro-batch of the window; the divisor is
        their sum over every process (at least 1) divided by the number of processes (DDP
        averages gradients), so the step's gradient is that of the mean over every item,
        as one big batch. One all-reduce per window under several processes; no host sync."""
        device = self.strategy.root_device
        # counted on the host (raw batches): copied without waiting for the device
        n = torch.stack([torch.as_tensor(c).to(device, torch.float32, non_blocking=True) for c in counts]).sum()
        world = self.strategy.world_size
        if world > 1:
            n = self.strategy.reduce(n, "sum")
        return n.clamp(min=1.0) / world

    def no_sync(self, *models: Any, enabled: bool = True) -> ContextManager[None]:
        """Context: no gradient all-reduce of ``models`` (DDP ``no_sync``; FSDP keeps its
        unsharded gradients). A no-op on one process or when not ``enabled``."""
        if not enabled or not models or self.strategy.world_size == 1:
            return NULL_CONTEXT
        if len(models) == 1:
            return self.strategy.no_backward_sync(models[0], True)
        return _entered([self.strategy.no_backward_sync(m, True) for m in models])

    def hooked(self, backward: Callable, before: Callable | None, after: Callable | None) -> Callable:
        """``backward(loss, ...)`` between ``before(loss)`` (``on_before_backward``, which sees
        the loss divided by :attr:`loss_divisor` as the backward does) and ``after()``
        (``on_after_backward``); ``backward`` itself when neither is given."""
        if before is None and after is None:
            return backward

        def run(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if before is not None:
                div = self.loss_divisor
                before(loss / div if div.__class__ is not int or div != 1 else loss)
            backward(loss, *args, **kwargs)
            if after is not None:
                after()
        return run

    # -- backward ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss / loss_divisor``, backward through the strategy and precision (times the
        loss scale under "16-mixed")."""
        div = self.loss_divisor
        if div.__class__ is not int or div != 1:   # a tensor divisor: no host sync
            loss = loss / div
        if self._plain_backward:
            self.strategy.precision.backward(loss, **kwargs)
        else:
            self.strategy.backward(loss, self.model, **kwargs)

    def manual_backward(self, loss: torch.Tensor, model: Any = None, **kwargs: Any) -> None:
        """Manual optimization: the loss as given, through the strategy's manual backward
        (DDP prepares its gradient reduction for this loss)."""
        self.strategy.manual_backward(loss, model if model is not None else self.model, **kwargs)

    # -- unscale and clip --------------------------------------------------------------
    def unscale(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the loss scale ("16-mixed"), once per step (a
        second call before the step is a no-op). Applies a deferred scheduler step first."""
        if self._pending is not None:
            self.flush()
        self.strategy.precision.unscale_gradients(optimizer)

    def check_clip(self) -> None:
        """Refuse to clip where an engine clips by its own config (DeepSpeed)."""
        if self.strategy.owns_optimizer_step:
            raise MisconfigurationError(
                f"under the {self.strategy.name} strategy the engine clips gradients: set Trainer("
                "gradient_clip_val=...) or 'gradient_clipping' in its config instead of clipping by hand")

    def clip_grad_norm(self, params: Any, max_norm: float, norm_type: float = 2.0,
                       optimizers: Iterable[Any] = ()) -> torch.Tensor:
        """Unscale the optimizers (of ``optimizers``) holding ``params`` (a tensor or an
        iterable of them), then clip the total norm of their gradients (:func:`clip_by_norm`);
        return the norm before clipping. On a micro-batch that does not step: the norm of
        the gradients accumulated so far (divided by the loss scale), nothing clipped, no
        host sync."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if not self.sync_gradients:
            return self.grad_norm(params, norm_type)
        self.check_clip()
        if self.strategy.precision.scaler is not None:
            for o in owning(optimizers, params):
                self.unscale(o)
        return clip_by_norm(params, max_norm, norm_type)

    def grad_norm(self, params: list, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the gradients of ``params`` divided by the current loss scale
        (0-d tensor, no host sync, nothing unscaled or clipped)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.strategy.root_device)
        norm = total_norm(grads, norm_type)
        scale = self.strategy.precision.loss_scale()
        return norm / scale.to(norm.device).reshape(()) if scale is not None else norm

    def clip_grad_value(self, params: Any, clip_value: float, optimizers: Iterable[Any] = ()) -> None:
        """Unscale (as :meth:`clip_grad_norm`), then clamp every gradient element to
        ``[-clip_value, clip_value]``; nothing on a micro-batch that does not step."""
        if not self.sync_gradients:
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.check_clip()
        if self.strategy.precision.scaler is not None:
            for o in owning(optimizers, params):
                self.unscale(o)
        torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], clip_value)

    def clip_optimizer(self, optimizer: Any, clip_val: float, algorithm: str = "norm") -> torch.Tensor | None:
        """Clip ``optimizer``'s gradients (unscaled first): their total norm (returned) or
        each value (``algorithm="value"``). The Trainer's ``gradient_clip_val`` and
        ``TrainModule.clip_gradients`` both come here."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if algorithm == "value":
            self.clip_grad_value(params, clip_val, (optimizer,))
            return None
        return self.clip_grad_norm(params, clip_val, 2.0, (optimizer,))

    # -- the optimizer step --------------------------------------------------------------
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None = None) -> None:
        """Step ``optimizer`` (the raw one) through the strategy and precision: skipped on
        inf/NaN gradients under loss scaling. Applies a deferred scheduler step first."""
        if self._pending is not None:
            self.flush()
        if self._plain_step:
            self.strategy.precision.optimizer_step(optimizer, closure)
        else:
            self.strategy.optimizer_step(optimizer, self.model, closure)

    def end_step(self) -> None:
        """Every optimizer of this step stepped: update the loss scale now ("16-mixed").
        A caller that cannot tell when a step is complete (the Accelerator) leaves the update
        to the next backward or to whatever reads the scale (a checkpoint,
        ``Accelerator.scaler``): the same scale either way."""
        self.strategy.precision.update()

    def step_was_skipped(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s last step was skipped for inf/NaN gradients. Reading it
        waits for the device (a host sync on a GPU): the loops never call it per step."""
        return self.strategy.precision.step_skipped(optimizer)

    def zero_grad(self, optimizer: Any, set_to_none: bool = True) -> None:
        """Clear ``optimizer``'s gradients; nothing when an engine owns the step (DeepSpeed
        zeroes its own)."""
        if not self.strategy.owns_optimizer_step:
            if set_to_none:
                clear_grads(optimizer)
            else:
                optimizer.zero_grad(set_to_none=False)

    def discard(self, optimizers: Iterable[Any]) -> None:
        """A run broken mid-window (an exception): drop the gradients accumulated so far
        (:meth:`zero_grad`: an engine that owns the step keeps its own) and start the next
        window afresh."""
        for o in optimizers:
            self.zero_grad(o)
        self.reset_window()

    # -- schedulers -----------------------------------------------------------------------
    def scheduler_step(self, optimizers: Iterable[Any], apply: Callable[[], None], defer: bool = True) -> None:
        """Run ``apply()`` (which steps schedulers) unless the last step of one of
        ``optimizers`` (raw) was skipped. Under loss scaling that is known only from a
        flag on the device: with ``defer`` it is read later, when it has long reached
        the host (:meth:`flush`), so no step waits for the device; ``defer=False`` reads
        it now (a scheduler that reads a monitored metric must see today's)."""
        precision = self.strategy.precision
        if precision.scaler is None:
            apply()
            return
        flags = [f for f in (precision.skip_flag(o) for o in optimizers) if f is not None]
        if not flags:
            apply()
        elif defer:
            if self._pending is None:
                self._pending = []
            self._pending.append((flags, apply))
        elif not any(f.value() for f in flags):
            apply()

    @property
    def scheduler_step_pending(self) -> bool:
        """A scheduler step waits for its optimizer step's skip flag (see :meth:`flush`)."""
        return self._pending is not None

    def flush(self) -> None:
        """Apply the deferred scheduler steps whose optimizer steps were not skipped. Runs
        before the next unscale or optimizer step by itself; call it before anything reads
        the schedulers or learning rates (a log point, a checkpoint, an epoch end)."""
        pending, self._pending = self._pending, None
        for flags, apply in pending or ():
            if not any(f.value() for f in flags):
                apply()

    # -- the Trainer's automatic step ------------------------------------------------------
    def make_step(self, optimizers: list, *, before_step: Callable | None = None,
                  clip: tuple[float, str] | None = None, clip_override: Callable | None = None,
                  step_override: Callable | None = None, before_zero_grad: Callable | None = None,
                  zero_grad_override: Callable | None = None, wrap: Callable | None = None
                  ) -> Callable[[int, int, Any], None]:
        """The end of an accumulation window for the Trainer's automatic optimization, as
        one function ``step(epoch, batch_idx, loss)`` built once per epoch; the order of its
        hooks is written in ember/trainer/events.py. ``optimizers`` are :class:`StepOptimizer` s.
        Each hook or override is None when it does not apply: ``before_step(optimizer)``
        (``on_before_optimizer_step``; it and ``clip_override`` see unscaled gradients),
        ``clip_override(optimizer, clip_val, algorithm)`` (``configure_gradient_clipping``),
        else ``clip=(clip_val, algorithm)`` (:meth:`clip_optimizer`),
        ``step_override(epoch, batch_idx, optimizer, closure)`` (``optimizer_step``; the
        closure returns the loss: forward and backward already ran), else
        :meth:`optimizer_step`, ``before_zero_grad(optimizer)`` (``on_before_zero_grad``),
        ``zero_grad_override(epoch, batch_idx, optimizer)`` (``optimizer_zero_grad``), else
        :meth:`zero_grad`. ``wrap(name, fn)`` (a profiler) times the step and zero_grad. The
        loss scale is updated at the end (:meth:`end_step`); the scheduler step is the
        caller's (:meth:`scheduler_step`). With no hook, no clipping and one optimizer this
        is one call around the precision's step."""
        raw = [o.optimizer for o in optimizers]
        owns = self.strategy.owns_optimizer_step
        plain = self._plain_step and step_override is None
        precision_step = self.strategy.precision.optimizer_step
        opt_step = precision_step if plain else self.optimizer_step
        zero = None if owns else [functools.partial(clear_grads, o) for o in raw]
        if wrap is not None:
            opt_step = wrap("optimizer_step", opt_step)
            zero = None if zero is None else [wrap("zero_grad", z) for z in zero]
        update = self.strategy.precision.update if self.strategy.precision.scaler is not None else None
        if (before_step is None and clip is None and clip_override is None and step_override is None
                and before_zero_grad is None and zero_grad_override is None and len(raw) == 1):
            opt, zero_one = raw[0], (zero[0] if zero is not None else None)

            def step(epoch: int, batch_idx: int, loss: Any) -> None:
                if self._pending is not None:
                    self.flush()
                opt_step(opt)                       # skipped on inf/NaN gradients under 16-mixed
                if zero_one is not None:
                    zero_one()
                if update is not None:
                    update()                        # the step is complete: one scale update
            return step

        clip_val, algorithm = clip if clip is not None else (None, "norm")

        def step(epoch: int, batch_idx: int, loss: Any) -> None:
            if self._pending is not None:
                self.flush()
            if before_step is not None or clip_override is not None:
                for o in raw:
                    self.unscale(o)                 # hooks and clipping see true gradients
            if before_step is not None:
                before_step(raw[0])
            if clip_override is not None:
                for o in optimizers:
                    clip_override(o, clip_val, algorithm)
            elif clip_val is not None:
                for o in raw:
                    self.clip_optimizer(o, clip_val, algorithm)
            for o, r in zip(optimizers, raw):
                if step_override is not None:
                    step_override(epoch, batch_idx, o, lambda: loss)
                else:
                    opt_step(r)
            for i, o in enumerate(optimizers):
                if before_zero_grad is not None:
                    before_zero_grad(o)
                if zero_grad_override is not None:
                    zero_grad_override(epoch, batch_idx, o)
                elif zero is not None:
                    zero[i]()
            if update is not None:
                update()
        return step


class StepOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` and ``zero_grad()`` go through :class:`StepRules`:
    through the strategy and the precision (skipped on inf/NaN gradients under loss
    scaling), and not at all on micro-batches where ``rules.sync_gradients`` is False.
    It is a ``torch.optim.Optimizer`` (schedulers can be built on it); its state lives in
    the wrapped :attr:`optimizer`. ``after_step()`` runs after each step that ran (the
    Trainer's manual optimization counts ``global_step`` there)."""

    def __init__(self, optimizer: torch.optim.Optimizer, rules: StepRules,
                 after_step: Callable[[], None] | None = None) -> None:  # state is the inner one's
        self.optimizer, self.rules, self._after_step = optimizer, rules, after_step

    param_groups = property(lambda self: self._flushed().param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v), doc="the wrapped optimizer's")
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v),
                     doc="the wrapped optimizer's")
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v),
                        doc="the wrapped optimizer's")

    def _flushed(self) -> torch.optim.Optimizer:
        rules = self.rules
        if rules._pending is not None:   # learning rates are read: apply a deferred scheduler step
            rules.flush()
        return self.optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step through the rules; nothing while accumulating."""
        rules = self.rules
        if not rules.sync_gradients:
            return None
        rules.optimizer_step(self.optimizer, closure)
        if self._after_step is not None:
            self._after_step()
        return None

    @property
    def step_was_skipped(self) -> bool:
        """Under "16-mixed": the last step found inf/NaN gradients and was skipped (reading it
        waits for the device)."""
        return self.rules.step_was_skipped(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; nothing while accumulating, nothing under an engine that
        zeroes its own (DeepSpeed)."""
        if self.rules.sync_gradients:
            self.rules.zero_grad(self.optimizer, set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self._flushed().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


@contextlib.contextmanager
def _entered(ctxs: list) -> Any:
    """Several contexts entered as one (in order; left in reverse, on every path)."""
    with contextlib.ExitStack() as stack:
        for c in ctxs:
            stack.enter_context(c)
        yield


def step_scheduler(scheduler: Any, *args: Any, **kwargs: Any) -> bool:
    """``scheduler.step(*args, **kwargs)``, except past the end of a schedule with a fixed
    length (``total_steps``: ``OneCycleLR``, which raises there; a last partial
    accumulation window can ask for it): return whether it stepped."""
    total = getattr(scheduler, "total_steps", None)
    if total is not None and scheduler._step_count > total:
        return False
    scheduler.step(*args, **kwargs)
    return True
