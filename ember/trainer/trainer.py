"""The Trainer: arguments, setup, and the fit / validate / test / predict entry points.
How it is put together (its state, step rules, dispatcher and metrics objects): docs/architecture.md."""
from __future__ import annotations

import datetime as _dt
import functools
import os
import time
import warnings
from typing import Any

import torch

from ember.callbacks.base import Callback
from ember.errors import CheckpointError, DistributedOperationError, MisconfigurationError, invalid_choice
from ember.module import DataModule, TrainModule, overrides
from ember.step import StepOptimizer, StepRules
from ember.trainer import arguments as _args
from ember.trainer import checkpoint as _ckpt
from ember.trainer import checks as _checks
from ember.trainer import summary as _summary
from ember.trainer.arguments import _check_limit, _parse_max_time
from ember.trainer.data import count_batches, setup_data
from ember.trainer.events import Dispatcher, Event
from ember.trainer.logging import Results
from ember.trainer.loops import EvalLoop, FitLoop
from ember.trainer.metrics import Metrics
from ember.trainer.optim import configure_optimizers
from ember.trainer.predict import run_predict
from ember.trainer.state import FN_STAGE, RunningStage, TrainerFn, TrainerState, TrainerStatus
from ember.trainer.stopping import SignalHandlers, exit_if_preempted


def _records_given(init):
    """``Trainer.__init__`` that records whether ``accumulate_grad_batches`` was passed
    (``accumulate_given``): not given, a resume on another number of processes may choose
    the value that keeps the checkpoint's global batch (``resume_data.reshard``). The
    signature stays the one written (``inspect.signature`` follows ``__wrapped__``)."""
    @functools.wraps(init)
    def __init__(self, **kwargs: Any) -> None:
        init(self, **kwargs)
        self.accumulate_given = "accumulate_grad_batches" in kwargs
    return __init__


