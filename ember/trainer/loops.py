"""The loops. The order of events is documented once, here.

Event order of ``trainer.fit`` (hooks run on callbacks first, then the module;
a hook nobody overrides is never called)::

    configure_callbacks                      # the module's callbacks join (or replace) the Trainer's
    prepare_data                             # datamodule's, then the module's; local rank 0; barrier
    setup(stage="fit")                       # datamodule, callbacks, module; then configure_model,
                                             # strategy wrap, data, optimizers
    [restore checkpoint]                     # ckpt_path: weights, optimizers, loop position, RNG
    on_fit_start
    [sanity check (num_sanity_val_steps batches per val dataloader; results discarded):
        on_sanity_check_start
        on_validation_epoch_start; on_validation_batch_start/end per batch; on_validation_epoch_end
        (no on_validation_start/end during the sanity check)
        on_sanity_check_end]
    on_train_start
    while not stopped:                       # one epoch
        [every reload_dataloaders_every_n_epochs epochs: the dataloader hooks again]
        sampler.set_epoch(epoch)
        on_train_epoch_start
        for batch_idx, batch in loader:      # resumed epochs skip sampler indices, not batches
            on_before_batch_transfer; transfer_batch_to_device; on_after_batch_transfer
                                              # (default: strategy.batch_to_device, skipped on CPU)
            on_train_batch_start              # module may return -1 to end the epoch
            with no_sync(unless last micro-batch), precision.forward_context():
                out = module.training_step(batch, batch_idx)   # loss | {"loss": ...} | None (skip)
            on_before_backward(loss / window size)
            strategy.backward(loss / accumulate_grad_batches)
            on_after_backward
            if last micro-batch of the window (or of the epoch):
                on_before_optimizer_step      # sees unscaled gradients under 16-mixed
                configure_gradient_clipping   # default: clip to gradient_clip_val
                optimizer_step(epoch, batch_idx, opt, closure)  # default: opt.step() through the
                                              # precision; closure() returns the loss (already run)
                on_before_zero_grad(opt); optimizer_zero_grad(epoch, batch_idx, opt)
                                              # default: opt.zero_grad(set_to_none=True)
                step-interval schedulers; global_step += 1
                every log_every_n_steps: emit step metrics to loggers (one host transfer)
            (manual optimization: training_step under forward_context; the module calls
             manual_backward / opt.step() / its schedulers; each opt.step() is a global step)
            on_train_batch_end(outputs)       # {"loss": loss} when training_step returned a tensor
            if val_check_interval reached mid-epoch: validation loop
            stop when max_steps, or at a check point when a stop was agreed (below; a stop
            request waits for min_epochs / min_steps)
        emit epoch metrics of the training stage
        if epoch % check_val_every_n_epoch == 0: validation loop   # on_validation_* hooks
        epoch-interval schedulers (ReduceLROnPlateau reads its monitor; lr_scheduler_step if overridden)
        on_train_epoch_end                   # ModelCheckpoint / EarlyStopping act here
        emit what the module logged in on_train_epoch_end   # epoch values by default
        epoch += 1
    on_train_end
    on_fit_end
    teardown(stage="fit")                    # callbacks', then the module's; datamodule's

Where the ranks agree (each decision made once; never a collective per step)::

    setup                 rank 0 picks the logger version folders (trainer.log_dir), broadcast
                          (state.agree_log_versions); ckpt_path "last"/"best" (and whether an
                          elastic restart resumes) is resolved on rank 0 only, broadcast, so
                          every rank restores the same checkpoint, or none;
                          a train loader kept with the user's sampler generator gets rank 0's
                          generator state (ember.data.agree_generator: one all_gather_object
                          of a digest, a broadcast only when the states differ)
    resume (ckpt_path)    the checks of the checkpoint are agreed: one all_gather_object of
                          each rank's outcome before the strategy's load (the files as each
                          node sees them; rank 0's EMBER_ALLOW_DATA_CHANGE sent along) and one
                          after it (the load, optimizer/scheduler counts, loop state, the train
                          data's shape): one rank's refusal raises the same CheckpointError,
                          naming that rank, on every rank (state.restore, ember.checkpoint.agree)
    each checkpoint save  rank 0's outcome (its write, or its check of every rank's shard
                          files) is broadcast in place of a closing barrier: a failure
                          raises on every rank, no rank waits for the timeout
    fit start, epoch end  stop: one all-reduce of [stop request, preemption signal] (agree_stop
                          in trainer/progress.py, through Strategy.agree)
    log points            (every log_every_n_steps optimizer steps) the same stop agreement:
                          should_stop set on any rank, Timer, max_time (each rank's clock),
                          SIGTERM/SIGUSR1 on any rank; the highest request wins, a signal first
    non-finite loss       checked before the optimizer steps that are log points; under several
                          processes one all-reduce of each rank's verdict there, so every rank
                          raises NonFiniteLossError at that step (checks.check_finite_loss)
    after a validation    the same stop agreement at the next optimizer step (mid-epoch
                          EarlyStopping); EarlyStopping itself agrees on its decision (max)
    ModelCheckpoint save  whether to save, the name, the monitored score and the top-k list
                          (as rank 0 restored it from the files its node sees) are rank 0's,
                          broadcast in one collective per save point, so save/keep/delete and
                          the top-k bookkeeping are the same on every rank; train_time_interval
                          is rank 0's clock, checked at log points. A weights-only write (and
                          Accelerator.save_model, export_full, ExportBestPretrained) broadcasts
                          rank 0's outcome in place of a closing barrier
    EarlyStopping check   one all-reduce of [metric missing on each rank, stop]: a monitor logged
                          on some ranks only is missing on every rank (strict: all raise the
                          same error; else all skip the check), never a rank returning alone
    validation points     by batch count and epoch: the same on every rank; the number of training
                          batches per epoch is agreed at setup (the smallest of the ranks',
                          checks.agree_train_batches: one all-reduce, a warning when they differ)
    max_steps / epochs    counters: the same on every rank by construction

A rank that does not reach an agreement within the process-group timeout is named in
the error (Strategy.agree counts the agreement points in the rendezvous store).

On one process the same checks run without a collective: a stop request is acted on at
the next optimizer step. A stop at an optimizer step before the epoch's last batch is
recorded as mid-epoch (``trainer.stop_reason``; the checkpoint holds the same epoch and
the next batch; no epoch-end work, epoch-interval schedulers do not step). ``max_steps``
reached before the epoch's last batch is such a stop too: ModelCheckpoint saves where it
stopped (as for the other mid-epoch stops), and neither the epoch-end validation nor the
training epoch metrics of the partial epoch are emitted (their accumulators are in the
checkpoint: a resumed run emits the whole epoch's values once, at its real end).

Validation / test loop::

    on_{stage}_model_eval                    # module.eval() unless overridden
    torch.inference_mode() (Trainer(inference_mode=False): torch.no_grad())
    on_{stage}_start; on_{stage}_epoch_start
    for each dataloader, batch:
        on_before_batch_transfer; transfer_batch_to_device; on_after_batch_transfer
        on_{stage}_batch_start; {stage}_step; on_{stage}_batch_end
    on_{stage}_epoch_end                     # the module may still self.log here
    emit epoch metrics (sync_dist reduced here); on_{stage}_end
    on_{stage}_model_train                   # module.train(), when the module was training before

Predict runs the same way with the predict hooks (on_predict_model_eval; no model_train).
"""
from __future__ import annotations

