"""The Accelerator's keywords, under Accelerate's names: the kwargs handlers and
configuration classes, and how each Accelerator keyword of Accelerate maps onto ember
(it works the same, or it raises naming the keyword and why). Users import these from
:mod:`ember.utils`. Guide: ``docs/porting.md``.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from datetime import timedelta
from typing import Any

import torch

from ember.errors import MisconfigurationError

__all__ = ["DistributedType", "DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs",
           "ProfileKwargs", "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin",
           "TorchDynamoPlugin"]


class DistributedType(str, enum.Enum):
    """How the processes are organised (Accelerate's names; compares equal to its strings)."""
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    XLA = "XLA"


def distributed_type_of(strategy: Any) -> DistributedType:
    """Accelerate's :class:`DistributedType` of a strategy."""
    name = getattr(strategy, "name", "single")
    if name == "deepspeed":
        return DistributedType.DEEPSPEED
    if name in ("fsdp", "model_parallel"):
        return DistributedType.FSDP
    if strategy.world_size == 1:
        return DistributedType.NO
    return DistributedType.MULTI_GPU if strategy.root_device.type == "cuda" else DistributedType.MULTI_CPU


class _Handler:
    def to_kwargs(self) -> dict:
        """The fields that differ from their defaults (Accelerate's ``to_kwargs``)."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclasses.dataclass
class DistributedDataParallelKwargs(_Handler):
    """Arguments for ``DistributedDataParallel`` (used under the DDP strategy)."""
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = None
    comm_wrapper: Any = None
    comm_state_option: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GradScalerKwargs(_Handler):
    """Arguments for the ``GradScaler`` of ``mixed_precision="fp16"``."""
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class InitProcessGroupKwargs(_Handler):
    """Arguments for ``init_process_group``: ``backend``, ``init_method`` (ember's
    launcher sets the rendezvous; only ``None`` / ``"env://"``), ``timeout``."""
    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclasses.dataclass
class ProfileKwargs(_Handler):
    """Arguments for :meth:`ember.Accelerator.profile` (``torch.profiler.profile``)."""
    activities: list | None = None
    schedule_option: dict | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> Any:
        """A ``torch.profiler.profile`` from these fields."""
        from torch.profiler import ProfilerActivity, profile, schedule
        names = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
        acts = [names[a] for a in self.activities] if self.activities else None
        on_ready = self.on_trace_ready
        if on_ready is None and self.output_trace_dir:
            on_ready = torch.profiler.tensorboard_trace_handler(self.output_trace_dir)
        return profile(activities=acts, schedule=schedule(**self.schedule_option) if self.schedule_option else None,
                       on_trace_ready=on_ready, record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                       with_stack=self.with_stack, with_flops=self.with_flops, with_modules=self.with_modules)


@dataclasses.dataclass
class ProjectConfiguration:
    """Where trackers and checkpoints go. ``automatic_checkpoint_naming``:
    ``save_state()`` writes ``project_dir/checkpoints/checkpoint_<iteration>`` (ember
    does so whenever no directory is given); ``total_limit``: keep that many automatic
    checkpoints (the oldest are removed); ``iteration``: the next number."""
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders (Accelerate's fields; see ``docs/porting.md``)."""
    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class GradientAccumulationPlugin:
    """``num_steps`` micro-batches per optimizer step; the last batch of a prepared
    dataloader always syncs (``sync_with_dataloader=True``, ember's only mode)."""
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class TorchDynamoPlugin:
    """``torch.compile`` options for prepared models."""
    backend: str | None = None
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None


# -- Accelerator(...) keywords -----------------------------------------------------------------------
def _refuse(kwarg: str, why: str) -> MisconfigurationError:
    return MisconfigurationError(f"Accelerator({kwarg}): {why}")


def resolve_precision(mixed_precision: str | None, precision: str | None) -> tuple[str | None, bool]:
    """Accelerate's ``mixed_precision`` (also from ``$ACCELERATE_MIXED_PRECISION``) as an
    ember precision, and whether it was Accelerate's ``"fp16"``."""
    if precision is None and mixed_precision is None and "EMBER_PRECISION" not in os.environ:
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if precision is None and mixed_precision is not None:
        mp = str(getattr(mixed_precision, "value", mixed_precision)).lower()
        if mp == "fp8":
            raise _refuse("mixed_precision='fp8'", "fp8 training is not supported; use 'bf16' or 'fp16'")
        return {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}.get(mp, mp), mp == "fp16"
    return precision, False


def cpu_fp16_as_accelerate(strategy: Any) -> bool:
    """Accelerate's ``mixed_precision="fp16"`` on the CPU runs in float32 (no autocast,
    no GradScaler); ember does the same, and says so once."""
    if strategy.root_device.type != "cpu":
        return False
    import warnings
    warnings.warn("mixed_precision='fp16' on the CPU runs in float32, as in Accelerate (no autocast, no "
                  "GradScaler); pass precision='16-mixed' for float16 autocast with loss scaling on the CPU, or "
                  "mixed_precision='bf16'", UserWarning, stacklevel=3)
    return True


def strategy_options(kwargs_handlers: list | None, cpu: bool, devices: Any) -> tuple[dict, Any]:
    """Split the kwargs handlers: (DDP/process-group options for the strategy, the rest)."""
    ddp: dict = {}
    pg: dict = {}
    seen: set = set()
    scaler = profile = None
    for h in kwargs_handlers or ():
        kind = type(h).__name__
        if kind in seen:
            raise _refuse("kwargs_handlers", f"two {kind} objects; pass each kind once")
        seen.add(kind)
        if isinstance(h, DistributedDataParallelKwargs):
            ddp = h.to_kwargs()
            for k in ("comm_hook", "comm_wrapper", "comm_state_option"):
                if k in ddp:
                    raise _refuse(f"kwargs_handlers=[DistributedDataParallelKwargs({k}=...)]",
                                  "DDP communication hooks are not supported by ember")
        elif isinstance(h, InitProcessGroupKwargs):
            if h.init_method not in (None, "env://"):
                raise _refuse("kwargs_handlers=[InitProcessGroupKwargs(init_method=...)]",
                              "ember's launcher sets the rendezvous (env://); set MASTER_ADDR/MASTER_PORT instead")
            pg = {k: v for k, v in (("process_group_backend", h.backend), ("timeout", h.timeout)) if v is not None}
        elif isinstance(h, GradScalerKwargs):
            scaler = h
        elif isinstance(h, ProfileKwargs):
            profile = h
        else:
            raise _refuse("kwargs_handlers", f"{kind} is not one of DistributedDataParallelKwargs, "
                          "GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs")
    return {"ddp": ddp, "pg": pg}, (scaler, profile)


def configure_strategy(strategy: Any, options: dict) -> None:
    """Apply DDP / process-group options to a strategy that was not set up yet."""
    if not (options["ddp"] or options["pg"]):
        return
    if not hasattr(strategy, "ddp_kwargs"):
        if strategy.world_size > 1 or getattr(strategy, "name", "") in ("fsdp", "deepspeed"):
            raise _refuse("kwargs_handlers", f"DistributedDataParallelKwargs/InitProcessGroupKwargs do not apply "
                          f"to the {strategy.name} strategy")
        return   # one process: nothing to pass on (as Accelerate)
    ddp = dict(options["ddp"])
    if ddp and strategy.name != "ddp":
        raise _refuse("kwargs_handlers=[DistributedDataParallelKwargs(...)]",
                      f"only the DDP strategy uses them (this is {strategy.name})")
    strategy.ddp_kwargs.update(ddp)
    pg = options["pg"]
    if "timeout" in pg:
        t = pg["timeout"]
        strategy.timeout = t if isinstance(t, timedelta) else timedelta(seconds=float(t))
    if "process_group_backend" in pg:
        strategy._backend = pg["process_group_backend"]


def apply_scaler_kwargs(precision: Any, h: GradScalerKwargs | None) -> None:
    """Apply ``GradScalerKwargs`` to the precision's loss scaler."""
    if h is None:
        return
    scaler = getattr(precision, "scaler", None)
    if scaler is None:   # no loss scaling in this precision: nothing to configure (as Accelerate)
        return
    if not h.enabled:
        raise _refuse("kwargs_handlers=[GradScalerKwargs(enabled=False)]", "use mixed_precision='bf16' or 'no' "
                      "instead of fp16 without loss scaling")
    precision.configure_scaler(h.init_scale, h.growth_factor, h.backoff_factor, h.growth_interval)


def dataloader_options(split_batches: bool | None, even_batches: bool | None, dataloader_config: Any,
                       gradient_accumulation_plugin: Any, gradient_accumulation_steps: int, rng_types: Any,
                       device_placement: bool) -> dict:
    """Check Accelerate's data keywords; return ember's settings."""
    cfg = dataloader_config or DataLoaderConfiguration()
    if dataloader_config is not None and (split_batches is not None or even_batches is not None):
        raise _refuse("split_batches/even_batches", "pass them inside dataloader_config, not both")
    split = bool(cfg.split_batches if split_batches is None else split_batches)
    even = bool(cfg.even_batches if even_batches is None else even_batches)
    if cfg.dispatch_batches:
        raise _refuse("dataloader_config=DataLoaderConfiguration(dispatch_batches=True)",
                      "every process reads its own shard in ember (no dispatch from the main process)")
    if rng_types is not None:
        bad = [r for r in rng_types if str(getattr(r, "value", r)).lower() not in ("generator",)]
        if bad:
            raise _refuse(f"rng_types={list(rng_types)!r}", "ember's data order comes from (seed, epoch), not from "
                          "a global RNG synchronised across processes; 'generator' (the default) is the only "
                          "choice; seed each process's global RNG yourself (ember.utils.set_seed)")
    gas = gradient_accumulation_steps
    if gas == 1 and gradient_accumulation_plugin is None:   # set by `ember launch` / `accelerate launch`
        gas = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1))
    if gradient_accumulation_plugin is not None:
        p = gradient_accumulation_plugin
        if gas != 1:
            raise _refuse("gradient_accumulation_steps", "pass it inside gradient_accumulation_plugin, not both")
        if not p.sync_with_dataloader:
            raise _refuse("gradient_accumulation_plugin=GradientAccumulationPlugin(sync_with_dataloader=False)",
                          "ember always steps on the last batch of a prepared dataloader")
        if p.sync_each_batch:
            raise _refuse("gradient_accumulation_plugin=GradientAccumulationPlugin(sync_each_batch=True)",
                          "ember skips the gradient all-reduce on every accumulated micro-batch")
        gas = int(p.num_steps or 1)
    return {"split_batches": split, "even_batches": even, "non_blocking": bool(cfg.non_blocking),
            "use_seedable_sampler": True, "data_seed": cfg.data_seed, "gradient_accumulation_steps": gas,
            "use_stateful_dataloader": bool(cfg.use_stateful_dataloader), "device_placement": bool(device_placement)}


