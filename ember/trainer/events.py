"""The Trainer's events, in the order a run fires them, and the one dispatcher that
calls their handlers: the callbacks that override a hook (in ``trainer.callbacks``
order), then the module's hook of the same name.

Event order of ``trainer.fit`` (an event nobody handles costs nothing: it is never
called)::

    configure_precision(device)              # module: only at a Trainer's first run, when it was given
                                             # no precision; then the device is set up (one gather
                                             # checks that every rank chose the same)
    configure_callbacks                      # module: its callbacks join (or replace) the Trainer's
    prepare_data                             # datamodule's, then the module's; each node's local rank 0
    SETUP (stage="fit")                      # datamodule, callbacks, module; then configure_model,
                                             # strategy wrap, data, optimizers
    [restore checkpoint]                     # ckpt_path: weights, optimizers, loop state, RNG;
                                             # ON_LOAD_CHECKPOINT
    ON_FIT_START
    [sanity check (num_sanity_val_steps batches per val dataloader; results discarded):
        ON_SANITY_CHECK_START
        ON_VALIDATION_EPOCH_START; ON_VALIDATION_BATCH_START/END per batch; ON_VALIDATION_EPOCH_END
        (no ON_VALIDATION_START/END during the sanity check)
        ON_SANITY_CHECK_END]
    ON_TRAIN_START
    while not stopped:                       # one epoch
        [every reload_dataloaders_every_n_epochs epochs: the dataloader hooks again]
        sampler.set_epoch(epoch)
        ON_TRAIN_EPOCH_START
        for batch_idx, batch in loader:      # a resumed epoch skips sampler indices, not batches
            on_before_batch_transfer; transfer_batch_to_device; on_after_batch_transfer
                                             # module overrides (default: the strategy's move,
                                             # skipped on the CPU)
            ON_TRAIN_BATCH_START             # the module may return -1 to end the epoch
            with no_sync (unless the window ends), precision.forward_context():
                out = module.training_step(batch, batch_idx)   # loss | {"loss": ...} | None (skip)
            ON_BEFORE_BACKWARD(loss / window size)
            backward(loss / window size)     # ember.step: loss scaling, no_sync
            ON_AFTER_BACKWARD
            if the accumulation window ends (ember.step.StepRules.make_step):
                ON_BEFORE_OPTIMIZER_STEP     # gradients unscaled first under 16-mixed
                configure_gradient_clipping  # module override; default: gradient_clip_val
                optimizer_step(epoch, batch_idx, optimizer, closure)   # module override;
                                             # default: the precision's step (skip on inf/NaN)
                ON_BEFORE_ZERO_GRAD(optimizer); optimizer_zero_grad   # module override;
                                             # default: zero_grad(set_to_none=True)
                global_step += 1; step-interval schedulers (never after a skipped step)
                every log_every_n_steps: emit step metrics to the loggers (one host transfer)
            (manual optimization: training_step under forward_context; the module calls
             manual_backward / opt.step() / its schedulers; each opt.step() is a global step)
            ON_TRAIN_BATCH_END(outputs)       # {"loss": loss} when training_step returned a tensor
            if val_check_interval is reached mid-epoch: the validation loop
            stop at max_steps, or at a check point when a stop was agreed (stopping.py agree_stop)
        emit the training stage's epoch metrics
        if epoch % check_val_every_n_epoch == 0: the validation loop
        epoch-interval schedulers (ReduceLROnPlateau reads its monitor; lr_scheduler_step override)
        ON_TRAIN_EPOCH_END                   # ModelCheckpoint / EarlyStopping act here
        emit what was logged in on_train_epoch_end   # epoch values by default
        epoch += 1
    ON_TRAIN_END
    ON_FIT_END
    TEARDOWN (stage="fit")                   # callbacks', then the module's; the datamodule's

(ON_SAVE_CHECKPOINT fires whenever a checkpoint is written; ON_EXCEPTION when a run raises,
Ctrl-C included, before the loggers are finalised.)

Validation and test (``{stage}`` is ``validation`` or ``test``)::

    on_{stage}_model_eval                    # module override (default: module.eval())
    torch.inference_mode() (Trainer(inference_mode=False): torch.no_grad())
    ON_{STAGE}_START; ON_{STAGE}_EPOCH_START
    for each dataloader, batch:
        on_before_batch_transfer; transfer_batch_to_device; on_after_batch_transfer
        ON_{STAGE}_BATCH_START; {stage}_step; ON_{STAGE}_BATCH_END
    ON_{STAGE}_EPOCH_END                     # the module may still self.log here
    emit the epoch metrics (sync_dist reduced here); ON_{STAGE}_END
    on_{stage}_model_train                   # module override (default: module.train(), when it
                                             # was training before)

Predict runs the same way with the predict events (on_predict_model_eval; no model_train).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from ember.callbacks.base import Event

__all__ = ["Event", "Dispatcher", "OVERRIDES"]


#: module hooks that replace part of what the loop does (not events: the loop calls the
#: override instead of its default)
OVERRIDES = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
             "configure_gradient_clipping", "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step")


def _overrides(obj: Any, base: type, name: str) -> bool:
    """``type(obj)`` defines ``name`` other than ``base`` does."""
    return getattr(type(obj), name, None) is not getattr(base, name, None)


class Dispatcher:
    """The handlers of every :class:`Event` for one run: built once (at setup) from the
    callbacks and the module, so the loop looks a handler up once per epoch or pass and
    an event nobody overrides costs nothing.

    ``dispatcher[event]`` is None when no callback and not the module override the hook,
    else one function ``fire(*args)`` that calls each overriding callback as
    ``hook(trainer, module, *args)`` (a callback may leave hooks out with
    ``inactive_hooks``), then the module's ``hook(*args)``, and returns what the module's
    hook returned. ``dispatcher(event, *args)`` fires it now. ``wrap(name, fn)`` (a
    profiler) times each handler as region ``"<Class>.<hook>"``.
    """

    def __init__(self, trainer: Any, module: Any, callbacks: Iterable[Any],
                 wrap: Callable[[str, Callable], Callable] | None = None) -> None:
        from ember.callbacks.base import Callback
        from ember.module import TrainModule
        self.trainer, self.module = trainer, module
        self._handlers: dict[Event, list] = {}
        self._fire: dict[Event, Callable | None] = {}
        callbacks = list(callbacks)
        for ev in Event:
            name = ev.value
            cbs = [getattr(cb, name) for cb in callbacks
                   if _overrides(cb, Callback, name) and name not in cb.inactive_hooks]
            if wrap is not None:   # a profiler times every hook but its own
                owner = getattr(wrap, "__self__", None)
                cbs = [h if h.__self__ is owner else wrap(f"{type(h.__self__).__name__}.{name}", h) for h in cbs]
            mh = getattr(module, name) if module is not None and hasattr(TrainModule, name) \
                and _overrides(module, TrainModule, name) else None
            if mh is not None and wrap is not None:
                mh = wrap(f"{type(module).__name__}.{name}", mh)
            self._handlers[ev] = cbs
            self._fire[ev] = self._build(cbs, mh)

    def _build(self, cbs: list, mh: Callable | None) -> Callable | None:
        if not cbs:
            return mh       # the module's bound hook itself (or None): no extra call
        trainer, module = self.trainer, self.module

        def fire(*args: Any) -> Any:
            for h in cbs:
                h(trainer, module, *args)
            return mh(*args) if mh is not None else None
        return fire

    def __getitem__(self, event: Event | str) -> Callable | None:
        return self._fire[Event(event)]

    def __call__(self, event: Event | str, *args: Any) -> Any:
        """Fire ``event`` now (callbacks, then the module); returns the module hook's result."""
        fn = self._fire[Event(event)]
        return fn(*args) if fn is not None else None

    def handlers(self, event: Event | str) -> list:
        """The callbacks' bound hooks that handle ``event``, in call order (the module's hook
        runs after them)."""
        return list(self._handlers[Event(event)])

    def retire(self, callback: Any, event: Event | str) -> None:
        """``callback`` stops handling ``event`` for the rest of the run (e.g. a callback
        whose per-batch work is done): it is no longer called, from the next batch on."""
        hooks = self._handlers[Event(event)]
        hooks[:] = [h for h in hooks if getattr(getattr(h, "__wrapped__", h), "__self__", None) is not callback]

    def module_override(self, name: str) -> Callable | None:
        """The module's override of ``name`` (one of :data:`OVERRIDES`, or any TrainModule
        hook), or None when its class keeps the default."""
        from ember.module import TrainModule
        m = self.module
        return getattr(m, name) if m is not None and _overrides(m, TrainModule, name) else None
