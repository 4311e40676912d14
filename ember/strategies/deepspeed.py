"""``DeepSpeedStrategy``: ZeRO stage 1/2/3 through ``deepspeed.initialize``.

DeepSpeed is optional (``pip install "ember[deepspeed]"``) and imported only when
this strategy sets up. Processes are started and found as for
:class:`~ember.strategies.ddp.DDPStrategy`; the torch process group is created
first and DeepSpeed reuses it.

How ember drives the engine:

- The DeepSpeed config (a dict or a JSON file) may say ``"auto"``; ember fills
  ``train_micro_batch_size_per_gpu`` (train dataloader batch size),
  ``gradient_accumulation_steps``, ``train_batch_size`` (micro x accumulation x
  world), ``gradient_clipping`` (always set; ``0.0`` when the Trainer does not
  clip) and ``bf16``/``fp16`` (from the precision). A value that contradicts the
  Trainer's arguments is an error that names both.
- The caller owns accumulation: the engine runs with
  ``managed_gradient_accumulation: false``, ``backward`` never rescales the loss
  (:mod:`ember.step` already divided it by its accumulation window's size) and
  every ``engine.step()`` (called on the last micro-batch of a window) is an
  optimizer step.
- The user's module is wrapped so that ``training_step`` runs through the
  engine's forward (its hooks prepare backward); ``engine.module`` is an
  ``_EmberModuleWrapper`` around it.
- Checkpoints: the engine's own files in ``model/`` of ember's atomic checkpoint
  directory, plus ``trainer_state.pt`` and ``meta.json``. DeepSpeed reads its
  files with ``torch.load(weights_only=False)``: load only checkpoints you trust.

See ``docs/sharding.md``.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from ember.errors import CheckpointError, MisconfigurationError, invalid_choice
from ember.strategies.async_save import cpu_snapshot
from ember.precision import NULL_CONTEXT
from ember.strategies.ddp import DDPStrategy
from ember.strategies.fsdp import init_single_process_group

TAG = "model"                      # engine.save_checkpoint(tag=...) -> files in <checkpoint>/model/
_STEP_METHODS = ("training_step",)
_PRECISION_SECTION = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16",
                      "32-true": None}
_BUILD_MESSAGE = "ember: compiling DeepSpeed CPU ops once (~1 min)..."


def import_deepspeed():
    """``import deepspeed`` with an install hint when it is missing."""
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import deepspeed
    except ImportError as err:
        raise MisconfigurationError(
            "strategy='deepspeed' needs the deepspeed package: pip install 'ember[deepspeed]' "
            "(it compiles against the installed torch: add --no-build-isolation)") from err
    return deepspeed


# DeepSpeed 0.19.4 added ``managed_gradient_accumulation`` (an older engine ignores the key and
# steps on its own micro-batch counter: every acc_n**2 micro-batches); 0.19.5 made it work with
# ZeRO offload, which this strategy offers.
MIN_VERSION = (0, 19, 5)


def check_version(version: str) -> None:
    """Raise a MisconfigurationError when DeepSpeed ``version`` is older than
    :data:`MIN_VERSION` (ember relies on ``managed_gradient_accumulation: false``)."""
    parts = []
    for piece in str(version).split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    if tuple(parts + [0] * (3 - len(parts))) < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        raise MisconfigurationError(
            f"strategy='deepspeed' needs deepspeed>={need} (found {version}): ember decides the gradient "
            f"accumulation boundaries with the config key managed_gradient_accumulation=false, which older "
            f"versions ignore (they would step every accumulate_grad_batches**2 micro-batches). Upgrade: "
            f"pip install -U 'deepspeed>={need}' --no-build-isolation")


def prebuild_ops(verbose: bool = True) -> bool:
    """Compile the C++ ops DeepSpeed loads on a CPU run (its shared-memory collective)
    into ``$TORCH_EXTENSIONS_DIR`` once; later runs reuse the build. Returns True when
    it compiled something. Safe to call from several processes: they take turns on an
    ``flock`` the kernel releases when its holder dies, so a builder killed mid-compile
    (which leaves torch's own ``lock`` file behind, and torch would wait on it for
    ever) is noticed by the next one, which removes that file and builds again."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu") if not torch.cuda.is_available() else None
    deepspeed = import_deepspeed()
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        return False
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return False
    import fcntl
    from torch.utils.cpp_extension import _get_build_directory
    folder = _get_build_directory(builder.name, False)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "ember-build.lock"), "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)        # one ember builder at a time, on this machine
        stale = os.path.join(folder, "lock")
        if os.path.exists(stale):               # torch's baton, left by a builder that died
            warnings.warn(f"ember: removing {stale}, left by a DeepSpeed op build that was stopped; "
                          "building again", stacklevel=2)
            os.remove(stale)
        built = os.path.exists(os.path.join(folder, builder.name + ".so"))
        if not built and verbose:
            print(_BUILD_MESSAGE, file=sys.stderr, flush=True)
        builder.load(verbose=False)
    return not built


