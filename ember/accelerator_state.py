"""What :class:`ember.accelerator.Accelerator` hands back from ``prepare`` and the
state it keeps: the optimizer, scheduler and dataloader wrappers, the forward
wrapper for mixed precision, trackers, and the debug-mode check of collectives.
Checkpoints (``save_state`` / ``load_state`` / ``save_model``) live in
:mod:`ember.accelerator_checkpoint`.
"""
from __future__ import annotations

import functools
import itertools
import os
import types
from typing import Any, Callable

import torch

from ember import data as edata
from ember.errors import DistributedOperationError, MisconfigurationError, invalid_choice

_END = object()


# -- the accumulation rule (Trainer and Accelerator) -----------------------------------------
def accumulation_window(index: int, total: int | None, steps: int) -> tuple[bool, int]:
    """The accumulation rule of the Trainer and the Accelerator (docs/accelerator.md,
    "The optimizer step"): for micro-batch ``index`` (0-based, counted from the start
    of the epoch) of ``total`` (None: unknown length), return whether the optimizer
    steps after it and the size of its window. Windows hold ``steps`` micro-batches;
    the last window of an epoch of known length may be shorter and its losses are
    divided by its own size, so every step equals one big batch of its samples."""
    if total is not None:
        last = total - total % steps   # where a short last window starts
        if index >= last:
            return index + 1 == total, total - last
    return (index + 1) % steps == 0, steps


# -- optimizer / scheduler ------------------------------------------------------------------
class AcceleratedOptimizer(torch.optim.Optimizer):
    """A prepared optimizer. ``step()`` goes through the strategy and precision (loss
    scaling: skipped on inf/NaN under 16-mixed) and, like ``zero_grad()``, does
    nothing on micro-batches where ``accelerator.sync_gradients`` is False.
    It is a ``torch.optim.Optimizer`` (schedulers can be built on it); its state lives
    in the wrapped :attr:`optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: Any) -> None:  # state is the inner one's
        self.optimizer, self._acc, self._strategy = optimizer, accelerator, accelerator.strategy

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v), doc="the wrapped optimizer's")
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v),
                     doc="the wrapped optimizer's")
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v),
                        doc="the wrapped optimizer's")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step through the strategy and precision; nothing while accumulating."""
        acc = self._acc
        if not acc.sync_gradients:
            return None
        if acc._plain_step:   # the strategy's step is the precision's (one call less per step)
            return self._strategy.precision.optimizer_step(self.optimizer, closure)
        return self._strategy.optimizer_step(self.optimizer, None, closure)

    @property
    def step_was_skipped(self) -> bool:
        """Under 16-mixed: the last step found inf/NaN gradients and was skipped."""
        return self._strategy.precision.step_skipped(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; nothing while accumulating."""
        if self._acc.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is an LR scheduler (torch's, or one with ``step``, ``optimizer``, ``state_dict``)."""
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return True
    return (callable(getattr(obj, "step", None)) and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")
            and not isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)))


class AcceleratedScheduler:
    """A prepared LR scheduler (Accelerate's rules, ``step_scheduler_with_optimizer=True``):
    it steps only when its optimizer stepped (not while accumulating, not after a
    16-mixed step skipped on inf), and ``num_processes`` times per step: each process
    sees ``1/num_processes`` of the batches, so a schedule written for the number of
    batches of one process keeps its length. ``ReduceLROnPlateau`` steps once."""

    def __init__(self, scheduler: Any, accelerator: Any) -> None:
        self.scheduler, self._acc = scheduler, accelerator
        self._opts: list | None = None
        self._once = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _optimizers(self) -> list:
        if not self._opts:
            target = getattr(self.scheduler, "optimizer", None)
            self._opts = [o for o in self._acc._optimizers if o is target or o.optimizer is target]
        return self._opts

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler by the rules above."""
        acc = self._acc
        sched = self.scheduler
        if not acc.step_scheduler_with_optimizer:
            sched.step(*args, **kwargs)
            return
        if not acc.sync_gradients:
            return
        for opt in self._optimizers():
            if opt.step_was_skipped:
                return
        n = 1 if self._once else acc.strategy.world_size
        total = getattr(sched, "total_steps", None)
        for _ in range(n):
            if total is not None and sched._step_count > total:
                break  # OneCycleLR raises past its end (a last partial window)
            sched.step(*args, **kwargs)

    def state_dict(self) -> dict:
        """The wrapped scheduler's state dict."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped scheduler."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"


