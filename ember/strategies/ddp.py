"""``DDPStrategy``: one process per device, gradients all-reduced by
``torch.nn.parallel.DistributedDataParallel``.

Ranks come from ``torchrun`` / ``ember launch``, from SLURM, or, from a plain
``python script.py`` with ``devices=N``, from ember's own subprocess launcher
(see :mod:`ember.strategies.environments` and :mod:`ember.strategies.launchers`).
"""
from __future__ import annotations

import types
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ember.distributed.collectives import ProcessGroupOps
from ember.errors import MisconfigurationError, invalid_choice
from ember.precision import NULL_CONTEXT
from ember.strategies.base import Strategy
from ember.strategies.environments import (ClusterEnvironment, LocalEnvironment, TorchElasticEnvironment,
                                          detect_environment)
from ember.strategies import launchers

START_METHODS = ("popen",)
_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


class _RoutedMethod:
    """``module.<name>`` that runs through ``wrapper.__call__``; see :func:`route_through_forward`.
    A deep copy or a pickle of the module gets the plain method back."""

    _ember_routed = True

    def __init__(self, wrapper: nn.Module, module: nn.Module, name: str, original):
        self.wrapper, self.module, self.name, self.__wrapped__ = wrapper, module, name, original

    def __call__(self, *args, **kwargs):
        module, original = self.module, self.__wrapped__
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        had_own_forward = "forward" in module.__dict__
        own_forward = module.__dict__.get("forward")

        def restore():
            if had_own_forward:
                module.forward = own_forward
            else:
                del module.forward

        def forward_once(*a, **k):
            restore()   # the method may call the real forward (self(x)) itself
            return original(*a, **k)

        module.forward = forward_once
        try:
            return self.wrapper(*args, **kwargs)
        finally:
            if module.__dict__.get("forward") is forward_once:  # the wrapper did not call it
                restore()

    def __reduce__(self):
        return getattr, (self.module, self.name)   # unpickles to the class's method

    def __deepcopy__(self, memo):
        copy = memo.get(id(self.module))
        return types.MethodType(self.__wrapped__.__func__, copy) if copy is not None else self


def route_through_forward(wrapper: nn.Module, module: nn.Module, name: str) -> None:
    """Make ``module.<name>(...)`` run through ``wrapper.__call__`` (DDP's forward, which
    prepares the gradient all-reduce of the following backward), as Lightning Fabric
    does: ``module.forward`` is swapped for the method just for that call and restored
    before the method runs. The Trainer calls ``module.training_step`` directly."""
    current = module.__dict__.get(name)
    original = current.__wrapped__ if getattr(current, "_ember_routed", False) else None
    if original is None:
        if not callable(getattr(type(module), name, None)):
            return
        original = getattr(module, name)
    object.__setattr__(module, name, _RoutedMethod(wrapper, module, name, original))