def _load_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise MisconfigurationError(f"DeepSpeed config={path!r}: no such file")
        try:
            with open(path) as f:
                out = json.load(f)
        except ValueError as err:
            raise MisconfigurationError(f"DeepSpeed config {path} is not valid JSON: {err}") from err
        if not isinstance(out, dict):
            raise MisconfigurationError(f"DeepSpeed config {path} must hold a JSON object")
        return out
    raise MisconfigurationError(f"config={config!r} is not valid; pass a dict or the path of a JSON file")


def _env_offload(name: str) -> bool | None:
    v = os.environ.get(name)
    return None if not v else v.strip().lower() == "cpu"


class _EmberModuleWrapper(nn.Module):
    """What the engine wraps: ``forward`` of the user's module, or (with
    ``_ember_method=name``) one of its step methods, so that they run through the
    engine's forward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._methods: dict[str, Any] = {}

    def forward(self, *args, _ember_method: str | None = None, **kwargs):
        if _ember_method is None:
            return self.module(*args, **kwargs)
        return self._methods[_ember_method](*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The wrapped module's own ``load_state_dict`` (what the engine's load calls): a
        module whose state leaves keys out (an adapter run's frozen base) decides which
        missing keys are errors."""
        from torch.nn.modules.module import _IncompatibleKeys
        inner = collections.OrderedDict((k[len("module."):], v) for k, v in state_dict.items()
                                        if k.startswith("module."))
        meta = getattr(state_dict, "_metadata", None)
        if meta is not None:   # per-module versions (e.g. BatchNorm's), keyed by module path
            inner._metadata = {k[len("module."):] if k.startswith("module.") else "": v
                               for k, v in meta.items() if k == "module" or k.startswith("module.")}
        other = [k for k in state_dict if not k.startswith("module.")]
        if strict and other:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: "
                               f"unexpected keys {other[:10]}")
        result = self.module.load_state_dict(inner, strict=strict, assign=assign)
        return _IncompatibleKeys([f"module.{k}" for k in result.missing_keys],
                                 [f"module.{k}" for k in result.unexpected_keys] + other)


