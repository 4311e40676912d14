"""The Accelerator: custom training loops on the same Strategy + Precision
machinery the Trainer uses (the Trainer prepares its module, optimizers and data
through the flat verbs ``setup_module`` / ``setup_optimizers`` /
``setup_dataloader`` below).

    acc = Accelerator(precision="bf16-mixed", gradient_accumulation_steps=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    for batch in loader:
        with acc.accumulate(model):
            loss = model(batch)
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from ember import data as edata
from ember.errors import MisconfigurationError
from ember.precision import Precision

_NULL = contextlib.nullcontext()


class Accelerator:
    def __init__(self, strategy="auto", devices="auto", precision=None, gradient_accumulation_steps: int = 1,
                 log_with=None, project_dir: str | None = None, seed: int | None = None, num_nodes: int = 1,
                 debug: bool | None = None, mixed_precision: str | None = None,
                 step_scheduler_with_optimizer: bool = True):
        from ember.strategies import build_strategy
        if mixed_precision is not None and precision is None:
            precision = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}.get(mixed_precision, mixed_precision)
        if precision is None:
            precision = os.environ.get("EMBER_PRECISION", "32-true")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise MisconfigurationError(f"gradient_accumulation_steps={gradient_accumulation_steps!r}: use an int >= 1")
        strat = build_strategy(strategy, devices, num_nodes)
        strat.precision = Precision.from_string(precision)
        self._init(strat)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.project_dir = project_dir or os.getcwd()
        self.log_with = log_with
        self.debug = bool(int(os.environ.get("EMBER_DEBUG", "0"))) if debug is None else debug
        if seed is not None:
            from ember import seed_everything
            seed_everything(seed)
        self.seed = seed if seed is not None else int(self.strategy.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item())))

    def _init(self, strategy) -> None:
        self.strategy = strategy
        strategy.setup_environment()
        self.gradient_accumulation_steps = 1
        self.sync_gradients = True
        self._step = 0
        self._models: list = []
        self._optimizers: list = []
        self._schedulers: list = []
        self._dataloaders: list = []
        self._custom_objects: list = []
        self._active_loader = None
        self.trackers: list = []

    @classmethod
    def _for_trainer(cls, strategy) -> "Accelerator":
        """The Trainer's accelerator: same strategy object, no trackers or seeding."""
        acc = cls.__new__(cls)
        acc._init(strategy)
        acc.debug = False
        return acc

    # -- topology -------------------------------------------------------------------
    device = property(lambda self: self.strategy.root_device)
    num_processes = property(lambda self: self.strategy.world_size)
    process_index = property(lambda self: self.strategy.global_rank)
    local_process_index = property(lambda self: self.strategy.local_rank)
    is_main_process = property(lambda self: self.strategy.is_global_zero)
    is_local_main_process = property(lambda self: self.strategy.is_local_zero)
    precision = property(lambda self: self.strategy.precision.name)

    # -- flat verbs (shared with the Trainer) --------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self.strategy.setup_module(module)

    def setup_optimizers(self, module: nn.Module, optimizers: list):
        return self.strategy.setup_optimizers(module, list(optimizers))

    def setup_dataloader(self, dataloader, *, seed: int | None = None, shuffle: bool | None = None):
        kw = self.strategy.distributed_sampler_kwargs() or {}
        return edata.prepare_dataloader(dataloader, seed=self.seed if seed is None else seed, shuffle=shuffle, **kw)

    # -- prepare -------------------------------------------------------------------------
    def prepare(self, *objs, device_placement=None):
        """Prepare modules, optimizers, dataloaders and schedulers (any order; returned in
        the same order)."""
        from torch.utils.data import DataLoader
        out = list(objs)
        mods = [i for i, o in enumerate(objs) if isinstance(o, nn.Module)]
        opts = [i for i, o in enumerate(objs) if isinstance(o, torch.optim.Optimizer)]
        for i in mods:
            out[i] = self.setup_module(objs[i])
        if opts:
            if len(mods) > 1 and self.strategy.owns_optimizer_step:
                raise MisconfigurationError("the deepspeed strategy prepares one model with its optimizer; "
                                            f"got {len(mods)} models")
            model = out[mods[0]] if mods else None
            new_model, new_opts = self.setup_optimizers(model, [objs[i] for i in opts])
            if mods:
                out[mods[0]] = new_model
            for j, i in enumerate(opts):
                out[i] = AcceleratedOptimizer(new_opts[j], self)
        for i, o in enumerate(objs):
            if isinstance(o, DataLoader):
                out[i] = DataLoaderShard(self.setup_dataloader(o), self)
            elif _is_scheduler(o):
                out[i] = AcceleratedScheduler(o, self)
        self._models += [out[i] for i in mods]
        self._optimizers += [out[i] for i in opts]
        self._schedulers += [o for o in out if isinstance(o, AcceleratedScheduler)]
        self._dataloaders += [o for o in out if isinstance(o, DataLoaderShard)]
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model):
        return self.prepare(model)

    # -- step -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        model = self._models[0] if self._models else None
        self.strategy.backward(loss, model, **kwargs)

    def accumulate(self, *models):
        """Context for one micro-batch: sets ``sync_gradients`` and skips the gradient
        all-reduce until the last micro-batch of the window (or of the dataloader)."""
        self._step += 1
        loader = self._active_loader
        end = loader is not None and loader.end_of_dataloader
        self.sync_gradients = end or self._step % self.gradient_accumulation_steps == 0
        if end:
            self._step = 0
        if self.sync_gradients or self.strategy.world_size == 1:
            return _NULL
        return _MultiContext([self.strategy.no_backward_sync(m, True) for m in models])

    def no_sync(self, model):
        return self.strategy.no_backward_sync(model, True)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0):
        for opt in self._optimizers:
            self.strategy.precision.unscale_gradients(opt.optimizer)
        params = [p for p in parameters if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        for opt in self._optimizers:
            self.strategy.precision.unscale_gradients(opt.optimizer)
        torch.nn.utils.clip_grad_value_([p for p in parameters if p.grad is not None], clip_value)

    def autocast(self):
        return self.strategy.precision.forward_context()

    # -- collectives ----------------------------------------------------------------------
    def gather(self, tensor):
        from ember import distributed
        return distributed.gather(tensor, strategy=self.strategy)

    def gather_for_metrics(self, data):
        from ember import distributed
        loader = self._active_loader
        padded = edata.num_padded(loader.base) if loader is not None and loader.end_of_dataloader else 0
        return distributed.gather_for_metrics(data, num_padded=padded, strategy=self.strategy)

    def reduce(self, tensor, reduction: str = "mean"):
        return self.strategy.reduce(tensor, reduction)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        from ember import distributed
        return distributed.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first,
                                                strategy=self.strategy)

    def broadcast(self, obj, from_process: int = 0):
        return self.strategy.broadcast(obj, from_process)

    def wait_for_everyone(self) -> None:
        self.strategy.barrier("wait_for_everyone")

    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self):
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self):
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    def unwrap_model(self, model):
        return self.strategy.unwrap_module(model)

    def end_training(self) -> None:
        for tr in self.trackers:
            tr.finalize("success")
        self.strategy.teardown()