def dynamo_options(dynamo_backend: Any, dynamo_plugin: Any) -> dict | None:
    """``torch.compile`` options, or None (no compilation)."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise _refuse("dynamo_backend", "pass it inside dynamo_plugin, not both")
    backend = dynamo_plugin.backend if dynamo_plugin is not None else dynamo_backend
    if backend is None:
        backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND")
    backend = getattr(backend, "value", backend)
    if backend is None or str(backend).lower() == "no":
        return None
    opts = {"backend": str(backend).lower()}
    if dynamo_plugin is not None:
        opts.update(mode=dynamo_plugin.mode, fullgraph=dynamo_plugin.fullgraph, dynamic=dynamo_plugin.dynamic)
    return opts


def check_data_options(acc: Any, opts: dict) -> None:
    """Refuse data options the number of processes cannot honour (at construction)."""
    world = acc.strategy.world_size
    if not opts["even_batches"] and world > 1:
        raise _refuse("even_batches=False", "ember's sampler always gives every process the same number of "
                      "batches (padding the last one) and gather_for_metrics drops that padding; leave it True")
    if not opts["device_placement"] and acc.strategy.root_device.type != "cpu":
        raise _refuse("device_placement=False", "ember always moves prepared models and batches to the device; "
                      "move them yourself only with strategy='single' on the CPU")


def split_loader(loader: Any, num_processes: int) -> Any:
    """``split_batches=True``: the loader's batch size is the global one; each of the
    ``num_processes`` processes reads ``batch_size // num_processes`` samples per batch."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler
    bs = loader.batch_size
    if num_processes == 1:
        return loader
    if bs is None or type(loader.batch_sampler) is not BatchSampler:
        raise _refuse("split_batches=True", "needs a DataLoader built with batch_size= (not a batch_sampler)")
    if bs % num_processes:
        raise _refuse("split_batches=True", f"batch_size={bs} does not split evenly over {num_processes} processes")
    kw = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
              drop_last=loader.drop_last, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
              generator=loader.generator, persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, batch_size=bs // num_processes,
                      shuffle=isinstance(loader.sampler, RandomSampler), **kw)