class DeepSpeedStrategy(DDPStrategy):
    """ZeRO data parallelism with DeepSpeed.

    Args:
        devices, num_nodes, process_group_backend, timeout, accelerator, start_method,
            cluster_environment: as for :class:`~ember.strategies.ddp.DDPStrategy`.
        stage: ZeRO stage 1 (optimizer states sharded), 2 (+ gradients) or 3 (+ parameters).
            Default: the config's, else ``$EMBER_DEEPSPEED_ZERO_STAGE``, else 2.
        offload_optimizer: optimizer states and step on the CPU.
        offload_parameters: parameters on the CPU (stage 3 only).
        config: a DeepSpeed config dict or JSON file; ``"auto"`` values are filled in.
        async_save: write the ZeRO files in a background thread per rank: the save copies
            the states to CPU memory and returns; the checkpoint is checked and committed
            at the next save, before a load, or at teardown (see ``docs/sharding.md``).
        **kwargs: merged into the config's ``zero_optimization`` section
            (e.g. ``stage3_param_persistence_threshold=0``).
    """

    name = "deepspeed"
    is_sharded = True
    owns_optimizer_step = True
    loss_scaler = None   # DeepSpeed scales fp16 losses itself

    def __init__(self, devices: int | list[int] | str | None = None, num_nodes: int = 1, stage: int | None = None,
                 offload_optimizer: bool | None = None, offload_parameters: bool | None = None,
                 config: dict[str, Any] | str | os.PathLike | None = None, process_group_backend: str | None = None,
                 timeout: "timedelta | float" = timedelta(minutes=30), accelerator: str | None = None,
                 start_method: str = "popen", cluster_environment: Any = None, async_save: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(devices=devices, num_nodes=num_nodes, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, accelerator=accelerator,
                         cluster_environment=cluster_environment)
        self.ddp_kwargs = {}
        self._user_config = _load_config(config)
        zero = self._user_config.get("zero_optimization") or {}
        if not isinstance(zero, dict):
            raise MisconfigurationError("DeepSpeed config 'zero_optimization' must be an object")
        cfg_stage = zero.get("stage")
        if stage is not None and cfg_stage not in (None, "auto") and int(cfg_stage) != int(stage):
            raise MisconfigurationError(f"stage={stage} conflicts with the DeepSpeed config's "
                                        f"zero_optimization.stage={cfg_stage}; pass one of them")
        if stage is None:
            env = os.environ.get("EMBER_DEEPSPEED_ZERO_STAGE")
            stage = cfg_stage if cfg_stage not in (None, "auto") else (int(env) if env else 2)
        if stage not in (1, 2, 3) and str(stage) not in ("1", "2", "3"):
            raise invalid_choice("stage", stage, (1, 2, 3))
        self.stage = int(stage)
        self.offload_optimizer = bool(_env_offload("EMBER_DEEPSPEED_OFFLOAD_OPTIMIZER")
                                      if offload_optimizer is None else offload_optimizer)
        self.offload_parameters = bool(_env_offload("EMBER_DEEPSPEED_OFFLOAD_PARAMS")
                                       if offload_parameters is None else offload_parameters)
        if self.offload_parameters and self.stage != 3:
            raise MisconfigurationError(f"offload_parameters=True needs ZeRO stage 3 (stage={self.stage}); "
                                        "use stage=3 or offload_optimizer=True")
        for section in ("optimizer", "scheduler"):
            if section in self._user_config:
                raise MisconfigurationError(
                    f"the DeepSpeed config has a {section!r} section; ember passes the optimizer and scheduler "
                    "from configure_optimizers (or Accelerator.prepare) to DeepSpeed: remove the section")
        self.zero_kwargs = kwargs
        self._trainer_values: dict | None = None
        self.config: dict | None = None
        self._engine = None
        self._module: nn.Module | None = None
        self.async_save = bool(async_save)
        self._ds_pending: tuple | None = None   # (path, state, meta, engine, writer, error) awaiting its commit

    # -- configuration -----------------------------------------------------------------
    def configure_from_trainer(self, accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
                               micro_batch_size: int | None = None, gradient_clip_algorithm: str = "norm") -> None:
        """The Trainer's values for the config's ``"auto"`` entries: the Trainer calls
        this before :meth:`setup_optimizers` (the strategy never looks for a trainer)."""
        if gradient_clip_val is not None and gradient_clip_algorithm != "norm":
            raise MisconfigurationError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not supported by DeepSpeed, which clips "
                "by norm; use gradient_clip_algorithm='norm'")
        self._trainer_values = {"accumulate_grad_batches": int(accumulate_grad_batches),
                                "gradient_clip_val": gradient_clip_val, "micro_batch_size": micro_batch_size}

    def resolve_config(self, module: nn.Module | None = None) -> dict:
        """The config handed to ``deepspeed.initialize``: the user's, with ``"auto"``
        filled in and conflicts with the Trainer's arguments reported."""
        cfg = copy.deepcopy(self._user_config)
        tv = self._trainer_values   # set by the Trainer through configure_from_trainer(); None otherwise

        def fill(key: str, value, arg: str | None):
            cur = cfg.get(key, "auto")
            if cur == "auto" or cur is None:
                cfg[key] = value
            elif arg is not None and cur != value:
                raise MisconfigurationError(
                    f"the DeepSpeed config sets {key}={cur!r}, but {arg}={value!r}; make them agree "
                    f"(or set {key} to \"auto\" in the config)")

        if tv is not None:
            micro = tv["micro_batch_size"]
            fill("gradient_accumulation_steps", tv["accumulate_grad_batches"], "Trainer accumulate_grad_batches")
            clip = float(tv["gradient_clip_val"]) if tv["gradient_clip_val"] is not None else 0.0
            fill("gradient_clipping", clip, "Trainer gradient_clip_val")
            if micro is not None:
                fill("train_micro_batch_size_per_gpu", int(micro), "the train dataloader's batch_size")
        else:
            fill("gradient_accumulation_steps", 1, None)
            fill("gradient_clipping", 0.0, None)
        fill("train_micro_batch_size_per_gpu", 1, None)
        gas, micro = int(cfg["gradient_accumulation_steps"]), int(cfg["train_micro_batch_size_per_gpu"])
        fill("train_batch_size", micro * gas * self.world_size,
             f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size ({micro} x {gas} x "
             f"{self.world_size})")
        want = self._precision_section()
        for section in ("bf16", "fp16"):
            sec = cfg.get(section)
            sec = dict(sec) if isinstance(sec, dict) else {}
            enabled = sec.get("enabled", "auto")
            if enabled != "auto" and bool(enabled) != (section == want):
                raise MisconfigurationError(
                    f"the DeepSpeed config sets {section}.enabled={enabled!r}, but precision="
                    f"{self.precision.name!r}; make them agree (or set it to \"auto\")")
            sec["enabled"] = section == want
            cfg[section] = sec
        if cfg.get("managed_gradient_accumulation", False):
            raise MisconfigurationError("the DeepSpeed config sets managed_gradient_accumulation=true; ember "
                                        "decides the accumulation boundaries itself: remove the entry")
        cfg["managed_gradient_accumulation"] = False
        zero = dict(cfg.get("zero_optimization") or {})
        zero["stage"] = self.stage
        pin = self.root_device.type == "cuda"
        if self.offload_optimizer:
            zero["offload_optimizer"] = dict(zero.get("offload_optimizer") or {}, device="cpu", pin_memory=pin)
        if self.offload_parameters:
            zero["offload_param"] = dict(zero.get("offload_param") or {}, device="cpu", pin_memory=pin)
        zero.update(self.zero_kwargs)
        cfg["zero_optimization"] = zero
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)   # a torch optimizer is fine; no cpu_adam build
        cfg.setdefault("zero_allow_untested_optimizer", True)
        cfg.setdefault("steps_per_print", 2**31 - 1)
        cfg.setdefault("wall_clock_breakdown", False)
        return cfg

    def _precision_section(self) -> str | None:
        name = self.precision.name
        if name not in _PRECISION_SECTION:
            raise invalid_choice("precision (with strategy='deepspeed')", name, tuple(_PRECISION_SECTION))
        return _PRECISION_SECTION[name]

    # -- lifecycle -------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        deepspeed = import_deepspeed()
        check_version(deepspeed.__version__)            # too old for managed_gradient_accumulation: fail first
        section = self._precision_section()             # unsupported precision: fail before any work
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from deepspeed.accelerator import get_accelerator
        supported = {"fp16": get_accelerator().is_fp16_supported, "bf16": get_accelerator().is_bf16_supported}
        if section is not None and not supported[section]():
            raise MisconfigurationError(
                f"precision={self.precision.name!r} under DeepSpeed needs {section} support, which DeepSpeed's "
                f"{get_accelerator().device_name()} accelerator lacks; use "
                f"{'bf16-mixed' if section == 'fp16' else '16-mixed'!r} or '32-true'")
        self.cluster_environment.export()               # RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
        super().setup_environment()
        if self._single:
            init_single_process_group("nccl" if self._use_cuda and self._backend == "nccl" else "gloo")
        # every rank builds or loads, one at a time (a file lock, not a collective: a first
        # compile can outlast the process-group timeout)
        prebuild_ops(verbose=self.is_local_zero)
        deepspeed.init_distributed(dist_backend=self._backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=self.timeout)

    @contextlib.contextmanager
    def module_init_context(self):
        """Under ZeRO-3, ``configure_model`` runs in ``deepspeed.zero.Init``: each parameter
        is partitioned as soon as its module is built (full-size only transiently)."""
        if self.stage != 3:
            with super().module_init_context():
                yield
            return
        deepspeed = import_deepspeed()
        section = self._precision_section()
        # the parameter dtype follows the bf16/fp16 sections (an explicit dtype= is ignored by
        # DeepSpeed 0.19 on devices without fp16); no global F.linear replacement
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": self.resolve_config()["zero_optimization"],
               "bf16": {"enabled": section == "bf16"}, "fp16": {"enabled": section == "fp16"}}
        with super().module_init_context(), deepspeed.zero.Init(
                config_dict_or_path=cfg, mem_efficient_linear=False,
                remote_device="cpu" if self.offload_parameters else None):
            yield

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move to the device; DeepSpeed converts and wraps the module in :meth:`setup_optimizers`."""
        if type(module).__name__ == "DeepSpeedEngine":
            return module
        self._module = module
        return module.to(self.root_device)

    def setup_optimizers(self, module: nn.Module, optimizers: list) -> tuple[nn.Module, list]:
        """``deepspeed.initialize(model, optimizer, config)``: returns the engine and its optimizer."""
        deepspeed = import_deepspeed()
        if not optimizers:
            return module, optimizers
        if len(optimizers) != 1:
            raise MisconfigurationError(f"the deepspeed strategy trains one optimizer; got {len(optimizers)} "
                                        "(return one optimizer from configure_optimizers)")
        if module is None:
            raise MisconfigurationError("the deepspeed strategy needs the model with its optimizer "
                                        "(Accelerator.prepare(model, optimizer))")
        raw = self.unwrap_module(module)
        if self._engine is not None and self.unwrap_module(self._engine) is raw:
            if self.stage == 3:
                raise MisconfigurationError("a module trained under ZeRO stage 3 cannot be set up again; "
                                            "build a new module (or load its checkpoint) for another fit")
            self._restore_methods(self._engine.module)
        self.config = self.resolve_config(raw)
        wrapper = _EmberModuleWrapper(raw)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=wrapper, optimizer=optimizers[0],
                                                          config=self.config, dist_init_required=False)
        for name in _STEP_METHODS:
            method = getattr(raw, name, None)
            if callable(method) and isinstance(raw, nn.Module):
                wrapper._methods[name] = method
                setattr(raw, name, _through_engine(engine, name))
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # imports deepspeed's checkpoint engine at its top
            from ember.strategies.deepspeed_writes import install
        install(engine, background=self.async_save)     # a failed write is reported, not waited on
        self._engine = engine
        self._module = raw
        return engine, [ds_optimizer]

    @staticmethod
    def _restore_methods(wrapper) -> None:
        for name in list(wrapper._methods):
            if name in vars(wrapper.module):
                delattr(wrapper.module, name)
        wrapper._methods.clear()

    def _engine_for(self, module) -> Any:
        if module is not None and type(module).__name__ == "DeepSpeedEngine":
            return module
        if self._engine is not None and module is not None and self.unwrap_module(self._engine) is \
                self.unwrap_module(module):
            return self._engine
        return None

    # -- step --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: nn.Module | None = None, **kwargs) -> None:
        engine = self._engine_for(module) or self._engine
        if engine is None:
            raise MisconfigurationError("backward() under the deepspeed strategy needs the model prepared "
                                        "with its optimizer")
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def optimizer_step(self, optimizer, module: nn.Module | None = None, closure=None) -> None:
        if closure is not None:
            closure()
        engine = self._engine_for(module) or self._engine
        engine.step()

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        # the engine reduces at step() (stage 1) or per backward (stages 2/3): nothing to skip here
        return NULL_CONTEXT

    # -- state dicts -----------------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full fp32 weights on CPU, on every rank (a collective under ZeRO)."""
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from deepspeed.utils import safe_get_full_fp32_param
        raw = self.unwrap_module(module)
        out = {}
        engine = self._engine_for(module)
        for name, p in raw.named_parameters():
            full = safe_get_full_fp32_param(p) if engine is not None else None
            if full is None:
                if hasattr(p, "ds_id"):
                    from ember.checkpoint.rng import keep_rng_states
                    with keep_rng_states():   # a first import leaves the user's random streams as they were
                        import deepspeed
                    with deepspeed.zero.GatheredParameters([p]):
                        full = p.detach().clone()
                else:
                    full = p.detach()
            out[name] = full.detach().to("cpu", copy=True).reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
        for name, b in raw.named_buffers():
            out[name] = b.detach().to("cpu", copy=True)
        # state_dict order, persistent buffers only
        return {k: out[k] for k in raw.state_dict(keep_vars=True) if k in out}

    def load_module_state_dict(self, module: nn.Module, state: dict, strict: bool = True):
        """Load full weights into the model (and the optimizer's fp32 master copy)."""
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from deepspeed.utils import safe_set_full_fp32_param
            import deepspeed
        raw = self.unwrap_module(module)
        params = dict(raw.named_parameters())
        if strict:
            missing = [k for k in raw.state_dict() if k not in state]
            unexpected = [k for k in state if k not in raw.state_dict()]
            if missing or unexpected:
                raise CheckpointError(f"weights do not match the model: missing {missing[:10]}, "
                                      f"unexpected {unexpected[:10]}")
        zero3 = any(hasattr(p, "ds_id") for p in params.values())
        ctx = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0) if zero3 else NULL_CONTEXT
        with torch.no_grad():
            with ctx:
                for n, p in params.items():
                    if n in state:
                        p.data.copy_(state[n].to(p.device, p.dtype).reshape(p.shape))
            if self._engine_for(module) is not None:
                for n, p in params.items():
                    if n in state:
                        safe_set_full_fp32_param(p, state[n].to(self.root_device, torch.float32))
            for n, b in raw.named_buffers():
                if n in state:
                    b.copy_(state[n].to(b.device, b.dtype))

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, module: nn.Module, optimizers: list, trainer_state: dict,
                        meta: dict, weights_only: bool = False) -> None:
        """``engine.save_checkpoint`` into ``NAME.ember-tmp/model/`` (every rank writes its
        partitions), then rank 0 checks that every rank's files are there (:meth:`_commit`),
        adds ``trainer_state.pt`` and ``meta.json`` and renames."""
        from ember.checkpoint import io as cio
        self._finish_pending_save()
        path = os.path.normpath(os.fspath(path))
        meta = dict(meta, sharded=True, deepspeed={"zero_stage": self.stage, "tag": TAG})
        engine = self._engine_for(module)
        if weights_only or engine is None:
            weights = self.module_state_dict(module)
            meta["sharded"] = False
            error = None
            if self.is_global_zero:
                try:
                    state = None if weights_only else dict(trainer_state, optimizers=[])
                    cio.write_checkpoint(path, weights, state, meta)
                except Exception as err:     # reported to every rank below, raised here as it is
                    error = err
            from ember.strategies.full_load import raise_rank0_error
            raise_rank0_error(self, error, f"checkpoint {path} was not written on rank 0")
            return
        from ember.strategies.full_load import staging_on_rank0
        tmp = staging_on_rank0(self, path)
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # imports deepspeed's checkpoint engine at its top
            from ember.strategies.deepspeed_writes import EmberCheckpointEngine
        writes = engine.checkpoint_engine if isinstance(engine.checkpoint_engine, EmberCheckpointEngine) else None
        if writes is not None:
            writes.begin()
        failed = None
        try:
            engine.save_checkpoint(tmp, tag=TAG, client_state={}, save_latest=False,
                                   exclude_frozen_parameters=_frozen_left_out(self.unwrap_module(engine)))
        except Exception as err:     # reported at the commit, so no rank waits for this one
            failed = err
        writer, write_error = writes.take() if writes is not None else (None, None)
        failed = failed or write_error     # a failed write on this rank: recorded, DeepSpeed's barrier still met
        state = dict(trainer_state, optimizers=[{"stored_in": cio.DCP_WEIGHTS_DIR, "format": "deepspeed"}])
        if writer is not None:           # this rank's writer writes the files; commit (and trainer_state.pt) deferred
            state, meta = cpu_snapshot((state, meta))
        self._ds_pending = (path, state, meta, engine, writer, failed)
        self._async_in_flight = True     # every rank defers the commit, failed or not
        if not self.async_save:          # a synchronous save commits now
            self._finish_pending_save()

    def _finish_pending_save(self) -> None:
        """Wait for this rank's writer of the last checkpoint (``async_save``), then commit
        it with :meth:`_commit` (a collective: every rank calls it, at a save, a load, teardown)."""
        if not self._async_in_flight:
            return
        from ember.checkpoint import io as cio
        self._async_in_flight = False
        (path, state, meta, engine, writer, failed), self._ds_pending = self._ds_pending, None
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # imports deepspeed's checkpoint engine at its top
            from ember.strategies.deepspeed_writes import report, written_by
        mine, error = report(writer, failed, lambda: written_by(engine, cio.tmp_path(path), TAG))
        with self._committing():
            try:
                self._commit(path, state, meta, mine)
            except CheckpointError as err:
                if error is not None and err.__cause__ is None and err is not error:
                    raise err from error     # this rank's own write error: the real traceback under the common message
                raise

    def on_exception(self, exc: BaseException) -> None:
        """A checkpoint not committed yet is dropped without a collective: this rank's
        writer is let finish, rank 0 removes ``NAME.ember-tmp`` (which never counts)."""
        pending, self._ds_pending = self._ds_pending, None
        self._async_in_flight = False
        if pending is not None:
            from ember.checkpoint.rng import keep_rng_states
            with keep_rng_states():   # imports deepspeed's checkpoint engine at its top
                from ember.strategies.deepspeed_writes import drop
            drop(pending[0], pending[4], self.is_global_zero, exc)
        super().on_exception(exc)

    def _commit(self, path: str, state: dict, meta: dict, mine: "dict[str, int] | str") -> None:
        """Every rank reports the ZeRO files it wrote (``{name: bytes}``, or its error);
        rank 0 renames ``NAME.ember-tmp`` into place only when each of them is there with its
        bytes, all listed in ``meta.json``. A missing or short file, or a failed write on
        any rank, raises on every rank a CheckpointError naming the rank (as
        :meth:`Strategy.save_checkpoint`)."""
        from ember.checkpoint import io as cio
        from ember.strategies.full_load import raise_rank0_error, verify_shards
        reports = self.all_gather_object(mine)       # every rank has returned from its write
        error = None
        if self.is_global_zero:
            try:
                failed = [f"rank {r}: {rep}" for r, rep in enumerate(reports) if isinstance(rep, str)]
                if failed:
                    raise CheckpointError(f"checkpoint {path} not committed: the DeepSpeed write failed on "
                                          + "; ".join(failed))
                need = {name: (size, f"rank {r}'s file") for r, rep in enumerate(reports)
                        for name, size in rep.items()}
                folder = os.path.join(cio.tmp_path(path), TAG)
                shards = verify_shards(folder, path, need, TAG, "the ranks' DeepSpeed writes")
                cio.write_checkpoint(path, None, state, meta, keep_existing_tmp=True, extra_files=shards)
            except Exception as err:     # reported to every rank below, raised here as it is
                error = err
        raise_rank0_error(self, error, f"checkpoint {path} was not committed", complete=True)

    def load_checkpoint(self, path: str, module: nn.Module, optimizers: list, strict: bool = True,
                        weights_only: bool = False) -> dict:
        """Resume from a checkpoint this strategy wrote (same world size for optimizer
        states), or load weights from any ember checkpoint."""
        from ember.checkpoint import io as cio
        self._finish_pending_save()
        path = os.fspath(path)
        weights, state, meta = cio.read_checkpoint(path, load_state=not weights_only)
        state = state or {}
        engine = self._engine_for(module)
        want_optim = bool(optimizers) and not weights_only
        if weights is None:
            if meta.get("strategy") != "deepspeed":
                raise CheckpointError(f"{path} holds sharded weights written by the {meta.get('strategy')!r} "
                                      "strategy; load it with that strategy (or export full weights there)")
            saved_world = meta.get("world_size")
            if want_optim and engine is not None and saved_world not in (None, self.world_size):
                raise CheckpointError(
                    f"{path} was saved by {saved_world} DeepSpeed rank(s); its ZeRO optimizer partitions load "
                    f"only at that world size (now {self.world_size}). Resume with {saved_world} processes, or "
                    "load the weights only (validate/test, or load_full_weights) and start a new fit")
            if want_optim and engine is not None:
                load_path, _ = engine.load_checkpoint(path, tag=TAG, load_module_strict=strict,
                                                      load_optimizer_states=True, load_lr_scheduler_states=False)
                if load_path is None:
                    raise CheckpointError(f"DeepSpeed found no checkpoint under {path}/{TAG}")
            else:
                weights = load_full_weights(path)
        if weights is not None:
            if want_optim and [s for s in state.get("optimizers", []) if s]:
                raise CheckpointError(f"{path} holds optimizer states of the {meta.get('strategy')!r} strategy, "
                                      "which DeepSpeed cannot load; load its weights with "
                                      "Module.load_from_checkpoint and start a new fit")
            cio.check_compatible(_shapes_of(self.unwrap_module(module)), weights, path, strict=strict)
            self.load_module_state_dict(module, weights, strict=strict)
        state["meta"] = meta
        return state

    def _last_module(self) -> nn.Module | None:
        return self._engine or self._module

    def __repr__(self) -> str:
        return (f"DeepSpeedStrategy(stage={self.stage}, world_size={self.world_size}, rank={self.global_rank}, "
                f"offload_optimizer={self.offload_optimizer}, offload_parameters={self.offload_parameters})")