import inspect
import math
import re
import time

import torch

from ember.data import sampling as edata
from ember.errors import MisconfigurationError
from ember.trainer import hooks as _hooks
from ember.trainer.arguments import maybe_reload_dataloaders as reload_dataloaders
from ember.trainer.progress import agree_stop
from ember.trainer.checks import check_finite_loss
from ember.trainer.state import check_epoch_trained

_DL_SUFFIX = re.compile(r"/dataloader_idx_(\d+)")


def extract_loss(out, hook: str = "training_step"):
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


def _call(hooks, *args):
    for h in hooks:
        h(*args)


class FitLoop:
    """Runs the epochs of ``trainer.fit``. The training step is inline in
    :meth:`run_epoch` so it reads top to bottom."""

    def __init__(self, trainer):
        self.t = trainer

    # ------------------------------------------------------------------ epochs
    def run(self) -> None:
        t = self.t
        ls = t.loop_state
        t._call_hook("on_train_start")
        agree_stop(t, force=True)   # a stop asked for before training (Timer budget used up)
        while not self._done():
            steps_before, batches_before = ls.global_step, ls.batches_done
            self.run_epoch()
            if ls.stop_reason is not None and ls.batches_done < t.num_training_batches:
                break   # stopped mid-epoch: no epoch-end work; a resume continues at the next batch
            check_epoch_trained(t, steps_before, batches_before)
            ls.epoch_finished = True
            t._emit_epoch(t._results["train"])
            if t._val_loaders and (ls.epoch + 1) % max(t.check_val_every_n_epoch or 1, 1) == 0 \
                    and t.check_val_every_n_epoch is not None and not t._val_ran_at_batch_end:
                t._run_validation()
            t._step_schedulers("epoch")
            results = t._results["train"]
            results.epoch_end_hook = True
            try:
                t._call_hook("on_train_epoch_end")
            finally:
                results.epoch_end_hook = False
            if results.late or t.world_size > 1:   # values logged in on_train_epoch_end (every rank
                # takes part in the sync_dist names check, also one that logged nothing here)
                t._emit_epoch(results, names=results.late)
                results.late = set()
            ls.epoch += 1
            ls.batches_done = 0
            ls.epoch_finished = False
            if ls.stop_reason is not None or agree_stop(t, force=True):
                break
        t._call_hook("on_train_end")

    def _done(self) -> bool:
        t = self.t
        ls = t.loop_state
        if ls.stop_reason is not None:
            return True
        if t.max_steps >= 0 and ls.global_step >= t.max_steps:
            ls.stop_reason = "max_steps"
            return True
        if t.max_epochs is not None and t.max_epochs >= 0 and ls.epoch >= t.max_epochs:
            ls.stop_reason = "max_epochs"
            return True
        return False

    # ------------------------------------------------------------------- steps
    def run_epoch(self) -> None:
        t = self.t
        module, model, strategy, precision = t.module, t.model, t.strategy, t.strategy.precision
        ls = t.loop_state
        if t.reload_dataloaders_every_n_epochs:
            reload_dataloaders(t)
        loader = t._train_loader
        edata.set_epoch(loader, ls.epoch)
        t._val_ran_at_batch_end = False
        results = t._results["train"]
        if not ls.batches_done:   # a resumed epoch keeps the accumulators restored from the checkpoint
            results.reset()
        module._results = results
        module.train()
        t._call_hook("on_train_epoch_start")

        start = ls.batches_done
        limit = t.num_training_batches
        if start >= limit:
            return
        if start and not edata.skip_batches(loader, start):
            raise MisconfigurationError("cannot resume mid-epoch: the train dataloader is not index-based "
                                        "(IterableDataset); save checkpoints at epoch ends instead")
        acc_n = t.accumulate_grad_batches
        automatic = module.automatic_optimization
        # the step runs on the Accelerator's verbs (docs/accelerator.md, "The optimizer step"):
        # accumulation window and loss divisor, backward (loss scaling), unscale, clip, step, scale update
        acc = t._acc
        acc._bind_strategy()   # after a profiler wrapped strategy.backward / optimizer_step
        window = acc.accumulation_step if acc_n > 1 else None
        total = None if limit == math.inf else limit
        backward, no_sync = acc.backward, strategy.no_backward_sync
        optimizers = acc._optimizers          # AcceleratedOptimizers over t.optimizers
        opt = optimizers[0] if optimizers else None
        multi_opt = len(optimizers) > 1
        clip = t.gradient_clip_val
        clip_fn = None if clip is None or strategy.owns_optimizer_step else \
            acc.clip_grad_value_ if t.gradient_clip_algorithm == "value" else acc.clip_grad_norm_
        owns_step = strategy.owns_optimizer_step
        zero_grad = opt.optimizer.zero_grad if opt is not None and not owns_step else None
        update_scale = precision.update if precision.scaler is not None else None
        fwd_ctx = precision.forward_context if precision.autocast_dtype is not None else None
        to_device = _hooks.batch_transfer(t, 0) or (strategy.batch_to_device if t._needs_transfer else None)
        cast = precision.convert_input if precision.needs_input_cast else None
        use_no_sync = acc_n > 1 and strategy.world_size > 1
        h_start, h_end = t._hooks["on_train_batch_start"], t._hooks["on_train_batch_end"]
        m_start = t._module_hook("on_train_batch_start")
        m_end = t._module_hook("on_train_batch_end")
        step_sched = t._step_schedulers_list
        log_every = t.log_every_n_steps
        val_every = t._val_every_n_batches
        deadline = t._deadline
        # stop requests are acted on at optimizer-step boundaries: on one process at every one
        # (no collective), under several processes at log points and after a validation, where
        # the ranks agree with one small all-reduce (agree_stop)
        multi = strategy.world_size > 1
        agree_due = False
        training_step = _hooks.step_call(module.training_step)   # training_step(batch) works too
        backward = _hooks.with_backward_hooks(t, backward, acc)   # itself unless a backward hook is overridden
        t._backward_hooks = _hooks.backward_hooks(t) if not automatic else None   # manual_backward's
        ahead = None
        if acc_n > 1 and automatic and not edata.has_length(loader):
            # unknown epoch length (IterableDataset): look acc_n - 1 batches ahead, so the last
            # accumulation window is known in time to divide by its true size and step on its end
            loader = ahead = edata.LookAhead(loader, acc_n - 1)
        from ember.data.prefetch import DevicePrefetch, prefetch_enabled
        if prefetch_enabled(strategy.root_device):
            # CUDA: batch i + 1 pinned and its copy issued before step i runs (ember/data/prefetch.py)
            loader, to_device = DevicePrefetch(loader, to_device or strategy.batch_to_device, strategy.root_device), None
        before_step = bool(t._hooks["on_before_optimizer_step"] or t._module_hook("on_before_optimizer_step"))
        # optimizer_step / optimizer_zero_grad / configure_gradient_clipping / on_before_zero_grad
        # overridden: the step runs through them (None: the inline step below)
        step_hooks = _hooks.optimizer_step_with_overrides(t, optimizers, clip_fn, before_step, update_scale) \
            if automatic and optimizers else None
        # non-finite loss: checked (one host sync) only before steps that are log points, or
        # every step under detect_anomaly; a GradScaler (16-mixed) skips such steps by itself
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
            ls.batch_idx = batch_idx
            if h_start:
                _call(h_start, t, module, batch, batch_idx)
            if m_start is not None and m_start(batch, batch_idx) == -1:
                break
            # the last micro-batch of its accumulation window? (sets backward's loss divisor)
            boundary = window(batch_idx, total) if window is not None else True
            if automatic:
                # forward + backward of one micro-batch
                sync_ctx = no_sync(model, True) if (use_no_sync and not boundary) else None
                if sync_ctx is not None:
                    sync_ctx.__enter__()
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
                        t._last_loss = loss   # checked at the epoch end and before a save (no sync here)
                        if check_loss is not None:
                            at_log = boundary and (ls.global_step + 1) % log_every == 0
                            if at_log or check_every:   # agreed at log points under several processes
                                check_loss(t, loss, batch_idx, multi and at_log)
                        backward(loss)   # divided by the window's size; scaled under 16-mixed
                finally:
                    if sync_ctx is not None:
                        sync_ctx.__exit__(None, None, None)
                # optimizer step on the last micro-batch of the window
                if boundary and (loss is not None or ls.grads_pending):
                    ls.grads_pending = False
                    if step_hooks is not None:
                        step_hooks(batch_idx, loss)
                    else:
                        if before_step:
                            t._before_optimizer_step(opt.optimizer)   # sees unscaled gradients
                        if clip_fn is not None:    # each optimizer's gradients (unscaled first)
                            for o in optimizers:
                                clip_fn([p for g in o.param_groups for p in g["params"]], clip)
                        if multi_opt:
                            for o in optimizers:
                                o.step()
                                o.zero_grad()
                        else:
                            opt.step()             # skipped on inf/NaN gradients under 16-mixed
                            if zero_grad is not None:
                                zero_grad(set_to_none=True)
                        if update_scale is not None:   # 16-mixed: one scale update after every optimizer stepped
                            update_scale()
                    ls.global_step += 1
                    if step_sched:
                        t._step_schedulers("step")   # not after a skipped step
                    if ls.global_step % log_every == 0:
                        t._emit_step(results)
                        agree_due = multi
                elif loss is not None:
                    ls.grads_pending = True
            else:
                if fwd_ctx is not None:   # manual optimization also runs forward under autocast
                    with fwd_ctx():
                        out = training_step(batch, batch_idx)
                else:
                    out = training_step(batch, batch_idx)
                if t._manual_steps_since_log >= log_every:
                    t._manual_steps_since_log = 0
                    t._emit_step(results)
                    agree_due = multi
            ls.batches_done = batch_idx + 1
            if h_end:
                _call(h_end, t, module, out, batch, batch_idx)
            if m_end is not None:
                m_end(out, batch, batch_idx)
            if val_every and (batch_idx + 1) % val_every == 0 and t._val_loaders:
                t._val_ran_at_batch_end = batch_idx + 1 >= limit
                if (ls.epoch + 1) % max(t.check_val_every_n_epoch or 1, 1) == 0:
                    t._run_validation()
                    module.train()
                    agree_due = multi
            if t.max_steps >= 0 and ls.global_step >= t.max_steps:
                ls.stop_reason = "max_steps"   # before the epoch's last batch: a mid-epoch stop
                break
            if boundary:
                if multi:
                    if agree_due or ls.stop_agreed:
                        agree_due = False
                        if agree_stop(t):
                            break
                else:
                    if deadline is not None and ls.stop_request is None and time.monotonic() >= deadline:
                        ls.stop_request = "max_time"
                    if (ls.stop_request is not None or t._signal_pending) and agree_stop(t):
                        break
        else:
            if batch_idx < 0 and start == 0:
                raise MisconfigurationError("the train dataloader yielded no batches; check the dataset "
                                            "and limit_train_batches")