class DDPStrategy(Strategy):
    """Data parallel over processes: each rank holds the full model and a shard of the data.

    Args:
        devices: processes per node (``None``/``"auto"``: the launcher's count, else the
            number of GPUs, else 1). On CUDA, a list selects GPU indices.
        num_nodes: machines (more than one needs ``torchrun`` or SLURM).
        process_group_backend: ``"gloo"`` (CPU default) or ``"nccl"`` (CUDA default).
        timeout: collective timeout (``timedelta`` or seconds).
        accelerator: ``"cpu"`` or ``"cuda"`` (default: CUDA when available).
        find_unused_parameters, static_graph, gradient_as_bucket_view, **ddp_kwargs:
            passed to ``DistributedDataParallel``.
        start_method: how ember starts the other ranks itself: ``"popen"`` (re-run the script).
        async_save: write checkpoints in a background thread on rank 0 (the state is
            copied to CPU memory first; see docs/checkpointing.md), as ``FSDPStrategy``.
    """

    name = "ddp"

    def __init__(self, devices: "int | list[int] | str | None" = None, num_nodes: int = 1,
                 process_group_backend: str | None = None,
                 timeout: "timedelta | float" = timedelta(minutes=30),
                 find_unused_parameters: bool = False, static_graph: bool = False,
                 gradient_as_bucket_view: bool = False, start_method: str = "popen",
                 accelerator: str | None = None,
                 cluster_environment: ClusterEnvironment | None = None, async_save: bool = False,
                 **ddp_kwargs: Any) -> None:
        super().__init__(async_save=async_save)
        if start_method not in START_METHODS:
            raise invalid_choice("start_method", start_method, START_METHODS)
        if process_group_backend is not None and process_group_backend not in _BACKENDS:
            raise invalid_choice("process_group_backend", process_group_backend, _BACKENDS)
        if accelerator not in (None, "cpu", "cuda", "gpu"):
            raise invalid_choice("accelerator", accelerator, ("cpu", "cuda"))
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise MisconfigurationError(f"num_nodes={num_nodes!r} is not valid; use an integer >= 1")
        self.num_nodes = num_nodes
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self.start_method = start_method
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, static_graph=static_graph,
                               gradient_as_bucket_view=gradient_as_bucket_view, **ddp_kwargs)
        self._use_cuda = (accelerator in ("cuda", "gpu")) or (accelerator is None and torch.cuda.is_available())
        if self._use_cuda and not torch.cuda.is_available():
            raise MisconfigurationError("accelerator='cuda' but CUDA is not available; use accelerator='cpu'")
        self._backend = process_group_backend or ("nccl" if self._use_cuda else "gloo")
        self._user_environment = cluster_environment
        self._launcher: launchers.SubprocessLauncher | None = None
        self._ops: ProcessGroupOps | None = None
        self._configure_topology(devices)
        if self.name == "ddp" and self._single and not self.cluster_environment.creates_processes_externally \
                and self._devices_explicit:   # FSDP and DeepSpeed run one process as they are
            warnings.warn(f"strategy='ddp' with devices={devices!r} means one process: running it without "
                          "DistributedDataParallel (pass devices=N for N processes)", UserWarning, stacklevel=3)

    def _configure_topology(self, devices) -> None:
        self._gpu_ids = self._parse_devices(devices)
        per_node = len(self._gpu_ids) if self._gpu_ids is not None else self._devices_count
        self.cluster_environment = self._user_environment or self._detect(per_node)
        self._single = self.cluster_environment.world_size == 1
        if self._single and (dist.is_available() and dist.is_initialized()):
            self._single = dist.get_world_size() == 1
        self.num_processes = self.cluster_environment.world_size

    def apply_trainer_devices(self, devices, num_nodes: int) -> None:
        """``Trainer(strategy=DDPStrategy(...), devices=2, num_nodes=...)``: the Trainer's
        ``devices``/``num_nodes`` fill what the instance left unset (as in Lightning); a
        conflict with what the instance was given is an error."""
        if num_nodes != 1 and self.num_nodes not in (1, num_nodes):
            raise MisconfigurationError(f"num_nodes={num_nodes} conflicts with {type(self).__name__}"
                                        f"(num_nodes={self.num_nodes}); pass it in one place")
        mine = (self._gpu_ids if self._gpu_ids is not None else self._devices_count) if self._devices_explicit else None
        if devices in (None, "auto", -1, "-1"):
            devices = mine
        elif mine is not None and mine != (list(devices) if isinstance(devices, (list, tuple)) else int(devices)):
            raise MisconfigurationError(f"devices={devices!r} conflicts with {type(self).__name__}"
                                        f"(devices={mine!r}); pass devices in one place")
        if devices != mine or num_nodes not in (1, self.num_nodes):
            self.num_nodes = max(num_nodes, self.num_nodes)
            self._configure_topology(devices)
        elif self._devices_explicit:
            return   # __init__ warned already
        if self._single and not self.cluster_environment.creates_processes_externally:
            warnings.warn(f"{type(self).__name__} with devices={devices!r} means one process (pass devices=N "
                          "for N processes)", UserWarning, stacklevel=4)

    def _parse_devices(self, devices):
        """Sets ``self._devices_count`` (None: decided by the environment); returns GPU ids or None."""
        self._devices_explicit = devices not in (None, "auto", -1, "-1")
        if not self._devices_explicit:
            self._devices_count = torch.cuda.device_count() if self._use_cuda else None
            return None
        if isinstance(devices, str):
            devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
        if isinstance(devices, (list, tuple)):
            ids = [int(d) for d in devices]
            if not ids:
                raise MisconfigurationError("devices=[] is not valid; give a count or a non-empty list of GPU ids")
            if self._use_cuda:
                bad = [i for i in ids if i >= torch.cuda.device_count() or i < 0]
                if bad:
                    raise MisconfigurationError(
                        f"devices={list(devices)!r} names GPU(s) {bad}, but only "
                        f"{torch.cuda.device_count()} are visible")
                self._devices_count = len(ids)
                return ids
            self._devices_count = len(ids)
            return None
        if not isinstance(devices, int) or devices < 1:
            raise MisconfigurationError(f"devices={devices!r} is not valid; use a positive integer, a list "
                                        "of GPU ids, or 'auto'")
        if self._use_cuda and devices > torch.cuda.device_count():
            raise MisconfigurationError(
                f"devices={devices} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                "lower devices or pass accelerator='cpu' for CPU processes")
        self._devices_count = devices
        return None

    def _detect(self, per_node: int | None) -> ClusterEnvironment:
        env = detect_environment(per_node or 1, self.num_nodes)
        if isinstance(env, TorchElasticEnvironment):
            # every rank agrees on the worker group's attempt number now, before the Trainer
            # reads TORCHELASTIC_RESTART_COUNT to decide whether to resume (see its docstring)
            from ember.distributed import elastic
            elastic.agreed_attempt(self.timeout)
        if isinstance(env, LocalEnvironment) and env.world_size > 1 and self._devices_explicit \
                and per_node is not None and per_node != env.local_world_size:
            raise MisconfigurationError(
                f"devices={per_node}, but this script already runs {env.world_size} processes (started "
                f"for an earlier Trainer/Accelerator); use devices={env.world_size}")
        if env.creates_processes_externally and not isinstance(env, LocalEnvironment):
            if self._devices_explicit and per_node is not None and per_node != env.local_world_size:
                raise MisconfigurationError(
                    f"devices={per_node} does not match the {env.local_world_size} process(es) per node "
                    f"that {env.name} started; pass devices={env.local_world_size} or leave devices unset")
            if self.num_nodes > 1 and env.num_nodes != self.num_nodes:
                raise MisconfigurationError(
                    f"num_nodes={self.num_nodes} does not match the {env.num_nodes} node(s) that "
                    f"{env.name} started")
        return env

    # -- topology ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return 1 if self._single else self.cluster_environment.world_size

    @property
    def global_rank(self) -> int:
        return 0 if self._single else self.cluster_environment.global_rank

    @property
    def local_rank(self) -> int:
        return 0 if self._single else self.cluster_environment.local_rank

    @property
    def node_rank(self) -> int:
        return 0 if self._single else self.cluster_environment.node_rank

    @property
    def process_group_backend(self) -> str:
        return self._backend

    @property
    def root_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        if self._use_cuda:
            return torch.device("cuda", cuda_index(self.local_rank, self._gpu_ids, torch.cuda.device_count()))
        return torch.device("cpu")

    @root_device.setter
    def root_device(self, device) -> None:
        self._device = torch.device(device)

    # -- lifecycle -----------------------------------------------------------------
    def setup_environment(self) -> None:
        if self._single:
            return super().setup_environment()
        env = self.cluster_environment
        launch = not env.creates_processes_externally and launchers._LAUNCHER is None
        cmd = launchers.relaunch_command() if launch else None  # fails before anything is changed
        env.export()
        if launch:
            self._launcher = launchers.SubprocessLauncher(env)
            self._launcher.launch(cmd)
        if LocalEnvironment.is_launched_child():
            launchers.watch_parent()
        device = self.root_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            kwargs = {}
            if device.type == "cuda" and self._backend == "nccl":
                kwargs["device_id"] = device
            store = _restarted_agent_store(self.timeout)
            if store is not None:
                kwargs["store"] = store
            else:
                kwargs["init_method"] = "env://"
            dist.init_process_group(self._backend, world_size=env.world_size,
                                    rank=env.global_rank, timeout=self.timeout, **kwargs)
        elif dist.get_world_size() != env.world_size:
            raise MisconfigurationError(
                f"a process group of world size {dist.get_world_size()} already exists, but the "
                f"{env.name} environment says {env.world_size}")
        launchers.install_exit_handlers()
        self.precision.setup(device, self.loss_scaler)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.precision.convert_module(module).to(self.root_device)
        if self._single or isinstance(module, nn.parallel.DistributedDataParallel):
            return module
        if not any(p.requires_grad for p in module.parameters()):
            return module  # nothing to synchronise (e.g. evaluation only); DDP would refuse it
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        route_through_forward(ddp, module, "training_step")
        return ddp

    def teardown(self) -> None:
        # The process group lives until the interpreter exits (or ember.distributed.destroy()),
        # so that several fit/validate/test calls in one script share it.
        super().teardown()

    # -- data ----------------------------------------------------------------------
    def distributed_sampler_kwargs(self) -> dict | None:
        if self._single:
            return None
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- step ------------------------------------------------------------------------
    def manual_backward(self, loss: torch.Tensor, module: nn.Module | None = None, **kwargs) -> None:
        """Manual optimization: DDP's forward (``training_step``) prepared one gradient
        reduction, but the step may run several backwards (one per toggled optimizer, each
        leaving the other parameters without gradients). Prepare the reduction for each, from
        this loss's graph, as Lightning does; unused parameters need
        ``find_unused_parameters=True``."""
        if isinstance(module, nn.parallel.DistributedDataParallel) and torch.is_grad_enabled() \
                and module.require_backward_grad_sync:
            from torch.nn.parallel.distributed import _find_tensors
            module.require_forward_param_sync = True
            outputs = list(_find_tensors(loss)) if module.find_unused_parameters and not module.static_graph else []
            module.reducer._rebuild_buckets()
            module.reducer.prepare_for_backward(outputs)
        self.backward(loss, module, **kwargs)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        if enabled and isinstance(module, nn.parallel.DistributedDataParallel):
            return module.no_sync()
        return NULL_CONTEXT

    # -- collectives (see ember.distributed.ProcessGroupOps) ---------------------------
    @property
    def _pg(self) -> ProcessGroupOps | None:
        if self._single or not (dist.is_available() and dist.is_initialized()):
            return None
        if self._ops is None:
            self._ops = ProcessGroupOps(self.root_device)
        return self._ops

    def barrier(self, name: str | None = None) -> None:
        if self._pg is not None:
            self._pg.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._pg is None else self._pg.broadcast(obj, src)

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0) if self._pg is None else self._pg.all_gather(tensor, sync_grads)

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._pg is None else self._pg.all_gather_cat(tensor)

    def all_gather_object(self, obj: Any) -> list:
        return [obj] if self._pg is None else self._pg.all_gather_object(obj)

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if self._pg is None:
            return ProcessGroupOps(self.root_device).reduce(tensor, op)  # validates op; identity
        return self._pg.reduce(tensor, op)

    def __repr__(self) -> str:
        return (f"DDPStrategy(world_size={self.world_size}, rank={self.global_rank}, "
                f"backend={self._backend!r}, device={self.root_device}, env={self.cluster_environment.name})")


