"""``FSDPStrategy``: fully sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank keeps only its shard (dim 0) of every parameter, gradient and
optimizer state; parameters are all-gathered for forward/backward per wrapped
layer and freed again. Processes are started and found exactly as for
:class:`~ember.strategies.ddp.DDPStrategy`.

- ``configure_model`` runs on the meta device: layers built there cost no
  memory until they are sharded, then each rank allocates its shard and calls
  ``reset_parameters()`` on every module that owns meta tensors (so every such
  module must define it, as the ``torch.nn`` layers do). A module marked by
  ``ember.integrations.hf_load`` (a Transformers model read on rank 0 only) takes
  rank 0's weights into its shards instead (``full_load.shard_from_rank0``).
- Checkpoints are ``torch.distributed.checkpoint`` (DCP) folders ``model/``
  holding model and optimizer shards; they load at any world size.
  ``state_dict_type="full"`` writes ``model.safetensors`` (+ full optimizer
  states) instead. :meth:`FSDPStrategy.export_full` writes full weights.

See ``docs/sharding.md``.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import os
import warnings
import weakref
from datetime import timedelta
from itertools import chain
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ember.errors import CheckpointError, MisconfigurationError, invalid_choice
from ember.precision import NULL_CONTEXT
from ember.strategies.blocks import apply_activation_checkpointing, check_block_policy, find_blocks
from ember.strategies.full_load import allocate_meta, rank0_full_state, shard_from_rank0, to_meta
from ember.strategies.full_load import load_full_weights  # noqa: F401  (a public name here too)
from ember.strategies.ddp import DDPStrategy

_STATE_DICT_TYPES = ("sharded", "full")
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_DCP_KEY_MODEL, _DCP_KEY_OPTIM = "model", "optim"


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def init_single_process_group(backend: str = "gloo") -> bool:
    """A one-rank process group (FSDP and DCP need one even on one device).
    Returns True when it created one."""
    if dist.is_initialized():
        return False
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    def _destroy():
        if dist.is_initialized():
            dist.destroy_process_group()
    atexit.register(_destroy)
    return True


class FSDPStrategy(DDPStrategy):
    """Shard parameters, gradients and optimizer states over the ranks (FSDP2).

    Args:
        devices, num_nodes, process_group_backend, timeout, accelerator, start_method,
            cluster_environment: as for :class:`~ember.strategies.ddp.DDPStrategy`.
        auto_wrap_policy: which submodules become their own FSDP unit (all-gathered
            and freed on their own, so the all-gather of the next block overlaps the
            compute of this one): a set/list of layer classes, or a callable
            ``fn(module) -> bool``. Default ``"auto"``: the transformer blocks, found
            as the classes named in transformers' ``_no_split_modules``, else the
            children of every ``nn.ModuleList`` / ``nn.Sequential`` of two or more
            modules of one class (see :func:`find_blocks`). ``False``: only the root
            (one unit, one whole-model all-gather).
        reshard_after_forward: free the gathered parameters after forward (and gather
            again in backward). Default True (``$EMBER_FSDP_RESHARD_AFTER_FORWARD``).
        cpu_offload: keep shards, gradients and optimizer states on the CPU
            (``CPUOffloadPolicy``). Default False (``$EMBER_FSDP_CPU_OFFLOAD``).
        activation_checkpointing: layer classes whose activations are recomputed in
            backward; ``True`` means the ``auto_wrap_policy`` classes.
        mixed_precision: a ``torch.distributed.fsdp.MixedPrecisionPolicy``; default
            derived from the precision: ``bf16-mixed`` -> bf16 compute, fp32 reduce;
            ``16-mixed`` -> fp16 compute, fp32 reduce, sharded loss scaling. This policy is
            the only precision path: under a mixed precision the loop adds no autocast
            (the strategy runs its own :class:`~ember.precision.ShardedMixedPrecision`).
        state_dict_type: ``"sharded"`` (DCP folder, default) or ``"full"``
            (``model.safetensors`` gathered on rank 0; memory of the full model).
        async_save: write checkpoints in a background thread (DCP's ``async_save``;
            with ``state_dict_type="full"``, rank 0's writer thread); the checkpoint
            directory appears once the write finishes (at the latest at the next
            save or at teardown).
        init_on_meta: build ``configure_model`` layers on the meta device (default True).
        device_mesh: the mesh to shard over: a ``DeviceMesh``, or its sizes, ``(replicate,
            shard)`` for HSDP (a 2-D mesh named ``("replicate", "shard")``: parameters are
            sharded inside each group of ``shard`` ranks and replicated across the
            ``replicate`` groups, e.g. one group per node). Default: one dimension over
            every rank (plain FSDP).
        hsdp: ``(replicate, shard)`` sizes; the same as ``device_mesh=(replicate, shard)``.
        shard_accumulated_grads: under gradient accumulation, reduce-scatter after every
            micro-batch so the accumulated gradients stay sharded (1/N of the gradient
            memory; default True). False: each rank accumulates full gradients and
            reduce-scatters once, on the window's last micro-batch (fewer collectives,
            full gradient memory until then).
        **kwargs: passed to ``fully_shard`` (e.g. ``shard_placement_fn``).
    """

    name = "fsdp"
    is_sharded = True
    loss_scaler = "sharded"   # 16-mixed: torch's ShardedGradScaler (inf checks across shards)

    def __init__(self, devices: int | list[int] | str | None = None, num_nodes: int = 1,
                 auto_wrap_policy: str | set[type[nn.Module]] | Callable | None = "auto",
                 reshard_after_forward: bool | None = None, cpu_offload: bool | None = None,
                 activation_checkpointing: bool | set[type[nn.Module]] | list[type[nn.Module]] | None = None,
                 mixed_precision: Any = None, state_dict_type: str = "sharded", async_save: bool = False,
                 init_on_meta: bool = True, device_mesh: dist.device_mesh.DeviceMesh | tuple[int, ...] | None = None,
                 hsdp: "tuple[int, int] | None" = None, shard_accumulated_grads: bool = True,
                 process_group_backend: str | None = None,
                 timeout: "timedelta | float" = timedelta(minutes=30), accelerator: str | None = None,
                 start_method: str = "popen", cluster_environment: Any = None, **kwargs: Any) -> None:
        super().__init__(devices=devices, num_nodes=num_nodes, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, accelerator=accelerator,
                         cluster_environment=cluster_environment)
        self.ddp_kwargs = {}
        if state_dict_type not in _STATE_DICT_TYPES:
            raise invalid_choice("state_dict_type", state_dict_type, _STATE_DICT_TYPES)
        self._auto_wrap = isinstance(auto_wrap_policy, str) and auto_wrap_policy == "auto"
        if isinstance(auto_wrap_policy, str) and not self._auto_wrap:
            raise invalid_choice("auto_wrap_policy", auto_wrap_policy, ["auto", "False", "a set of classes",
                                                                         "a callable"])
        self._wrap_check = None if (self._auto_wrap or auto_wrap_policy is False) else \
            self._parse_policy("auto_wrap_policy", auto_wrap_policy)
        if hsdp is not None:
            if device_mesh is not None:
                raise MisconfigurationError("pass either hsdp=(replicate, shard) or device_mesh, not both")
            device_mesh = hsdp
        self._mesh_request = self._parse_mesh(device_mesh)
        self.shard_accumulated_grads = bool(shard_accumulated_grads)
        if activation_checkpointing is True and not self._auto_wrap:
            if auto_wrap_policy in (None, False) or callable(auto_wrap_policy) \
                    and not isinstance(auto_wrap_policy, type):
                raise MisconfigurationError(
                    "activation_checkpointing=True means 'the auto_wrap_policy layer classes', but "
                    f"auto_wrap_policy={auto_wrap_policy!r} is not a set of classes; pass the classes "
                    "(activation_checkpointing={MyBlock})")
            activation_checkpointing = auto_wrap_policy
        # True (with the default auto_wrap_policy): the blocks find_blocks() detects
        self._ac_policy = check_block_policy("activation_checkpointing", activation_checkpointing or None)
        self.reshard_after_forward = (_env_flag("EMBER_FSDP_RESHARD_AFTER_FORWARD", True)
                                      if reshard_after_forward is None else bool(reshard_after_forward))
        self.cpu_offload = _env_flag("EMBER_FSDP_CPU_OFFLOAD", False) if cpu_offload is None else bool(cpu_offload)
        from torch.distributed.fsdp import MixedPrecisionPolicy
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise MisconfigurationError(f"mixed_precision={mixed_precision!r} is not valid; pass a "
                                        "torch.distributed.fsdp.MixedPrecisionPolicy or None (derived from precision)")
        self.mixed_precision = mixed_precision
        self.state_dict_type = state_dict_type
        self.async_save = bool(async_save)
        self.init_on_meta = bool(init_on_meta)
        from torch.distributed.fsdp import fully_shard
        allowed = set(inspect.signature(fully_shard).parameters) - {"module", "mesh", "reshard_after_forward",
                                                                     "mp_policy", "offload_policy"}
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise MisconfigurationError(f"FSDPStrategy got unknown argument(s) {unknown}; extra keyword arguments "
                                        f"are passed to fully_shard, which accepts {sorted(allowed)}")
        self.fsdp_kwargs = kwargs
        self._mesh = None
        self._models: list[nn.Module] = []
        self._old_params: dict[int, tuple[nn.Module, str, weakref.ref]] = {}
        self._pending_save = None
        self._async_pg = None

    @staticmethod
    def _parse_mesh(mesh):
        if mesh is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh
        if isinstance(mesh, DeviceMesh):
            return mesh
        if isinstance(mesh, int) and not isinstance(mesh, bool):
            mesh = (mesh,)
        if isinstance(mesh, (tuple, list)) and 1 <= len(mesh) <= 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh):
            return tuple(mesh)
        raise MisconfigurationError(f"device_mesh/hsdp={mesh!r} is not valid; pass a DeviceMesh, or sizes "
                                    "(replicate, shard) for HSDP, e.g. hsdp=(2, 4) for 2 nodes of 4 GPUs")

    def _build_mesh(self):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        req, world = self._mesh_request, dist.get_world_size()
        if isinstance(req, DeviceMesh):
            return req
        if req is None or len(req) == 1:
            if req is not None and req[0] != world:
                raise MisconfigurationError(f"device_mesh=({req[0]},) does not match the {world} processes")
            return init_device_mesh(self.root_device.type, (world,))
        if req[0] * req[1] != world:
            raise MisconfigurationError(f"hsdp/device_mesh=(replicate={req[0]}, shard={req[1]}) needs "
                                        f"{req[0] * req[1]} processes, but {world} are running")
        return init_device_mesh(self.root_device.type, tuple(req), mesh_dim_names=("replicate", "shard"))

    @staticmethod
    def _parse_policy(arg: str, policy) -> Callable[[nn.Module], bool] | None:
        if policy is None:
            return None
        if isinstance(policy, type) and issubclass(policy, nn.Module):
            policy = {policy}
        if isinstance(policy, (set, frozenset, list, tuple)):
            classes = tuple(policy)
            bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
            if bad or not classes:
                raise MisconfigurationError(f"{arg}={policy!r}: expected nn.Module subclasses (e.g. {{MyBlock}}) "
                                            "or a callable fn(module) -> bool")
            return lambda m: isinstance(m, classes)
        if callable(policy):
            return policy
        raise MisconfigurationError(f"{arg}={policy!r} is not valid; use a set of nn.Module classes or a "
                                    "callable fn(module) -> bool")

    # -- lifecycle -------------------------------------------------------------------
    def setup_environment(self) -> None:
        # one precision path: "bf16-mixed"/"16-mixed" cast through fully_shard's MixedPrecisionPolicy
        # (parameters all-gathered in the low dtype), so the loop adds no autocast on top
        if hasattr(self.precision, "for_sharding"):
            self.precision = self.precision.for_sharding()
        super().setup_environment()
        if self._single:       # one process: FSDP and DCP still need a (one-rank) process group
            init_single_process_group("nccl" if self._use_cuda and self._backend == "nccl" else "gloo")

    @property
    def mesh(self):
        """The mesh ``fully_shard`` shards over (1-D, or 2-D ``("replicate", "shard")`` for HSDP)."""
        if self._mesh is None:
            self._mesh = self._build_mesh()
        return self._mesh

    @property
    def device_mesh(self):
        """The strategy's DeviceMesh (``TrainModule.device_mesh`` in ``configure_model``)."""
        return self.mesh

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        if self.mixed_precision is not None:
            return self.mixed_precision
        name = self.precision.name
        if name == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if name == "16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    @contextlib.contextmanager
    def module_init_context(self):
        """Meta device (plus the precision's default dtype) while ``configure_model`` runs."""
        with super().module_init_context():
            if not self.init_on_meta:
                yield
                return
            with torch.device("meta"):
                yield

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
        if isinstance(module, FSDPModule):
            return module
        module = self.precision.convert_module(module)
        tensors = list(chain(module.named_parameters(), module.named_buffers()))
        meta = {n for n, t in tensors if t.is_meta}
        full = rank0_full_state(self, module)         # weights read on rank 0 only (hf_load)
        if meta and full is None:
            self._check_resettable(module, meta)      # before any change to the module
        elif not meta and full is None:
            module = module.to(self.root_device)
        for fqn, p in module.named_parameters():      # weak: an optimizer may still hold them
            self._old_params[id(p)] = (module, fqn, weakref.ref(p))
        rank0_buffers = None
        if full is not None and not meta:
            # rank 0 shards from the meta device like the others: its full weights stay in
            # host memory (``full``) and reach the device one tensor at a time, never the
            # whole model at once (new Parameter objects: the old ones are recorded above)
            rank0_buffers = {n: b.detach().cpu() for n, b in module.named_buffers() if n not in full}
            module = to_meta(module)
            meta = {n for n, _ in chain(module.named_parameters(), module.named_buffers())}
        apply_activation_checkpointing(module, self._ac_policy)   # before sharding, as torchtitan
        kw = dict(mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self._mp_policy(),
                  offload_policy=(CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
                                  if self.cpu_offload else OffloadPolicy()), **self.fsdp_kwargs)
        if self._wrap_check is not None:
            units = [m for m in module.modules() if m is not module and self._wrap_check(m)]
        else:
            units = find_blocks(module) if self._auto_wrap else []
        # bottom-up: inner matches first, then the layers that contain them; a module the
        # user already sharded in configure_model (fully_shard) is left as it is
        for m in reversed(units):
            if not isinstance(m, FSDPModule):
                fully_shard(m, **kw)
        fully_shard(module, **kw)
        if full is not None:
            shard_from_rank0(self, module, meta, full, rank0_buffers)
        elif meta:
            self._materialize(module, meta)
        for name in _STEP_METHODS:
            if callable(getattr(module, name, None)):
                from torch.distributed.fsdp import register_fsdp_forward_method
                register_fsdp_forward_method(module, name)
        self._models.append(module)
        return module

    @staticmethod
    def _check_resettable(module: nn.Module, meta: set[str]) -> None:
        missing = []
        for mod_name, m in module.named_modules():
            own = [f"{mod_name}.{n}" if mod_name else n
                   for n, _ in chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))]
            if any(n in meta for n in own) and not callable(getattr(m, "reset_parameters", None)):
                missing.append(f"{mod_name or '<root>'} ({type(m).__name__})")
        if missing:
            raise MisconfigurationError(
                "FSDP built these modules on the meta device in configure_model, but they have no "
                f"reset_parameters() to initialise their shards: {', '.join(missing[:10])}. Define "
                "reset_parameters() on them, build them in __init__ instead, or pass "
                "FSDPStrategy(init_on_meta=False)")

    def _materialize(self, module: nn.Module, meta: set[str]) -> None:
        """Allocate the shards of meta tensors and initialise them with ``reset_parameters``."""
        allocate_meta(module, meta, self.root_device)
        with torch.no_grad():
            for mod_name, m in module.named_modules():
                own = [f"{mod_name}.{n}" if mod_name else n
                       for n, _ in chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))]
                if any(n in meta for n in own):
                    _reset_full(m, self.root_device)

    def setup_optimizers(self, module: nn.Module, optimizers: list) -> tuple[nn.Module, list]:
        """Point optimizers created before sharding (``Accelerator.prepare(model, opt)``)
        at the sharded parameters; those created after need nothing."""
        for opt in optimizers:
            for group in opt.param_groups:
                new = []
                for p in group["params"]:
                    rec = self._old_params.get(id(p))
                    if rec is not None and rec[2]() is p:
                        if opt.state.get(p):
                            raise MisconfigurationError(
                                "an optimizer that already stepped was passed with a model that FSDP "
                                "sharded; create or prepare the optimizer before its first step")
                        p = rec[0].get_parameter(rec[1])
                    new.append(p)
                group["params"] = new
        self._old_params.clear()
        return module, optimizers

    def teardown(self) -> None:
        self._finish_pending_save()
        super().teardown()

    def on_exception(self, exc: BaseException) -> None:
        """As :meth:`Strategy.on_exception`; a pending DCP ``async_save`` is dropped, not
        committed (a commit needs every rank at its collectives), and its ``NAME.ember-tmp``
        stays behind, never counting as a checkpoint."""
        if not isinstance(self._pending_save, tuple):   # a full-state write by rank 0's thread
            return super().on_exception(exc)
        self._commit_actions = None     # the dropped save is never committed
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            warnings.warn(f"the asynchronous save of {pending[1]} was not committed: the run failed "
                          f"({type(exc).__name__})", UserWarning, stacklevel=2)

    # -- step ------------------------------------------------------------------------
    def optimizer_step(self, optimizer, module: nn.Module | None = None, closure=None) -> None:
        if self.precision.scaler is None:
            return self.precision.optimizer_step(optimizer, closure)
        with warnings.catch_warnings():   # the sharded inf check reduces a 1-element tensor: benign
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            self.precision.optimizer_step(optimizer, closure)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        from torch.distributed.fsdp import FSDPModule
        if not enabled or self.shard_accumulated_grads or not isinstance(module, FSDPModule):
            return NULL_CONTEXT      # reduce-scatter now: the accumulated gradients stay sharded
        return _no_gradient_sync(module)

    # -- state dicts ---------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on CPU, gathered on global rank 0 (an empty dict on the others).
        A collective: every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_module_state_dict(self, module: nn.Module, state: dict, strict: bool = True):
        """Load full weights (every rank passes the same full dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        return set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def optimizer_state_dict(self, optimizer, module: nn.Module | None = None) -> dict:
        """Full optimizer state keyed by parameter name, on rank 0 (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        module = module if module is not None else self._owner(optimizer)
        return get_optimizer_state_dict(module, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state_dict(self, optimizer, state: dict, module: nn.Module | None = None):
        """Load a full optimizer state: keyed by parameter name (as :meth:`optimizer_state_dict`
        writes) or by index (``optimizer.state_dict()`` of an unsharded run)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        module = module if module is not None else self._owner(optimizer)
        state = self._fqn_keyed(module, optimizer, state)
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def _owner(self, optimizer) -> nn.Module:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for m in self._models:
            if any(id(p) in ids for p in m.parameters()):
                return m
        raise MisconfigurationError("this optimizer does not train a module that FSDPStrategy set up")

    @staticmethod
    def _fqn_keyed(module: nn.Module, optimizer, state: dict) -> dict:
        groups = state.get("param_groups") or []
        if not groups or all(isinstance(k, str) for g in groups for k in g["params"]):
            return state
        names = {id(p): n for n, p in module.named_parameters()}
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"optimizer state has {len(groups)} parameter groups, the optimizer "
                                  f"{len(optimizer.param_groups)}")
        index_to_name, out_groups = {}, []
        for saved, live in zip(groups, optimizer.param_groups):
            if len(saved["params"]) != len(live["params"]):
                raise CheckpointError(f"optimizer state has a group of {len(saved['params'])} parameters where "
                                      f"the optimizer has {len(live['params'])}")
            for idx, p in zip(saved["params"], live["params"]):
                index_to_name[idx] = names[id(p)]
            out_groups.append(dict(saved, params=[index_to_name[i] for i in saved["params"]]))
        return {"state": {index_to_name[k]: v for k, v in state.get("state", {}).items()},
                "param_groups": out_groups}

    # -- checkpoints -----------------------------------------------------------------------
    @staticmethod
    def _meta(module: nn.Module, meta: dict, **extra) -> dict:
        from torch.distributed.fsdp import FSDPModule
        meta = dict(meta)
        cls = next((c for c in type(module).__mro__ if not issubclass(c, FSDPModule)), type(module))
        if "module_class" in meta:   # the class fully_shard swapped in is FSDP<Name>; record the user's
            meta["module_class"] = f"{cls.__module__}.{cls.__qualname__}"
        meta.update(extra)
        return meta

    def save_checkpoint(self, path: str, module: nn.Module, optimizers: list, trainer_state: dict,
                        meta: dict, weights_only: bool = False) -> None:
        """Write ``path`` atomically: rank 0 prepares ``NAME.ember-tmp``, every rank writes its
        shards into ``NAME.ember-tmp/model/`` (DCP), rank 0 adds ``trainer_state.pt`` and
        ``meta.json`` and renames ``NAME.ember-tmp`` to ``NAME``."""
        from ember.checkpoint import io as cio
        self._finish_pending_save()
        path = os.path.normpath(os.fspath(path))
        meta = self._meta(module, meta, sharded=self.state_dict_type == "sharded",
                          state_dict_type=self.state_dict_type)
        if self.state_dict_type == "full":   # gathered to rank 0, written as one device does (async_save too)
            return super().save_checkpoint(path, module, optimizers, trainer_state, meta, weights_only)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
        from ember.strategies.full_load import staging_on_rank0
        tmp = staging_on_rank0(self, path)
        if weights_only:
            sd = {_DCP_KEY_MODEL: get_model_state_dict(module)}
        else:
            msd, osd = get_state_dict(module, optimizers=tuple(optimizers))
            sd = {_DCP_KEY_MODEL: msd, _DCP_KEY_OPTIM: osd}
        state = None if weights_only else dict(
            trainer_state, optimizers=[{"stored_in": cio.DCP_WEIGHTS_DIR, "key": _DCP_KEY_OPTIM}] * len(optimizers))
        target = os.path.join(tmp, cio.DCP_WEIGHTS_DIR)
        if self.async_save:
            if self._async_pg is None:
                self._async_pg = dist.new_group(backend="gloo")
            future = dcp.async_save(sd, checkpoint_id=target, process_group=self._async_pg)
            # trainer state is a snapshot of this moment: callbacks mutate their state later
            self._pending_save = (future, path, copy.deepcopy(state), meta)
            return
        try:
            dcp.save(sd, checkpoint_id=target)
        except BaseException:
            if self.is_global_zero:
                cio.remove_staging(path)
            raise
        self._commit(path, state, meta)

    def _commit(self, path: str, state: dict | None, meta: dict) -> None:
        """Rank 0 renames ``NAME.ember-tmp`` into place only when every shard file the DCP
        metadata names is there with its bytes (listed in ``meta.json``). A missing shard,
        or a failed write on rank 0, raises on every rank (as :meth:`Strategy.save_checkpoint`)."""
        from ember.checkpoint import io as cio
        from ember.strategies.full_load import raise_rank0_error, verify_dcp_shards
        self.barrier("save_checkpoint:shards")       # every rank has returned from its write
        error = None
        if self.is_global_zero:
            try:
                shards = verify_dcp_shards(os.path.join(cio.tmp_path(path), cio.DCP_WEIGHTS_DIR), path)
                cio.write_checkpoint(path, None, state, meta, keep_existing_tmp=True, extra_files=shards)
            except Exception as err:     # reported to every rank below, raised here as it is
                error = err
        raise_rank0_error(self, error, f"checkpoint {path} was not committed", complete=True)

    def _finish_pending_save(self) -> None:
        """Wait for a background (``async_save``) write, then commit its directory."""
        if not isinstance(self._pending_save, tuple):   # state_dict_type="full": rank 0's writer thread
            return super()._finish_pending_save()
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        future, path, state, meta = pending
        with self._committing():
            future.result()
            self._commit(path, state, meta)

    def wait_for_checkpoint(self) -> None:
        """Block until an ``async_save`` checkpoint is complete on disk."""
        self._finish_pending_save()

    @property
    def save_pending(self) -> bool:
        """Whether an ``async_save`` checkpoint may not be committed yet (every rank)."""
        return isinstance(self._pending_save, tuple) or super().save_pending

    def load_checkpoint(self, path: str, module: nn.Module, optimizers: list, strict: bool = True,
                        weights_only: bool = False) -> dict:
        """Load a DCP checkpoint (any world size), a ``state_dict_type="full"``
        checkpoint, or an unsharded one (``model.safetensors``, e.g. from a single device)."""
        from ember.checkpoint import io as cio
        self._finish_pending_save()
        path = os.fspath(path)
        if self.world_size > 1 and os.path.isfile(os.path.join(path, cio.WEIGHTS_NAME)):
            # full weights: read on rank 0 only and broadcast, each rank keeps its shard
            from ember.strategies.full_load import load_full_from_rank0
            return load_full_from_rank0(self, path, module, optimizers, strict=strict, weights_only=weights_only)
        weights, state, meta = cio.read_checkpoint(path, load_state=not weights_only)
        state = state or {}
        if optimizers and not weights_only:   # before anything is loaded
            from ember.checkpoint.trust import check_optimizers
            check_optimizers(optimizers, state.get("optimizers"), meta, path)
        if weights is not None:
            cio.check_compatible(self.unwrap_module(module), weights, path, strict=strict)
            self.load_module_state_dict(module, weights, strict=strict)
            saved = state.get("optimizers", [])
            if optimizers and len(saved) != len(optimizers):
                raise CheckpointError(f"{path} has {len(saved)} optimizer state(s) but {len(optimizers)} "
                                      "optimizer(s) are set up")
            for opt, s in zip(optimizers, saved):
                self.load_optimizer_state_dict(opt, s, module)
        else:
            self._load_dcp(path, module, optimizers, state, strict, weights_only)
        state["meta"] = meta
        return state

    def _load_dcp(self, path, module, optimizers, state, strict, weights_only) -> None:
        import torch.distributed.checkpoint as dcp
        from ember.checkpoint import io as cio
        from ember.checkpoint.trust import dcp_planner, dcp_reader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict, set_model_state_dict, set_state_dict)
        folder = os.path.join(path, cio.DCP_WEIGHTS_DIR)
        try:
            md = dcp_reader(folder).read_metadata().state_dict_metadata
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{folder} is not a readable torch.distributed.checkpoint folder "
                                  f"({type(err).__name__}: {err})") from err
        prefix = _DCP_KEY_MODEL + "."
        shapes = {k[len(prefix):]: torch.empty(tuple(v.size), dtype=v.properties.dtype, device="meta")
                  for k, v in md.items()
                  if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
        cio.check_compatible(self.unwrap_module(module), shapes, path, strict=strict)
        load_optim = bool(optimizers) and not weights_only
        if load_optim:
            saved = state.get("optimizers", [])
            if len(saved) != len(optimizers):
                raise CheckpointError(f"{path} has {len(saved)} optimizer state(s) but {len(optimizers)} "
                                      "optimizer(s) are set up")
            if not any(k.startswith(_DCP_KEY_OPTIM + ".") for k in md):
                raise CheckpointError(f"{path} holds weights only (no optimizer states)")
            msd, osd = get_state_dict(module, optimizers=tuple(optimizers))
            sd = {_DCP_KEY_MODEL: msd, _DCP_KEY_OPTIM: osd}
        else:
            sd = {_DCP_KEY_MODEL: get_model_state_dict(module)}
        try:
            dcp.load(sd, checkpoint_id=folder, storage_reader=dcp_reader(folder),
                     planner=dcp_planner(allow_partial_load=not strict))
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"could not load {folder}: {type(err).__name__}: {str(err)[:2000]}") from err
        opts = StateDictOptions(strict=strict)
        if load_optim:
            set_state_dict(module, optimizers=tuple(optimizers), model_state_dict=sd[_DCP_KEY_MODEL],
                           optim_state_dict=sd[_DCP_KEY_OPTIM], options=opts)
        else:
            set_model_state_dict(module, sd[_DCP_KEY_MODEL], options=opts)

    def _last_module(self) -> nn.Module | None:
        return self._models[-1] if self._models else None

    def __repr__(self) -> str:
        return (f"FSDPStrategy(world_size={self.world_size}, rank={self.global_rank}, "
                f"device={self.root_device}, reshard_after_forward={self.reshard_after_forward}, "
                f"cpu_offload={self.cpu_offload}, state_dict_type={self.state_dict_type!r})")


def _reset_full(m: nn.Module, device: torch.device) -> None:
    """``m.reset_parameters()`` on full-size stand-ins of its sharded parameters, then each
    rank keeps its slice: the same initialisation as on one device (given the same seed on
    every rank), and no duplicated shards where DTensor has no sharded RNG (CPU)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    sharded = {n: p for n, p in m._parameters.items() if isinstance(p, DTensor)}
    for n, p in sharded.items():
        m._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                        requires_grad=p.requires_grad)
    try:
        m.reset_parameters()
        for n, p in sharded.items():
            full = m._parameters[n].detach()
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
    finally:
        for n, p in sharded.items():
            m._parameters[n] = p


@contextlib.contextmanager
def _no_gradient_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
