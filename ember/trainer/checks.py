"""Checks that turn silent mistakes into a clear error or a one-time warning,
each naming the argument or hook and the fix. None of them runs per step."""
from __future__ import annotations

import warnings

from ember.errors import MisconfigurationError

LOGGER_NAMES = ("tensorboard", "csv", "wandb")


def check_logger_arg(arg) -> None:
    """``Trainer(logger=...)``: checked at construction (the loggers are built at setup)."""
    from ember.loggers import Logger

    def ok(x):
        return isinstance(x, Logger) or (isinstance(x, str) and x.lower() in LOGGER_NAMES)
    items = arg if isinstance(arg, (list, tuple)) else [arg]
    if arg is True or arg is False or arg is None or ok(arg) or (isinstance(arg, (list, tuple)) and all(map(ok, arg))):
        if any(isinstance(x, str) and x.lower() == "wandb" for x in items):
            import importlib.util
            if importlib.util.find_spec("wandb") is None:
                raise MisconfigurationError("logger='wandb' needs the wandb package: pip install wandb")
        return
    bad = [x for x in arg if not ok(x)] if isinstance(arg, (list, tuple)) else [arg]
    raise MisconfigurationError(
        f"logger={arg!r} is not valid ({bad[0]!r}); use True (TensorBoard), False, one of "
        f"{', '.join(repr(n) for n in LOGGER_NAMES)}, a Logger, or a list of those")


def check_loader(value, arg: str, returned: bool = False, warn_empty: bool = False):
    """A torch ``Dataset`` where a DataLoader is expected would be iterated one
    unbatched sample at a time: refuse it, naming the argument (``returned``: ``arg``
    is a hook such as ``MyModule.train_dataloader()``). ``warn_empty`` (evaluation
    loaders): a DataLoader with no batches is warned about, naming the argument, as
    Lightning does; its pass is skipped."""
    from torch.utils.data import DataLoader, Dataset
    values = value if isinstance(value, (list, tuple)) else [value]
    for i, v in enumerate(values):
        if warn_empty and isinstance(v, DataLoader) and _length(v) == 0:
            which = f" (#{i})" if len(values) > 1 else ""
            warnings.warn(f"{arg}{'' if returned else '='}{which} has no batches (an empty dataset, or drop_last=True "
                          "with fewer samples than batch_size): its pass is skipped. Give it data, or leave it out "
                          "(limit_val_batches=0 runs no validation)", UserWarning, stacklevel=4)
        if isinstance(v, Dataset) and not isinstance(v, DataLoader):
            what = f"a {type(v).__name__} (a Dataset), not a DataLoader: it would be iterated one unbatched sample at a time"
            if returned:
                raise MisconfigurationError(f"{arg} returned {what}. Return DataLoader(dataset, batch_size=...) instead")
            raise MisconfigurationError(f"{arg}= got {what}. Pass {arg}=DataLoader(dataset, batch_size=...) instead")
    return value