def _restarted_agent_store(timeout):
    """Under torchrun's elastic agent with its shared store (``TORCHELASTIC_USE_AGENT_STORE``),
    a client of that store under a prefix of this worker group's own: the store outlives
    the worker groups, the default group's keys are the same in every attempt, and a
    restarted rank could read a dead peer's address before the new one is written and
    fail to connect. The prefix is the generation the ranks agreed on in the store
    (:mod:`ember.distributed.elastic`), not the agent's ``TORCHELASTIC_RESTART_COUNT``,
    which differs between nodes after one node's restart. None elsewhere (``env://``)."""
    from ember.distributed import elastic
    if not elastic.under_agent_store():
        return None
    generation = elastic.agreed_generation(timeout)
    return dist.PrefixStore(f"/ember/attempt_{generation}/", elastic.agent_store(timeout))


def cuda_index(local_rank: int, gpu_ids: "list[int] | None", visible: int) -> int:
    """The CUDA device of a process: ``gpu_ids[local_rank]`` when given, else
    ``local_rank``; but when the process sees exactly one GPU (per-task binding:
    ``srun --gpus-per-task=1`` / ``--gpu-bind``, or ``CUDA_VISIBLE_DEVICES`` set per
    process) that GPU is index 0 whatever the local rank. A local rank past the visible
    GPUs is an error rather than two processes silently sharing one."""
    idx = gpu_ids[local_rank] if gpu_ids else local_rank
    if gpu_ids or visible == 0 or idx < visible:
        return idx
    if visible == 1:
        return 0
    raise MisconfigurationError(
        f"local rank {local_rank} would use cuda:{idx}, but this process sees {visible} GPU(s) "
        "(CUDA_VISIBLE_DEVICES / the scheduler's GPU binding); start at most one process per visible GPU")