class EvalLoop:
    """validation / test (and the sanity check)."""

    def __init__(self, trainer, stage: str):
        self.t, self.stage = trainer, stage

    def run(self, loaders: list, limit) -> list[dict]:
        t, stage = self.t, self.stage
        module = t.module
        hook_stage = "validation" if stage in ("validate", "sanity") else "test"
        step_fn = getattr(module, f"{hook_stage}_step", None)
        if step_fn is None or not callable(step_fn):
            raise MisconfigurationError(f"{type(module).__name__} has no {hook_stage}_step; implement it to run {stage}")
        results = t._results[stage]
        results.reset()
        prev_results = module._results
        module._results = results
        was_training = module.training
        getattr(module, f"on_{hook_stage}_model_eval")()   # module.eval() unless overridden
        accepts_idx = "dataloader_idx" in inspect.signature(step_fn).parameters
        step_fn = _hooks.step_call(step_fn)   # validation_step(batch) works too
        pre = f"on_{hook_stage}"
        hs, he = t._hooks[f"{pre}_batch_start"], t._hooks[f"{pre}_batch_end"]
        ms, me = t._module_hook(f"{pre}_batch_start"), t._module_hook(f"{pre}_batch_end")
        grad_ctx = torch.inference_mode if t.inference_mode else torch.no_grad
        t._call_hook(f"{pre}_start") if stage != "sanity" else None
        t._call_hook(f"{pre}_epoch_start")
        per_loader = []
        with grad_ctx():
            for dl_idx, loader in enumerate(loaders):
                t.current_dataloader = loader
                transfer = _hooks.batch_transfer(t, dl_idx)
                n = t._limit_batches(loader, limit)
                if stage == "sanity":   # trainer.num_sanity_val_batches
                    n = min(n, float("inf") if t.num_sanity_val_steps == -1 else t.num_sanity_val_steps)
                t._current_pass_batches = n   # a shorter pass never reaches the sampler's padding
                kwargs = {"dataloader_idx": dl_idx} if (accepts_idx and len(loaders) > 1) else {}
                results.dataloader_idx = dl_idx if len(loaders) > 1 else None
                count = 0
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= n:
                        break
                    batch = t._prepare_batch(batch, transfer)
                    results.batch, results._batch_size = batch, None
                    t._eval_batch_idx = batch_idx   # a per-batch gather_for_metrics drops padding on the last only
                    _call(hs, t, module, batch, batch_idx, dl_idx)
                    if ms is not None:
                        ms(batch, batch_idx, dl_idx)
                    fwd = t.strategy.precision.forward_context()
                    with fwd:
                        out = step_fn(batch, batch_idx, **kwargs)
                    _call(he, t, module, out, batch, batch_idx, dl_idx)
                    if me is not None:
                        me(out, batch, batch_idx, dl_idx)
                    if results.eval_step_values and stage != "sanity":   # on_step=True in *_step, as Lightning
                        t._emit_eval_step(results, stage)
                    count += 1
                t._eval_batch_idx = None
                if count == 0 and n != 0 and stage != "sanity":
                    raise MisconfigurationError(f"the {stage} dataloader #{dl_idx} yielded no batches")
                per_loader.append(count)
        results.dataloader_idx = None
        t._call_hook(f"{pre}_epoch_end")
        metrics = t._emit_epoch(results, log=stage != "sanity")
        if stage != "sanity":
            t._call_hook(f"{pre}_end")
        t.current_dataloader = None
        module._results = prev_results
        if was_training:
            getattr(module, f"on_{hook_stage}_model_train")()   # module.train() unless overridden
        if len(per_loader) > 1:
            # one dict per dataloader: its own "/dataloader_idx_N" values plus the shared ones
            return [{k: v for k, v in metrics.items() if _loader_of(k) in (None, i)} for i in range(len(per_loader))]
        return [metrics]


def _loader_of(name: str):
    m = _DL_SUFFIX.search(name)
    return int(m.group(1)) if m else None


def limit_batches(num: int | float, limit, name: str) -> int:
    if limit is None:
        return num
    if isinstance(limit, float):
        return num if math.isinf(num) else int(num * limit) if limit < 1.0 else num
    return min(num, limit)