# -- dataloader ------------------------------------------------------------------------------
class DataLoaderShard:
    """A prepared DataLoader: sharded over processes, resumable, moves batches to the
    device, and tells the accelerator when the last batch is out
    (:attr:`end_of_dataloader`). Each full pass is one epoch (:attr:`epoch` advances
    and reshuffles); :attr:`batches_done` counts the batches of the current pass."""

    def __init__(self, loader: Any, accelerator: Any, original: Any = None) -> None:
        self.base, self._acc, self._strategy = loader, accelerator, accelerator.strategy
        self.end_of_dataloader = False
        self._skip = self.batches_done = self.epoch = 0
        self._draws = global_rng_draws(original) if original is not None else 0
        self._restored = False

    def __len__(self) -> int:
        return len(self.base)

    @property
    def num_batches(self) -> int | None:
        """Batches per pass, or None when the loader has no length (IterableDataset)."""
        try:
            return len(self.base)
        except TypeError:
            return None

    @property
    def total_batch_size(self) -> int:
        """Samples per step over all processes (the loader's batch size times the processes)."""
        return (getattr(self.base, "batch_size", None) or 1) * self._strategy.world_size

    def set_epoch(self, epoch: int) -> None:
        """Use the data order of ``epoch`` for the next pass."""
        self.epoch = int(epoch)

    def skip(self, num_batches: int) -> None:
        """The next pass starts after ``num_batches`` batches (indices are skipped)."""
        self._skip = int(num_batches)

    def __iter__(self):
        acc, base = self._acc, self.base
        skip, self._skip = self._skip, 0
        if not self._restored:   # a pass resumed by load_state continues the saved RNG stream as is
            for _ in range(self._draws):   # what the user's DataLoader draws from the global RNG per pass
                torch.empty((), dtype=torch.int64).random_()
        self._restored = False
        edata.set_epoch(base, self.epoch)
        drop = skip if skip and not edata.skip_batches(base, skip) else 0  # iterable: read and drop
        self.batches_done = skip
        self.end_of_dataloader = False
        strategy = self._strategy
        to_device = strategy.batch_to_device if strategy.root_device.type != "cpu" else None
        prev = acc._active_loader
        acc._active_loader = self
        acc._finished_pass = None
        try:
            it = iter(base)
            for _ in range(drop):
                next(it, None)
            nxt = next(it, _END)
            while nxt is not _END:
                cur = nxt
                nxt = next(it, _END)
                if nxt is _END:
                    self.end_of_dataloader = True
                self.batches_done += 1
                yield cur if to_device is None else to_device(cur)
            self.epoch += 1
            self.batches_done = 0
            acc._finished_pass = self   # an epoch-end gather_for_metrics drops this pass's padding
        finally:
            acc._active_loader = prev

    def state_dict(self) -> dict:
        """Where the pass stands (epoch, batches done, the sampler's state), for a resume."""
        s = edata.sampler_of(self.base)
        out = {"epoch": self.epoch, "batches_done": self.batches_done,
               "sampler": s.state_dict() if isinstance(s, edata.ResumableSampler) else {}}
        out.update(edata.generator_checkpoint_state(self.base))   # a user sampler's own generator
        return out

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next pass skips the batches already done."""
        s = edata.sampler_of(self.base)
        if state.get("sampler") and isinstance(s, edata.ResumableSampler):
            s.load_state_dict(state["sampler"])
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        n = self.num_batches
        if n is not None and done >= n:  # saved on the last batch: resume at the next epoch
            epoch, done = epoch + 1, 0
        # written before generator_epoch was recorded: the epoch start's state mid-pass, else
        # the state the next pass starts from
        edata.restore_generator(self.base, state, legacy_epoch=epoch, where="load_state (dataloader state)")
        self.epoch, self.batches_done, self._skip = epoch, done, done
        self._restored = done > 0

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.__dict__["base"], name)



def global_rng_draws(loader: Any) -> int:
    """How many values a plain ``DataLoader`` takes from the global torch RNG per
    ``__iter__``: its workers' base seed (no ``generator``) and, for a
    ``RandomSampler`` without a generator, the sampler's seed. The prepared loader
    (whose order comes from (seed, epoch)) takes as many, so dropout and any later
    ``torch.rand`` in the loop see the raw loop's stream."""
    from torch.utils.data import RandomSampler
    n = int(getattr(loader, "generator", None) is None)
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        n += 1
    return n


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


