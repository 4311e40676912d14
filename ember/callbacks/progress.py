"""Progress display. Nothing runs per training step: a background thread (rich's
own auto-refresh on a terminal, a plain timer otherwise) reads the trainer's
counters a few times a second and draws."""
from __future__ import annotations

import sys
import threading
import time

from ember.callbacks.base import Callback


def _fmt(v: float) -> str:
    return f"{v:.4g}"


class ProgressBar(Callback):
    """Base class of progress displays (the trainer adds a RichProgressBar unless one is given)."""


class RichProgressBar(ProgressBar):
    """A rich progress bar showing epoch, step, rate, ETA and the ``prog_bar`` metrics.

    On a terminal it refreshes ``refresh_per_second`` times a second from rich's
    refresh thread; without one (CI, logs) it prints a plain line every
    ``plain_interval`` seconds and at each epoch end.
    """

    inactive_hooks = frozenset()

    def __init__(self, refresh_per_second: float = 4, plain_interval: float = 10.0, leave: bool = True,
                 console=None):
        self.refresh_per_second = refresh_per_second
        self.plain_interval = plain_interval
        self.leave = leave
        self._console = console
        self._progress = None
        self._thread = None
        self._stop = threading.Event()
        self._trainer = None
        self._task = None
        self._t0 = 0.0
        self._start_batch = 0

    # -- lifecycle ---------------------------------------------------------------------
    def _console_(self):
        if self._console is None:
            from rich.console import Console
            self._console = Console(file=sys.stderr)
        return self._console

    def on_train_start(self, trainer, module):
        if not trainer.is_global_zero:
            return
        self._trainer = trainer
        if self._console_().is_terminal:
            self._start_rich(trainer)
        else:
            self._stop.clear()
            self._thread = threading.Thread(target=self._plain_loop, name="ember-progress", daemon=True)
            self._thread.start()

    def on_train_epoch_start(self, trainer, module):
        self._t0 = time.monotonic()
        self._start_batch = trainer._batches_done
        if self._progress is not None:
            total = trainer.num_training_batches
            self._progress.reset(self._task, total=None if total == float("inf") else total,
                                 completed=self._start_batch,
                                 description=f"Epoch {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer, module):
        if not trainer.is_global_zero:
            return
        if self._progress is None:
            self._print_line(trainer, final=True)

    def on_train_end(self, trainer, module):
        self._shutdown()

    def on_exception(self, trainer, module, exception):
        self._shutdown()

    def teardown(self, trainer, module, stage):
        self._shutdown()

    def on_validation_end(self, trainer, module):
        if trainer.is_global_zero and trainer.stage in ("validate", "test") and self._progress is None:
            pass

    def _shutdown(self):
        self._stop.set()
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
            self._progress = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    # -- rich (terminal) ------------------------------------------------------------------
    def _start_rich(self, trainer):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        bar = self

        class _Progress(Progress):
            def get_renderables(self):
                bar._sync()
                yield from super().get_renderables()

        self._progress = _Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("<"), TimeRemainingColumn(),
            TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[metrics]}"),
            console=self._console_(), refresh_per_second=self.refresh_per_second, transient=not self.leave)
        total = trainer.num_training_batches
        self._task = self._progress.add_task(f"Epoch {trainer.current_epoch}", total=None if total == float("inf") else total,
                                             rate="", metrics="")
        self._progress.start()

    def _sync(self):
        """Runs on rich's refresh thread: copy the trainer's counters into the task."""
        t = self._trainer
        if t is None or self._task is None:
            return
        done = t._batches_done
        rate = (done - self._start_batch) / max(time.monotonic() - self._t0, 1e-9)
        metrics = self._metrics_text(t)
        self._progress.update(self._task, completed=done, rate=f"{rate:.1f} it/s",
                              metrics=f"step {t.global_step} " + metrics, description=f"Epoch {t.current_epoch}")

    @staticmethod
    def _metrics_text(t) -> str:
        try:
            vals = t.progress_bar_metrics
        except Exception:  # a tensor freed mid-read: skip this refresh
            return ""
        return " ".join(f"{k}={_fmt(v)}" for k, v in vals.items())

    # -- plain lines (no terminal) -----------------------------------------------------------
    def _plain_loop(self):
        while not self._stop.wait(self.plain_interval):
            self._print_line(self._trainer)

    def _print_line(self, t, final: bool = False):
        if t is None:
            return
        total = t.num_training_batches
        done = t._batches_done   # at epoch end too: an epoch stopped early (max_steps, should_stop) shows where
        el = time.monotonic() - self._t0
        rate = (done - self._start_batch) / max(el, 1e-9)
        eta = (total - done) / rate if rate > 0 and total != float("inf") else float("nan")
        tot = "?" if total == float("inf") else total
        line = (f"Epoch {t.current_epoch}: {done}/{tot} batches, step {t.global_step}, {rate:.1f} it/s, "
                f"elapsed {el:.0f}s, eta {eta:.0f}s {self._metrics_text(t)}")
        err = sys.stderr
        err.write(line.rstrip() + "\n")   # one write: the timer thread and the epoch end may print at once
        err.flush()
