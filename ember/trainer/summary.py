"""What the Trainer tells a person (global rank 0 only): the end-of-fit summary
(why it stopped, epochs and steps done, wall time, best checkpoint, final
metrics), the line printed when a checkpoint is restored, the message of a
Ctrl-C stop, and the results table of ``validate()``/``test()``.

Text goes through the progress bar callback (so it lands above a live bar);
without a progress bar the summary is not printed, and the restore line goes to
stderr (batch jobs and CI logs still say what was restored). The
results table follows ``verbose=`` of ``validate()``/``test()``.
"""
from __future__ import annotations

import math
import signal
import sys
import time


def _bar(t):
    from ember.callbacks.progress import ProgressBar
    for cb in t.callbacks:
        if isinstance(cb, ProgressBar):
            return cb
    return None


def _say(t, text: str) -> None:
    bar = _bar(t)
    if bar is not None and t.is_global_zero:
        bar.print(text)


def _say_always(t, text: str) -> None:
    """On global rank 0: through the progress bar when there is one, else on stderr."""
    if not t.is_global_zero:
        return
    bar = _bar(t)
    if bar is not None:
        bar.print(text)
    else:
        print(text, file=sys.stderr, flush=True)


def _fmt(v) -> str:
    v = float(v)
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _early_stopper(t):
    """The EarlyStopping callback (a subclass too) that stopped the run, if any."""
    return next((cb for cb in t.early_stopping_callbacks if getattr(cb, "stopping_reason", None)), None)


def _describe_stop(t) -> str:
    """One line on why the fit stopped, from ``trainer.stop_reason`` (the loop's record,
    agreed by every rank) and the facts behind it."""
    reason = t.stop_reason
    if reason == "max_epochs":
        return f"reached max_epochs={t.max_epochs}"
    if reason == "max_steps":
        return f"reached max_steps={t.max_steps}"
    if reason == "max_time":
        return f"reached max_time ({_duration(t.max_time or 0)})"
    if reason == "early_stopping":
        es = _early_stopper(t)
        if es is None:
            return "early stopping"
        value = getattr(es, "stopped_value", None)
        head = f"early stopping on {es.monitor}" + (f"={_fmt(value)}" if value is not None else "")
        return f"{head} (patience={es.patience}): {es.stopping_reason}"
    if reason == "timer":
        return "the Timer callback's time budget was used up"
    if reason == "preempted":
        sig = t.state.signal
        name = f" {signal.Signals(sig).name}" if sig else ""
        return f"preemption signal{name} (the last checkpoint was saved)"
    if reason == "interrupted":
        return "interrupted (Ctrl-C)"
    if reason == "exception":
        exc = t.state.exception
        return "an exception" + (f": {type(exc).__name__}: {exc}" if exc is not None else "")
    if reason == "should_stop":
        return "trainer.should_stop was set"
    if reason == "pruned":
        return "the trial was pruned (a hyperparameter search's pruner, e.g. PruningCallback)"
    return reason or "finished"


def _epochs_done(t) -> str:
    """Complete epochs, and the batches of an epoch stopped part-way (read from the loop's
    position, whether or not the epoch counter advanced at the stop)."""
    n, done, epoch = t.num_training_batches, t.batches_done, t.current_epoch
    if done and done >= n:   # the last epoch's batches all ran; its counter did not advance
        return f"{epoch + 1}"
    if done:
        total = f"/{n}" if isinstance(n, int) else ""
        return f"{epoch} complete + {done}{total} batches of epoch {epoch}"
    return f"{epoch}"


def fit_summary(t, wall_time: float) -> str:
    """The end-of-fit summary text."""
    lines = [f"Fit stopped: {_describe_stop(t)}",
             f"  epochs: {_epochs_done(t)}, steps: {t.global_step}, wall time: {_duration(wall_time)}"]
    cb = t.checkpoint_callback
    if cb is not None:
        best, score = getattr(cb, "best_model_path", ""), getattr(cb, "best_model_score", None)
        if best:
            mon = getattr(cb, "monitor", None)
            tail = f" ({mon}={_fmt(score)})" if mon and score is not None else ""
            lines.append(f"  best checkpoint: {best}{tail}")
        last = getattr(cb, "last_model_path", "")
        if last and last != best:
            lines.append(f"  last checkpoint: {last}")
    metrics = {k: v for k, v in t.callback_metrics.items()}
    if metrics:
        lines.append("  final metrics: " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))
    return "\n".join(lines)


