"""The loops: fit (epochs and the training step) and evaluation (validation, test, the
sanity check). The order of events is in ``ember/trainer/events.py``; the rules of the
optimizer step in ``ember/step.py``; the loop state in ``ember/trainer/state.py``. One
training step reads top to bottom in :meth:`FitLoop.run_epoch`.

Where the ranks agree: each decision is made once and agreed, never with a collective per
step; every point, its file and its test are listed once, in docs/architecture.md ("Where
the ranks agree").

Stopping: a stop request is acted on at the next optimizer step on one process, at the next
agreement point (a log point, an epoch end) under several. A stop at an optimizer step before the epoch's last batch is
recorded as mid-epoch (``trainer.stop_reason``; the checkpoint holds the same epoch and
the next batch; no epoch-end work, epoch-interval schedulers do not step). ``max_steps``
reached before the epoch's last batch is such a stop too: ModelCheckpoint saves where it
stopped (as for the other mid-epoch stops), and neither the epoch-end validation nor the
training epoch metrics of the partial epoch are emitted (their accumulators are in the
checkpoint: a resumed run emits the whole epoch's values once, at its real end).
A Ctrl-C is acted on at the next batch boundary (stopping.py).
"""
from __future__ import annotations

import inspect
import math
import re
import time
import warnings
from typing import Any, Callable

import torch

from ember.data import sampling as edata
from ember.errors import MisconfigurationError
from ember.precision import NULL_CONTEXT
from ember.step import accumulation_window, step_scheduler
from ember.trainer.checks import check_epoch_trained, check_finite_loss
from ember.data.resume import begin_pass, end_pass
from ember.trainer.data import batch_transfer, count_batches, maybe_reload, prepare_batch, start_pass
from ember.trainer.events import Event
from ember.trainer.state import RunningStage
from ember.trainer.stopping import agree_stop, raise_interrupt

_DL_SUFFIX = re.compile(r"/dataloader_idx_(\d+)")


def extract_loss(out: Any, hook: str = "training_step") -> Any:
    """The loss in what ``hook`` returned: a tensor, ``{"loss": ...}`` or None (skip)."""
    if out is None or isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        if "loss" not in out:
            raise MisconfigurationError(
                f"{hook} returned a dict without a 'loss' key (keys: {sorted(out)}); return a loss tensor, "
                "a dict with 'loss', or None to skip the batch")
        return out["loss"]
    raise MisconfigurationError(
        f"{hook} returned {type(out).__name__}; return a loss tensor, a dict with 'loss', or None to skip the batch")