class Trainer:
    """Fits, validates, tests and predicts a :class:`~ember.TrainModule`.

    The order of events: ``ember/trainer/events.py``; a guide: docs/trainer.md.

    Args:
        max_epochs: stop after this many epochs (None with no other limit: 1000; -1: no limit).
        max_steps: stop after this many optimizer steps (-1: no limit).
        max_time: stop after this wall time: seconds, "DD:HH:MM:SS", a timedelta or a dict like {"hours": 2}.
        devices: "auto", "cpu", "cuda", "cuda:N", "mps", a number of processes, or a list of CUDA indices.
        strategy: "auto", "single", "ddp", "fsdp", "deepspeed", "model_parallel" or a Strategy instance.
        num_nodes: number of machines (each runs ``devices`` processes).
        accelerator: Lightning's "auto", "cpu", "gpu"/"cuda" or "mps", mapped onto ``devices``.
        precision: "64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true" or a
            ``Precision``. None (default): ``$EMBER_PRECISION`` if set, else the module's choice
            (``TrainModule.configure_precision``; "32-true" unless the module overrides it).
        accumulate_grad_batches: micro-batches per optimizer step. Not given (1), a resume on
            another number of processes sets it so that the checkpoint's global batch is kept
            (docs/checkpointing.md, "A different world size"); given, it wins (with a warning
            when the global batch changes).
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

    @_records_given
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
        from ember.strategies import resolve_accelerator
        from ember.precision import Precision
        from ember.strategies import build_strategy
        devices = resolve_accelerator(accelerator, devices)   # Lightning's accelerator= onto devices=
        #: no precision given: the module's choice (TrainModule.configure_precision), asked at the first setup
        self._precision_auto = precision in ("auto", None) and not os.environ.get("EMBER_PRECISION")
        if precision in ("auto", None):
            precision = os.environ.get("EMBER_PRECISION") or "32-true"
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
        self.max_epochs, self.max_steps, self.max_time = max_epochs, max_steps, _parse_max_time(max_time)
        self.accumulate_grad_batches = accumulate_grad_batches
        self.accumulate_given = True   # (set by _records_given)
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
            from ember.data.worker_seed import seed_everything
            seed_everything(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
            if benchmark is None:   # benchmark=True wins (with a warning), as Lightning
                torch.backends.cudnn.benchmark = False
        self.callbacks = _args.default_callbacks(
            callbacks, enable_checkpointing, enable_progress_bar, enable_model_summary)
        from ember.trainer.profiler import build_profiler
        from ember.callbacks.run_record import RunRecord
        self.profiler = build_profiler(profiler)   # None: nothing is wrapped, no cost
        if self.profiler is not None:
            self.callbacks.insert(0, self.profiler)
        if not barebones:
            self.callbacks.append(RunRecord(report=report))   # run.json (+ report.html) in the log folder
        _checks.check_logger_arg(logger)
        from ember.loggers import loggers_for
        # built now, as Lightning's: trainer.logger is usable before fit (log_hyperparams by hand,
        # as the lightning-hydra-template does), and every run logs into the same objects
        self.loggers: list = loggers_for(logger, self.default_root_dir)
        #: all the loop state, in one object (ember/trainer/state.py); Lightning's trainer.state
        self.state = TrainerState()
        # what was logged, what callbacks monitor, what the loggers got (ember/trainer/metrics.py)
        self.state.metrics = Metrics(self, _args.BarebonesResults if barebones else Results)
        #: the handlers of every event of a run (ember/trainer/events.py), built at setup
        self.events = Dispatcher(self, None, [])
        #: Ctrl-C and preemption signals during fit (ember/trainer/stopping.py)
        self.signal_handlers = SignalHandlers(self)
        self.module: TrainModule | None = None
        self.model = None
        self.datamodule: DataModule | None = None
        self.optimizers: list = []

    # ------------------------------------------------------------------ where it runs
    world_size = property(lambda self: self.strategy.world_size, doc="int: processes in the run")
    global_rank = property(lambda self: self.strategy.global_rank, doc="int: this process's rank")
    local_rank = property(lambda self: self.strategy.local_rank, doc="int: its rank on this machine")
    node_rank = property(lambda self: self.strategy.node_rank, doc="int: this machine's rank")
    is_global_zero = property(lambda self: self.strategy.is_global_zero, doc="bool: global rank 0")
    precision = property(lambda self: self._precision.name,
                         doc='str: the precision ("32-true", ...); given none, the module\'s choice from the first run on')
    logger = property(lambda self: self.loggers[0] if self.loggers else None, doc="the first logger, or None")
    lightning_module = property(lambda self: self.module, doc="the module (Lightning's name)")

    @property
    def num_nodes(self) -> int:
        """Machines this Trainer runs on."""
        return int(getattr(self.strategy, "num_nodes", 1))

    @property
    def device_ids(self) -> list[int]:
        """Device indices used on this machine: the CUDA indices, or ``0..N-1`` for N CPU processes."""
        s = self.strategy
        if s.world_size <= 1:
            return [s.root_device.index or 0]
        ids = getattr(s, "gpu_ids", None)
        if ids:
            return list(ids)
        env = getattr(s, "cluster_environment", None)
        n = getattr(env, "local_world_size", None) or s.world_size // self.num_nodes
        return list(range(int(n)))

    @property
    def num_devices(self) -> int:
        """Devices (processes) this Trainer uses per machine."""
        return len(self.device_ids)

    @property
    def log_dir(self) -> str:
        """The first logger's folder (its version folder), else ``default_root_dir``."""
        if self.loggers:
            return self.loggers[0].log_dir
        return self.default_root_dir

    # ------------------------------------------------------------------ the loop's state
    @property
    def loop_state(self) -> TrainerState:
        """:attr:`state` (the name of earlier releases)."""
        return self.state

    @property
    def metrics(self) -> Metrics:
        """What was logged, what callbacks monitor, what the loggers got (``state.metrics``,
        ember/trainer/metrics.py)."""
        return self.state.metrics

    @property
    def step_rules(self) -> StepRules | None:
        """The optimizer-step rules (ember/step.py; ``state.step_rules``), built when the
        strategy is set up at the first run; None before."""
        return self.state.step_rules

    @property
    def step_optimizers(self) -> list:
        """The optimizers of automatic optimization, stepping through the rules
        (:class:`ember.step.StepOptimizer`; ``state.step_optimizers``)."""
        return self.state.step_optimizers

    @property
    def lr_scheduler_configs(self) -> list[dict]:
        """The lr schedulers of the current (or last) fit, one dict each (``scheduler``,
        ``interval``, ``frequency``, ``monitor``, ``strict``, ...), as ``configure_optimizers``
        returned them (``state.lr_scheduler_configs``)."""
        return self.state.lr_scheduler_configs

    @lr_scheduler_configs.setter
    def lr_scheduler_configs(self, configs: list[dict]) -> None:
        self.state.lr_scheduler_configs = configs

    @property
    def interrupted(self) -> bool:
        """Whether the last run was interrupted: Ctrl-C, or a fit that saved ``last`` for a
        preemption signal (``state.interrupted``)."""
        return self.state.interrupted

    @property
    def report_path(self) -> str | None:
        """The run report (``report.html``) the last fit wrote with ``Trainer(report=True)``,
        else None (``state.report_path``)."""
        return self.state.report_path

    @property
    def stage(self) -> str | None:
        """The entry point that runs now (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``);
        None between runs. ``state.fn`` keeps the last one."""
        st = self.state
        return st.fn.value if st.active and st.fn is not None else None

    @property
    def current_epoch(self) -> int:
        """The current epoch (0-based); after a fit that finished its epochs, their number."""
        return self.state.epoch

    @current_epoch.setter
    def current_epoch(self, v: int) -> None:
        self.state.epoch = v

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.state.global_step

    @global_step.setter
    def global_step(self, v: int) -> None:
        self.state.global_step = v

    @property
    def batch_idx(self) -> int:
        """Index in the epoch of the current (or last) training batch."""
        return self.state.batch_idx

    @property
    def batches_done(self) -> int:
        """Training batches finished in the current epoch."""
        return self.state.batches_done

    @property
    def num_training_batches(self) -> int | float:
        """Training batches per epoch (``limit_train_batches`` applied; ``inf``: no length)."""
        return self.state.num_training_batches

    @property
    def is_last_batch(self) -> bool:
        """Whether the current training batch is the last one of the epoch."""
        return self.state.batch_idx + 1 >= self.state.num_training_batches

    @property
    def epoch_finished(self) -> bool:
        """Whether every batch of the current epoch is done and its epoch-end work runs."""
        return self.state.epoch_finished

    @property
    def stop_reason(self) -> str | None:
        """Why the last fit stopped, agreed by every rank: one of ``max_epochs``, ``max_steps``,
        ``max_time``, ``early_stopping``, ``timer``, ``should_stop``, ``preempted``,
        ``interrupted``, ``exception``, ``pruned``; None while it runs."""
        return self.state.stop_reason

    @property
    def should_stop(self) -> bool:
        """Set it to True (in any hook) to stop the fit. The request takes effect at the next
        optimizer step that is a check point: every step on one process; under several
        processes the ranks agree every ``log_every_n_steps`` steps, after a validation and
        at epoch ends. A stop mid-epoch is recorded as mid-epoch: a resume continues at the
        next batch."""
        return self.state.stop_request is not None

    @should_stop.setter
    def should_stop(self, v: bool) -> None:
        st = self.state
        if not v:
            st.stop_request, st.stop_agreed = None, False
        elif st.stop_request is None:
            st.stop_request = "should_stop"

    def request_stop(self, reason: str = "should_stop", agreed: bool = False) -> None:
        """Ask the fit to stop for ``reason`` (``should_stop``, ``early_stopping``, ``timer``,
        ``max_time`` or ``pruned``): as ``trainer.should_stop = True``, with the reason recorded in
        :attr:`stop_reason`. Agreed with the other ranks as described under :attr:`should_stop`;
        ``agreed=True`` says every rank makes this same request at the same step (it was decided
        after a collective), so the ranks act on it at the next optimizer step. ``min_epochs`` /
        ``min_steps`` hold back ``should_stop`` and ``early_stopping`` only."""
        self.state.request_stop(reason, agreed)

    def raise_after_fit(self, exc: BaseException) -> None:
        """Make the current ``fit`` raise ``exc`` once it has ended cleanly: after ``on_fit_end``,
        the loggers' ``finalize("success")``, the checkpoints and ``teardown``. A callback that
        stopped the fit for a reason the caller must see (``PruningCallback``: the trial was
        pruned, ``optuna.TrialPruned``) calls it, on every rank, from ``on_fit_end``."""
        self.state.end_error = exc

    @property
    def received_sigterm(self) -> bool:
        """Whether this run received SIGTERM (ember then saves ``last`` and ends the fit, see
        docs/checkpointing.md)."""
        import signal
        return self.state.signal is not None and self.state.signal == getattr(signal, "SIGTERM", None)

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint the current (or last) run restored from; None when it restored none.
        Setting it (as in Lightning) makes the next runs restore from that path when they are
        given no ``ckpt_path``, until it is set back to None."""
        return self.state.ckpt_path

    @ckpt_path.setter
    def ckpt_path(self, path: str | None) -> None:
        self.state.ckpt_path = path
        self.state.ckpt_path_pinned = path is not None

    def _stage_is(self, stage: RunningStage) -> bool:
        return self.state.stage == stage

    def _set_stage(self, stage: RunningStage, on: bool) -> None:
        if on:
            self.state.stage = stage
        elif self.state.stage == stage:
            self.state.stage = None

    training = property(lambda self: self._stage_is(RunningStage.TRAINING),
                        lambda self, v: self._set_stage(RunningStage.TRAINING, v),
                        doc="Whether the training stage of ``fit`` runs (``state.stage == 'train'``).")
    sanity_checking = property(lambda self: self._stage_is(RunningStage.SANITY_CHECKING),
                               lambda self, v: self._set_stage(RunningStage.SANITY_CHECKING, v),
                               doc="Whether the sanity check before training runs (``state.stage == "
                                   "'sanity_check'``): hooks and callbacks may skip work then.")
    validating = property(lambda self: self._stage_is(RunningStage.VALIDATING),
                          lambda self, v: self._set_stage(RunningStage.VALIDATING, v),
                          doc="Whether a validation pass runs (inside ``fit`` or ``validate()``).")
    testing = property(lambda self: self._stage_is(RunningStage.TESTING),
                       lambda self, v: self._set_stage(RunningStage.TESTING, v),
                       doc="Whether ``test()`` runs.")
    predicting = property(lambda self: self._stage_is(RunningStage.PREDICTING),
                          lambda self, v: self._set_stage(RunningStage.PREDICTING, v),
                          doc="Whether ``predict()`` runs.")

    @property
    def evaluating(self) -> bool:
        """Whether a validation, test or sanity-check pass runs."""
        return self.state.stage is not None and self.state.stage.evaluating

    @property
    def estimated_stepping_batches(self) -> int:
        """Total optimizer steps this fit will take (for warmup/decay schedules)."""
        n = self.state.num_training_batches   # inf: an IterableDataset of unknown length
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

    # ------------------------------------------------------------------ data
    @property
    def train_dataloader(self) -> Any:
        """The training DataLoader of the current (or last) fit, as prepared for the strategy; None before."""
        return self.state.train_dataloader

    @property
    def val_dataloaders(self) -> list:
        """The validation DataLoaders (prepared for the strategy): those of ``validate()``
        while it runs, else those of the current (or last) fit."""
        st = self.state
        if st.fn == TrainerFn.VALIDATING and st.active:
            return list(st.eval_dataloaders)
        return list(st.val_dataloaders)

    @property
    def test_dataloaders(self) -> list:
        """The DataLoaders of the current (or last) ``test()``, one per dataloader given."""
        return list(self.state.run_dataloaders.get("test", ()))

    @property
    def predict_dataloaders(self) -> list:
        """The DataLoaders of the current (or last) ``predict()``, one per dataloader given."""
        return list(self.state.run_dataloaders.get("predict", ()))

    @property
    def current_dataloader(self) -> Any:
        """The evaluation DataLoader being iterated (None outside an evaluation pass)."""
        return self.state.dataloader

    @property
    def num_val_batches(self) -> list:
        """Validation batches per val dataloader (``limit_val_batches`` applied): those of
        ``validate()`` while it runs (or ran last), else those of fit's validation."""
        st = self.state
        if st.fn == TrainerFn.VALIDATING:
            return [count_batches(dl, self.limit_val_batches) for dl in st.run_dataloaders.get("validate", ())]
        return [count_batches(dl, self.limit_val_batches) for dl in st.val_dataloaders]

    @property
    def num_sanity_val_batches(self) -> list:
        """Batches per val dataloader of the sanity check before training:
        ``min(num_sanity_val_steps, num_val_batches)`` (-1: all of them)."""
        n = float("inf") if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
        return [min(n, count_batches(dl, self.limit_val_batches)) for dl in self.state.val_dataloaders]

    @property
    def num_test_batches(self) -> list:
        """Test batches per test dataloader (``limit_test_batches`` applied)."""
        return [count_batches(dl, self.limit_test_batches) for dl in self.state.run_dataloaders.get("test", ())]

    @property
    def num_predict_batches(self) -> list:
        """Predict batches per predict dataloader (``limit_predict_batches`` applied)."""
        return [count_batches(dl, self.limit_predict_batches)
                for dl in self.state.run_dataloaders.get("predict", ())]

    @property
    def padding_to_drop(self) -> int:
        """Samples ``gather_for_metrics`` drops now: inside an evaluation step, the sampler's
        padding on the last batch of a full pass only; after the steps (epoch-end hooks),
        all of it from the end of the concatenated pass (see ``ember.data.sampling.batch_padding``)."""
        from ember.data.sampling import ShardedIterable, batch_padding
        st = self.state
        loader = st.dataloader
        if loader is None:
            return 0
        if st.eval_batch_idx is not None and isinstance(getattr(loader, "dataset", None), ShardedIterable) \
                and self.world_size > 1:
            raise MisconfigurationError(
                "gather_for_metrics inside an evaluation step on an IterableDataset: its ranks may run "
                "different numbers of batches, and a per-batch gather would wait for a batch that never "
                "comes. Gather once after the steps instead (in on_validation_epoch_end, or with the "
                "GatherMetrics callback), or evaluate on a map-style dataset")
        return batch_padding(loader, st.eval_batch_idx, st.pass_batches)

    # ------------------------------------------------------------------ metrics
    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """What callbacks monitor: every emitted value, and during fit the latest value of
        each training metric logged with ``on_step=True`` (on its device: read here, at
        the reader's own pace, not copied per step)."""
        return self.state.metrics.callback_metrics()

    @callback_metrics.setter
    def callback_metrics(self, value: dict) -> None:
        self.state.metrics.emitted = dict(value)

    @property
    def logged_metrics(self) -> dict[str, float]:
        """What was sent to the loggers, as floats."""
        return self.state.metrics.logged_metrics

    @logged_metrics.setter
    def logged_metrics(self, value: dict) -> None:
        self.state.metrics.logged_metrics = dict(value)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What the progress bar shows, as floats: the latest value of each ``prog_bar``
        step metric and, for each ``prog_bar`` epoch metric, the value that was logged
        (equal to ``callback_metrics[name]``); read by the progress bar on its timer."""
        return self.state.metrics.progress_bar_metrics()

    def log_metric(self, name: str, value: Any, logger: bool = True) -> None:
        """Record an already-reduced value (used by callbacks such as GatherMetrics)."""
        self.state.metrics.log_metric(name, value, logger)

    def describe_missing_metric(self, name: str) -> str:
        """Why ``name`` is not in :attr:`callback_metrics` (never logged, or logged but
        without a value yet), for callbacks' error messages."""
        return _checks.describe_missing_metric(self, name)

    # ------------------------------------------------------------------ callbacks
    @property
    def checkpoint_callbacks(self) -> list:
        """The :class:`~ember.callbacks.ModelCheckpoint` callbacks of this Trainer."""
        from ember.callbacks.checkpoint import ModelCheckpoint
        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        """The first :class:`~ember.callbacks.ModelCheckpoint`, or None."""
        cbs = self.checkpoint_callbacks
        return cbs[0] if cbs else None

    @property
    def early_stopping_callbacks(self) -> list:
        """The :class:`~ember.callbacks.EarlyStopping` callbacks of this Trainer."""
        from ember.callbacks.early_stopping import EarlyStopping
        return [c for c in self.callbacks if isinstance(c, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> Any:
        """The first :class:`~ember.callbacks.EarlyStopping` callback, or None."""
        cbs = self.early_stopping_callbacks
        return cbs[0] if cbs else None

    @property
    def progress_bar_callback(self) -> Any:
        """The :class:`~ember.callbacks.ProgressBar` callback, or None."""
        from ember.callbacks.progress import ProgressBar
        return next((c for c in self.callbacks if isinstance(c, ProgressBar)), None)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only (Lightning prints on local rank 0 of each machine).
        While a progress bar is live on a terminal the text goes through its console, above
        the bar, so the bar is not torn; otherwise (and with ``file=``) it is the built-in
        ``print``. Not for per-step use in a hot loop: each call writes to the terminal."""
        if not self.strategy.is_global_zero:
            return
        bar = self.progress_bar_callback
        if "file" not in kwargs and bar is not None and bar.is_live:
            sep = kwargs.get("sep")
            bar.print((" " if sep is None else sep).join(map(str, args)))   # one line above the bar
            return
        print(*args, **kwargs)

    # ------------------------------------------------------------------ entry points
    def fit(self, module: TrainModule | None = None, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | None = None, *,
            model: TrainModule | None = None) -> None:
        """Train ``module`` (or ``model=``, Lightning's name). Data: ``train_dataloaders``/``val_dataloaders`` (a DataLoader or a
        list), a ``datamodule``, or the module's ``train_dataloader()``/``val_dataloader()``.
        ``ckpt_path``: a checkpoint folder, "last" or "best" to resume from (exactly)."""
        module = _one_module(module, model)
        self._run("fit", module, datamodule, ckpt_path, train=train_dataloaders, val=val_dataloaders)
        exc, self.state.end_error = self.state.end_error, None
        if exc is not None:
            raise exc   # the fit ended cleanly; a callback asked for this (raise_after_fit)

    def validate(self, module: TrainModule | None = None, dataloaders: Any = None,
                 datamodule: DataModule | None = None, ckpt_path: str | None = None,
                 verbose: bool = True, *, model: TrainModule | None = None) -> list[dict]:
        """Run one validation pass; returns one dict of epoch metrics per dataloader and
        (``verbose``, rank 0) prints them as a table. ``module`` defaults to the fitted one."""
        module = _one_module(module, model)
        return self._run("validate", module, datamodule, ckpt_path, verbose, val=dataloaders)

    def test(self, module: TrainModule | None = None, dataloaders: Any = None,
             datamodule: DataModule | None = None, ckpt_path: str | None = None,
             verbose: bool = True, *, model: TrainModule | None = None) -> list[dict]:
        """Run the test loop (``test_step``); returns one dict of metrics per dataloader and
        (``verbose``, rank 0) prints them as a table."""
        module = _one_module(module, model)
        return self._run("test", module, datamodule, ckpt_path, verbose, test=dataloaders)

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
        _ckpt.save_checkpoint(self, path, weights_only=weights_only)

    # ------------------------------------------------------------------ running
    def _run(self, stage: str, module: Any, datamodule: Any, ckpt_path: Any, verbose: bool = True,
             **loaders: Any) -> Any:
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
        st = self.state
        if ckpt_path is None and st.ckpt_path_pinned:
            ckpt_path = st.ckpt_path   # trainer.ckpt_path = ... (Lightning's user-managed path)
        elastic = ckpt_path is None and stage == "fit" and _ckpt.elastic_restart()
        if elastic and (self.world_size == 1 or self.global_rank == 0):
            ckpt_path = _ckpt.elastic_resume_path(self)   # "last" when rank 0 sees a checkpoint
        elif ckpt_path is None and stage == "fit" and self.global_rank == 0:
            note = _ckpt.elastic_not_resumed(self)   # a first attempt ember cannot tell from a membership change
            if note is not None:
                warnings.warn(note, UserWarning, stacklevel=3)
        by_name = ckpt_path in ("last", "best") or elastic   # rank 0's answer, broadcast after setup
        early = None   # under several processes a refusal waits for the agreement in restore
        if ckpt_path is not None and not (by_name and self.world_size > 1 and self.global_rank != 0):
            # errors before any work; "last"/"best" only on rank 0 (the rank is known from the
            # environment before setup): the other ranks take rank 0's path, broadcast below
            try:
                ckpt_path = _ckpt.resolve_ckpt_path(self, ckpt_path, stage)
            except CheckpointError as err:
                if self.world_size == 1:
                    raise
                early = err   # the files as this node sees them: every rank refuses, or none
        st.status, st.fn, st.stage, st.active = TrainerStatus.RUNNING, TrainerFn(stage), FN_STAGE[stage], True
        if not st.ckpt_path_pinned:
            st.ckpt_path = None   # set when this run restores a checkpoint
        st.resumed = st.preempted = False
        st.fit_started = st.exception = None
        if stage == "fit":
            st.start_fit()
        if self.profiler is not None:
            self.profiler.begin(self, stage)   # its clock starts with the setup of a fit
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
                _ckpt.restore(self, ckpt_path, full=(stage == "fit"), early=early)
                _summary.restored(self, ckpt_path)
            if stage == "fit":
                return self._fit()
            if stage == "predict":
                return run_predict(self)
            return self._evaluate(stage, verbose)
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            st.status, st.exception = TrainerStatus.INTERRUPTED, exc   # (trainer.interrupted reads them)
            if stage == "fit":   # a later fit() restarts the broken epoch from its first batch
                st.stop_reason = "interrupted" if interrupted else "exception"
                st.reset_epoch()
                self.step_rules.discard(self.optimizers)   # an engine (DeepSpeed) zeroes its own
            self.events(Event.ON_EXCEPTION, exc)
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize("interrupted" if interrupted else "failed")
            self.strategy.on_exception(exc) if hasattr(self.strategy, "on_exception") else None
            if stage == "fit" and st.fit_started is not None:
                _summary.fit_ended(self, st.fit_started, failed=True)   # never raises
            if interrupted:
                _summary.on_keyboard_interrupt(self)   # message + SystemExit(130), outside interactive sessions
            raise
        finally:
            torch.autograd.set_detect_anomaly(anomaly)
            self.signal_handlers.uninstall()
            self.events(Event.TEARDOWN, stage)
            if self.datamodule is not None:
                self.datamodule.teardown(stage)
            self.strategy.teardown()
            st.stage, st.active = None, False
            if st.status == TrainerStatus.RUNNING:
                st.status = TrainerStatus.INTERRUPTED if st.stop_reason == "preempted" \
                    and stage == "fit" else TrainerStatus.FINISHED
            if self.profiler is not None:
                self.profiler.end(self, stage)
            exit_if_preempted(self)   # SystemExit(0) after a preemption save (docs/checkpointing.md)

    def _choose_precision(self, module: TrainModule) -> None:
        """No precision was given: run in the module's choice on this device (once, before
        the device is set up), and say so on rank 0 when it is not float32."""
        from ember.precision import Precision
        device = self.strategy.root_device
        name = module.configure_precision(device)
        if name is None or Precision.from_string(name).name == self._precision.name:
            return
        self._precision = Precision.from_string(name)
        if self.is_global_zero:
            from ember.loggers.rank_zero import rank_zero_info
            rank_zero_info(f"precision: {self._precision.name} on {device.type}, chosen by "
                           f"{type(module).__name__}.configure_precision (the Trainer was given no precision); "
                           "pass Trainer(precision=\"32-true\") for float32")

    def _setup(self, module: TrainModule, datamodule: DataModule | None, stage: str, loaders: dict) -> None:
        st = self.state
        first = self.module is not module
        self.module, self.datamodule = module, datamodule
        module._trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        if not st.env_ready:   # the first run of this Trainer
            chosen = self._precision_auto
            if chosen:
                self._choose_precision(module)
            self.strategy.precision = self._precision
            self.strategy.setup_environment()   # processes, process group, device
            st.step_rules = StepRules(self.strategy, self.accumulate_grad_batches)
            st.env_ready = True
            if chosen and self.world_size > 1:
                _checks.agree_chosen_precision(self)   # one gather, at setup: one precision on every rank
            _checks.warn_fp16_on_cpu(self)
            if self.seed is not None:
                st.data_seed = self.seed
            else:
                # the seed of the data order: no draw from the user's random streams (torch's
                # initial seed, which seed_everything sets), the same on every rank (rank 0's)
                seed = torch.initial_seed() % (2**31 - 1)
                st.data_seed = int(self.strategy.broadcast(seed)) if self.world_size > 1 else seed
        _args.log_hparams(self)   # the module's and datamodule's, merged with any logged by hand
        if stage != "fit":   # as Lightning: validate/test/predict report their own metrics only
            self.state.metrics.emitted = {}
        _args.agree_log_versions(self)   # rank 0 picks the run folders, before callbacks read log_dir
        _args.configure_callbacks(self, module)   # the module's callbacks join (or replace) the Trainer's
        prof = self.profiler
        self.events = Dispatcher(self, module, self.callbacks,
                                 wrap=prof.wrap if prof is not None and prof.active else None)
        _checks.check_module_hooks(self, module)
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
        self.events(Event.SETUP, stage)   # callbacks', then the module's setup(stage)
        if first or self.model is None:
            with self.strategy.module_init_context():
                module.configure_model()
            # per block, before the strategy wraps (DDP) or shards (FSDP) the model
            from ember.strategies.blocks import apply_activation_checkpointing, compile_blocks
            apply_activation_checkpointing(module, self._ac_policy)
            if self._compile:
                compile_blocks(module, self._compile if isinstance(self._compile, dict) else None)
            module = _args.convert_sync_batchnorm(self, module)   # sync_batchnorm under several processes
            from ember.big_modeling import check_prepare
            placed = any(hasattr(m, "hf_device_map") for m in module.modules()) and \
                check_prepare(module, self.strategy.name)   # placed by a device map: stays (one process)
            self.model = module if placed else self.strategy.setup_module(module)
        setup_data(self, stage, loaders)   # before optimizers: schedules may use estimated_stepping_batches
        if stage == "fit":
            self.optimizers, st.lr_scheduler_configs = configure_optimizers(module)
            if hasattr(self.strategy, "configure_from_trainer"):   # DeepSpeed fills its "auto" config values
                self.strategy.configure_from_trainer(
                    accumulate_grad_batches=self.accumulate_grad_batches, gradient_clip_val=self.gradient_clip_val,
                    micro_batch_size=getattr(st.train_dataloader, "batch_size", None),
                    gradient_clip_algorithm=self.gradient_clip_algorithm)
            self.model, self.optimizers = self.strategy.setup_optimizers(self.model, list(self.optimizers))
            rules = st.step_rules
            rules.model, rules.accumulation_steps = self.model, self.accumulate_grad_batches
            rules.reset_window()
            st.step_optimizers = [StepOptimizer(o, rules) for o in self.optimizers]

    def _fit(self) -> None:
        st = self.state
        t0 = st.fit_started = time.monotonic()
        _checks.warn_finished(self)
        _checks.warn_log_interval(self)
        st.deadline = time.monotonic() + self.max_time if self.max_time else None
        self.signal_handlers.install()
        self.events(Event.ON_FIT_START)
        if self.num_sanity_val_steps and st.val_dataloaders and not st.resumed:
            # as Lightning: the sanity check leaves the random streams as they were, so a run
            # trains the same with or without it
            from ember.checkpoint.rng import collect_rng_states, restore_rng_states
            rng = collect_rng_states()
            st.stage = RunningStage.SANITY_CHECKING
            self.events(Event.ON_SANITY_CHECK_START)
            EvalLoop(self, "sanity").run(st.val_dataloaders, self.limit_val_batches)   # num_sanity_val_batches
            self.events(Event.ON_SANITY_CHECK_END)
            st.stage = RunningStage.TRAINING
            restore_rng_states(rng, "the state before the sanity check")
        FitLoop(self).run()
        st.step_rules.flush()   # the last optimizer step's deferred scheduler step (16-mixed)
        self.events(Event.ON_FIT_END)
        for lg in self.loggers if self.is_global_zero else []:
            lg.finalize("interrupted" if st.interrupted else "success")
        _summary.fit_ended(self, t0)

    def _evaluate(self, stage: str, verbose: bool) -> list[dict]:
        out = EvalLoop(self, stage).run(self.state.eval_dataloaders,
                                        self.limit_val_batches if stage == "validate" else self.limit_test_batches)
        for lg in self.loggers if self.is_global_zero else []:
            lg.save()
        if verbose:
            _summary.print_results(self, stage, out)
        return out


def _one_module(module: Any, model: Any) -> Any:
    """``fit(module)`` or Lightning's ``fit(model=...)``; both is an error."""
    if model is not None and module is not None:
        raise MisconfigurationError("pass the module once: positionally or as model=, not both")
    return module if model is None else model


def _prepare_data_agreed(strategy: Any, error: "BaseException | None") -> None:
    """In place of a barrier after ``prepare_data``: a failure on a local rank 0 raises on
    every rank instead of leaving the others waiting in the barrier."""
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
