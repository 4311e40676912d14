"""What :class:`ember.accelerator.Accelerator` hands back from ``prepare`` and the
state it keeps: the optimizer, scheduler and dataloader wrappers, the forward
wrapper for mixed precision, ``save_state`` / ``load_state`` in the checkpoint
format of ``docs/checkpoint_format.md``, ``save_model``, trackers, and the
debug-mode check of collectives.
"""
from __future__ import annotations

import os
import re
import shutil
import types
import warnings
from typing import Any

import torch

from ember import checkpoint_io as cio
from ember import data as edata
from ember.errors import CheckpointError, DistributedOperationError, MisconfigurationError, invalid_choice

_END = object()


# -- optimizer / scheduler ------------------------------------------------------------------
class AcceleratedOptimizer(torch.optim.Optimizer):
    """A prepared optimizer. ``step()`` goes through the strategy and precision (loss
    scaling: skipped on inf/NaN under 16-mixed) and, like ``zero_grad()``, does
    nothing on micro-batches where ``accelerator.sync_gradients`` is False.
    It is a ``torch.optim.Optimizer`` (schedulers can be built on it); its state lives
    in the wrapped :attr:`optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator):  # no Optimizer.__init__: state is inner
        self.optimizer, self._acc, self._strategy = optimizer, accelerator, accelerator.strategy

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v))

    def step(self, closure=None):
        if not self._acc.sync_gradients:
            return None
        return self._strategy.optimizer_step(self.optimizer, None, closure)

    @property
    def step_was_skipped(self) -> bool:
        """Under 16-mixed: the last step found inf/NaN gradients and was skipped."""
        return self._strategy.precision.step_skipped(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._acc.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


def is_scheduler(obj) -> bool:
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

    def __init__(self, scheduler, accelerator):
        self.scheduler, self._acc = scheduler, accelerator
        self._opts: list | None = None
        self._once = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def _optimizers(self) -> list:
        if not self._opts:
            target = getattr(self.scheduler, "optimizer", None)
            self._opts = [o for o in self._acc._optimizers if o is target or o.optimizer is target]
        return self._opts

    def step(self, *args, **kwargs) -> None:
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

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict) -> None:
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

    def __init__(self, loader, accelerator, original=None):
        self.base, self._acc, self._strategy = loader, accelerator, accelerator.strategy
        self.end_of_dataloader = False
        self._skip = self.batches_done = self.epoch = 0
        self._draws = global_rng_draws(original) if original is not None else 0
        self._restored = False

    def __len__(self) -> int:
        return len(self.base)

    @property
    def total_batch_size(self) -> int:
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
        s = edata.sampler_of(self.base)
        return {"epoch": self.epoch, "batches_done": self.batches_done,
                "sampler": s.state_dict() if isinstance(s, edata.ResumableSampler) else {}}

    def load_state_dict(self, state: dict) -> None:
        s = edata.sampler_of(self.base)
        if state.get("sampler") and isinstance(s, edata.ResumableSampler):
            s.load_state_dict(state["sampler"])
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        try:
            n = len(self.base)
        except TypeError:
            n = None
        if n is not None and done >= n:  # saved on the last batch: resume at the next epoch
            epoch, done = epoch + 1, 0
        self.epoch, self.batches_done, self._skip = epoch, done, done
        self._restored = done > 0

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.__dict__["base"], name)



def global_rng_draws(loader) -> int:
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


def wrap_forward(module: torch.nn.Module, precision) -> None:
    """Make ``module.forward`` run under the precision's autocast (outputs in float32)
    or cast floating inputs to the precision's dtype ("16-true" ...). Bound to the
    module, so ``copy.deepcopy`` rebinds it to the copy. No-op under 32-true."""
    autocast = precision.autocast_dtype is not None
    if not (autocast or precision.needs_input_cast) or module.__dict__.get("_ember_forward_wrapped"):
        return
    bound = module.forward
    func = bound.__func__ if isinstance(bound, types.MethodType) and bound.__self__ is module else None
    if autocast:
        low = precision.autocast_dtype

        def forward(self, *args, **kwargs):
            with precision.forward_context():
                out = func(self, *args, **kwargs) if func is not None else bound(*args, **kwargs)
            return _to_float32(out, low)
    else:
        def forward(self, *args, **kwargs):
            args, kwargs = precision.convert_input(args), precision.convert_input(kwargs)
            return func(self, *args, **kwargs) if func is not None else bound(*args, **kwargs)
    module.forward = types.MethodType(forward, module)
    module.__dict__["_ember_forward_wrapped"] = True


def unwrap_forward(module: torch.nn.Module) -> None:
    if module.__dict__.pop("_ember_forward_wrapped", False):
        module.__dict__.pop("forward", None)


# -- split_between_processes ---------------------------------------------------------------------
def split_inputs(inputs, num_processes: int, rank: int, apply_padding: bool):
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


def check_collective(strategy, op: str, data: Any, free_dim: int | None = None) -> None:
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


# -- save_model / save_state / load_state ----------------------------------------------------------
_AUTO_RE = re.compile(r"^checkpoint_(\d+)$")


def _auto_dir(acc, new: bool) -> str:
    root = os.path.join(acc.project_dir, "checkpoints")
    if new:
        return next_auto_dir(acc)
    newest = _newest_auto(root)
    if newest < 0:
        raise CheckpointError(f"load_state(): no checkpoint_N directories under {root}; pass the directory")
    acc.save_iteration = newest + 1
    return os.path.join(root, f"checkpoint_{newest}")


def save_model(acc, model, save_directory, max_shard_size, safe_serialization: bool) -> list:
    if not safe_serialization:
        raise MisconfigurationError("save_model(safe_serialization=False) is not supported: ember writes "
                                    "safetensors only")
    cio.parse_size(max_shard_size)
    weights = acc.strategy.module_state_dict(model)   # every process (sharded strategies gather)
    files: list = []
    if acc.is_main_process:
        files = cio.save_model_sharded(weights, save_directory, max_shard_size)
    acc.strategy.barrier("save_model")
    return files


def _guarded_by_main_process_check() -> bool:
    """True when the user's call to ``save_state`` sits right under an ``if`` on
    ``is_main_process`` / ``is_local_main_process`` (the usual Accelerate pattern)."""
    import inspect
    import linecache
    frame = inspect.currentframe()
    try:
        f = frame.f_back.f_back.f_back   # _guarded.. <- save_state (here) <- Accelerator.save_state <- user
        if f is None:
            return False
        fn, line = f.f_code.co_filename, f.f_lineno
    finally:
        del frame
    text = linecache.getline(fn, line)
    indent = len(text) - len(text.lstrip())
    for n in range(line - 1, max(0, line - 60), -1):   # the enclosing blocks, innermost first
        above = linecache.getline(fn, n)
        if not above.strip() or above.lstrip().startswith("#"):
            continue
        ind = len(above) - len(above.lstrip())
        if ind >= indent:
            continue
        indent, head = ind, above.strip()
        if head.startswith(("if ", "elif ")):
            return "not " not in head and ("is_main_process" in head or "is_local_main_process" in head
                                           or "process_index == 0" in head)
        if not head.startswith(("try:", "with ", "else:", "for ", "while ")):
            return False
    return False


def _wait_for_all_ranks(acc, what: str) -> None:
    """Sharded strategies: every rank must call ``what``. Each rank counts itself in
    the rendezvous store (no collective) and waits, at most the strategy's collective
    timeout, for the others; a rank left alone raises instead of hanging in a gather."""
    import time
    from torch.distributed import distributed_c10d as c10d
    world = acc.strategy.world_size
    acc._arrivals[what] = n = acc._arrivals.get(what, 0) + 1
    if world == 1 or not c10d.is_initialized():
        return
    store, key = c10d._get_default_store(), f"ember/accelerator/{what}/{n}"
    limit = getattr(acc.strategy, "timeout", None)
    limit = limit.total_seconds() if limit is not None else 1800.0
    store.add(key, 1)
    deadline = time.monotonic() + limit
    while (got := int(store.add(key, 0))) < world:
        if time.monotonic() > deadline:
            raise MisconfigurationError(
                f"{what}() under the {acc.strategy.name} strategy must be called on every process (the state is "
                f"sharded: every rank writes its part); {got} of {world} called it within {limit:.0f} s. Call "
                f"accelerator.{what}(...) outside 'if accelerator.is_main_process:'")
        time.sleep(0.01)


def _main_only_error(acc, what: str) -> MisconfigurationError:
    return MisconfigurationError(
        f"{what}() under the {acc.strategy.name} strategy must be called on every process: its state is "
        f"sharded, each rank writes its part. Call accelerator.{what}(...) outside "
        f"'if accelerator.is_main_process:' (every rank calls it; the files are written correctly)")


def rng_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rng_state_{rank}.pt")


def save_state(acc, output_dir) -> str:
    """Non-sharded strategies (single, DDP) enter no collective: the main process writes
    the checkpoint atomically, so ``if accelerator.is_main_process: save_state()`` works.
    When the other ranks call it too, each adds its own RNG state (``rng_state_<rank>.pt``)
    once the main process's checkpoint is in place. Sharded strategies (FSDP, DeepSpeed)
    need every rank: a main-process-only call raises instead of hanging."""
    strategy = acc.strategy
    sharded = strategy.is_sharded or strategy.owns_optimizer_step
    if sharded and strategy.world_size > 1:
        if _guarded_by_main_process_check():
            raise _main_only_error(acc, "save_state")
        _wait_for_all_ranks(acc, "save_state")
    if output_dir is None:
        output_dir = next_auto_dir(acc)
    path = os.path.normpath(os.fspath(output_dir))
    models = acc._models
    raw_opts = [o.optimizer for o in acc._optimizers]
    state = {
        "schedulers": [s.scheduler.state_dict() for s in acc._schedulers],
        "precision": strategy.precision.state_dict(),
        "dataloaders": [dl.state_dict() for dl in acc._dataloaders],
        "custom_objects": [o.state_dict() for o in acc._custom_objects],
        "rng": strategy.all_gather_object(cio.collect_rng_states()) if sharded else [cio.collect_rng_states()],
        "accelerator": {"step": acc._step, "num_models": len(models), "model_files": {},
                        "gradient_accumulation_steps": acc.gradient_accumulation_steps},
    }
    meta = {"kind": "accelerator", "strategy": strategy.name, "world_size": strategy.world_size,
            "precision": strategy.precision.name, "num_models": len(models)}
    if sharded:   # FSDP, DeepSpeed: the strategy writes
        if len(models) != 1:
            raise MisconfigurationError(f"save_state() under the {strategy.name} strategy needs exactly one "
                                        f"prepared model; {len(models)} are prepared")
        strategy.save_checkpoint(path, models[0], raw_opts, state, meta)
        return path
    meta["state_token"] = _state_token(acc, state)
    if not strategy.is_global_zero:   # no collective: add this rank's RNG once the main process committed
        _write_rank_rng(acc, path, meta["state_token"])
        return path
    weights = [strategy.module_state_dict(m) for m in models]
    opt_states = [strategy.optimizer_state_dict(o, models[0] if models else None) for o in raw_opts]
    tmp = cio.tmp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for i, w in enumerate(weights[1:], 1):  # model 0 is model.safetensors, as in Trainer checkpoints
            name = f"model_{i}.safetensors"
            cio.save_safetensors(w, os.path.join(tmp, name))
            state["accelerator"]["model_files"][name] = os.path.getsize(os.path.join(tmp, name))
        state["optimizers"] = opt_states
        cio.write_checkpoint(path, weights[0] if weights else {}, state, meta, keep_existing_tmp=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _state_token(acc, state: dict) -> str:
    """What every DDP rank holds alike at a save (weights, optimizer steps, data
    position), condensed: the main process records it in ``meta.json``; another rank
    knows the main process committed *this* save when the token matches."""
    import hashlib
    sums = [p.detach().double().sum() for m in acc._models for p in m.parameters()]
    h = hashlib.sha1(repr((state["dataloaders"], state["accelerator"]["step"],
                           [o.optimizer.state_dict()["param_groups"] for o in acc._optimizers])).encode())
    if sums:
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return h.hexdigest()


def _write_rank_rng(acc, path: str, token: str) -> None:
    """Wait (polling the file system, at most the strategy's timeout) until the main
    process committed this save (its ``meta.json`` holds the same state token), then
    write this rank's RNG state next to it, atomically."""
    import json
    import time
    limit = getattr(acc.strategy, "timeout", None)
    limit = limit.total_seconds() if limit is not None else 1800.0
    deadline = time.monotonic() + limit
    meta_file = os.path.join(path, cio.META_NAME)
    states = cio.collect_rng_states()
    while True:
        try:
            with open(meta_file) as f:
                if json.load(f).get("state_token") == token:
                    break
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            warnings.warn(f"save_state(): the main process did not write {path} within {limit:.0f} s; "
                          f"rank {acc.process_index}'s RNG state is not saved (load_state gives this rank the "
                          "main process's RNG state). Call save_state on every process or on the main one "
                          "only, the same way each time", UserWarning, stacklevel=4)
            return
        time.sleep(0.02)
    target = rng_file(path, acc.process_index)
    cio.save_torch(states, target + ".tmp")
    os.replace(target + ".tmp", target)


def next_auto_dir(acc) -> str:
    """``project_dir/checkpoints/checkpoint_<save_iteration>`` (Accelerate's automatic
    naming); :attr:`Accelerator.save_iteration` then advances. No collective: every rank
    counts its own calls. With ``ProjectConfiguration(total_limit=N)`` the main process
    removes the oldest automatic checkpoints beyond N."""
    root = os.path.join(acc.project_dir, "checkpoints")
    if acc.save_iteration is None:
        acc.save_iteration = _newest_auto(root) + 1
    path = os.path.join(root, f"checkpoint_{acc.save_iteration}")
    acc.save_iteration += 1
    limit = getattr(acc.project_configuration, "total_limit", None)
    if limit is not None and acc.is_main_process and os.path.isdir(root):
        nums = sorted(int(m.group(1)) for n in os.listdir(root) if (m := _AUTO_RE.match(n)))
        for n in nums[: max(0, len(nums) + 1 - int(limit))]:
            shutil.rmtree(os.path.join(root, f"checkpoint_{n}"), ignore_errors=True)
    return path


def _newest_auto(root: str) -> int:
    nums = sorted(int(m.group(1)) for n in (os.listdir(root) if os.path.isdir(root) else [])
                  if (m := _AUTO_RE.match(n)) and cio.is_checkpoint(os.path.join(root, n)))
    return nums[-1] if nums else -1


def _count(what: str, saved: int, have: int, path: str) -> None:
    if saved != have:
        raise CheckpointError(f"checkpoint {path} holds {saved} {what}, but {have} are prepared/registered "
                              f"now: prepare the same objects, in the same order, before load_state()")


def _load_extra_model(strategy, model, path: str, name: str, size, strict: bool) -> None:
    fp = os.path.join(path, name)
    if not os.path.isfile(fp):
        raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    if size is not None and os.path.getsize(fp) != size:
        raise CheckpointError(f"{fp} is truncated or corrupt: it has {os.path.getsize(fp)} bytes, "
                              f"the checkpoint recorded {size}")
    weights = cio.load_safetensors(fp)
    cio.check_compatible(strategy.unwrap_module(model), weights, fp, strict=strict)
    strategy.load_module_state_dict(model, weights, strict=strict)


def load_state(acc, input_dir, strict: bool = True) -> dict:
    strategy = acc.strategy
    path = os.fspath(input_dir) if input_dir is not None else _auto_dir(acc, new=False)
    models = acc._models
    raw_opts = [o.optimizer for o in acc._optimizers]
    if strategy.is_sharded or strategy.owns_optimizer_step:   # FSDP, DeepSpeed: the strategy writes
        if len(models) != 1:
            raise MisconfigurationError(f"load_state() under the {strategy.name} strategy needs exactly one "
                                        f"prepared model; {len(models)} are prepared")
        state = strategy.load_checkpoint(path, models[0], raw_opts, strict=strict)
        meta = state.pop("meta", {})
        info = state.get("accelerator") or {}
    else:
        weights, state, meta = cio.read_checkpoint(path)
        if state is None:
            raise CheckpointError(f"{path} holds weights only (no {cio.STATE_NAME}); load them with "
                                  "ember.checkpoint_io.read_checkpoint / load_model_sharded instead")
        info = state.get("accelerator")
        if info is None:
            raise CheckpointError(f"{path} was not written by Accelerator.save_state() (a Trainer checkpoint?); "
                                  "resume it with Trainer.fit(ckpt_path=...)")
        _count("models", int(info.get("num_models", 0)), len(models), path)
        _count("optimizers", len(state.get("optimizers", [])), len(raw_opts), path)
        if models:
            if weights is None:
                raise CheckpointError(f"{path} holds sharded (DCP) weights; load it with the strategy that wrote "
                                      f"it ({meta.get('strategy')})")
            cio.check_compatible(strategy.unwrap_module(models[0]), weights, path, strict=strict)
            strategy.load_module_state_dict(models[0], weights, strict=strict)
        files = info.get("model_files") or {}
        for i, m in enumerate(models[1:], 1):
            name = f"model_{i}.safetensors"
            _load_extra_model(strategy, m, path, name, files.get(name), strict)
        for o, s in zip(raw_opts, state.get("optimizers", [])):
            strategy.load_optimizer_state_dict(o, s, models[0] if models else None)
    _count("schedulers", len(state.get("schedulers", [])), len(acc._schedulers), path)
    _count("dataloaders", len(state.get("dataloaders", [])), len(acc._dataloaders), path)
    _count("registered objects", len(state.get("custom_objects", [])), len(acc._custom_objects), path)
    saved_world = int(meta.get("world_size", strategy.world_size) or strategy.world_size)
    if saved_world != strategy.world_size and acc._dataloaders:
        warnings.warn(f"load_state(): {path} was saved by {saved_world} process(es) and is loaded by "
                      f"{strategy.world_size}; the dataloaders restart their epoch from the start",
                      UserWarning, stacklevel=3)
    for s, sd in zip(acc._schedulers, state.get("schedulers", [])):
        s.scheduler.load_state_dict(sd)
    strategy.precision.load_state_dict(state.get("precision") or {})
    for dl, sd in zip(acc._dataloaders, state.get("dataloaders", [])):
        if saved_world != strategy.world_size:
            sd = dict(sd, batches_done=0)
        dl.load_state_dict(sd)
    for o, sd in zip(acc._custom_objects, state.get("custom_objects", [])):
        o.load_state_dict(sd)
    rng = state.get("rng") or []
    own = rng_file(path, strategy.global_rank)
    if os.path.isfile(own) and not (strategy.is_sharded or strategy.owns_optimizer_step):
        cio.restore_rng_states(cio.load_torch(own))
    elif rng:
        cio.restore_rng_states(rng[strategy.global_rank % len(rng)])
    acc._step = int(info.get("step", 0))
    return meta


# -- trackers ------------------------------------------------------------------------------------
def tracker_name(spec) -> str:
    if isinstance(spec, str):
        return spec.strip().lower()
    from ember.loggers import CSVLogger, TensorBoardLogger, WandbLogger
    for cls, name in ((TensorBoardLogger, "tensorboard"), (CSVLogger, "csv"), (WandbLogger, "wandb")):
        if isinstance(spec, cls):
            return name
    name = getattr(spec, "tracker_name", None) or type(spec).__name__.lower()
    return name[:-6] if name.endswith("logger") and len(name) > 6 else name


def check_log_with(log_with) -> list:
    from ember.loggers import LOGGER_CHOICES, Logger
    specs = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    out = []
    for s in specs:
        key = s.strip().lower() if isinstance(s, str) else None
        if not isinstance(s, Logger) and key not in LOGGER_CHOICES + ("all",):
            raise invalid_choice("log_with", s, list(LOGGER_CHOICES) + ["all", "a Logger", "a list of these"])
        out += ["tensorboard", "csv"] if key == "all" else [key or s]
    return out


def init_trackers(acc, project_name: str, config, init_kwargs) -> None:
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


def get_tracker(acc, name: str, unwrap: bool):
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
