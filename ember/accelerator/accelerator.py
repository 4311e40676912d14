"""The Accelerator: custom training loops on the Trainer's Strategy + Precision machinery.
Guide: ``docs/accelerator.md``.
"""
from __future__ import annotations

import gc
import os
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from ember.accelerator.prepared import AcceleratedOptimizer, AcceleratedScheduler, is_scheduler
from ember.accelerator.config import ProfileKwargs, distributed_type_of
from ember.accelerator.state import AcceleratorState, GradientState
from ember.data import sampling as edata
from ember.data.loader import DataLoaderShard
from ember.distributed import collectives as _dist
from ember.distributed.debug import check_collective
from ember.distributed.processes import Topology, _Islice, _Yield, _only, split_inputs
from ember.distributed.processes import share_strategy
from ember.errors import DistributedOperationError, MisconfigurationError, invalid_choice
from ember.loggers.trackers import check_log_with
from ember.precision import NULL_CONTEXT, Precision
from ember.precision.forward import unwrap_forward, wrap_forward
from ember.step import StepRules

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "DataLoaderShard",
           "DistributedOperationError"]

if TYPE_CHECKING:
    from ember.loggers.base import Logger
    from ember.strategies.base import Strategy

_REDUCTIONS = ("sum", "mean", "max", "min", "none")