def takes_batch_idx(fn: Callable) -> bool:
    """Whether a ``*_step`` accepts ``batch_idx`` (Lightning allows ``training_step(self,
    batch)``): inspected once per epoch or pass, never per step."""
    # read the function under any functools.wraps layers: FSDP's register_fsdp_forward_method
    # re-binds a wrapper of the *bound* method, whose own signature would lose ``batch`` as if
    # it were ``self``; a decorator inside the class wraps the plain function, which still
    # lists ``self``
    target = inspect.unwrap(fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return True
    n = len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    if inspect.ismethod(fn) and not inspect.ismethod(target):
        n -= 1   # the unwrapped plain function's ``self``
    return n >= 2


def step_call(fn: Callable) -> Callable:
    """``fn`` itself when it takes ``(batch, batch_idx, ...)``; else an adapter that drops
    ``batch_idx`` (one extra call per step only for the short form)."""
    if takes_batch_idx(fn):
        return fn

    def short(batch, batch_idx, **kwargs):
        return fn(batch, **kwargs)
    return short


def _with_dataloader_idx(step: Callable, combined_pass: Any) -> Callable:
    """``training_step(batch, batch_idx, dataloader_idx=...)`` with the index of the loader
    the batch came from (a CombinedLoader in ``"sequential"`` mode)."""
    def run(batch, batch_idx):
        return step(batch, batch_idx, dataloader_idx=combined_pass.dataloader_idx)
    return run


# -------------------------------------------------------------------------------- schedulers
def step_schedulers(t: Any, interval: str) -> None:
    """Step the ``interval`` schedulers of automatic optimization (manual optimization
    steps its own, as Lightning) by :meth:`ember.step.StepRules.scheduler_step`; one that
    reads a monitored metric reads the skip flag at once (it must see this step's metric)."""
    if not t.module.automatic_optimization:
        return
    st = t.state
    rules = st.step_rules
    if rules.scheduler_step_pending:
        rules.flush()
    count = st.global_step if interval == "step" else st.epoch + 1
    configs = [c for c in st.lr_scheduler_configs if c["interval"] == interval and not count % c["frequency"]]
    if not configs:
        return
    custom = t.events.module_override("lr_scheduler_step")
    if interval == "epoch":
        _apply(t, configs, custom)
    else:
        rules.scheduler_step(t.optimizers, lambda: _apply(t, configs, custom),
                             defer=not any(c["monitor"] for c in configs))


def _apply(t: Any, configs: list, custom: Callable | None) -> None:
    for cfg in configs:
        s = cfg["scheduler"]
        if cfg["monitor"]:
            value = t.callback_metrics.get(cfg["monitor"])
            if value is None:
                if cfg["strict"]:
                    raise MisconfigurationError(
                        f"lr_scheduler monitor {cfg['monitor']!r} was never logged; logged metrics: "
                        f"{sorted(t.callback_metrics)}")
                continue
            s.step(float(value)) if custom is None else custom(s, float(value))
        elif custom is not None:
            custom(s, None)
        elif not step_scheduler(s) and "scheduler_past_end" not in t.state.warned:
            t.state.warned.add("scheduler_past_end")   # OneCycleLR past its total_steps raises: held there
            if t.is_global_zero:
                warnings.warn(f"{type(s).__name__} reached its total_steps={s.total_steps} at global_step "
                              f"{t.global_step}; it is no longer stepped (its last learning rate stays). Size "
                              "the schedule with trainer.estimated_stepping_batches", stacklevel=2)


def run_validation(t: Any) -> None:
    """A validation pass inside fit."""
    st = t.state
    st.stage = RunningStage.VALIDATING
    EvalLoop(t, "validate").run(st.val_dataloaders, t.limit_val_batches)
    st.stage = RunningStage.TRAINING


class FitLoop:
    """Runs the epochs of ``trainer.fit``. The training step is inline in
    :meth:`run_epoch` so it reads top to bottom."""

    def __init__(self, trainer: Any) -> None:
        self.t = trainer

    # ------------------------------------------------------------------ epochs
    def run(self) -> None:
        t = self.t
        metrics = t.metrics
        prof = t.profiler if t.profiler is not None and t.profiler.active else None
        validate = prof.wrap("validation", run_validation) if prof is not None else run_validation
        emit_epoch = prof.wrap("log (epoch metrics)", metrics.emit_epoch) if prof is not None else metrics.emit_epoch
        st = t.state
        st.in_loop = True   # from here a Ctrl-C is acted on at the next batch or epoch boundary
        try:
            self._run(validate, emit_epoch)
        finally:
            st.in_loop = False

    def _run(self, validate: Callable, emit_epoch: Callable) -> None:
        t = self.t
        st, ev, metrics = t.state, t.events, t.metrics
        ev(Event.ON_TRAIN_START)
        agree_stop(t, force=True)   # a stop asked for before training (Timer budget used up)
        while not self._done():
            steps_before, batches_before = st.global_step, st.batches_done
            self.run_epoch(validate)
            if st.stop_reason is not None and st.batches_done < st.num_training_batches:
                break   # stopped mid-epoch: no epoch-end work; a resume continues at the next batch
            check_epoch_trained(t, steps_before, batches_before)
            st.epoch_finished = True
            results = metrics.results["train"]
            emit_epoch(results)
            every = t.check_val_every_n_epoch
            if st.val_dataloaders and every is not None and (st.epoch + 1) % max(every, 1) == 0 \
                    and not st.val_ran_at_batch_end:
                validate(t)
            step_schedulers(t, "epoch")
            results.epoch_end_hook = True
            try:
                ev(Event.ON_TRAIN_EPOCH_END)
            finally:
                results.epoch_end_hook = False
            if results.late or t.world_size > 1:   # values logged in on_train_epoch_end (every rank
                # takes part in the sync_dist names check, also one that logged nothing here)
                emit_epoch(results, names=results.late)
                results.late = set()
            st.epoch += 1
            st.batches_done = 0
            st.epoch_finished = False
            if st.interrupt:
                raise_interrupt(t)
            if st.stop_reason is not None or agree_stop(t, force=True):
                break
        ev(Event.ON_TRAIN_END)

    def _done(self) -> bool:
        t, st = self.t, self.t.state
        if st.stop_reason is not None:
            return True
        if t.max_steps >= 0 and st.global_step >= t.max_steps:
            st.stop_reason = "max_steps"
            return True
        if t.max_epochs is not None and t.max_epochs >= 0 and st.epoch >= t.max_epochs:
            st.stop_reason = "max_epochs"
            return True
        return False

    # ------------------------------------------------------------------- steps
    def run_epoch(self, validate: Callable = run_validation) -> None:
        t = self.t
        st, ev, rules, metrics = t.state, t.events, t.step_rules, t.metrics
        module, model, strategy = t.module, t.model, t.strategy
        precision = strategy.precision
        if t.reload_dataloaders_every_n_epochs:
            maybe_reload(t)
        loader = st.train_dataloader
        edata.set_epoch(loader, st.epoch)
        st.val_ran_at_batch_end = False
        results = metrics.results["train"]
        if not st.batches_done:   # a resumed epoch keeps the accumulators restored from the checkpoint
            st.epoch_batches = None
            results.reset()
            start_pass(t, loader)   # the global RNG draws of the user's DataLoader
        st.results = results   # where the module's self.log writes
        module.train()
        ev(Event.ON_TRAIN_EPOCH_START)

        start, limit = st.batches_done, st.num_training_batches
        if st.epoch_batches is not None:   # agreed at a resume (a stream's shards carried to other ranks)
            limit = min(limit, st.epoch_batches)
        if start >= limit:
            return
        # -- resolved once per epoch: what each step calls (a hook nobody overrides costs nothing)
        acc_n = t.accumulate_grad_batches
        automatic = module.automatic_optimization
        from ember.data.prefetch import DevicePrefetch, prefetch_enabled
        prefetch = prefetch_enabled(strategy.root_device)
        # losses that are sums over items (TrainModule.loss_count): each window divides by its item count
        count_of = ev.module_override("loss_count") if automatic else None
        look_ahead = acc_n > 1 and automatic and (count_of is not None or not edata.has_length(loader))
        # the pass from batch ``start``: an index-based loader skips by index and is iterated as it
        # is; a stateful, stream or combined loader continues from the checkpoint's position
        # (ember/data/resume.py) and records it for the next checkpoint
        saved, st.data_position = st.data_position, None
        loader = st.train_pass = begin_pass(loader, start, saved, warn=t.is_global_zero,
                                            read_ahead=(acc_n - 1 if look_ahead else 0) + (2 if prefetch else 0))
        total = None if limit == math.inf else limit
        # the accumulation window, its loss divisor and no_sync (ember.step); nothing without accumulation
        micro_batch = rules.micro_batch if acc_n > 1 or count_of is not None else None
        divisor, window_end = None, -1
        sync_models = (model,)
        owns_step = strategy.owns_optimizer_step
        fwd_ctx = precision.forward_context if precision.autocast_dtype is not None else None
        to_device = batch_transfer(t, 0)
        cast = precision.convert_input if precision.needs_input_cast else None
        on_start, on_end = ev[Event.ON_TRAIN_BATCH_START], ev[Event.ON_TRAIN_BATCH_END]
        has_step_sched = any(c["interval"] == "step" for c in t.lr_scheduler_configs)
        log_every, val_every = t.log_every_n_steps, st.val_every_n_batches
        every_val_epoch = max(t.check_val_every_n_epoch or 1, 1)
        # stop requests are acted on at optimizer-step boundaries: on one process at every one
        # (no collective), under several processes at log points and after a validation, where
        # the ranks agree with one small all-reduce (stopping.agree_stop)
        multi = strategy.world_size > 1
        agree_due = False
        training_step = step_call(module.training_step)   # training_step(batch) works too
        if getattr(loader, "mode", None) == "sequential" and \
                "dataloader_idx" in inspect.signature(module.training_step).parameters:
            training_step = _with_dataloader_idx(module.training_step, loader)   # CombinedLoader(mode="sequential")
        backward = rules.backward
        emit_step = metrics.emit_step
        prof = t.profiler if t.profiler is not None and t.profiler.active else None
        if prof is not None:
            training_step = prof.wrap("training_step", training_step)
            backward = prof.wrap("backward", backward)
            emit_step = prof.wrap("log (step metrics)", emit_step)
        backward = rules.hooked(backward, ev[Event.ON_BEFORE_BACKWARD], ev[Event.ON_AFTER_BACKWARD])
        ahead = None
        if look_ahead:
            # unknown epoch length (IterableDataset): look acc_n - 1 batches ahead, so the last
            # accumulation window is known in time to divide by its true size and step on its end
            loader = ahead = edata.LookAhead(loader, acc_n - 1, start=start, count=count_of)
        if prof is not None:
            loader = prof.iterate(loader)
        if prefetch:
            # CUDA: batch i + 1 pinned and its copy issued before step i runs (ember/data/prefetch.py)
            loader, to_device = DevicePrefetch(loader, to_device or strategy.batch_to_device, strategy.root_device), None
        # the end of an accumulation window: unscale, clip, step, zero_grad (ember.step)
        step = rules.make_step(
            t.step_optimizers, before_step=ev[Event.ON_BEFORE_OPTIMIZER_STEP],
            clip=(t.gradient_clip_val, t.gradient_clip_algorithm) if t.gradient_clip_val is not None and not owns_step
            else None,
            clip_override=ev.module_override("configure_gradient_clipping"),
            step_override=ev.module_override("optimizer_step"), before_zero_grad=ev[Event.ON_BEFORE_ZERO_GRAD],
            zero_grad_override=ev.module_override("optimizer_zero_grad"),
            wrap=prof.wrap if prof is not None else None) if automatic else None
        # non-finite loss: checked (one host sync) only before steps that are log points, or
        # every step under detect_anomaly; a loss scaler (16-mixed) skips such steps by itself
        check_loss = None if (precision.scaler is not None or owns_step) else check_finite_loss
        check_every = bool(t.detect_anomaly)

        batch_idx = start - 1
        for batch in loader:
            batch_idx += 1
            if batch_idx >= limit:
                break
            if ahead is not None and ahead.length is not None and ahead.length < limit:
                limit = total = ahead.length
            if to_device is not None:
                batch = to_device(batch)
            if cast is not None:
                batch = cast(batch)
            results.batch, results._batch_size = batch, None
            st.batch_idx = batch_idx
            if on_start is not None and on_start(batch, batch_idx) == -1:
                break
            if automatic:
                # the last micro-batch of its accumulation window? (sets backward's loss divisor)
                if micro_batch is not None:
                    if count_of is not None and batch_idx >= window_end:   # a window starts: its item count
                        window_end = batch_idx - batch_idx % acc_n + accumulation_window(batch_idx, total, acc_n)[1]
                        counts = [ahead.counts.pop(i, None) for i in range(batch_idx, window_end)] \
                            if ahead is not None else [count_of(batch)]
                        divisor = None if any(c is None for c in counts) else rules.count_divisor(counts)
                    sync_ctx = micro_batch(batch_idx, total, sync_models, divisor)
                    boundary = rules.sync_gradients
                    if sync_ctx is NULL_CONTEXT:
                        sync_ctx = None
                    else:
                        sync_ctx.__enter__()
                else:
                    boundary, sync_ctx = True, None
                # forward + backward of one micro-batch
                try:   # no_sync is left on every path, an exception included
                    if fwd_ctx is not None:
                        with fwd_ctx():
                            out = training_step(batch, batch_idx)
                    else:
                        out = training_step(batch, batch_idx)
                    if type(out) is torch.Tensor:
                        loss = out
                        out = {"loss": loss}   # what on_train_batch_end receives, as Lightning
                    else:
                        loss = extract_loss(out)
                    if loss is not None:
                        st.last_loss = loss   # checked at the epoch end and before a save (no sync here)
                        if check_loss is not None:
                            at_log = boundary and (st.global_step + 1) % log_every == 0
                            if at_log or check_every:   # agreed at log points under several processes
                                check_loss(t, loss, batch_idx, multi and at_log)
                        backward(loss)   # divided by the window's size; scaled under 16-mixed
                finally:
                    if sync_ctx is not None:
                        sync_ctx.__exit__(None, None, None)
                # the optimizer step on the last micro-batch of the window
                if boundary and (loss is not None or st.grads_pending):
                    st.grads_pending = False
                    step(st.epoch, batch_idx, loss)   # skipped on inf/NaN gradients under 16-mixed
                    st.global_step += 1
                    if has_step_sched:
                        step_schedulers(t, "step")    # never after a skipped step; no host sync
                    if st.global_step % log_every == 0:
                        if rules.scheduler_step_pending:
                            rules.flush()             # the logged learning rate is this step's
                        emit_step(results)
                        agree_due = multi
                elif loss is not None:
                    st.grads_pending = True
            else:
                boundary = True
                steps_before = st.global_step
                if fwd_ctx is not None:   # manual optimization also runs forward under autocast
                    with fwd_ctx():
                        out = training_step(batch, batch_idx)
                else:
                    out = training_step(batch, batch_idx)
                st.steps_since_log += st.global_step - steps_before   # each opt.step() counts
                if st.steps_since_log >= log_every:
                    st.steps_since_log = 0
                    emit_step(results)
                    agree_due = multi
            st.batches_done = batch_idx + 1
            if on_end is not None:
                on_end(out, batch, batch_idx)
            if st.interrupt:
                raise_interrupt(t)   # Ctrl-C, acted on at this batch boundary (stopping.py)
            if val_every and (batch_idx + 1) % val_every == 0 and st.val_dataloaders:
                st.val_ran_at_batch_end = batch_idx + 1 >= limit
                if (st.epoch + 1) % every_val_epoch == 0:
                    validate(t)
                    module.train()
                    agree_due = multi
            if t.max_steps >= 0 and st.global_step >= t.max_steps:
                st.stop_reason = "max_steps"   # before the epoch's last batch: a mid-epoch stop
                break
            if boundary:
                if multi:
                    if agree_due or st.stop_agreed:
                        agree_due = False
                        if agree_stop(t):
                            break
                else:
                    if st.deadline is not None and st.stop_request is None and time.monotonic() >= st.deadline:
                        st.stop_request = "max_time"
                    if (st.stop_request is not None or st.signal_pending) and agree_stop(t):
                        break
        else:
            if batch_idx < 0 and start == 0:
                raise MisconfigurationError("the train dataloader yielded no batches; check the dataset "
                                            "and limit_train_batches")
        end_pass(st.train_dataloader)   # a StatefulDataLoader keeps its iterator: its workers go now


class EvalLoop:
    """validation / test (and the sanity check)."""

    def __init__(self, trainer: Any, stage: str) -> None:
        self.t, self.stage = trainer, stage

    def run(self, loaders: list, limit: Any) -> list[dict]:
        t, stage = self.t, self.stage
        st, ev, metrics = t.state, t.events, t.metrics
        module = t.module
        hook_stage = "validation" if stage in ("validate", "sanity") else "test"
        step_fn = getattr(module, f"{hook_stage}_step", None)
        if step_fn is None or not callable(step_fn):
            raise MisconfigurationError(f"{type(module).__name__} has no {hook_stage}_step; implement it to run {stage}")
        results = metrics.results[stage]
        results.reset()
        prev_results, st.results = st.results, results   # where the module's self.log writes
        was_training = module.training
        getattr(module, f"on_{hook_stage}_model_eval")()   # module.eval() unless overridden
        accepts_idx = "dataloader_idx" in inspect.signature(step_fn).parameters
        step_fn = step_call(step_fn)   # validation_step(batch) works too
        pre = f"on_{hook_stage}"
        on_start, on_end = ev[f"{pre}_batch_start"], ev[f"{pre}_batch_end"]
        grad_ctx = torch.inference_mode if t.inference_mode else torch.no_grad
        if loaders:
            start_pass(t, loaders[0])   # its iterator starts before the hooks, as Lightning's (each next one later)
        if stage != "sanity":
            ev(f"{pre}_start")
        ev(f"{pre}_epoch_start")
        per_loader = []
        with grad_ctx():
            for dl_idx, loader in enumerate(loaders):
                st.dataloader = loader
                if dl_idx:
                    start_pass(t, loader)
                transfer = batch_transfer(t, dl_idx)
                n = count_batches(loader, limit)
                if stage == "sanity":   # trainer.num_sanity_val_batches
                    n = min(n, float("inf") if t.num_sanity_val_steps == -1 else t.num_sanity_val_steps)
                st.pass_batches = n   # a shorter pass never reaches the sampler's padding
                kwargs = {"dataloader_idx": dl_idx} if (accepts_idx and len(loaders) > 1) else {}
                results.dataloader_idx = dl_idx if len(loaders) > 1 else None
                count = 0
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= n:
                        break
                    batch = prepare_batch(t, batch, transfer)
                    results.batch, results._batch_size = batch, None
                    st.eval_batch_idx = batch_idx   # a per-batch gather_for_metrics drops padding on the last only
                    if on_start is not None:
                        on_start(batch, batch_idx, dl_idx)
                    with t.strategy.precision.forward_context():
                        out = step_fn(batch, batch_idx, **kwargs)
                    if on_end is not None:
                        on_end(out, batch, batch_idx, dl_idx)
                    if results.eval_step_values and stage != "sanity":   # on_step=True in *_step, as Lightning
                        metrics.emit_eval_step(results, stage)
                    count += 1
                    if st.interrupt:
                        raise_interrupt(t)
                st.eval_batch_idx = None
                if count == 0 and n != 0 and stage != "sanity":
                    raise MisconfigurationError(f"the {stage} dataloader #{dl_idx} yielded no batches")
                per_loader.append(count)
        results.dataloader_idx = None
        ev(f"{pre}_epoch_end")
        out_metrics = metrics.emit_epoch(results, log=stage != "sanity")
        if stage != "sanity":
            ev(f"{pre}_end")
        st.dataloader = None
        st.results = prev_results
        if was_training:
            getattr(module, f"on_{hook_stage}_model_train")()   # module.train() unless overridden
        if len(per_loader) > 1:
            # one dict per dataloader: its own "/dataloader_idx_N" values plus the shared ones
            return [{k: v for k, v in out_metrics.items() if _loader_of(k) in (None, i)}
                    for i in range(len(per_loader))]
        return [out_metrics]


def _loader_of(name: str) -> int | None:
    m = _DL_SUFFIX.search(name)
    return int(m.group(1)) if m else None
