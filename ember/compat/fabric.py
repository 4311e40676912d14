"""``Fabric``: ember's Accelerator under Lightning Fabric's names, so a Fabric training
loop runs after renaming its import (``from lightning.fabric import Fabric`` becomes
``from ember import Fabric``). It only translates the vocabulary: everything runs on
:class:`ember.Accelerator`'s public verbs. What differs from Lightning Fabric:
docs/porting.md, "Lightning Fabric".
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ember.errors import CheckpointError, MisconfigurationError

__all__ = ["Fabric", "FabricModule"]

#: Lightning Fabric precision inputs -> ember precision names
_PRECISION = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true", "half": "16-true"}
#: Lightning strategy names that start processes in a way ember does not (ember re-runs the script)
_SPAWNING = ("ddp_spawn", "ddp_fork", "ddp_notebook", "dp", "xla", "xla_fsdp")
_FABRIC_META = "fabric"


def _precision(precision: Any) -> str | None:
    if precision is None:
        return None
    key = str(precision).lower()
    if key.startswith("transformer-engine"):
        raise MisconfigurationError(f"Fabric(precision={precision!r}): Transformer Engine precisions are not "
                                    "supported; use '16-mixed' or 'bf16-mixed'")
    return _PRECISION.get(key, key)


def _strategy(strategy: Any) -> Any:
    if not isinstance(strategy, str):
        return strategy
    key = strategy.lower()
    if key in _SPAWNING:
        raise MisconfigurationError(
            f"Fabric(strategy={strategy!r}) is not supported: ember starts the other processes by re-running "
            "the script (or with `ember launch` / torchrun); use strategy='ddp'")
    if key == "ddp_find_unused_parameters_true":
        from ember.strategies import DDPStrategy
        return DDPStrategy(find_unused_parameters=True)
    return {"single_device": "single"}.get(key, key)


class FabricModule(nn.Module):
    """What :meth:`Fabric.setup` returns for a model: its ``forward`` runs the prepared
    module (moved, wrapped for DDP) under Lightning Fabric's precision rules: floating
    inputs cast to the precision's dtype, the forward autocast under ``"16-mixed"`` /
    ``"bf16-mixed"``, floating outputs cast back to the default dtype (float32). As in
    Lightning Fabric, ``training_step`` and the other ``*_step`` methods (and those given to
    :meth:`mark_forward_method`) called through the wrapper go through this ``forward`` when
    the module is wrapped (DDP); otherwise, and for any other method, the original module's
    method runs as it is (not autocast). ``state_dict``,
    ``load_state_dict`` and attribute reads go to the original module, so its keys carry
    no wrapper prefix on any number of processes. ``module`` is the original module."""

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, precision: Any = None) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module
        self._precision = precision   # None: the forward runs as it is (a strategy that casts by itself)
        #: methods called through the wrapper that go through ``forward`` (as Lightning Fabric's)
        self._forward_methods = set(_STEP_METHODS)
        self._fabric_ready = True

    @property
    def module(self) -> nn.Module:
        """The module as it was passed to ``setup`` (moved to the device)."""
        return self._original_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The prepared module's forward (DDP's gradient hooks) under the precision (see the class)."""
        prec = self._precision
        low = None if prec is None else (prec.autocast_dtype or (prec.param_dtype if prec.needs_input_cast else None))
        if low is None:
            return self._forward_module(*args, **kwargs)
        from ember.precision import _cast_floats
        args, kwargs = _cast_floats(args, low), _cast_floats(kwargs, low)
        with prec.forward_context():
            out = self._forward_module(*args, **kwargs)
        return _cast_floats(out, torch.get_default_dtype())

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The original module's state dict (no ``_forward_module.`` / ``module.`` prefixes)."""
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, **kwargs: Any) -> Any:
        """Load into the original module."""
        return self._original_module.load_state_dict(state_dict, strict=strict, **kwargs)

    def mark_forward_method(self, method: Any) -> None:
        """Route calls of ``method`` (a name or a bound method of the original module) made
        through this wrapper through :meth:`forward` (the strategy's wrapper, the precision),
        as Lightning Fabric's ``mark_forward_method``; ``training_step``, ``validation_step``,
        ``test_step`` and ``predict_step`` are marked already."""
        name = method if isinstance(method, str) else getattr(method, "__name__", None)
        if name is None:
            raise TypeError(f"mark_forward_method: expected a method or a name, got {type(method).__name__}")
        if name == "forward":
            raise ValueError("mark_forward_method: forward itself cannot be marked")
        if not callable(getattr(self._original_module, name, None)):
            raise AttributeError(f"mark_forward_method({name!r}): {type(self._original_module).__name__} has no "
                                 f"method {name!r}")
        self._forward_methods.add(name)

    def _through_forward(self, name: str) -> Callable:
        """``name`` called as the forward of the wrapped module (DDP's hooks, the precision),
        as Lightning Fabric redirects a marked method when the module is wrapped."""
        original = self._original_module

        def call(*args: Any, **kwargs: Any) -> Any:
            own = original.__dict__.get("forward")

            def restore() -> None:
                if own is None:
                    original.__dict__.pop("forward", None)
                else:
                    original.__dict__["forward"] = own

            def redirected(*a: Any, **k: Any) -> Any:
                restore()   # the method may call the real forward itself
                return getattr(original, name)(*a, **k)
            original.__dict__["forward"] = redirected
            try:
                return self.forward(*args, **kwargs)
            finally:
                restore()
        return call

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        original = super().__getattr__("_original_module")
        if name in self.__dict__.get("_forward_methods", ()) and \
                super().__getattr__("_forward_module") is not original:   # wrapped (DDP, ...): through forward
            return self._through_forward(name)
        return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_fabric_ready") or name.startswith("_"):
            super().__setattr__(name, value)
            return
        original = self._original_module   # as Fabric: the original module's attributes are set there
        own, has = name in self.__dict__, hasattr(original, name)
        if own:
            super().__setattr__(name, value)
        if has or not own:
            setattr(original, name, value)