class Accelerator(Topology):
    """Prepare models, optimizers, dataloaders and schedulers for the chosen
    strategy (single device, DDP, FSDP, DeepSpeed) and precision, and give a
    custom loop the verbs it needs (backward, accumulation, clipping, collectives,
    checkpoints, trackers).

    Args:
        strategy: ``"auto"`` | ``"single"`` | ``"ddp"`` | ``"fsdp"`` | ``"deepspeed"`` | a Strategy.
        devices: as for the Trainer (``"auto"``, an int, ``"cpu"``, ``"cuda:N"``, a list of GPU ids).
        precision: ``"32-true"`` (default, or ``$EMBER_PRECISION`` set by ``ember launch``),
            ``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"``, ``"64-true"``.
        gradient_accumulation_steps: micro-batches per optimizer step (see :meth:`accumulate`).
        log_with: ``"tensorboard"`` | ``"csv"`` | ``"wandb"`` | ``"mlflow"`` | ``"all"`` | a Logger | a list of them.
        project_dir: where trackers and automatically named checkpoints go (default: cwd).
        seed: seeds python/numpy/torch and the data order (a shuffled loader's order is then
            ``(seed, epoch)``); default: a prepared ``DataLoader(shuffle=True)`` draws its
            order from the global torch RNG at the start of each pass, as the plain loader
            does (rank 0's draw on every rank), so ``set_seed`` before or after the
            Accelerator fixes it, and one process sees the plain loader's order.
        debug: check every collective's operation and shapes across ranks first
            (default: ``$EMBER_DEBUG``).
        mixed_precision: Accelerate's spelling (``"no"`` | ``"fp16"`` | ``"bf16"``) of ``precision``.
        step_scheduler_with_optimizer: prepared schedulers step only when the optimizers
            did, ``num_processes`` times per step (as Accelerate); False: on every call.
        convert_outputs_to_fp32: cast a prepared model's floating outputs to float32 under a
            mixed precision, as Accelerate always does; default False: they stay in the
            autocast dtype (LLM logits are not doubled in memory; see docs/porting.md).
    """

    def __init__(self, strategy: str | Strategy = "auto", devices: str | int | list[int] = "auto",
                 precision: str | None = None, gradient_accumulation_steps: int = 1,
                 log_with: str | Logger | list | None = None, project_dir: str | None = None,
                 seed: int | None = None, num_nodes: int = 1, debug: bool | None = None,
                 mixed_precision: str | None = None, step_scheduler_with_optimizer: bool = True, *,
                 cpu: bool = False, device_placement: bool = True, split_batches: bool | None = None,
                 even_batches: bool | None = None, kwargs_handlers: list | None = None,
                 project_config: Any = None, dataloader_config: Any = None, rng_types: list[str] | None = None,
                 dynamo_backend: str | None = None, dynamo_plugin: Any = None,
                 gradient_accumulation_plugin: Any = None, convert_outputs_to_fp32: bool = False) -> None:
        from ember.accelerator import config
        from ember.strategies import build_strategy
        precision, accelerate_fp16 = config.resolve_precision(mixed_precision, precision)
        if precision is None:
            precision = os.environ.get("EMBER_PRECISION", "32-true")
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) \
                or gradient_accumulation_steps < 1:
            raise MisconfigurationError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} is not "
                                        "valid; use an int >= 1")
        if cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
            devices = "cpu" if devices == "auto" else devices
        log_with = check_log_with(log_with)
        data_opts = config.dataloader_options(split_batches, even_batches, dataloader_config,
                                              gradient_accumulation_plugin, gradient_accumulation_steps,
                                              rng_types, device_placement)
        strat_opts, (scaler_kw, profile_kw) = config.strategy_options(kwargs_handlers, cpu, devices)
        dynamo = config.dynamo_options(dynamo_backend, dynamo_plugin)
        prec = Precision.from_string(precision)
        strat = build_strategy(strategy, devices, num_nodes)
        if accelerate_fp16 and config.cpu_fp16_as_accelerate(strat):
            prec = Precision.from_string("32-true")
        strat.precision = prec
        config.configure_strategy(strat, strat_opts)
        self._init(strat)
        self._profile_kwargs, self._dynamo = profile_kw, dynamo
        self.convert_outputs_to_fp32 = bool(convert_outputs_to_fp32)
        config.apply_scaler_kwargs(strat.precision, scaler_kw)
        config.check_data_options(self, data_opts)
        self.gradient_accumulation_steps = data_opts.pop("gradient_accumulation_steps")
        self._data_opts = data_opts
        if data_opts.get("use_stateful_dataloader"):   # as Accelerate: needs torchdata, checked now
            from ember.data.stateful import stateful_loader_class
            stateful_loader_class("DataLoaderConfiguration(use_stateful_dataloader=True)")
        self.log_with = log_with
        self.step_scheduler_with_optimizer = bool(step_scheduler_with_optimizer)
        self.project_configuration = project_config if project_config is not None else config.ProjectConfiguration()
        if project_dir is None:
            project_dir = self.project_configuration.project_dir
        self.project_dir = os.fspath(project_dir) if project_dir is not None else os.getcwd()
        self.project_configuration.set_directories(self.project_dir)
        from ember.accelerator.checkpoint import _newest_auto   # counted now, before any rank saves
        self.save_iteration = _newest_auto(os.path.join(self.project_dir, "checkpoints")) + 1
        if project_config is not None and project_config.iteration:
            self.save_iteration = int(project_config.iteration)
        share_strategy(strat)   # what every PartialState() sees from now on
        self.debug = os.environ.get("EMBER_DEBUG", "0").lower() not in ("", "0", "false", "no") \
            if debug is None else bool(debug)
        if seed is not None:
            from ember.data.worker_seed import seed_everything
            seed_everything(seed)
            self.seed = int(seed)
        else:  # no draw from the global RNG: a loop's random streams stay those of a raw loop
            self.seed = torch.initial_seed() % (2**31 - 1)
        if self.strategy.world_size > 1:
            # rank 0's count: another rank may list the folder before or after a save, or on another node
            s0, it0 = self.strategy.broadcast([self.seed, self.save_iteration])
            self.seed = int(s0) if seed is None else self.seed
            self.save_iteration = int(it0)
        if data_opts.get("data_seed") is not None:   # DataLoaderConfiguration(data_seed=): the data order only
            self.seed = int(data_opts["data_seed"])
        self._seed_given = seed is not None or data_opts.get("data_seed") is not None

    def _init(self, strategy) -> None:
        self.strategy = strategy
        strategy.setup_environment()
        #: the optimizer-step rules (ember.step), as the Trainer's
        self.step_rules = StepRules(strategy, 1)
        self.step_scheduler_with_optimizer = True
        self.debug = False
        self.seed = None
        self._seed_given = True
        self._step = 0
        self._models: list = []
        self._optimizers: list = []
        self._schedulers: list = []
        self._dataloaders: list = []
        self._custom_objects: list = []
        self._active_loader = None
        self._finished_pass = None   # the prepared dataloader whose last pass ran to its end
        self._trigger = False
        self._log_step = 0
        self._arrivals: dict = {}
        self._data_opts: dict = {}
        self._dynamo = self._profile_kwargs = None
        self.convert_outputs_to_fp32 = False
        self.save_iteration: int | None = None
        self.project_configuration = None
        self.project_dir = os.getcwd()
        self.log_with = []
        self.trackers: list = []

    # -- topology: device, num_processes, process_index, is_main_process, ... (Topology) ----
    precision = property(lambda self: self.strategy.precision.name, doc='str: the precision ("32-true", ...)')

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler under 16-mixed (else None), its scale updated for the last step."""
        precision = self.strategy.precision
        if precision.scaler is not None:
            precision.update()
        return precision.scaler
    step = property(lambda self: self._step, doc="int: micro-batches seen in the current accumulation window")

    @property
    def gradient_accumulation_steps(self) -> int:
        """int: micro-batches per optimizer step (see :meth:`accumulate`)."""
        return self.step_rules.accumulation_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.step_rules.accumulation_steps = int(value)

    @property
    def sync_gradients(self) -> bool:
        """bool: the current micro-batch ends its accumulation window (prepared optimizers and
        schedulers step after it, ``zero_grad`` clears)."""
        return self.step_rules.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.step_rules.sync_gradients = bool(value)

    @property
    def mixed_precision(self) -> str:
        """Accelerate's name of the precision: ``"no"``, ``"fp16"``, ``"bf16"`` (or the ember string)."""
        return {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16"}.get(self.precision, self.precision)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when a 16-mixed step found inf/NaN gradients and was skipped."""
        return any(self.step_rules.step_was_skipped(o.optimizer) for o in self._optimizers)

    # -- flat verbs (shared with the Trainer) --------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move, convert and wrap ``module`` for the strategy (the Trainer's verb; see :meth:`prepare`)."""
        if any(hasattr(m, "hf_device_map") for m in module.modules()):   # placed by a device map: stays
            from ember.big_modeling import check_prepare
            if check_prepare(module, self.strategy.name):     # raises under DDP/FSDP/DeepSpeed
                return module
        return self.strategy.setup_module(module)

    def setup_optimizers(self, module: nn.Module | None, optimizers: list) -> tuple[Any, list]:
        """``(module, optimizers)`` set up by the strategy (the Trainer's verb; see :meth:`prepare`)."""
        return self.strategy.setup_optimizers(module, list(optimizers))

    def setup_dataloader(self, dataloader: Any, *, seed: int | None = None, shuffle: bool | None = None,
                         even: bool = True, stateful: bool | None = None) -> Any:
        """Shard ``dataloader`` over the data-parallel ranks (``ember.data.sampling.prepare_for``:
        ``even=False`` keeps every item of an IterableDataset, for evaluation). Under several
        processes, a sampler kept with the user's own generator gets rank 0's generator
        state on every rank (one small collective here, warning when the states differed).
        Every rank must call it at the same point. ``stateful`` (default:
        ``DataLoaderConfiguration(use_stateful_dataloader=...)``): rebuild it as a torchdata
        ``StatefulDataLoader``."""
        if seed is None:
            seed = self.seed if self.seed is not None else 0
        if stateful is None:
            stateful = bool(self._data_opts.get("use_stateful_dataloader", False))
        return edata.prepare_for(self.strategy, dataloader, seed=seed, shuffle=shuffle, even=even, stateful=stateful)

    # -- prepare -------------------------------------------------------------------------
    def prepare(self, *objs: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers, in any order; they come
        back in the same order (a single object comes back alone). Anything else is
        returned unchanged, and so is an object prepared before.

        Models are moved to the device, converted and wrapped (DDP, ...); under a mixed or
        true-low precision their ``forward`` runs in autocast (outputs stay in the autocast
        dtype unless ``convert_outputs_to_fp32=True``) / casts its inputs.
        Optimizers step through the precision (loss scaling) and only on the last
        micro-batch of an accumulation window; dataloaders are sharded over processes,
        resumable, and move batches to the device.
        """
        from torch.utils.data import DataLoader
        out = list(objs)
        known = {id(m) for m in self._models}
        mods = [i for i, o in enumerate(objs) if isinstance(o, nn.Module) and id(o) not in known]
        opts = [i for i, o in enumerate(objs) if isinstance(o, torch.optim.Optimizer)
                and not isinstance(o, AcceleratedOptimizer)]
        # which model does each optimizer train? (decided before wrapping: FSDP replaces parameters)
        owner: dict[int, int] = {}
        for i in mods:
            for p in objs[i].parameters():
                owner.setdefault(id(p), i)
        groups: dict[int | None, list[int]] = {}
        for j in opts:
            mi = next((owner[id(p)] for g in objs[j].param_groups for p in g["params"] if id(p) in owner), None)
            groups.setdefault(mi, []).append(j)
        if self.strategy.owns_optimizer_step and len([k for k in groups if k is not None]) > 1:
            raise MisconfigurationError(f"the {self.strategy.name} strategy prepares one model with its "
                                        f"optimizer per Accelerator; got optimizers for {len(groups)} models")
        patch = not self.strategy.owns_optimizer_step
        for i in mods:
            placed = False
            if any(hasattr(m, "hf_device_map") for m in objs[i].modules()):   # placed by a device map: stays
                from ember.big_modeling import check_prepare
                placed = check_prepare(objs[i], self.strategy.name)     # raises under DDP/FSDP/DeepSpeed
            if patch:
                wrap_forward(objs[i], self.strategy.precision, self.convert_outputs_to_fp32)
            out[i] = objs[i] if placed else self.setup_module(objs[i])
            if self._dynamo is not None and not placed:
                out[i] = torch.compile(out[i], **self._dynamo)
        for mi, js in groups.items():
            model = out[mi] if mi is not None else None
            new_model, new_opts = self.setup_optimizers(model, [objs[j] for j in js])
            if mi is not None:
                out[mi] = new_model
            for j, o in zip(js, new_opts):
                out[j] = AcceleratedOptimizer(o, self.step_rules)
        for i, o in enumerate(objs):
            if isinstance(o, DataLoader):
                from ember.accelerator.config import split_loader
                dl = split_loader(o, self.num_processes) if self._data_opts.get("split_batches") else o
                out[i] = DataLoaderShard(self.setup_dataloader(dl), self, original=o, draw_order=not self._seed_given)
            elif is_scheduler(o) and not isinstance(o, AcceleratedScheduler):
                out[i] = AcceleratedScheduler(o, self)
        self._models += [out[i] for i in mods]
        if self._models:
            self.step_rules.model = self._models[0]   # the model an engine (DeepSpeed) steps
        self._optimizers += [out[j] for j in opts]
        self._schedulers += [out[i] for i, o in enumerate(objs) if isinstance(out[i], AcceleratedScheduler)
                             and out[i] is not o]
        self._dataloaders += [out[i] for i, o in enumerate(objs) if isinstance(out[i], DataLoaderShard)
                              and out[i] is not o]
        return out[0] if len(out) == 1 else tuple(out)

    def verify_device_map(self, model: nn.Module) -> bool:
        """True when ``model`` (or a submodule) was dispatched over several devices by a device
        map (``hf_device_map``, see ``ember.big_modeling``); such a model is not wrapped for DDP."""
        return any(len(getattr(m, "hf_device_map", None) or {}) > 1 for m in model.modules())

    def prepare_model(self, model: Any, device_placement: bool | None = None) -> Any:
        """:meth:`prepare` of one object (also ``prepare_optimizer``/``_data_loader``/``_scheduler``)."""
        return self.prepare(model)

    prepare_optimizer = prepare_data_loader = prepare_scheduler = prepare_model

    # -- step -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` through the strategy and precision (loss scaling under
        16-mixed), divided first by the size of the current accumulation window
        (``gradient_accumulation_steps``; a short last window of a prepared dataloader:
        its own size). The rule: :meth:`ember.step.StepRules.backward`."""
        self.step_rules.backward(loss, **kwargs)

    def accumulation_step(self, index: int, total: int | None) -> bool:
        """Micro-batch ``index`` (0-based, in its epoch) of ``total`` (None: unknown):
        set :attr:`sync_gradients` and the divisor :meth:`backward` applies (the rule:
        :func:`ember.step.accumulation_window`); return :attr:`sync_gradients`.
        :meth:`accumulate` calls it with the prepared dataloader's position."""
        return self.step_rules.window(index, total)

    def accumulate(self, *models: nn.Module) -> ContextManager[None]:
        """Context for one micro-batch. Sets :attr:`sync_gradients` (True on every
        ``gradient_accumulation_steps``-th batch of a prepared dataloader's pass and on
        its last batch; without one, on every ``gradient_accumulation_steps``-th call)
        and the loss divisor of :meth:`backward` (the window's size: a short last window
        divides by its own size, as the Trainer, also for a dataloader of unknown length,
        which is read ahead far enough to know it), and, on the micro-batches that do not
        step, skips the gradient all-reduce of ``models`` (default: every prepared model).
        Prepared optimizers and schedulers only step, and ``zero_grad`` only clears, when
        ``sync_gradients`` is True."""
        gas = self.gradient_accumulation_steps
        if gas == 1:
            return NULL_CONTEXT
        rules = self.step_rules
        loader = self._active_loader
        if loader is not None:   # windows from the start of the pass, as the Trainer's
            index, total = loader.batches_done - 1, loader.known_length
        else:                    # windows of calls
            index, total = self._step, None
        ctx = rules.micro_batch(index, total, models or self._models)
        self._step = 0 if rules.sync_gradients else index % gas + 1
        return ctx

    def no_sync(self, *models: nn.Module) -> ContextManager[None]:
        """Context that skips the gradient all-reduce of ``models`` (DDP ``no_sync``)."""
        return self.step_rules.no_sync(*models)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Under 16-mixed, divide the gradients of ``optimizer`` (default: all prepared
        optimizers) by the loss scale, once per step (a second call is a no-op)."""
        opts = self._optimizers if optimizer is None else (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in opts:
            self.step_rules.unscale(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the total gradient norm of ``parameters`` (unscaling them first under
        16-mixed; DTensor parameters of several device meshes clip together); returns the
        norm before clipping. On a micro-batch where the optimizer will not step
        (``sync_gradients`` False) it does not clip and returns the norm of the
        gradients accumulated so far, unclipped (Accelerate clips them). Under DeepSpeed
        the engine clips (``gradient_clipping`` in its config)."""
        return self.step_rules.clip_grad_norm(parameters, max_norm, norm_type, [o.optimizer for o in self._optimizers])

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (unscaled first; as
        :meth:`clip_grad_norm_`, only when the optimizer will step)."""
        self.step_rules.clip_grad_value(parameters, clip_value, [o.optimizer for o in self._optimizers])

    def autocast(self) -> ContextManager[None]:
        """The precision's autocast context (prepared models already run in it)."""
        return self.strategy.precision.forward_context()

    # -- collectives ----------------------------------------------------------------------
    def _check(self, op: str, data: Any, free_dim: int | None = None) -> None:   # debug mode only
        if self.strategy.world_size > 1:
            check_collective(self.strategy, op, data, free_dim)

    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or nested tensors) from every process along dim 0
        (first dimensions may differ; a 0-d tensor becomes one row per process)."""
        if self.debug:
            self._check("gather", tensor, 0)
        return _dist.gather(tensor, strategy=self.strategy)

    def gather_object(self, obj: Any) -> list:
        """Every process's ``obj`` (lists are concatenated, as Accelerate)."""
        if self.debug:
            self._check("gather_object", None)
        got = self.strategy.all_gather_object(obj)
        if isinstance(obj, list):
            return [x for part in got for x in part]
        return got

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """Gather predictions/targets from every process in dataset order, dropping the
        samples the distributed sampler duplicated, so that exactly the dataset comes back:

        - called per batch inside the loop over a prepared dataloader (as with Accelerate),
          the duplicates are dropped from the last batch of the pass only;
        - called once after a full pass on the concatenation of this process's outputs
          (as many rows as the process had samples), they are dropped from the end.

        Anything else (outside a pass, or after it on other data) is gathered whole."""
        if self.debug:
            self._check("gather_for_metrics", data, 0)
        loader = self._active_loader
        if loader is not None:
            padded = edata.num_padded(loader.base) if loader.end_of_dataloader else 0
        else:
            done = self._finished_pass
            padded = edata.num_padded(done.base) if done is not None and \
                _dist.first_rows(data) == edata.samples_per_rank(done.base) else 0
        if use_gather_object and not isinstance(data, list):
            data = [data]
        return _dist.gather_for_metrics(data, num_padded=padded, strategy=self.strategy)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` (or nested tensors) over processes: ``"sum"`` (default, as
        Accelerate), ``"mean"``, ``"max"``, ``"min"`` or ``"none"``; then multiply by ``scale``."""
        if reduction not in _REDUCTIONS:
            raise invalid_choice("reduction", reduction, _REDUCTIONS)
        if isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
            tensor = torch.tensor(tensor, device=self.device)
        if self.debug:
            self._check(f"reduce:{reduction}", tensor)
        out = tensor if reduction == "none" else _dist.reduce(tensor, reduction, strategy=self.strategy)
        if scale != 1.0:
            out = _dist._map(out, lambda t: t * scale)
        return out

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad along ``dim`` to the largest size over processes (so it can be gathered)."""
        if self.debug:
            self._check("pad_across_processes", tensor, dim)
        return _dist.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first,
                                          strategy=self.strategy)

    def broadcast(self, obj: Any, from_process: int = 0) -> Any:
        """Process ``from_process``'s tensor (same shape everywhere) or picklable object."""
        if self.debug:
            self._check("broadcast", obj if isinstance(obj, torch.Tensor) else None)
        return _dist.broadcast(obj, from_process, strategy=self.strategy)

    def wait_for_everyone(self) -> None:
        """Barrier: every process waits here until all arrive."""
        if self.debug:
            self._check("wait_for_everyone", None)
        self.strategy.barrier("wait_for_everyone")

    def set_trigger(self) -> None:
        """Raise a flag on this process; :meth:`check_trigger` sees it on every process."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger` (then resets it)."""
        flag = torch.tensor(1.0 if self._trigger else 0.0, device=self.device)
        hit = bool(self.strategy.reduce(flag, "max").item() > 0) if self.use_distributed else self._trigger
        self._trigger = False
        return hit

    # -- processes --------------------------------------------------------------------------
    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on the main process only (the others get None)."""
        return self.on_process(function, 0)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: run ``function`` on each node's local main process only."""
        return self.on_local_process(function, 0)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: ``function`` runs on the last process only (elsewhere it returns None)."""
        return self.on_process(function, self.num_processes - 1)

    def on_process(self, function: Callable | None = None, process_index: int = 0) -> Callable:
        """Decorator: run ``function`` on global process ``process_index`` only."""
        return _only(self, function, "process_index", process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int = 0) -> Callable:
        """Decorator: run ``function`` on local process ``local_process_index`` of each node."""
        return _only(self, function, "local_process_index", local_process_index)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """Context yielding this process's contiguous share of a list, tuple, tensor (dim 0)
        or dict of them; the first ``len % num_processes`` processes get one more item.
        ``apply_padding``: repeat the last item so every process gets the same count."""
        return _Yield(split_inputs(inputs, self.num_processes, self.process_index, apply_padding))

    # -- models & checkpoints ------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The user's module inside the strategy's wrappers (DDP, compile, ...).
        ``keep_fp32_wrapper=False`` also removes the autocast/cast ``forward`` of prepare."""
        module = self.strategy.unwrap_module(model)
        if not keep_fp32_wrapper:
            unwrap_forward(module)
        return module

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """The full (unsharded) state dict of ``model``, gathered from every rank's shards."""
        return self.strategy.module_state_dict(model)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> list:
        """Export the weights of ``model`` to ``save_directory`` as safetensors: one
        ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when larger
        than ``max_shard_size`` (``"500MB"``, ``"2GB"``, bytes). The main process writes."""
        from ember.accelerator.checkpoint import save_model
        return save_model(self, model, save_directory, max_shard_size, safe_serialization)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write ``obj`` on the main process: a dict of tensors as safetensors when
        ``safe_serialization`` or ``f`` ends in ``.safetensors``; anything else with
        ``torch.save``, refusing objects ``torch.load(weights_only=True)`` cannot read back
        (state dicts, tensors and plain containers are fine)."""
        if self.is_main_process:
            from ember.checkpoint import io as cio
            if safe_serialization or os.fspath(f).endswith(".safetensors"):
                if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
                    raise MisconfigurationError("save(..., safe_serialization=True): safetensors holds a dict of "
                                                f"tensors only, got {type(obj).__name__}")
                cio.save_safetensors(obj, f)
            else:
                cio.save_torch(obj, f)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Include objects with ``state_dict()``/``load_state_dict()`` in :meth:`save_state`."""
        bad = [type(o).__name__ for o in objects
               if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if bad:
            raise MisconfigurationError(f"register_for_checkpointing: {', '.join(bad)} must have state_dict() "
                                        "and load_state_dict() methods")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True) -> str:
        """Write an atomic checkpoint directory: models (safetensors), optimizers,
        schedulers, grad scaler, dataloader positions, per-process RNG states,
        registered objects. ``None``: ``project_dir/checkpoints/checkpoint_N``."""
        from ember.accelerator.checkpoint import save_state
        return save_state(self, output_dir)

    def load_state(self, input_dir: str | os.PathLike | None = None, strict: bool = True) -> dict:
        """Restore what :meth:`save_state` wrote into the prepared objects (call after
        ``prepare``). Prepared dataloaders then resume mid-epoch, skipping the
        indices already seen. ``None``: the newest under ``project_dir/checkpoints``."""
        from ember.accelerator.checkpoint import load_state
        return load_state(self, input_dir, strict)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The next pass over ``dataloader`` starts after ``num_batches`` batches. A
        prepared dataloader skips indices (no data is read) and is returned itself; any
        other iterable is wrapped."""
        if isinstance(dataloader, DataLoaderShard):
            dataloader.skip(num_batches)
            return dataloader
        return _Islice(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop the references held to prepared objects, collect garbage, empty the CUDA
        cache. Returns ``[None] * len(objects)`` for ``a, b = acc.free_memory(a, b)``."""
        for held in (self._models, self._optimizers, self._schedulers, self._dataloaders,
                     self._custom_objects):
            held.clear()
        self._active_loader = self._finished_pass = None
        self._step = 0
        self.step_rules.reset_window()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    clear = free_memory

    # -- trackers (log_with=) -----------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Create the ``log_with`` trackers (main process only) under ``project_dir``
        with ``project_name`` as experiment name / W&B project, and log ``config`` as
        hyperparameters. ``init_kwargs={"wandb": {...}}`` go to that tracker."""
        from ember.loggers.trackers import init_trackers
        init_trackers(self, project_name, config, init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log scalar ``values`` (numbers or 0-d tensors, fetched in one transfer) to every
        tracker at ``step`` (default: the number of earlier ``log`` calls). Main process only."""
        if not self.trackers:
            return
        if step is None:
            step = self._log_step
        self._log_step = step + 1
        metrics = dict(values)
        keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
        if keys:  # one device-to-host transfer for all tensors
            metrics.update(zip(keys, torch.stack([metrics[k].detach().reshape(()).double() for k in keys]).tolist()))
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step=step)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker named ``"tensorboard"``, ``"csv"``, ``"wandb"`` (or a custom
        Logger's name); ``unwrap=True``: its writer / run. Other processes get a
        tracker whose methods do nothing."""
        from ember.loggers.trackers import get_tracker
        return get_tracker(self, name, unwrap)

    def end_training(self) -> None:
        """Finish every tracker (flush, close)."""
        for tr in self.trackers:
            tr.finalize("success")
        self.trackers = []
        self.strategy.teardown()

    # -- Accelerate's names: read-only views of ember's state, profile, save/load hooks ----------
    distributed_type = property(lambda self: distributed_type_of(self.strategy),
                                doc=":class:`DistributedType` of the run (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ...)")
    state = property(lambda self: AcceleratorState(self), doc="the process layout (:class:`AcceleratorState`)")
    gradient_state = property(lambda self: GradientState(self), doc=":class:`GradientState`")
    split_batches = property(lambda self: bool(self._data_opts.get("split_batches", False)),
                             doc="bool: a loader's batch is split over the processes")
    even_batches = property(lambda self: bool(self._data_opts.get("even_batches", True)),
                            doc="bool: every process gets as many batches (samples repeated)")
    use_seedable_sampler = property(lambda self: self._seed_given,
                                    doc="whether the order comes from (seed, epoch) (a seed was given), "
                                        "else from the global RNG at each pass")
    non_blocking = property(lambda self: bool(self._data_opts.get("non_blocking", False)),
                            doc="bool: batches are copied to the device with non_blocking=True")
    device_placement = property(lambda self: bool(self._data_opts.get("device_placement", True)),
                                doc="bool: prepared objects are moved to the device")
    logging_dir = property(lambda self: getattr(self.project_configuration, "logging_dir", None) or self.project_dir,
                           doc="str: where trackers write")
    multi_device = property(lambda self: self.num_processes > 1, doc="bool: more than one process")
    data_parallel_rank = property(lambda self: self.process_index, doc="int: the process index (Accelerate's name)")
    tensor_parallel_rank = property(lambda self: 0, doc="int: always 0 (Accelerate's name)")
    is_fsdp2 = property(lambda self: getattr(self.strategy, "name", "") == "fsdp", doc="bool: FSDP (FSDP2) runs")

    def profile(self, profile_handler: ProfileKwargs | None = None) -> ContextManager[Any]:
        """Context manager: ``torch.profiler.profile`` built from ``profile_handler``
        (default: the ``ProfileKwargs`` of ``kwargs_handlers``, else CPU activities)."""
        return (profile_handler or self._profile_kwargs or ProfileKwargs()).build()

    def register_save_state_pre_hook(self, hook: Callable) -> _Handle:
        """``hook(models, weights, output_dir)`` runs in :meth:`save_state` before writing
        (``weights``: the list of state dicts, may be edited). Returns a handle with ``remove()``."""
        return _Handle(self.__dict__.setdefault("_save_hooks", []), hook)

    def register_load_state_pre_hook(self, hook: Callable) -> _Handle:
        """``hook(models, input_dir)`` runs in :meth:`load_state` before loading."""
        return _Handle(self.__dict__.setdefault("_load_hooks", []), hook)

    def __repr__(self) -> str:
        return (f"Accelerator(strategy={self.strategy.name!r}, num_processes={self.num_processes}, "
                f"process_index={self.process_index}, device={self.device}, precision={self.precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")


class _Handle:
    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook
        hooks.append(hook)

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)
