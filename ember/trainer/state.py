"""All the loop state of a Trainer, in one object: :class:`TrainerState` (``trainer.state``).
Its groups of fields, who reads them and its part of a checkpoint: docs/architecture.md,
"The state object". The loops read and write its fields directly (plain attribute access,
no call per step).
"""
from __future__ import annotations

import enum
from typing import Any


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class TrainerStatus(_StrEnum):
    """Whether a run is going on, and how the last one ended."""

    INITIALIZING = "initializing"   # the Trainer was created; nothing ran yet
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"     # the run raised (KeyboardInterrupt included) or was preempted

    @property
    def stopped(self) -> bool:
        return self in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)


class TrainerFn(_StrEnum):
    """The Trainer entry point that runs (or ran last)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(_StrEnum):
    """The part of a run that runs: ``fit`` goes through ``sanity_check``, ``train`` and
    ``validate``; the other entry points have one stage each."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


#: the stage each entry point starts in
FN_STAGE = {"fit": RunningStage.TRAINING, "validate": RunningStage.VALIDATING, "test": RunningStage.TESTING,
            "predict": RunningStage.PREDICTING}

#: why a fit stopped (``trainer.stop_reason``); None while it runs
STOP_REASONS = ("max_epochs", "max_steps", "max_time", "early_stopping", "timer", "should_stop",
                "preempted", "interrupted", "exception", "pruned")

#: the stop requests ranks agree on, in priority order (the highest code any rank asks for wins;
#: ``pruned``, a hyperparameter search ending this trial, is asked for on rank 0 only)
REQUESTS = ("should_stop", "early_stopping", "timer", "max_time", "pruned")
REQUEST_CODE = {r: i + 1 for i, r in enumerate(REQUESTS)}

#: the fields of :meth:`TrainerState.state_dict` (``trainer_state.pt["loop"]``)
LOOP_FIELDS = ("epoch", "batch_idx", "batches_done", "global_step", "grads_pending", "epoch_finished",
               "stop_request", "stop_agreed", "stop_reason")