def _owner(key: str, modules: list[str]) -> str | None:
    """The module entry that weights key ``key`` (``<name>.<param>``) belongs to: the longest
    name it starts with, so ``model.ema.w`` is the ``model.ema`` entry's ``w``."""
    best = None
    for name in modules:
        if key.startswith(f"{name}.") and (best is None or len(name) > len(best)):
            best = name
    return best


def _prefixes(modules: list[str]) -> dict[str, str]:
    """The key prefix of each model entry in ``model.safetensors``: ``<name>.``, or, when
    one entry's name starts another's (``model`` and ``model.ema``: ``model.ema.w`` could be
    either's), ``[<i>]<name>.`` for all, which no two entries share."""
    clash = any(a != b and b.startswith(f"{a}.") for a in modules for b in modules)
    return {name: f"[{i}]{name}." if clash else f"{name}." for i, name in enumerate(modules)}


class _EmptyInit(torch.overrides.TorchFunctionMode):
    """While active, the ``torch.nn.init`` functions return their tensor untouched (Lightning
    Fabric's ``init_module(empty_init=True)``): no time spent, no random number drawn."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.enabled and getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def _user_key_path(err: Exception) -> Exception:
    """A write error that names the format's inner level (``state['fabric']...``) names the
    user's own key path (``state[...]``) instead."""
    inner = f"state[{_FABRIC_META!r}]"
    if isinstance(err, CheckpointError) and inner in str(err):
        return CheckpointError(str(err).replace(inner, "state"))
    return err


def _unwrap(obj: Any) -> Any:
    return obj._original_module if isinstance(obj, FabricModule) else obj