class _MultiContext:
    def __init__(self, ctxs):
        self.ctxs = ctxs

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


def _is_scheduler(o) -> bool:
    return isinstance(o, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(o, "step") and hasattr(o, "optimizer") and hasattr(o, "state_dict") and not isinstance(o, torch.optim.Optimizer))


class AcceleratedOptimizer:
    """Steps through the strategy/precision; a no-op while accumulating."""

    def __init__(self, optimizer, accelerator: Accelerator):
        self.optimizer = optimizer
        self._acc = accelerator
        self._strategy = accelerator.strategy

    def step(self, closure=None):
        if self._acc.sync_gradients:
            self._strategy.optimizer_step(self.optimizer, None, closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._acc.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


class AcceleratedScheduler:
    """Steps only when the optimizer stepped (once per accumulation window); under
    several processes, as Accelerate, it advances once per process so a schedule
    written for the global number of steps keeps its shape."""

    def __init__(self, scheduler, accelerator: Accelerator):
        self.scheduler = scheduler
        self._acc = accelerator

    def step(self, *args, **kwargs):
        if not self._acc.sync_gradients:
            return
        n = self._acc.num_processes if self._acc.step_scheduler_with_optimizer else 1
        for _ in range(n):
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, sd):
        self.scheduler.load_state_dict(sd)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class DataLoaderShard:
    """A prepared (sharded, resumable) DataLoader that moves batches to the device
    and tells the accelerator when the last batch is out."""

    def __init__(self, loader, accelerator: Accelerator):
        self.base = loader
        self._acc = accelerator
        self.end_of_dataloader = False
        self._skip = 0
        self.batches_done = 0
        self.epoch = 0

    def __len__(self):
        return len(self.base)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        edata.set_epoch(self.base, epoch)

    def __iter__(self):
        acc = self._acc
        strategy = acc.strategy
        move = strategy.root_device.type != "cpu"
        if self._skip:
            edata.skip_batches(self.base, self._skip)
        self.batches_done, self._skip = self._skip, 0
        self.end_of_dataloader = False
        acc._active_loader = self
        edata.set_epoch(self.base, self.epoch)
        it = iter(self.base)
        try:
            nxt = next(it)
        except StopIteration:
            return
        while True:
            cur = nxt
            try:
                nxt = next(it)
            except StopIteration:
                self.end_of_dataloader = True
                self.batches_done += 1
                yield strategy.batch_to_device(cur) if move else cur
                break
            self.batches_done += 1
            yield strategy.batch_to_device(cur) if move else cur
        acc._active_loader = None
        self.epoch += 1

    def __getattr__(self, name):
        return getattr(self.__dict__["base"], name)