def fit_ended(t, t0: float, failed: bool = False) -> None:
    """Print the summary on rank 0 (through the progress bar). ``failed``: the fit ended on
    an exception; the summary must then never raise over it."""
    if not failed:
        _say(t, fit_summary(t, time.monotonic() - t0))
        return
    try:
        _say(t, fit_summary(t, time.monotonic() - t0))
    except Exception:   # noqa: BLE001 - the run's own error is what the user must see
        pass


def restored(t, path: str) -> None:
    """The line printed after a checkpoint is loaded: ``restored <path> (epoch E, step S)``,
    with the epoch and step the checkpoint was saved at (its ``meta.json``), not the
    trainer's counters after the restore (a checkpoint saved at an epoch's end resumes at the
    next epoch). A checkpoint without them (a weights file) is named alone."""
    note = getattr(t.state, "reshard_note", None)   # another number of processes (resume_data.reshard)
    _say_always(t, f"ember: restored {path}{_saved_at(path)}" + (f". {note}" if note else ""))


def _saved_at(path) -> str:
    import os
    try:
        from ember.checkpoint.format import META_NAME
        from ember.checkpoint.trust import read_meta
        meta_file = os.path.join(os.fspath(path), META_NAME)
        meta = read_meta(meta_file) if os.path.isfile(meta_file) else {}
    except Exception:   # noqa: BLE001 - a message must never fail (the restore itself read it)
        meta = {}
    epoch, step = meta.get("epoch"), meta.get("global_step")
    if isinstance(epoch, int) and isinstance(step, int):
        return f" (epoch {epoch}, step {step})"
    return ""


def last_checkpoint(t) -> str | None:
    """Where the newest checkpoint of this run is (for messages)."""
    cb = t.checkpoint_callback
    path = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "") if cb is not None else ""
    if path:
        return path
    try:
        from ember.trainer.checkpoint import find_last
        return find_last(t)
    except Exception:   # a message must never fail
        return None


def interrupted_message(t) -> str:
    path = last_checkpoint(t)
    where = (f"the last checkpoint is {path} (resume with trainer.fit(..., ckpt_path='last'))" if path
             else "no checkpoint was saved")
    return (f"ember: interrupted (Ctrl-C) at epoch {t.current_epoch}, step {t.global_step}; loggers were "
            f"flushed; {where}.")


def on_keyboard_interrupt(t) -> None:
    """After the on_exception hooks ran and the loggers were finalized: say where the
    last checkpoint is and end the process with exit status 130 (128 + SIGINT), as a
    shell does. In an interactive session (IPython/Jupyter, ``python -i``) the
    KeyboardInterrupt propagates instead, so the kernel survives."""
    if t.is_global_zero:
        print(interrupted_message(t), file=sys.stderr, flush=True)
    if _interactive():
        return
    raise SystemExit(130)


def _interactive() -> bool:
    if sys.flags.interactive or hasattr(sys, "ps1"):
        return True
    ipy = sys.modules.get("IPython")
    try:
        return ipy is not None and ipy.get_ipython() is not None
    except Exception:
        return False


def format_results(stage: str, results: list[dict]) -> str:
    """The ``validate()``/``test()`` results table (one block per dataloader)."""
    out = []
    for i, metrics in enumerate(results):
        title = f"{stage} metrics" + (f" (dataloader {i})" if len(results) > 1 else "")
        width = max([len(k) for k in metrics] + [len(title)])
        out.append(title)
        for key, value in metrics.items():
            value = value.item() if hasattr(value, "item") else value
            out.append(f"  {key:<{width}}  {value:.6g}" if isinstance(value, float) else f"  {key:<{width}}  {value}")
    return "\n".join(out)


def print_results(t, stage: str, results: list[dict]) -> None:
    """Print the results table on rank 0 (stdout, as the CLI did)."""
    if t.is_global_zero and results and any(results):
        print(format_results(stage, results), flush=True)