def _to_tensors(data: Any, device: torch.device) -> Any:
    """Numbers become tensors on ``device`` (as Fabric's collectives take them)."""
    if isinstance(data, torch.Tensor):
        return data
    if isinstance(data, (bool, int, float)):
        return torch.tensor(data, device=device)
    if isinstance(data, Mapping):
        return {k: _to_tensors(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_to_tensors(v, device) for v in data)
    return data


def _apply(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return {k: _apply(v, fn) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_apply(v, fn) for v in data)
    return data


class Fabric:
    """Lightning Fabric's API on ember (``from ember import Fabric``): the Accelerator under
    Fabric's vocabulary. A Fabric loop::

        fabric = Fabric(accelerator="cpu", devices=2)
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(loader)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": 100})

    Args:
        accelerator: ``"auto"``, ``"cpu"``, ``"gpu"``/``"cuda"`` or ``"mps"`` (as the Trainer's).
        strategy: ``"auto"``, ``"ddp"``, ``"fsdp"``, ``"deepspeed"``, ``"single_device"``,
            ``"ddp_find_unused_parameters_true"`` or an ember Strategy. The spawning strategies
            (``"ddp_spawn"``, ``"ddp_notebook"``, ...) are refused: ember starts the other
            processes by re-running the script, or under ``ember launch`` / torchrun.
        devices: processes (CPU) or GPUs: an int, ``"auto"``, or a list of GPU ids.
        num_nodes: machines (under ``ember launch --num_machines``).
        precision: ``None`` (``"32-true"``, or ``ember launch --mixed_precision``), ``"32-true"``,
            ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"``, ``"64-true"``, or
            Lightning's short forms (``32``, ``16``, ``"bf16"``, ``64``).
        plugins: not supported (a MisconfigurationError unless None).
        callbacks: objects whose methods :meth:`call` runs by name.
        loggers: ember loggers (``ember.loggers``) that :meth:`log` / :meth:`log_dict` write
            to, on global rank 0.

    Other ranks are started when the Fabric is built (a plain ``python script.py`` with
    ``devices=2`` re-runs the script, as the Trainer does); :meth:`launch` then runs the
    given function on every process.
    """

    def __init__(self, *, accelerator: str = "auto", strategy: Any = "auto", devices: Any = "auto",
                 num_nodes: int = 1, precision: Any = None, plugins: Any = None,
                 callbacks: Any = None, loggers: Any = None) -> None:
        from ember.accelerator import Accelerator
        from ember.strategies import resolve_accelerator
        if plugins is not None:
            raise MisconfigurationError("Fabric(plugins=...) is not supported: pass precision=, strategy= "
                                        "(an ember Strategy for its options) instead")
        if not isinstance(accelerator, str):   # an ember.fabric.accelerators.Accelerator (or Lightning-like) instance
            accelerator = getattr(accelerator, "name", accelerator)
        self._acc = Accelerator(strategy=_strategy(strategy), devices=resolve_accelerator(accelerator, devices),
                                num_nodes=num_nodes, precision=_precision(precision))
        self._callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else \
            ([] if callbacks is None else [callbacks])
        self._loggers = list(loggers) if isinstance(loggers, (list, tuple)) else ([] if loggers is None else [loggers])
        if self._loggers and self.is_global_zero:
            self._acc.trackers = self._loggers   # Accelerator.log writes to them (one transfer per call)
            import atexit
            atexit.register(self._finalize_loggers)
        self._launched = False

    # -- processes ----------------------------------------------------------------------
    device = property(lambda self: self._acc.device, doc="torch.device: this process's device")
    global_rank = property(lambda self: self._acc.process_index, doc="int: this process's rank over all machines")
    local_rank = property(lambda self: self._acc.local_process_index, doc="int: its rank on this machine")
    node_rank = property(lambda self: int(getattr(self._acc.strategy, "node_rank", 0)),
                         doc="int: this machine's rank")
    world_size = property(lambda self: self._acc.num_processes, doc="int: processes in the run")
    is_global_zero = property(lambda self: self._acc.is_main_process, doc="bool: global rank 0")
    strategy = property(lambda self: self._acc.strategy, doc="the ember Strategy that runs the loop")
    loggers = property(lambda self: list(self._loggers), doc="list: the loggers given as ``loggers=``")
    logger = property(lambda self: self._loggers[0] if self._loggers else None, doc="the first logger, or None")

    def launch(self, function: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        """Start the run. The processes already exist (started when the Fabric was built, or by
        ``ember launch``); with ``function``, call ``function(fabric, *args, **kwargs)`` here, on
        every process, and return its result (as Fabric's script launcher)."""
        self._launched = True
        if function is None:
            return None
        return function(self, *args, **kwargs)

    # -- setup --------------------------------------------------------------------------
    def setup(self, module: nn.Module, *optimizers: torch.optim.Optimizer, scheduler: Any = None,
              move_to_device: bool = True) -> Any:
        """Prepare ``module`` and its ``optimizers`` (``Accelerator.prepare``): returns
        ``(module, *optimizers)``, or the module alone; ``scheduler`` is returned last as
        given. The module comes back as a :class:`FabricModule`; optimizers step through
        the precision."""
        self._check_move(move_to_device)
        out = self._acc.prepare(module, *optimizers)
        out = out if isinstance(out, tuple) else (out,)
        result = (self._wrap(out[0], module), *out[1:])
        if scheduler is not None:
            result = (*result, scheduler)
        return result[0] if len(result) == 1 else result

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> FabricModule:
        """Prepare a model alone (set up its optimizers with :meth:`setup_optimizers`)."""
        self._check_move(move_to_device)
        return self._wrap(self._acc.prepare(module), module)

    def _wrap(self, prepared: nn.Module, module: nn.Module) -> FabricModule:
        """The FabricModule: Lightning Fabric's precision rules on its forward in place of the
        Accelerator's (which autocast the module's own forward, outputs in the low dtype)."""
        from ember.precision.forward import unwrap_forward
        unwrap_forward(module)
        strategy = self._acc.strategy
        precision = None if strategy.owns_optimizer_step else strategy.precision   # DeepSpeed casts by itself
        return FabricModule(prepared, module, precision)

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """Prepare optimizers alone: one comes back alone, several as a tuple."""
        return self._acc.prepare(*optimizers)

    def setup_dataloaders(self, *dataloaders: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """Shard the loaders over the processes (as Fabric's ``DistributedSampler``: a
        shuffled loader is shuffled with the ``seed_everything`` seed and the pass number,
        the same permutation; a loader's own sampler is sharded after it draws), move batches
        to the device, and advance the epoch at each pass (also a pass left before its end,
        unless ``set_epoch`` chose it). On one process a ``DataLoader(shuffle=True)`` draws
        its order from the global torch RNG at each pass, as the plain loader (and Lightning
        Fabric's) does. A loader reads no batch ahead of the loop. One loader comes back
        alone, several as a list."""
        if not use_distributed_sampler:
            raise MisconfigurationError("setup_dataloaders(use_distributed_sampler=False) is not supported: ember "
                                        "shards every prepared loader (give the loader a DistributedSampler of "
                                        "your own and leave the argument out)")
        self._check_move(move_to_device)
        seed = os.environ.get("EMBER_GLOBAL_SEED")
        if seed is not None:   # Fabric's sampler seed: the seed_everything seed (0 when none was set)
            self._acc.seed = int(seed)
        out = self._acc.prepare(*dataloaders)
        from ember.data.loader import DataLoaderShard
        for dl in out if isinstance(out, tuple) else (out,):
            if isinstance(dl, DataLoaderShard):
                dl.read_ahead = False   # as Lightning Fabric: never a batch past what the loop asked for
                if self.world_size > 1 and dl._draw_order:
                    # Lightning's DistributedSampler: (seed_everything seed, pass number), drawing no
                    # sampler seed from the global RNG (the loader's worker base seed only)
                    dl._draw_order = False
                    dl._draws -= 1
        return list(out) if isinstance(out, tuple) else out

    def init_module(self, empty_init: bool | None = None) -> ContextManager[None]:
        """Context in which to build the model (Lightning Fabric's): on this process's
        device, in the precision's dtype under a ``*-true`` precision. ``empty_init=True``:
        the ``torch.nn.init`` initialisers are skipped (the weights are uninitialised memory,
        to be loaded or initialised afterwards), so they draw no random numbers, as in
        Lightning Fabric; under the FSDP strategy the model is built on the meta device and
        materialised when set up. ``None``/``False``: initialised as usual."""
        stack = contextlib.ExitStack()
        strategy = self._acc.strategy
        if strategy.name in ("fsdp", "deepspeed"):
            if empty_init or strategy.name == "deepspeed":
                stack.enter_context(strategy.module_init_context())   # meta / ZeRO-3 init, materialised in setup
            else:
                ctx = getattr(strategy.precision, "module_init_context", None)
                stack.enter_context(ctx() if ctx is not None else contextlib.nullcontext())
            return stack
        stack.enter_context(torch.device(self.device))
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        ctx = getattr(strategy.precision, "module_init_context", None)
        if ctx is not None:
            stack.enter_context(ctx())
        return stack

    def init_tensor(self) -> ContextManager[None]:
        """Context in which new tensors are created on this process's device (and in the
        dtype of a ``*-true`` precision)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device(self.device))
        ctx = getattr(self._acc.strategy.precision, "module_init_context", None)
        if ctx is not None:
            stack.enter_context(ctx())
        return stack

    @staticmethod
    def _check_move(move_to_device: bool) -> None:
        if not move_to_device:
            raise MisconfigurationError("move_to_device=False is not supported: ember moves prepared models and "
                                        "batches to the process's device")

    # -- step ---------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, *args: Any, model: Any = None, **kwargs: Any) -> None:
        """``tensor.backward()`` through the strategy and precision (loss scaling under
        16-mixed). Extra arguments are ``Tensor.backward``'s."""
        for name, value in zip(("gradient", "retain_graph", "create_graph", "inputs"), args):
            kwargs[name] = value
        self._acc.backward(tensor, **kwargs)

    def clip_gradients(self, module: nn.Module, optimizer: Any, clip_val: float | None = None,
                       max_norm: float | None = None, norm_type: float = 2.0,
                       error_if_nonfinite: bool = True) -> torch.Tensor | None:
        """Clip the gradients of ``module``'s parameters (unscaled first under 16-mixed): by
        value with ``clip_val``, or to a total norm with ``max_norm`` (returns the norm before
        clipping). ``error_if_nonfinite``: a NaN/inf norm raises, as ``clip_grad_norm_``
        does (not under loss scaling, where such a step is skipped instead)."""
        if clip_val is not None and max_norm is not None:
            raise ValueError("Only one of `clip_val` or `max_norm` can be set as this specifies the underlying "
                             "clipping algorithm!")
        if clip_val is None and max_norm is None:
            raise ValueError("You have to specify either `clip_val` or `max_norm` to do gradient clipping!")
        params = list(_unwrap(module).parameters())
        if clip_val is not None:
            self._acc.clip_grad_value_(params, clip_val)
            return None
        norm = self._acc.clip_grad_norm_(params, max_norm, norm_type)
        if error_if_nonfinite and norm is not None and self._acc.strategy.precision.scaler is None \
                and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return norm

    def no_backward_sync(self, module: Any, enabled: bool = True) -> ContextManager[None]:
        """Context that skips the gradient all-reduce of ``module`` (gradient accumulation);
        ``enabled=False``, or one process: does nothing."""
        target = module._forward_module if isinstance(module, FabricModule) else module
        return self._acc.step_rules.no_sync(target, enabled=enabled)

    def autocast(self) -> ContextManager[None]:
        """The precision's autocast, for code outside a set-up module's forward."""
        return self._acc.autocast()

    def to_device(self, obj: Any) -> Any:
        """``obj`` (a module, tensor, or a collection of tensors) on this process's device."""
        if isinstance(obj, nn.Module):
            return obj.to(self.device)
        from ember.strategies.base import move_to_device
        return move_to_device(obj, self.device)

    # -- collectives --------------------------------------------------------------------
    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every process's ``data`` (tensors, numbers, or collections of them), stacked in a
        new first dimension of size ``world_size``; on one process ``data`` comes back as
        tensors, without that dimension (as Fabric). ``sync_grads``: gradients flow back."""
        self._no_group(group)
        data = _to_tensors(data, self.device)
        if self.world_size == 1:
            return data
        if sync_grads:
            from torch.distributed.nn.functional import all_gather
            return _apply(data, lambda t: torch.stack(all_gather(t)))
        return _apply(data, lambda t: self._acc.gather(t.unsqueeze(0)))

    def all_reduce(self, data: Any, group: Any = None, reduce_op: str | None = "mean") -> Any:
        """Reduce ``data`` over the processes: ``"mean"`` (default, as Fabric), ``"sum"``,
        ``"max"``, ``"min"``. Numbers become tensors."""
        self._no_group(group)
        op = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
        op = {"avg": "mean"}.get(op, op)
        if op not in ("mean", "sum", "max", "min"):
            raise MisconfigurationError(f"all_reduce(reduce_op={reduce_op!r}): use 'mean', 'sum', 'max' or 'min'")
        data = _to_tensors(data, self.device)
        if self.world_size == 1:
            return data
        return self._acc.reduce(data, op)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process arrives."""
        self._acc.wait_for_everyone()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Process ``src``'s ``obj`` (a tensor of the same shape everywhere, or any picklable object)."""
        return self._acc.broadcast(obj, from_process=src)

    def rank_zero_first(self, local: bool = False) -> ContextManager[None]:
        """Context: rank 0 (of each machine with ``local=True``) runs the body first (a
        download), the others after it finished."""
        return self._acc.local_main_process_first() if local else self._acc.main_process_first()

    @staticmethod
    def _no_group(group: Any) -> None:
        if group is not None:
            raise MisconfigurationError("group= is not supported: ember's collectives run over every process")

    # -- output -------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on each machine's local rank 0 (as Fabric)."""
        self._acc.print(*args, **kwargs)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one scalar to the loggers (global rank 0); see :meth:`log_dict`."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log scalars (numbers or 0-d tensors, fetched in one transfer) to every logger on
        global rank 0, at ``step`` (default: the number of earlier calls)."""
        self._acc.log(dict(metrics), step=step)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call method ``hook_name`` of every callback that has it, in order."""
        for cb in self._callbacks:
            method = getattr(cb, hook_name, None)
            if callable(method):
                method(*args, **kwargs)

    def _finalize_loggers(self) -> None:
        for lg in self._loggers:
            try:
                lg.finalize("success")
            except Exception:   # noqa: BLE001 - at exit: never hide the run's own outcome
                pass

    # -- checkpoints ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike, state: Mapping[str, Any],
             filter: Mapping[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Write ``state`` (names to models, optimizers, objects with ``state_dict()``, and
        plain values: numbers, strings, tensors, containers) as an ember checkpoint folder at
        ``path``, atomically: the models' weights in ``model.safetensors`` (each key prefixed by
        its name), the rest in ``trainer_state.pt`` (read back with ``weights_only=True``),
        ``meta.json`` last. ``filter``: ``{name: (key, value) -> keep?}`` per entry. Every
        process calls it; rank 0 writes. Like every ember save, it replaces only an ember
        checkpoint (a folder of other files, a file, a ``NAME.ember-tmp`` no ember save made are
        refused). Every process checks the target and ``state`` before anything is written,
        and a failed write on rank 0 is raised on every process, so a caught error leaves no
        process waiting."""
        from ember.checkpoint import io as cio
        from ember.checkpoint.trust import check_save_target, optimizer_names
        from ember.strategies.full_load import raise_rank0_error
        path = os.fspath(path)
        filter = dict(filter or {})
        per_module: dict[str, dict[str, torch.Tensor]] = {}
        rest: dict[str, Any] = {}
        modules: list[str] = []
        optimizers: dict[str, str] = {}
        for name, obj in state.items():
            if isinstance(obj, nn.Module):
                sd = self._acc.get_state_dict(obj._forward_module if isinstance(obj, FabricModule) else obj)
                keep = filter.get(name)
                per_module[name] = {k: v for k, v in sd.items() if keep is None or keep(k, v)}
                modules.append(name)
            elif callable(getattr(obj, "state_dict", None)):
                if isinstance(obj, torch.optim.Optimizer) and self._acc.strategy.name in ("fsdp", "deepspeed"):
                    raise MisconfigurationError(f"Fabric.save: the {self._acc.strategy.name} strategy shards "
                                                f"optimizer {name!r}; save it with accelerator.save_state instead")
                if isinstance(obj, torch.optim.Optimizer) or isinstance(getattr(obj, "optimizer", None),
                                                                        torch.optim.Optimizer):
                    optimizers[name] = optimizer_names([obj])[0]   # load refuses another class
                sd = obj.state_dict()
                keep = filter.get(name)
                rest[name] = {k: v for k, v in sd.items() if keep(k, v)} if keep is not None and isinstance(sd, dict) \
                    else sd
            else:
                rest[name] = obj
        prefixes = _prefixes(modules)
        weights = {prefixes[name] + k: v for name in modules for k, v in per_module[name].items()}
        # every process, before the write: one outcome for all (no process left in a collective)
        error = None
        try:
            check_save_target(path, "Fabric.save")
            rest = cio.savable(rest, "Fabric.save: state")
        except Exception as err:   # any error (an OSError reading the target...): agreed below
            error = err
        strategy = self._acc.strategy
        mine = None if error is None else str(error) if isinstance(error, CheckpointError) else \
            f"Fabric.save({path!r}) failed on rank {self.global_rank}: {type(error).__name__}: {error}"
        verdicts = strategy.all_gather_object(mine) if self.world_size > 1 else [mine]
        if error is not None:
            raise error
        failed = next((v for v in verdicts if v is not None), None)
        if failed is not None:
            raise CheckpointError(failed)
        if self.is_global_zero:
            meta = {_FABRIC_META: {"modules": modules, "entries": list(state), "prefixes": prefixes,
                                   "optimizers": optimizers},
                    "strategy": strategy.name, "world_size": self.world_size, "precision": self._acc.precision}
            try:
                cio.write_checkpoint(path, weights, {_FABRIC_META: rest}, meta, what="Fabric.save")
            except Exception as err:   # reported to every rank below, raised here as it is
                error = _user_key_path(err)
        raise_rank0_error(strategy, error, f"Fabric.save({path!r}) failed on rank 0")   # no closing barrier

    def load(self, path: str | os.PathLike, state: dict[str, Any] | None = None, strict: bool = True) -> dict[str, Any]:
        """Read a checkpoint :meth:`save` wrote. With ``state``, restore its objects in place
        (models and optimizers load their state dicts; other entries of the dict are replaced
        by the saved values) and return what the checkpoint holds beyond them; without it,
        return everything (models as state dicts). ``strict``: a requested name missing from
        the checkpoint, or a model's missing/unexpected keys, is an error."""
        weights, saved, meta = self._read(path)
        entries = self._entries(weights, saved, meta)
        if state is None:
            return entries
        missing = [k for k in state if k not in entries]
        if missing and strict:
            raise KeyError(f"Fabric.load: {missing} requested in `state` but not in the checkpoint {os.fspath(path)} "
                           f"(it holds {sorted(entries)}); pass strict=False to skip them")
        self._check_fits(path, state, entries, meta, strict)   # before anything is loaded
        for name, obj in list(state.items()):
            if name not in entries:
                continue
            value = entries[name]
            if isinstance(obj, nn.Module):
                _unwrap(obj).load_state_dict(value, strict=strict)
            elif callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return {k: v for k, v in entries.items() if k not in state}

    def load_raw(self, path: str | os.PathLike, obj: Any, strict: bool = True) -> None:
        """Load a bare state dict into ``obj`` (a model or an optimizer): a ``.safetensors``
        file, an ember checkpoint with one model, or a ``torch.save`` file that
        ``torch.load(weights_only=True)`` reads."""
        from ember.checkpoint import io as cio
        path = os.fspath(path)
        if os.path.isdir(path) or path.endswith(".safetensors"):
            weights, saved, meta = self._read(path)
            entries = self._entries(weights, saved, meta)
            models = meta.get(_FABRIC_META, {}).get("modules", [])
            if len(models) == 1:
                sd = entries[models[0]]
            elif not models and weights is not None:
                sd = weights
            else:
                raise CheckpointError(f"Fabric.load_raw: {path} holds {len(models)} models ({models}); use "
                                      "Fabric.load(path, {name: model}) to pick one")
        else:
            sd = cio.load_torch(path)
        self._check_fits(path, {"": obj}, {"": sd}, {}, strict)
        if isinstance(obj, nn.Module):
            _unwrap(obj).load_state_dict(sd, strict=strict)
        else:
            obj.load_state_dict(sd)

    @staticmethod
    def _check_fits(path, state: dict[str, Any], entries: dict[str, Any], meta: dict, strict: bool) -> None:
        """The Trainer's and the Accelerator's checks, per entry: a model's weights fit it
        (keys when ``strict``, shapes and dtype kinds always: int32 weights are not loaded
        into a float model); an optimizer's state is one of the same class (recorded at
        save: Adam's state would set an AdamW's weight decay to 0) with the same groups and
        options (SGD refuses Adam's state here, not with a ``KeyError`` at its first step)."""
        from ember.checkpoint import io as cio
        from ember.checkpoint.trust import check_optimizers
        recorded = meta.get(_FABRIC_META, {}).get("optimizers") or {}
        for name, obj in state.items():
            if name not in entries:
                continue
            where = f"{os.fspath(path)} (entry {name!r})"
            value = entries[name]
            if isinstance(obj, nn.Module) and isinstance(value, Mapping) and \
                    all(isinstance(v, torch.Tensor) for v in value.values()):
                cio.check_compatible(_unwrap(obj), dict(value), where, strict=strict)
            elif isinstance(obj, torch.optim.Optimizer) or isinstance(getattr(obj, "optimizer", None),
                                                                      torch.optim.Optimizer):
                names = [recorded[name]] if isinstance(recorded, dict) and name in recorded else []
                check_optimizers([obj], [entries[name]], {"optimizers": names}, where,
                                 given=f"the state to load gives {name!r} as", instead=f"leave {name!r} out")

    @staticmethod
    def _read(path) -> tuple[dict | None, dict, dict]:
        from ember.checkpoint import io as cio
        weights, saved, meta = cio.read_checkpoint(path)
        return weights, (saved or {}).get(_FABRIC_META, {}), meta

    @staticmethod
    def _entries(weights: dict | None, saved: dict, meta: dict) -> dict[str, Any]:
        fm = meta.get(_FABRIC_META, {})
        out: dict[str, Any] = {}
        modules = list(fm.get("modules", []))
        prefixes = fm.get("prefixes") if isinstance(fm.get("prefixes"), dict) else None
        for name in fm.get("entries", list(saved)):
            if name in modules:
                if prefixes is not None:       # written with unambiguous prefixes
                    prefix = prefixes.get(name, f"{name}.")
                    out[name] = {k[len(prefix):]: v for k, v in (weights or {}).items() if k.startswith(prefix)}
                else:                          # an older save: the longest module name owns a key
                    out[name] = {k[len(name) + 1:]: v for k, v in (weights or {}).items()
                                 if k.startswith(f"{name}.") and _owner(k, modules) == name}
            elif name in saved:
                out[name] = saved[name]
        return out

    # -- misc -----------------------------------------------------------------------------
    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """``ember.seed_everything``: seed python, numpy and torch; returns the seed."""
        from ember.data.worker_seed import seed_everything
        return seed_everything(seed, workers=bool(workers))

    def __repr__(self) -> str:
        return (f"Fabric(strategy={self._acc.strategy.name!r}, world_size={self.world_size}, "
                f"global_rank={self.global_rank}, device={self.device}, precision={self._acc.precision!r})")
