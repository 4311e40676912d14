"""The Trainer: arguments, setup, and the fit / validate / test / predict entry
points. The loops (and the documented event order) are in ``loops.py``; the
checkpoint state in ``state.py``."""
from __future__ import annotations

import datetime as _dt
import os
import time
from typing import Any

import torch

from ember.callbacks.base import Callback, hook_table
from ember.errors import CheckpointError, DistributedOperationError, MisconfigurationError, invalid_choice
from ember.module import DataModule, TrainModule, overrides
from ember.trainer import checks as _checks
from ember.trainer import arguments as _args
from ember.trainer.arguments import _check_limit, _parse_max_time
from ember.trainer import hooks as _hooks
from ember.trainer import state as _state
from ember.trainer import summary as _summary
from ember.trainer.logging import Results
from ember.trainer.metrics import MetricsMixin
from ember.trainer.loops import EvalLoop, FitLoop, limit_batches
from ember.trainer.optim import ManualOptimizer, configure_optimizers, flush_scheduler_steps, step_schedulers
from ember.trainer.progress import LoopProperties, LoopState
from ember.trainer.run_state import (FN_STAGE, RunningStage, RunProperties, TrainerFn, TrainerState,
                                     TrainerStatus)


class Trainer(MetricsMixin, LoopProperties, RunProperties):
    """Fits, validates, tests and predicts a :class:`~ember.TrainModule`.

    See ``ember/trainer/loops.py`` for the order of events and docs/trainer.md.

    Args:
        max_epochs: stop after this many epochs (None with no other limit: 1000; -1: no limit).
        max_steps: stop after this many optimizer steps (-1: no limit).
        max_time: stop after this wall time: seconds, "DD:HH:MM:SS", a timedelta or a dict like {"hours": 2}.
        devices: "auto", "cpu", "cuda", "cuda:N", "mps", a number of processes, or a list of CUDA indices.
        strategy: "auto", "single", "ddp", "fsdp", "deepspeed", "model_parallel" or a Strategy instance.
        num_nodes: number of machines (each runs ``devices`` processes).
        accelerator: Lightning's "auto", "cpu", "gpu"/"cuda" or "mps", mapped onto ``devices``.
        precision: "32-true" (default), "64-true", "16-mixed", "bf16-mixed", "16-true" or "bf16-true".
        accumulate_grad_batches: micro-batches per optimizer step.
        gradient_clip_val: clip gradients to this norm (or value); None: no clipping.
        gradient_clip_algorithm: "norm" (total norm) or "value" (each element).
        val_check_interval: validate every fraction of an epoch (float) or every N training batches (int).
        check_val_every_n_epoch: validate every N epochs (None: only by val_check_interval batches).
        num_sanity_val_steps: validation batches run before training to catch bugs (-1: all, 0: none).
        limit_train_batches: training batches per epoch: an int, a fraction (float) or None for all.
        limit_val_batches: validation batches per pass: an int, a fraction (float) or None for all.
        log_every_n_steps: send step metrics to the loggers every N optimizer steps.
        callbacks: a Callback or a list of them (checkpointing, progress bar and summary are added by default).
        logger: True (TensorBoard), False, "tensorboard", "csv", "wandb", a Logger, or a list of those.
        enable_checkpointing: add a ModelCheckpoint (one checkpoint per epoch) unless one is given (None: True
            unless barebones).
        enable_progress_bar: add a RichProgressBar (and print the end-of-fit summary) unless one is given (None: True
            unless barebones).
        enable_model_summary: print a table of the module's layers at the start of fit (None: True unless barebones).
        default_root_dir: folder for logs and checkpoints when no logger or callback says otherwise (default: cwd).
        deterministic: use deterministic algorithms ("warn": only warn about non-deterministic ones).
        seed: seed every RNG (python, numpy, torch) and the data order.
        compile: torch.compile each block of the module (True, or a dict of torch.compile arguments).
        fast_dev_run: run N (True: 1) training and validation batches, no logger or checkpoints: a smoke test.
        detect_anomaly: torch.autograd anomaly detection during this trainer's runs (slow; for debugging).
        activation_checkpointing: recompute activations of these blocks in backward (a class, classes or a policy).
        profiler: None, "simple" (a table of time per hook and step), "pytorch" (torch.profiler traces) or a Profiler.
        report: write report.html (every logged scalar's curve) and PNGs into the log folder after fit.
        min_epochs: a stop request (should_stop, EarlyStopping) waits until this many epochs are done.
        min_steps: a stop request waits until this many optimizer steps are done.
        overfit_batches: train and validate on the same first N (int) or fraction (float) of training batches, unshuffled.
        limit_test_batches: test batches per pass: an int, a fraction (float) or None for all.
        limit_predict_batches: predict batches per dataloader: an int, a fraction (float) or None for all.
        reload_dataloaders_every_n_epochs: call the dataloader hooks again every N epochs (0: never).
        sync_batchnorm: under several (GPU) processes, turn BatchNorm layers into SyncBatchNorm.
        use_distributed_sampler: False: use the DataLoaders as given (no sharding, no resumable sampler).
        inference_mode: evaluate under torch.inference_mode (False: torch.no_grad).
        benchmark: set torch.backends.cudnn.benchmark (None: leave it as it is).
        barebones: nothing but the loop: no logger, checkpointing, progress bar, summary; self.log is an error.
        enable_autolog_hparams: log the module's hparams to the loggers at the start of fit.
    """

    def __init__(self, *, max_epochs: int | None = None, max_steps: int = -1,
                 max_time: float | str | _dt.timedelta | dict | None = None,
                 devices: int | str | list[int] = "auto", strategy: str | Any = "auto", num_nodes: int = 1,
                 precision: str | int | None = None,
                 accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
                 gradient_clip_algorithm: str = "norm", val_check_interval: float | int = 1.0,
                 check_val_every_n_epoch: int | None = 1, num_sanity_val_steps: int = 2,
                 limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
                 log_every_n_steps: int = 50, callbacks: list[Callback] | Callback | None = None,
                 logger: bool | str | Any | list | None = True, enable_checkpointing: bool | None = None,
                 enable_progress_bar: bool | None = None, enable_model_summary: bool | None = None,
                 default_root_dir: str | os.PathLike | None = None, deterministic: bool | str = False,
                 seed: int | None = None, compile: bool | dict = False, fast_dev_run: bool | int = False,
                 detect_anomaly: bool = False, activation_checkpointing: type | tuple | Any = None,
                 profiler: str | Any = None, report: bool = False, accelerator: str | None = None,
                 min_epochs: int | None = None, min_steps: int | None = None, overfit_batches: int | float = 0.0,
                 limit_test_batches: int | float | None = None, limit_predict_batches: int | float | None = None,
                 reload_dataloaders_every_n_epochs: int = 0, sync_batchnorm: bool = False,
                 use_distributed_sampler: bool = True, inference_mode: bool = True, benchmark: bool | None = None,
                 barebones: bool = False, enable_autolog_hparams: bool = True) -> None:
        from ember.compat.lightning import resolve_accelerator
        from ember.precision import Precision
        from ember.strategies import build_strategy
        devices = resolve_accelerator(accelerator, devices)   # Lightning's accelerator= onto devices=
        if precision in ("auto", None):
            precision = os.environ.get("EMBER_PRECISION", "32-true")
        self._precision = Precision.from_string(precision)
        self._strategy_args = (strategy, devices, num_nodes)
        self.strategy = build_strategy(strategy, devices, num_nodes)   # validates; no process work yet
        if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise MisconfigurationError(f"accumulate_grad_batches={accumulate_grad_batches!r} is not valid; use an int >= 1")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise invalid_choice("gradient_clip_algorithm", gradient_clip_algorithm, ["norm", "value"])
        if gradient_clip_val is not None and (not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val <= 0):
            raise MisconfigurationError(f"gradient_clip_val={gradient_clip_val!r} is not valid; use a positive number or None")
        if not isinstance(max_steps, int) or max_steps < -1:
            raise MisconfigurationError(f"max_steps={max_steps!r} is not valid; use -1 (no limit) or an int >= 0")
        if max_epochs is not None and (not isinstance(max_epochs, int) or max_epochs < -1):
            raise MisconfigurationError(f"max_epochs={max_epochs!r} is not valid; use None, -1 (no limit) or an int >= 0")
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise MisconfigurationError(f"log_every_n_steps={log_every_n_steps!r} is not valid; use an int >= 1")
        if isinstance(val_check_interval, bool) or not isinstance(val_check_interval, (int, float)) or val_check_interval <= 0 \
                or (isinstance(val_check_interval, float) and val_check_interval > 1.0):
            raise MisconfigurationError(f"val_check_interval={val_check_interval!r} is not valid; use a float in "
                                        "(0.0, 1.0] (fraction of an epoch) or an int >= 1 (every N training batches)")
        if check_val_every_n_epoch is not None and (not isinstance(check_val_every_n_epoch, int) or check_val_every_n_epoch < 1):
            raise MisconfigurationError(f"check_val_every_n_epoch={check_val_every_n_epoch!r} is not valid; use an int >= 1 or None")
        if not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
            raise MisconfigurationError(f"num_sanity_val_steps={num_sanity_val_steps!r} is not valid; use -1 (all), 0 or a positive int")
        self.limit_train_batches = _check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = _check_limit("limit_val_batches", limit_val_batches)
        if fast_dev_run is not False and (isinstance(fast_dev_run, bool) is False and (not isinstance(fast_dev_run, int) or fast_dev_run < 0)):
            raise MisconfigurationError(f"fast_dev_run={fast_dev_run!r} is not valid; use True, False or a positive int")
        logger, enable_checkpointing, enable_progress_bar, enable_model_summary = _args.resolve_barebones(
            barebones, logger, enable_checkpointing, enable_progress_bar, enable_model_summary, callbacks)
        self.barebones = barebones
        _args.set_arguments(
            self, min_epochs=min_epochs, min_steps=min_steps, overfit_batches=overfit_batches,
            limit_test_batches=limit_test_batches, limit_predict_batches=limit_predict_batches,
            reload_dataloaders_every_n_epochs=reload_dataloaders_every_n_epochs, sync_batchnorm=sync_batchnorm,
            use_distributed_sampler=use_distributed_sampler, inference_mode=inference_mode, benchmark=benchmark,
            enable_autolog_hparams=enable_autolog_hparams, deterministic=deterministic)
        if max_epochs is None and max_steps == -1 and max_time is None:
            max_epochs = 1000   # as Lightning: stop eventually
        self.max_epochs, self.max_steps, self._max_time = max_epochs, max_steps, _parse_max_time(max_time)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val, self.gradient_clip_algorithm = gradient_clip_val, gradient_clip_algorithm
        self.val_check_interval, self.check_val_every_n_epoch = val_check_interval, check_val_every_n_epoch
        self.num_sanity_val_steps, self.log_every_n_steps = num_sanity_val_steps, log_every_n_steps
        self.fast_dev_run = int(fast_dev_run)
        if self.fast_dev_run:
            n = self.fast_dev_run
            self.limit_train_batches = self.limit_val_batches = n
            self.max_steps, self.max_epochs, self.num_sanity_val_steps = n, 1, 0
            self.val_check_interval, logger = 1.0, False   # checkpoint callbacks stay but write nothing
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()
        self.deterministic, self.seed, self._compile = deterministic, seed, compile
        from ember.strategies.blocks import check_block_policy
        self._ac_policy = check_block_policy("activation_checkpointing", activation_checkpointing)
        self.detect_anomaly = detect_anomaly
        if seed is not None:
            from ember import seed_everything
            seed_everything(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
            if benchmark is None:   # benchmark=True wins (with a warning), as Lightning
                torch.backends.cudnn.benchmark = False
        self.callbacks = _state.default_callbacks(
            callbacks, enable_checkpointing, enable_progress_bar, enable_model_summary)
        from ember.trainer.profiler import build_profiler
        from ember.callbacks.run_record import RunRecord
        self.profiler = build_profiler(profiler, self)   # None: nothing is wrapped, no cost
        if not barebones:
            self.callbacks.append(RunRecord(report=report))   # run.json (+ report.html) in the log folder
        self.report_path: str | None = None
        _checks.check_logger_arg(logger)
        from ember.loggers import loggers_for   # built now: trainer.logger is usable before fit, and fit
        self._logger_arg = loggers_for(logger, self.default_root_dir)   # keeps what was logged to it (ports)
        self.loggers = list(self._logger_arg)
        # state: the loop position and control, in one object (trainer/progress.py)
        self.loop_state = LoopState()
        self._callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        self.module: TrainModule | None = None
        self.model = None
        self.datamodule: DataModule | None = None
        self.optimizers: list = []
        self.lr_scheduler_configs: list[dict] = []
        self._step_schedulers_list: list = []
        self._manual_optimizers: list = []
        self._results = {s: (_args.BarebonesResults if barebones else Results)(s)
                         for s in ("train", "validate", "test", "sanity")}
        self._fit_loaders: dict = {}   # what fit() was given (reload_dataloaders_every_n_epochs)
        self._eval_log_steps: dict = {}   # logger step of per-batch validation/test values
        self._env_ready = False
        self._resumed = False
        self._signal_pending = False
        self._signal_received = None
        self._last_loss = None   # the latest training loss, checked at epoch ends and before saves
        self._val_ran_at_batch_end = False
        self._manual_steps_since_log = 0
        self._deadline = None
        self._train_loader = None
        self._val_loaders: list = []
        self.current_dataloader = None
        self._current_pass_batches = None
        self._eval_batch_idx = None   # the evaluation batch in progress (per-batch gather_for_metrics)
        self.stage = None
        self.state = TrainerState()   # Lightning's trainer.state (run_state.py); set at stage boundaries
        self._ckpt_path, self._ckpt_path_user = None, False
        self._run_loaders: dict = {}   # validate/test/predict: the dataloaders of the last such run
        self.interrupted = False
        self.num_training_batches = 0
        self._hooks = hook_table([])
        self._backward_hooks = None   # manual_backward's on_before/after_backward (set per epoch)
        self._lr_scheduler_step = None   # the module's lr_scheduler_step override (set at setup)

    # ------------------------------------------------------------------ properties
    world_size = property(lambda self: self.strategy.world_size)
    global_rank = property(lambda self: self.strategy.global_rank)
    local_rank = property(lambda self: self.strategy.local_rank)
    node_rank = property(lambda self: self.strategy.node_rank)
    is_global_zero = property(lambda self: self.strategy.is_global_zero)
    precision = property(lambda self: self._precision.name)
    logger = property(lambda self: self.loggers[0] if self.loggers else None)
    lightning_module = property(lambda self: self.module)

    @property
    def log_dir(self) -> str:
        if self.loggers:
            return self.loggers[0].log_dir
        return self.default_root_dir

    @property
    def val_dataloaders(self) -> list:
        """The validation dataloaders of the current fit (prepared for the strategy)."""
        return list(self._val_loaders)

    @property
    def checkpoint_callbacks(self) -> list:
        from ember.callbacks.checkpoint import ModelCheckpoint
        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self):
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

    @property
    def estimated_stepping_batches(self) -> int:
        """Total optimizer steps this fit will take (for warmup/decay schedules)."""
        n = self.num_training_batches   # inf: an IterableDataset of unknown length
        per_epoch = n if n == float("inf") else max(1, -(-n // self.accumulate_grad_batches))
        if self.max_epochs is None or self.max_epochs < 0:
            total = float("inf")
        else:
            total = per_epoch * self.max_epochs
        if self.max_steps >= 0:
            total = min(total, self.max_steps)
        if total == float("inf"):
            raise MisconfigurationError("estimated_stepping_batches is infinite: set max_epochs or max_steps")
        return int(total)

    # ------------------------------------------------------------------ entry points
    def fit(self, module: TrainModule | None = None, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | None = None, *,
            model: TrainModule | None = None) -> None:
        """Train ``module`` (or ``model=``, Lightning's name). Data: ``train_dataloaders``/``val_dataloaders`` (a DataLoader or a
        list), a ``datamodule``, or the module's ``train_dataloader()``/``val_dataloader()``.
        ``ckpt_path``: a checkpoint folder, "last" or "best" to resume from (exactly)."""
        module = _one_module(module, model)
        self._run("fit", module, datamodule, ckpt_path, train=train_dataloaders, val=val_dataloaders)

    def validate(self, module: TrainModule | None = None, dataloaders: Any = None,
                 datamodule: DataModule | None = None, ckpt_path: str | None = None,
                 verbose: bool = True, *, model: TrainModule | None = None) -> list[dict]:
        """Run one validation pass; returns one dict of epoch metrics per dataloader and
        (``verbose``, rank 0) prints them as a table. ``module`` defaults to the fitted one."""
        self._verbose, module = verbose, _one_module(module, model)
        return self._run("validate", module, datamodule, ckpt_path, val=dataloaders)

    def test(self, module: TrainModule | None = None, dataloaders: Any = None,
             datamodule: DataModule | None = None, ckpt_path: str | None = None,
             verbose: bool = True, *, model: TrainModule | None = None) -> list[dict]:
        """Run the test loop (``test_step``); returns one dict of metrics per dataloader and
        (``verbose``, rank 0) prints them as a table."""
        self._verbose, module = verbose, _one_module(module, model)
        return self._run("test", module, datamodule, ckpt_path, test=dataloaders)

    def predict(self, module: TrainModule | None = None, dataloaders: Any = None,
                datamodule: DataModule | None = None, ckpt_path: str | None = None,
                return_predictions: bool | None = None, *, model: TrainModule | None = None) -> list | None:
        """Run ``predict_step`` over the data; returns the outputs in dataset order (a list per
        dataloader when there are several), the same on every rank; None with
        ``return_predictions=False`` (Lightning's argument: e.g. a prediction writer keeps them)."""
        out = self._run("predict", _one_module(module, model), datamodule, ckpt_path, predict=dataloaders)
        return None if return_predictions is False else out

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Write a checkpoint folder at ``path`` (atomically); ``weights_only``: no trainer state."""
        _state.save_checkpoint(self, path, weights_only=weights_only)

    # ------------------------------------------------------------------ running
    def _run(self, stage, module, datamodule, ckpt_path, **loaders):
        module = module if module is not None else self.module
        if module is None:
            raise MisconfigurationError(f"trainer.{stage}() needs a module (none was fitted before)")
        if not isinstance(module, TrainModule):
            raise MisconfigurationError(f"trainer.{stage}(module=...): expected a ember.TrainModule, got "
                                        f"{type(module).__name__}")
        first = next(iter(loaders))   # trainer.fit(module, datamodule) works, as in Lightning
        if isinstance(loaders[first], DataModule):
            if datamodule is not None:
                raise MisconfigurationError(f"trainer.{stage}(): got a DataModule both in place of the dataloaders "
                                            "and as datamodule=; pass it once")
            datamodule, loaders = loaders[first], {**loaders, first: None}
        if ckpt_path is None and self._ckpt_path_user:
            ckpt_path = self._ckpt_path   # trainer.ckpt_path = ... (Lightning's user-managed path)
        elastic = ckpt_path is None and stage == "fit" and _state.elastic_restart()
        if elastic and (self.world_size == 1 or self.global_rank == 0):
            ckpt_path = _state.elastic_resume_path(self)   # "last" when rank 0 sees a checkpoint
        by_name = ckpt_path in ("last", "best") or elastic   # rank 0's answer, broadcast after setup
        early = None   # under several processes a refusal waits for the agreement in restore
        if ckpt_path is not None and not (by_name and self.world_size > 1 and self.global_rank != 0):
            # errors before any work; "last"/"best" only on rank 0 (the rank is known from the
            # environment before setup): the other ranks take rank 0's path, broadcast below
            try:
                ckpt_path = _state.resolve_ckpt_path(self, ckpt_path, stage)
            except CheckpointError as err:
                if self.world_size == 1:
                    raise
                early = err   # the files as this node sees them: every rank refuses, or none
        self.stage = stage
        self.state.status, self.state.fn, self.state.stage = TrainerStatus.RUNNING, TrainerFn(stage), FN_STAGE[stage]
        if not self._ckpt_path_user:
            self._ckpt_path = None   # set when this run restores a checkpoint
        self.interrupted = self._resumed = False
        self._fit_t0 = self._fit_exception = None
        if stage == "fit":
            self.loop_state.stop_request = self.loop_state.stop_reason = None
            self.loop_state.stop_agreed = False
        anomaly = torch.is_anomaly_enabled()
        if self.detect_anomaly:
            torch.autograd.set_detect_anomaly(True)   # for this run only; restored below
        try:
            self._setup(module, datamodule, stage, loaders)
            if by_name and self.world_size > 1:
                # "last"/"best" (and whether an elastic restart resumes) is rank 0's resolution:
                # every rank restores the same checkpoint, or none (file listings and
                # modification times may differ between nodes)
                ckpt_path = self.strategy.broadcast(ckpt_path)
            if ckpt_path is not None:
                _state.restore(self, ckpt_path, full=(stage == "fit"), early=early)
                _summary.restored(self, ckpt_path)
            if stage == "fit":
                return self._fit()
            if stage == "predict":
                return self._predict()
            return self._evaluate(stage)
        except BaseException as exc:
            self.interrupted = isinstance(exc, KeyboardInterrupt)
            self.state.status = TrainerStatus.INTERRUPTED
            if stage == "fit":   # a later fit() restarts the broken epoch from its first batch
                self.loop_state.stop_reason = "interrupted" if self.interrupted else "exception"
                self.loop_state.reset_epoch()
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
            for h in self._hooks["on_exception"]:
                h(self, module, exc)
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize("interrupted" if self.interrupted else "failed")
            self.strategy.on_exception(exc) if hasattr(self.strategy, "on_exception") else None
            if stage == "fit" and self._fit_t0 is not None:
                self._fit_exception = exc
                _summary.fit_ended(self, self._fit_t0, failed=True)   # never raises
            if self.interrupted:
                _summary.on_keyboard_interrupt(self)   # message + SystemExit(130), outside interactive sessions
            raise
        finally:
            torch.autograd.set_detect_anomaly(anomaly)
            _state.uninstall_signal_handlers(self)
            self._call_hook("teardown", stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage)
            self.strategy.teardown()
            self.stage = self.state.stage = None
            if self.state.status == TrainerStatus.RUNNING:
                self.state.status = TrainerStatus.INTERRUPTED if self.loop_state.stop_reason == "preempted" \
                    and stage == "fit" else TrainerStatus.FINISHED
            _state.exit_if_preempted(self)   # SystemExit(0) after a preemption save (docs/checkpointing.md)

    def _setup(self, module, datamodule, stage, loaders):
        from ember.accelerator import Accelerator
        first = self.module is not module
        self.module, self.datamodule = module, datamodule
        module._trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        if not self._env_ready:
            self.strategy.precision = self._precision
            self._acc = Accelerator._for_trainer(self.strategy)   # sets the environment up (processes, device)
            self._env_ready = True
            _checks.warn_fp16_on_cpu(self)
            if self.seed is None:
                # one sampler seed for every rank, drawn from the (seeded) global RNG
                self._data_seed = int(self.strategy.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item())))
            else:
                self._data_seed = self.seed
        self._needs_transfer = self.strategy.root_device.type != "cpu"
        self.loggers = _state.build_loggers(self) if stage == "fit" or not self.loggers else self.loggers
        if stage != "fit":   # as Lightning: validate/test/predict report their own metrics only
            self._callback_metrics = {}
        _state.agree_log_versions(self)   # rank 0 picks the run folders, before callbacks read log_dir
        _hooks.configure_callbacks(self, module)   # the module's callbacks join (or replace) the Trainer's
        self._hooks = hook_table(self.callbacks)
        _hooks.check_module_hooks(self, module)
        module_prepare = overrides(module, TrainModule, "prepare_data")
        if datamodule is not None or module_prepare:
            error = None
            if self.strategy.is_local_zero:
                try:
                    datamodule.prepare_data() if datamodule is not None else None
                    module.prepare_data() if module_prepare else None
                except Exception as err:   # agreed below: no rank waits for a local rank 0 that failed
                    error = err
            _prepare_data_agreed(self.strategy, error)
        if datamodule is not None:
            datamodule.setup(stage)
        self._call_hook("setup", stage)   # callbacks', then the module's setup(stage)
        self._lr_scheduler_step = self._module_hook("lr_scheduler_step")
        if first or self.model is None:
            with self.strategy.module_init_context():
                module.configure_model()
            # per block, before the strategy wraps (DDP) or shards (FSDP) the model
            from ember.strategies.blocks import apply_activation_checkpointing, compile_blocks
            apply_activation_checkpointing(module, self._ac_policy)
            if self._compile:
                compile_blocks(module, self._compile if isinstance(self._compile, dict) else None)
            _args.convert_sync_batchnorm(self, module)   # sync_batchnorm under several processes
            self.model = self._acc.setup_module(module)
        self._setup_data(stage, loaders)   # before optimizers: schedules may use estimated_stepping_batches
        if stage == "fit":
            cfg = configure_optimizers(module)
            self.optimizers, self.lr_scheduler_configs = cfg
            if hasattr(self.strategy, "configure_from_trainer"):   # DeepSpeed fills its "auto" config values
                self.strategy.configure_from_trainer(
                    accumulate_grad_batches=self.accumulate_grad_batches, gradient_clip_val=self.gradient_clip_val,
                    micro_batch_size=getattr(self._train_loader, "batch_size", None),
                    gradient_clip_algorithm=self.gradient_clip_algorithm)
            self.model, self.optimizers = self._acc.setup_optimizers(self.model, self.optimizers)
            self._acc.attach_trainer_step(self.model, self.optimizers, self.accumulate_grad_batches)
            self._step_schedulers_list = [c for c in self.lr_scheduler_configs if c["interval"] == "step"]
            self._manual_optimizers = [ManualOptimizer(o, self) for o in self.optimizers]

    def _setup_data(self, stage, loaders):
        dm = self.datamodule

        def pick(given, name, arg):
            ev = name != "train_dataloader"   # an evaluation loader with no batches is warned about
            if given is not None:
                return _checks.check_loader(given, arg, warn_empty=ev)
            if dm is not None and overrides(dm, DataModule, name):
                return _checks.check_loader(getattr(dm, name)(), f"{type(dm).__name__}.{name}()", returned=True,
                                            warn_empty=ev)
            if dm is None and overrides(self.module, TrainModule, name) if hasattr(TrainModule, name) else \
                    (dm is None and hasattr(self.module, name)):
                return _checks.check_loader(getattr(self.module, name)(), f"{type(self.module).__name__}.{name}()",
                                            returned=True, warn_empty=ev)
            return None

        def as_list(x):
            return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]

        prep = self._acc.setup_dataloader if self.use_distributed_sampler else (lambda dl, **_: dl)
        if stage == "fit":
            self._fit_loaders = loaders
            train = pick(loaders.get("train"), "train_dataloader", "train_dataloaders")
            if train is None:
                raise MisconfigurationError("trainer.fit() needs training data: pass train_dataloaders=, a datamodule, "
                                            "or define train_dataloader() on the module")
            if self.overfit_batches:   # the same first batches for training and validation, in order
                self._train_loader = prep(train, seed=self._data_seed, shuffle=False)
                if callable(getattr(self.module, "validation_step", None)):
                    loaders = {**loaders, "val": [self._train_loader]}
            else:
                self._train_loader = prep(train, seed=self._data_seed)
            self.num_training_batches = self._limit_batches(self._train_loader, self.limit_train_batches)
            if self.world_size > 1:   # the epoch's length, validation points: the same on every rank
                self.num_training_batches = _checks.agree_train_batches(self, self.num_training_batches)
            if self.num_training_batches == 0:
                raise MisconfigurationError("the train dataloader has no batches (limit_train_batches or an empty dataset)")
            self._val_loaders = [prep(v, seed=self._data_seed, shuffle=False, even=False)
                                 for v in as_list(pick(loaders.get("val"), "val_dataloader", "val_dataloaders"))]
            if self.limit_val_batches == 0:
                self._val_loaders = []
            elif self._val_loaders and not callable(getattr(self.module, "validation_step", None)):
                import warnings   # as Lightning: validation data without a validation_step skips validation
                warnings.warn(f"fit() was given validation data but {type(self.module).__name__} has no "
                              "validation_step: validation is skipped (define validation_step to run it)", stacklevel=4)
                self._val_loaders = []
            vci = self.val_check_interval
            if isinstance(vci, float):
                n = self.num_training_batches
                self._val_every_n_batches = None if vci >= 1.0 or n == float("inf") else max(1, int(n * vci))
            else:
                self._val_every_n_batches = vci
        elif stage in ("validate", "test"):
            name = "val_dataloader" if stage == "validate" else "test_dataloader"
            given = loaders.get("val") if stage == "validate" else loaders.get("test")
            ls = as_list(pick(given, name, "dataloaders"))
            if not ls:
                raise MisconfigurationError(f"trainer.{stage}() needs data: pass dataloaders=, a datamodule, or define {name}()")
            self._eval_loaders = self._run_loaders[stage] = [prep(v, seed=self._data_seed, shuffle=False, even=False)
                                                             for v in ls]
        else:
            ls = as_list(pick(loaders.get("predict"), "predict_dataloader", "dataloaders"))
            if not ls:
                raise MisconfigurationError("trainer.predict() needs data: pass dataloaders=, a datamodule, or define predict_dataloader()")
            self._eval_loaders = self._run_loaders[stage] = [prep(v, seed=self._data_seed, shuffle=False, even=False)
                                                             for v in ls]

    def _limit_batches(self, loader, limit) -> int:
        try:
            n = len(loader)
        except TypeError:
            n = float("inf")
        n = limit_batches(n, limit, "limit")
        return n if n == float("inf") else int(n)

    def _prepare_batch(self, batch, transfer=None):
        if transfer is not None:   # the module's batch-transfer hooks (hooks.batch_transfer)
            batch = transfer(batch)
        elif self._needs_transfer:
            batch = self.strategy.batch_to_device(batch)
        p = self.strategy.precision
        return p.convert_input(batch) if p.needs_input_cast else batch

    def _fit(self):
        t0 = self._fit_t0 = time.monotonic()
        _checks.warn_finished(self)
        _checks.warn_log_interval(self)
        self._deadline = time.monotonic() + self._max_time if self._max_time else None
        _state.install_signal_handlers(self)
        self._call_hook("on_fit_start")
        if self.num_sanity_val_steps and self._val_loaders and not self._resumed:
            self.state.stage = RunningStage.SANITY_CHECKING
            self._call_hook("on_sanity_check_start")
            EvalLoop(self, "sanity").run(self._val_loaders, self.limit_val_batches)   # num_sanity_val_batches
            self._call_hook("on_sanity_check_end")
            self.state.stage = RunningStage.TRAINING
        FitLoop(self).run()
        flush_scheduler_steps(self)   # the last optimizer step's deferred scheduler step (16-mixed)
        self._call_hook("on_fit_end")
        for lg in self.loggers if self.is_global_zero else []:
            lg.finalize("interrupted" if self.interrupted else "success")
        _summary.fit_ended(self, t0)
        return None

    def _run_validation(self):
        self.state.stage = RunningStage.VALIDATING
        EvalLoop(self, "validate").run(self._val_loaders, self.limit_val_batches)
        self.state.stage = RunningStage.TRAINING

    def _evaluate(self, stage):
        self._call_hook("on_fit_start") if False else None
        out = EvalLoop(self, stage).run(self._eval_loaders,
                                        self.limit_val_batches if stage == "validate" else self.limit_test_batches)
        for lg in self.loggers if self.is_global_zero else []:
            lg.save()
        if getattr(self, "_verbose", True):
            _summary.print_results(self, stage, out)
        return out

    def _predict(self):
        from ember.trainer.predict import run_predict
        return run_predict(self)

    # ------------------------------------------------------------------ hooks
    def _module_hook(self, name):
        """The module's hook if its class overrides it, else None."""
        m = self.module
        return getattr(m, name) if overrides(m, TrainModule, name) else None

    def _call_hook(self, name, *args):
        for h in self._hooks.get(name, ()):
            h(self, self.module, *args)
        mh = self._module_hook(name) if hasattr(TrainModule, name) else None
        if mh is not None:
            mh(*args)

    def _before_optimizer_step(self, opt):
        # the hook sees true gradients (as Lightning): unscale them first under loss scaling
        self._acc.unscale_gradients()
        for h in self._hooks["on_before_optimizer_step"]:
            h(self, self.module, opt)
        mh = self._module_hook("on_before_optimizer_step")
        if mh is not None:
            mh(opt)

    def _step_schedulers(self, interval):
        step_schedulers(self, interval)

    def _current_padding(self) -> int:
        """Samples ``gather_for_metrics`` drops now: inside an evaluation step, the sampler's
        padding on the last batch of a full pass only; after the steps (epoch-end hooks),
        all of it from the end of the concatenated pass (see ``ember.data.batch_padding``)."""
        from ember.data.sampling import ShardedIterable, batch_padding
        loader = self.current_dataloader
        if loader is None:
            return 0
        if self._eval_batch_idx is not None and isinstance(getattr(loader, "dataset", None), ShardedIterable) \
                and self.world_size > 1:
            raise MisconfigurationError(
                "gather_for_metrics inside an evaluation step on an IterableDataset: its ranks may run "
                "different numbers of batches, and a per-batch gather would wait for a batch that never "
                "comes. Gather once after the steps instead (in on_validation_epoch_end, or with the "
                "GatherMetrics callback), or evaluate on a map-style dataset")
        return batch_padding(loader, self._eval_batch_idx, self._current_pass_batches)

def _one_module(module: Any, model: Any) -> Any:
    """``fit(module)`` or Lightning's ``fit(model=...)``; both is an error."""
    if model is not None and module is not None:
        raise MisconfigurationError("pass the module once: positionally or as model=, not both")
    return module if model is None else model


def _prepare_data_agreed(strategy, error: "BaseException | None") -> None:
    """In place of a barrier after ``prepare_data`` (run by each node's local rank 0):
    one all-gather of the outcomes, so a failure raises on every rank (the failing rank
    its own error, the others a DistributedOperationError naming it) instead of the others
    waiting in the barrier."""
    if strategy.world_size == 1:
        if error is not None:
            raise error
        return
    outcomes = strategy.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, m) for r, m in enumerate(outcomes) if m is not None]
    if error is not None:
        raise error
    if failed:
        rank, msg = failed[0]
        raise DistributedOperationError(f"prepare_data failed on rank {rank} (that node's local rank 0): {msg}")