# -- split_between_processes ---------------------------------------------------------------------
def split_inputs(inputs: Any, num_processes: int, rank: int, apply_padding: bool) -> Any:
    """Rank ``rank``'s contiguous part of ``inputs`` (list, tuple, dict of them, tensor)."""
    if isinstance(inputs, dict):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise MisconfigurationError(f"split_between_processes: every value of the dict must have the "
                                        f"same length; got {lengths}")
        return type(inputs)((k, split_inputs(v, num_processes, rank, apply_padding)) for k, v in inputs.items())
    if not (hasattr(inputs, "__len__") and hasattr(inputs, "__getitem__")):
        raise MisconfigurationError(f"split_between_processes: inputs must be a list, tuple, tensor or dict "
                                    f"of them; got {type(inputs).__name__}")
    if num_processes == 1:
        return inputs
    per, extra = divmod(len(inputs), num_processes)
    start = rank * per + min(rank, extra)
    part = inputs[start: start + per + (1 if rank < extra else 0)]
    target = per + (1 if extra else 0)
    if apply_padding and len(part) < target and len(inputs):
        k = target - len(part)
        if isinstance(inputs, torch.Tensor):
            last = part[-1:] if len(part) else inputs[-1:]
            part = torch.cat([part, last.expand((k,) + tuple(last.shape[1:]))])
        else:
            last = part[-1] if len(part) else inputs[-1]
            part = type(part)(list(part) + [last] * k) if isinstance(part, (list, tuple)) else part + [last] * k
    return part


# -- debug mode --------------------------------------------------------------------------------------
def _describe(data: Any, out: list) -> list:
    if isinstance(data, torch.Tensor):
        out.append((str(data.dtype).replace("torch.", ""), tuple(data.shape)))
    elif isinstance(data, dict):
        for v in data.values():
            _describe(v, out)
    elif isinstance(data, (list, tuple)):
        if data and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in data):
            out.append(("objects", None))
        else:
            for v in data:
                _describe(v, out)
    elif data is not None:
        out.append(("objects", None))
    return out


def _fmt(op: str, leaves: list) -> str:
    parts = [f"{d}[{', '.join(str(s) for s in shape)}]" if shape is not None else d for d, shape in leaves]
    return f"{op}({', '.join(parts)})"


def _compatible(a: list, b: list, free_dim: int | None) -> bool:
    if len(a) != len(b):
        return False
    for (da, sa), (db, sb) in zip(a, b):
        if da != db or (sa is None) != (sb is None):
            return False
        if sa is None:
            continue
        if len(sa) != len(sb):
            return False
        free = None if free_dim is None or not sa else free_dim % len(sa)
        if any(x != y for i, (x, y) in enumerate(zip(sa, sb)) if i != free):
            return False
    return True


def check_collective(strategy: Any, op: str, data: Any, free_dim: int | None = None) -> None:
    """Debug mode: every process sends the others the name of the collective it is
    about to run and its tensors' dtypes and shapes; raise
    :class:`DistributedOperationError` on every process if they do not fit."""
    mine = (op, _describe(data, []))
    every = strategy.all_gather_object(mine)
    ok = all(o == every[0][0] for o, _ in every) and all(_compatible(every[0][1], l, free_dim) for _, l in every)
    if ok:
        return
    if len({o for o, _ in every}) > 1:
        what, rule = "different operations", "Every process must call the same collectives in the same order."
    else:
        what = f"`{op}` with tensors that do not fit"
        rule = ("Every process must pass tensors of the same dtype and number of dimensions and the same "
                "shape" + (f" except in dimension {free_dim}." if free_dim is not None else "."))
    lines = [f"ember debug mode: the processes called {what}; running it would hang or fail:"]
    lines += [f"  rank {r}: {_fmt(o, l)}" for r, (o, l) in enumerate(every)]
    lines.append(rule)
    raise DistributedOperationError("\n".join(lines))