class TrainerState:
    """Where a Trainer stands: every field the loops keep, in one place.

    Run status (Lightning's ``trainer.state``):
        fn: the entry point that runs (or ran last): ``"fit"``, ``"validate"``, ``"test"``, ``"predict"``.
        stage: the part of it that runs (``"train"``, ``"sanity_check"``, ``"validate"``, ...);
            None between runs.
        status: ``"initializing"``, ``"running"``, ``"finished"`` or ``"interrupted"``.

    Loop position (checkpointed):
        epoch: the current epoch (0-based).
        batch_idx: index in the epoch of the current (or last) training batch.
        batches_done: training batches finished in the current epoch; a resumed epoch
            starts at this batch.
        global_step: optimizer steps taken.
        grads_pending: an accumulation window is open (gradients accumulated, no step yet).
        epoch_finished: the epoch's batches are all done and its epoch-end work runs (a
            checkpoint saved then records the start of the next epoch).

    Control (checkpointed: the stop reason):
        stop_request: this rank's request to stop (``should_stop``, EarlyStopping, Timer,
            max_time), not yet agreed by the other ranks.
        stop_agreed: the request is the same on every rank (decided after a collective):
            the ranks act on it at the next optimizer step.
        stop_reason: why the fit stopped, agreed by every rank (:data:`STOP_REASONS`); None
            while it runs.
        signal: the preemption signal received (SIGTERM/SIGUSR1), None before one.
        signal_pending: a signal arrived and was not yet acted on.
        interrupt: Ctrl-C (SIGINT) presses not yet acted on (0, 1, 2...).
        preempted: the fit saved ``last`` for a preemption and ends.
        deadline: ``time.monotonic()`` value of ``max_time``'s end (None: no limit).

    The current epoch and pass:
        val_ran_at_batch_end: a mid-epoch validation ran after the epoch's last batch.
        steps_since_log: manual optimization steps since the last log point.
        last_loss: the latest training loss (a tensor on its device; checked at epoch
            ends and before saves, never per step).
        dataloader: the evaluation dataloader being iterated (None outside a pass).
        eval_batch_idx: the evaluation batch in progress (None after a pass's steps).
        pass_batches: batches the current evaluation pass runs.

    The run:
        resumed: this fit restored a checkpoint.
        ckpt_path: the checkpoint the current (or last) run restored (None: none);
            ckpt_path_pinned: set by the user (``trainer.ckpt_path = ...``).
        data_seed: the seed of the data order (the same on every rank).
        fit_started: ``time.monotonic()`` when the current fit started.
        exception: the exception that ended the last run, if any.
        end_error: the exception ``fit`` raises once the fit has ended cleanly
            (``Trainer.raise_after_fit``; e.g. ``optuna.TrialPruned``), None otherwise.

        active: a run (fit / validate / test / predict) is in progress.
        warned: the one-time warnings this Trainer already gave.

    The run's data (ember/trainer/data.py):
        train_dataloader, val_dataloaders: the prepared loaders of the current (or last) fit.
        eval_dataloaders: those of the current validate / test / predict;
            run_dataloaders: per entry point, those of its last run.
        fit_dataloaders: what ``fit`` was given (reload_dataloaders_every_n_epochs).
        num_training_batches: training batches per epoch (agreed across ranks; ``inf``: no length).
        val_every_n_batches: a mid-epoch validation every N training batches (None: at epoch ends).
        rng_draws: per prepared loader (by id), what the user's DataLoader takes from the global
            RNG per pass, taken again at each pass (ember/trainer/data.py, ``start_pass``).
        train_pass: what the current (or last) training pass iterates
            (``ember.data.resume.begin_pass``: the loader itself for an index-based one, else
            the pass object a checkpoint reads this rank's data position from).
        data_position: this rank's train-data position read from the checkpoint being
            resumed (``ember.data.resume.position``: a stateful loader's state, a combined
            loader's positions), applied when the resumed pass starts, then None.
        reshard_note: what a resume on another number of processes kept or chose (the
            sentence the restore line adds; ``ember.trainer.resume_data.reshard``), else None.
        reshard_stream: ``(old processes, examples each had read)`` when that resume carries a
            Hugging Face stream's shard positions (``resume_data.restore_position``), else None.
        epoch_batches: the batch the current epoch ends at when it ends before its loader
            does, agreed by every rank (a Hugging Face stream resumed on another number of
            processes leaves the ranks different numbers of examples: the smallest count of
            batches); saved with the loop position while the epoch runs; None otherwise.

        in_loop: the fit loop runs: a Ctrl-C is acted on at its next batch boundary
            (ember/trainer/stopping.py).
        env_ready: the strategy's environment (processes, process group, device) and the
            step rules are set up; once per Trainer, at its first run.
        report_path: the run report (``Trainer(report=True)``) the last fit wrote, else None.
        eval_log_steps: per evaluation stage, the logger step of its last per-batch values.

    Named objects:
        step_rules: the optimizer-step rules (:class:`ember.step.StepRules`), whose
            bookkeeping (the accumulation window, a scheduler step waiting for its skip
            flag) is loop state too.
        step_optimizers: the optimizers of automatic optimization, stepping through the
            rules (:class:`ember.step.StepOptimizer`), built at each fit's setup.
        manual_optimizers: ``(optimizers, wrappers)``: what ``TrainModule.optimizers()``
            returns under manual optimization, built at its first call of a fit.
        lr_scheduler_configs: the schedulers of the current (or last) fit, from
            ``configure_optimizers`` (checkpointed: ``trainer_state.pt["schedulers"]``).
        metrics: what was logged (:class:`ember.trainer.metrics.Metrics`: each stage's
            accumulators, ``callback_metrics``, ``logged_metrics``; checkpointed:
            ``"results"``, ``"callback_metrics"``).
        results: the accumulators the running stage's ``self.log`` writes into (one of
            ``metrics.results``); None before a loop ran.
    """

    def __init__(self) -> None:
        self.fn: TrainerFn | None = None
        self.stage: RunningStage | None = None
        self.status = TrainerStatus.INITIALIZING
        self.epoch = 0
        self.batch_idx = 0
        self.batches_done = 0
        self.global_step = 0
        self.grads_pending = False
        self.epoch_finished = False
        self.stop_request: str | None = None
        self.stop_agreed = False
        self.stop_reason: str | None = None
        self.signal: int | None = None
        self.signal_pending = False
        self.interrupt = 0
        self.preempted = False
        self.deadline: float | None = None
        self.val_ran_at_batch_end = False
        self.steps_since_log = 0
        self.last_loss: Any = None
        self.dataloader: Any = None
        self.eval_batch_idx: int | None = None
        self.pass_batches: int | float | None = None
        self.resumed = False
        self.ckpt_path: str | None = None
        self.ckpt_path_pinned = False
        self.data_seed: int | None = None
        self.fit_started: float | None = None
        self.exception: BaseException | None = None
        self.end_error: BaseException | None = None
        self.step_rules: Any = None
        self.step_optimizers: list = []
        self.manual_optimizers: tuple | None = None
        self.lr_scheduler_configs: list[dict] = []
        self.metrics: Any = None
        self.results: Any = None
        self.in_loop = False
        self.env_ready = False
        self.report_path: str | None = None
        self.eval_log_steps: dict[str, int] = {}
        self.warned: set[str] = set()
        # the run's data (ember/trainer/data.py)
        self.train_dataloader: Any = None
        self.val_dataloaders: list = []
        self.eval_dataloaders: list = []
        self.run_dataloaders: dict[str, list] = {}
        self.fit_dataloaders: dict = {}
        self.num_training_batches: int | float = 0
        self.val_every_n_batches: int | None = None
        self.rng_draws: dict[int, int] = {}
        self.train_pass: Any = None
        self.data_position: dict | None = None
        self.reshard_note: str | None = None
        self.reshard_stream: tuple[int, int] | None = None
        self.epoch_batches: int | None = None
        self.active = False

    # -- Lightning's trainer.state ---------------------------------------------------------
    @property
    def finished(self) -> bool:
        """The last run ended normally."""
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        """The last run ended, normally or not."""
        return self.status.stopped

    @property
    def interrupted(self) -> bool:
        """The last run was interrupted: it ended on Ctrl-C (``KeyboardInterrupt``), or it is
        a fit that saved ``last`` for a preemption signal and ends (``trainer.interrupted``)."""
        if self.exception is not None:   # the run raised
            return isinstance(self.exception, KeyboardInterrupt)
        return self.preempted or (self.stop_reason == "preempted" and self.fn == TrainerFn.FITTING
                                  and self.status == TrainerStatus.INTERRUPTED)

    # -- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The loop part of a checkpoint. A checkpoint saved after an epoch's last batch
        records the start of the next epoch (an epoch stopped mid-way records its next
        batch); a resumed fit runs on, so no stop request is saved."""
        out = {f: getattr(self, f) for f in LOOP_FIELDS}
        if self.epoch_finished:
            out.update(epoch=self.epoch + 1, batch_idx=0, batches_done=0, epoch_finished=False,
                       grads_pending=False)
        out["stop_request"], out["stop_agreed"] = None, False
        if self.epoch_batches is not None and not self.epoch_finished:
            out["epoch_batches"] = int(self.epoch_batches)   # only then: other checkpoints are as before
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore the loop position from :meth:`state_dict` (older checkpoints hold only
        ``epoch``, ``global_step`` and ``batches_done``). The saved stop reason says why that
        fit stopped; this one runs on."""
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.batches_done = int(state.get("batches_done", 0))
        self.batch_idx = int(state.get("batch_idx", max(self.batches_done - 1, 0)))
        self.grads_pending = False   # set again when the saved gradients are restored
        eb = state.get("epoch_batches")
        self.epoch_batches = int(eb) if eb is not None and self.batches_done else None
        self.epoch_finished = False
        self.stop_request, self.stop_agreed, self.stop_reason = None, False, None

    # -- transitions ------------------------------------------------------------------------
    def start_fit(self) -> None:
        """A fit starts: no stop is requested or agreed yet."""
        self.stop_request = self.stop_reason = None
        self.stop_agreed = False
        self.interrupt = 0
        self.end_error = None

    def reset_epoch(self) -> None:
        """After an exception: a later ``fit()`` restarts the broken epoch at its first batch."""
        self.batches_done, self.batch_idx, self.epoch_finished, self.grads_pending = 0, 0, False, False

    def request_stop(self, reason: str = "should_stop", agreed: bool = False) -> None:
        """Record a stop request (:data:`REQUESTS`); see ``Trainer.request_stop``."""
        if reason not in REQUEST_CODE:
            from ember.errors import invalid_choice
            raise invalid_choice("request_stop(reason)", reason, list(REQUEST_CODE))
        self.stop_request, self.stop_agreed = reason, agreed

    def __repr__(self) -> str:
        return (f"TrainerState(fn={self.fn!s}, stage={self.stage!s}, status={self.status!s}, epoch={self.epoch}, "
                f"global_step={self.global_step}, batches_done={self.batches_done}, stop_reason={self.stop_reason})")