def _frozen_left_out(module: nn.Module) -> bool:
    """Whether the module leaves all its frozen parameters out of its own state (an adapter
    run: the base is loaded from its pretrained files again, docs/transformers.md); then
    DeepSpeed's checkpoint leaves them out too (ZeRO-2 and 3 would store them). A module
    whose state holds its frozen parameters keeps them in the checkpoint."""
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if not frozen:
        return False
    keys = module.state_dict(keep_vars=True).keys()
    return not any(n in keys for n in frozen)


def _shapes_of(module: nn.Module):
    """An object whose ``state_dict()`` has the module's full shapes (ZeRO-3 parameters are
    empty locally), for ``checkpoint_io.check_compatible``; named like the module's class."""
    shapes = {}
    for k, v in module.state_dict(keep_vars=True).items():
        shape = tuple(getattr(v, "ds_shape", v.shape))
        shapes[k] = torch.empty(shape, device="meta")
    return type(type(module).__name__, (), {"state_dict": lambda self: shapes})()


def _through_engine(engine, name: str):
    def method(*args, **kwargs):
        return engine(*args, _ember_method=name, **kwargs)
    method.__name__ = name
    return method


def load_full_weights(path: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint written by :class:`DeepSpeedStrategy` (any
    ZeRO stage), consolidated in one process without a process group."""
    from ember.checkpoint import io as cio
    weights, _, _ = cio.read_checkpoint(path, load_state=False)
    if weights is not None:
        return weights
    import_deepspeed()
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    import io
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        sd = get_fp32_state_dict_from_zero_checkpoint(os.fspath(path), tag=TAG)
    prefix = "module."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