# -- trackers ------------------------------------------------------------------------------------
def tracker_name(spec: Any) -> str:
    """The name of a ``log_with`` entry (a string, or a Logger's name)."""
    if isinstance(spec, str):
        return spec.strip().lower()
    from ember.loggers import CSVLogger, TensorBoardLogger, WandbLogger
    for cls, name in ((TensorBoardLogger, "tensorboard"), (CSVLogger, "csv"), (WandbLogger, "wandb")):
        if isinstance(spec, cls):
            return name
    name = getattr(spec, "tracker_name", None) or type(spec).__name__.lower()
    return name[:-6] if name.endswith("logger") and len(name) > 6 else name


def check_log_with(log_with: Any) -> list:
    """``log_with`` as a list, each entry checked (at construction)."""
    from ember.loggers import LOGGER_CHOICES, Logger
    specs = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    out = []
    for s in specs:
        key = s.strip().lower() if isinstance(s, str) else None
        if not isinstance(s, Logger) and key not in LOGGER_CHOICES + ("all",):
            raise invalid_choice("log_with", s, list(LOGGER_CHOICES) + ["all", "a Logger", "a list of these"])
        out += ["tensorboard", "csv"] if key == "all" else [key or s]
    return out


def init_trackers(acc: Any, project_name: str, config: dict | None, init_kwargs: dict | None) -> None:
    """``Accelerator.init_trackers``."""
    from ember.loggers import build_logger
    from ember.loggers.base import next_version
    acc.trackers = []
    acc._log_step = 0
    if not acc.is_main_process:
        return
    init_kwargs = init_kwargs or {}
    version = None  # file loggers share one version_N folder
    for spec in acc.log_with:
        key = tracker_name(spec)
        kw = dict(init_kwargs.get(key, {}))
        if key in ("tensorboard", "csv") and isinstance(spec, str):
            if version is None:
                version = kw.get("version", next_version(os.path.join(acc.project_dir, project_name)))
            kw.setdefault("version", version)
        if key == "wandb" and isinstance(spec, str):   # kw may hold the run's own ``name``
            from ember.loggers import WandbLogger
            tracker = WandbLogger(project=kw.pop("project", project_name), save_dir=acc.project_dir, **kw)
        else:
            tracker = build_logger(spec, save_dir=acc.project_dir, name=project_name, **kw)
        if config is not None:
            tracker.log_hyperparams(config)
        acc.trackers.append(tracker)


class _NullTracker:
    """``get_tracker`` on non-main processes: every method does nothing."""
    name = "null"

    def __getattr__(self, name):
        return lambda *a, **k: None


def get_tracker(acc: Any, name: str, unwrap: bool) -> Any:
    """``Accelerator.get_tracker``."""
    if not acc.is_main_process:
        return _NullTracker()
    key = name.strip().lower()
    for tracker in acc.trackers:
        if tracker_name(tracker) == key:
            return tracker.experiment if unwrap else tracker
    have = [tracker_name(t) for t in acc.trackers]
    raise MisconfigurationError(f"get_tracker({name!r}): no such tracker; "
                                + (f"initialised: {have}" if have else
                                   "none is initialised (pass log_with= and call init_trackers() first)"))


# -- small helpers of the Accelerator's process verbs ---------------------------------------

def _only(acc, function, attr: str, index: int):
    if function is None:
        return functools.partial(_only, acc, attr=attr, index=index)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if getattr(acc, attr) == index else None
    return wrapper


class _MultiContext:
    __slots__ = ("ctxs",)

    def __init__(self, ctxs):
        self.ctxs = ctxs

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
        return False


class _InOrder:
    """``first`` processes run the body, then meet the others at a barrier; the others
    wait at that barrier before running it. On an exception in the body no barrier is
    entered (the process fails and the launcher ends the others)."""
    __slots__ = ("acc", "first")

    def __init__(self, acc, first: bool):
        self.acc, self.first = acc, first

    def __enter__(self):
        if not self.first:
            self.acc.wait_for_everyone()

    def __exit__(self, exc_type, exc, tb):
        if self.first and exc_type is None:
            self.acc.wait_for_everyone()
        return False


class _Yield:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


class _Islice:
    def __init__(self, iterable, n: int):
        self.iterable, self.n = iterable, n

    def __iter__(self):
        return itertools.islice(iter(self.iterable), self.n, None)

    def __len__(self):
        return max(0, len(self.iterable) - self.n)