def _length(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:   # an IterableDataset without __len__
        return None


def warn_log_interval(t) -> None:
    """``log_every_n_steps`` larger than the optimizer steps of an epoch, with a
    logger: a training epoch logs at most one point (or none). Warned once per Trainer."""
    if "log_interval" in t.state.warned:
        return
    n = t.num_training_batches
    if n == float("inf"):
        return
    steps = max(1, -(-int(n) // max(t.accumulate_grad_batches, 1)))
    if t.log_every_n_steps > steps and t.is_global_zero and t.loggers:
        t.state.warned.add("log_interval")
        warnings.warn(
            f"log_every_n_steps={t.log_every_n_steps} is larger than the {steps} optimizer step(s) of a training "
            f"epoch ({int(n)} batches): step metrics are logged only every {t.log_every_n_steps} steps. Set "
            f"Trainer(log_every_n_steps=...) to at most {steps} to see them within each epoch.",
            UserWarning, stacklevel=5)


def warn_finished(t) -> bool:
    """``fit`` on a Trainer whose run already reached its limit trains nothing: say
    which limit and how to continue. Returns True when that is the case."""
    if t.max_steps is not None and t.max_steps >= 0 and t.global_step >= t.max_steps:
        what = f"max_steps={t.max_steps} (global_step={t.global_step})"
        fix = "max_steps"
    elif t.max_epochs is not None and t.max_epochs >= 0 and t.current_epoch >= t.max_epochs:
        what = f"max_epochs={t.max_epochs} (current_epoch={t.current_epoch})"
        fix = "max_epochs"
    else:
        return False
    if t.is_global_zero:
        warnings.warn(
            f"trainer.fit() trains nothing: this run already reached {what}. To train further, raise the limit "
            f"(trainer.{fix} = N, then fit again) or continue from the checkpoint with a new Trainer: "
            f"Trainer({fix}=N, ...).fit(module, ..., ckpt_path='last').", UserWarning, stacklevel=5)
    return True


def warn_unsynced(t, stage: str, vals: dict, host: dict) -> None:
    """Under several processes, at the first epoch emission of each stage: an epoch
    value logged without ``sync_dist=True`` (and not a torchmetrics Metric, which syncs
    itself) that differs between ranks is shown and logged as rank 0's value only.
    One all_gather of those few floats, once per stage and Trainer (every rank
    reaches the same epoch emissions)."""
    done = t.metrics.unsynced_checked
    if stage in done or t.world_size <= 1:
        return
    done.add(stage)
    names = sorted(k for k, (e, _) in vals.items() if not e.sync_dist and e.metric is None and k in host)
    gathered = t.strategy.all_gather_object({k: host[k] for k in names})
    differ = sorted({k for g in gathered for k in g if any(o.get(k) != g[k] for o in gathered)})
    if differ and t.is_global_zero:
        warnings.warn(
            f"{', '.join(repr(n) for n in differ)} logged as epoch value(s) without sync_dist=True differ between "
            f"the {t.world_size} processes; the progress bar, loggers and checkpoints see rank 0's value only. "
            f"Use self.log({differ[0]!r}, ..., sync_dist=True) (or a torchmetrics Metric) to reduce across processes.",
            UserWarning, stacklevel=2)


def describe_missing_metric(t, name: str) -> str:
    """Why ``name`` is not in ``trainer.callback_metrics``: logged (and how: an epoch value
    appears at its stage's end, a step value once a step logged it) or never logged."""
    base = name.removesuffix("_epoch") if name.endswith("_epoch") else name.removesuffix("_step")
    for stage, res in t.metrics.results.items():
        e = res.entries.get(name) or res.entries.get(base)
        if e is None or stage == "sanity":
            continue
        where = {"train": "in training", "validate": "in validation", "test": "in test"}[stage]
        keys = ([e.name + "_step" if e.on_epoch else e.name] if e.on_step else []) + \
            ([e.name + "_epoch" if e.on_step else e.name] if e.on_epoch else [])
        if name not in keys:
            return (f"{name!r} is not a key of the metric logged as {e.name!r} {where} (on_step={e.on_step}, "
                    f"on_epoch={e.on_epoch}); its keys are {keys}")
        when = "at the end of its epoch or validation pass" if name.endswith("_epoch") or not e.on_step else \
            "after the first step that logs it"
        return (f"{name!r} was logged {where} (on_step={e.on_step}, on_epoch={e.on_epoch}) but has no value "
                f"yet: it appears {when}")
    return f"{name!r} was never logged; log it with self.log({name!r}, ...) or change the argument"


def agree_chosen_precision(t) -> None:
    """A Trainer given no precision runs the module's choice for each rank's device
    (``configure_precision``): ranks on machines that differ (one CPU with bfloat16 units,
    one without) could choose differently and train one model in two number formats.
    One gather at setup: every rank raises, naming the ranks and the fix."""
    names = t.strategy.all_gather_object(t.precision)
    if len(set(names)) < 2:
        return
    ranks: dict = {}
    for r, n in enumerate(names):
        ranks.setdefault(n, []).append(r)
    said = "; ".join(f"{n!r} on rank(s) {', '.join(map(str, rs[:8]))}{' ...' if len(rs) > 8 else ''}"
                     for n, rs in ranks.items())
    raise MisconfigurationError(
        f"the Trainer was given no precision, and {type(t.module).__name__}.configure_precision chose "
        f"differently on the ranks' devices ({said}): their machines differ (bfloat16 hardware on some). "
        "Pass Trainer(precision=...) so that every rank trains in one precision")


def warn_fp16_on_cpu(t) -> None:
    """``16-mixed`` on a CPU device: ember runs real fp16 autocast with a GradScaler, where
    Lightning switches to ``bf16-mixed``; say so once, with the fix."""
    if t.precision == "16-mixed" and t.strategy.root_device.type == "cpu" and t.is_global_zero:
        warnings.warn(
            "precision='16-mixed' on CPU runs fp16 autocast with a GradScaler (Lightning switches to "
            "'bf16-mixed' here instead): most CPUs have slow fp16 kernels. Pass precision='bf16-mixed' for "
            "Lightning's behaviour (no loss scaling needed), or '32-true'.", UserWarning, stacklevel=5)


def check_finite_loss(t, loss, batch_idx: int, agree: bool = False) -> None:
    """Raise NonFiniteLossError when ``loss`` is NaN/inf. One host sync: the loop calls
    this only at log points (or every step under ``detect_anomaly=True``). ``agree`` (log
    points under several processes): one small all-reduce of every rank's verdict, so
    every rank raises at the same step, naming the ranks whose loss is not finite."""
    import math
    from ember.errors import NonFiniteLossError
    v = float(loss.detach().float())
    where = ""
    if agree:
        flags = [False] * t.world_size
        flags[t.global_rank] = not math.isfinite(v)
        bad = [r for r, f in enumerate(t.strategy.agree(flags, "max")) if f]
        if not bad:
            return
        if math.isfinite(v):
            raise NonFiniteLossError(
                f"the training loss is not finite on rank(s) {bad} at global step {t.global_step + 1} (epoch "
                f"{t.current_epoch}, batch {batch_idx}); see that rank's error. Every rank stops here.")
        where = f" on rank {t.global_rank}" + (f" (and rank(s) {[r for r in bad if r != t.global_rank]})"
                                              if len(bad) > 1 else "")
    elif math.isfinite(v):
        return
    every = t.detect_anomaly
    raise NonFiniteLossError(
        f"the training loss is {v}{where} at global step {t.global_step + 1} (epoch {t.current_epoch}, batch "
        f"{batch_idx}); "
        + ("the optimizer step was not taken. " if every else
           f"the loss is checked every log_every_n_steps={t.log_every_n_steps} steps, so it may have become "
           "non-finite earlier: pass Trainer(detect_anomaly=True) to check every step and locate the first one. ")
        + "Lower the learning rate, clip gradients (gradient_clip_val) or use precision='16-mixed' or "
          "'bf16-mixed'.")


def agree_train_batches(t, n: float) -> float:
    """Under several processes: the number of training batches per epoch that every rank
    runs, the smallest of the ranks' (``len`` of each rank's train loader after
    ``limit_train_batches``, a Hugging Face stream's from its shards' lengths
    (``data.stateful.hf_rank_batches``); ``inf`` for one without a length). The epoch's end, the
    validation points (``val_check_interval``) and the last accumulation window are
    counted in batches, so ranks whose loaders differ in length would reach them at
    different batches and wait in each other's collectives. One small all-reduce at setup
    (each rank's count in its own slot); a warning on rank 0 names the counts when they differ."""
    counts = [0.0] * t.world_size
    counts[t.global_rank] = float(n)
    counts = t.strategy.agree(counts, "max")
    m = min(counts)
    if m != max(counts) and t.is_global_zero:
        shown = ", ".join(f"rank {r}: {int(c) if c != float('inf') else 'no length'}" for r, c in enumerate(counts))
        warnings.warn(
            f"the train dataloader has a different number of batches per epoch on each rank ({shown}); every "
            f"rank trains {int(m)} batch(es) per epoch, the smallest (their steps must pair up), and leaves the "
            "rest out. Give every rank the same number of batches (the distributed sampler does: "
            "use_distributed_sampler=True, the default; a Hugging Face stream needs shards of equal lengths, "
            "a multiple of the ranks)", UserWarning, stacklevel=4)
    return m if m == float("inf") else int(m)


#: module hooks that replace part of the automatic optimizer step
STEP_OVERRIDES = ("optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping")

#: Lightning hooks ember does not call, and what to use instead (warned at setup)
UNSUPPORTED = {
    "backward": "ember runs backward through the strategy (loss scaling, DDP); put code that must run "
                "around it in on_before_backward(loss) / on_after_backward()",
    "configure_sharded_model": "rename it configure_model (Lightning's current name, which ember calls)",
    "on_after_zero_grad": "put the code in on_before_zero_grad(optimizer) or optimizer_zero_grad",
}


def check_module_hooks(t, module) -> None:
    """At setup: a Lightning hook ember does not call is warned about (never ignored
    silently); a step override a strategy cannot honour is an error."""
    from ember.module import TrainModule
    for name, fix in UNSUPPORTED.items():
        if callable(getattr(type(module), name, None)) and not hasattr(TrainModule, name):
            warnings.warn(f"{type(module).__name__}.{name}() is never called by ember's Trainer: {fix}",
                          UserWarning, stacklevel=4)
    if t.strategy.owns_optimizer_step and module.automatic_optimization:
        bad = [n for n in STEP_OVERRIDES if t.events.module_override(n) is not None]
        if bad:
            raise MisconfigurationError(
                f"{type(module).__name__} overrides {', '.join(bad)}, but under the {t.strategy.name} strategy "
                "the engine steps, clips and zeroes gradients itself; remove the override (configure "
                "clipping and the optimizer in the engine's config) or use another strategy")


def check_finite_at(t, when: str) -> None:
    """The last training loss is finite (one sync, and under several processes one
    reduction so every rank raises): called at each epoch end and before each save."""
    import torch
    from ember.errors import NonFiniteLossError
    loss = t.state.last_loss
    if loss is None or not isinstance(loss, torch.Tensor) or t.strategy.precision.scaler is not None \
            or t.strategy.owns_optimizer_step:
        return
    bad = (~torch.isfinite(loss.detach().float())).float()
    if t.world_size > 1:
        bad = t.strategy.reduce(bad, "max")
    if bad.item():
        t.state.last_loss = None
        raise NonFiniteLossError(
            f"the training loss is not finite {when} (global step {t.global_step}, epoch {t.current_epoch}); "
            "nothing was saved from it. Pass Trainer(detect_anomaly=True) to find the first bad step; lower "
            "the learning rate, clip gradients (gradient_clip_val) or use a mixed precision")


def check_epoch_trained(t, steps_before: int, batches_before: int) -> None:
    """After a full epoch: it made at least one optimizer step (automatic optimization),
    and its last loss is finite. global_step is the same on every rank, so every rank
    decides alike without a collective."""
    module, st = t.module, t.state
    if getattr(module, "automatic_optimization", True) and st.global_step == steps_before \
            and st.batches_done > batches_before and not st.grads_pending and st.stop_reason is None:
        raise MisconfigurationError(
            f"epoch {st.epoch} made no optimizer step: {type(module).__name__}.training_step returned None "
            f"(skip the batch) on all {st.batches_done - batches_before} batch(es). Return the loss (a tensor "
            "or {'loss': ...}) for the batches that should train")
    check_finite_at(t, f"at the end of epoch {t.current_epoch}")
