"""Progress display. Nothing runs per training step: a background thread (rich's
own auto-refresh on a terminal or in Jupyter, a plain timer otherwise) reads the
trainer's counters a few times a second and draws.

What it shows is what is logged: ``trainer.progress_bar_metrics`` holds the
latest step value of each ``prog_bar`` step metric and the emitted value of each
``prog_bar`` epoch metric (the one loggers and checkpoints see), never a
per-batch partial value.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

from ember.callbacks.base import Callback

_EVAL_LABEL = {"validate": "Validation", "test": "Testing", "predict": "Predicting", "sanity": "Sanity check"}


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def metrics_text(metrics: dict[str, float]) -> str:
    """``name=value`` pairs, four significant digits, in logging order."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())


def _epoch_total(t) -> float:
    """Batches this epoch will run: the (limited) loader length, cut short by ``max_steps``."""
    total = t.num_training_batches
    if t.max_steps is not None and t.max_steps >= 0:
        left = max(t.max_steps - t.global_step, 0) * max(t.accumulate_grad_batches, 1)
        total = min(total, t.batches_done + left)
    return total


def _eval_total(t, stage: str) -> float | None:
    """Batches of a validation/test/predict pass (None when a loader has no length)."""
    counts = {"validate": t.num_val_batches, "test": t.num_test_batches,
              "predict": t.num_predict_batches}.get(stage, [])
    if any(n == float("inf") for n in counts):
        return None
    return sum(counts)


class ProgressBar(Callback):
    """Base class of progress displays (the trainer adds a RichProgressBar unless one is given).

    The trainer prints its end-of-fit summary and the ``validate()``/``test()``
    results table through :meth:`print`, so a subclass decides where text goes.
    """

    def print(self, *objects: Any) -> None:
        """Print text (or rich renderables) above the live display, on stderr."""
        print(*objects, file=sys.stderr, flush=True)

    @property
    def is_live(self) -> bool:
        """Whether a live display is drawn now (``trainer.print`` then prints through :meth:`print`)."""
        return False


class RichProgressBar(ProgressBar):
    """A rich progress bar: epoch, bar, batches done/total, elapsed time, ETA and
    rate on the first line; the global step and the ``prog_bar`` metrics on the
    second (wrapped when the terminal is narrow), so nothing vital is cut at 80
    columns. Validation, test and predict passes show a second, transient bar.

    On a terminal or in Jupyter it refreshes ``refresh_per_second`` times a
    second from rich's refresh thread (in a notebook: one output widget redrawn
    in place, which needs ``ipywidgets``; without it a warning says so and plain
    lines follow); elsewhere (CI, log files) it prints a plain line every
    ``plain_interval`` seconds and at each epoch end. Only global rank 0 draws.

    Args:
        refresh_per_second: redraws per second of the live display.
        plain_interval: seconds between plain lines when there is no terminal.
        leave: keep the final bar on screen after the fit.
        console: a ``rich.console.Console`` to draw on (default: stderr).
    """

    inactive_hooks: frozenset = frozenset()

    def __init__(self, refresh_per_second: float = 4, plain_interval: float = 10.0, leave: bool = True,
                 console: Any = None) -> None:
        self.refresh_per_second = refresh_per_second
        self.plain_interval = plain_interval
        self.leave = leave
        self._console = console
        self._progress = None
        self._thread = None
        self._stop = threading.Event()
        self._trainer = None
        self._task = None
        self._eval_task = None
        self._eval_stage = None
        self._eval_done = 0
        self._owns_progress = False   # started for a standalone validate/test/predict
        self._plain_eval: tuple | None = None   # plain lines: (label, total, start time) of the running
        self._owns_thread = False               # evaluation; its timer started for a standalone one
        self._t0 = 0.0
        self._start_batch = 0
        self._epoch = 0
        self._done = 0
        self._total: float = 0
        self._in_epoch = False
        self._widgets: bool | None = None   # ipywidgets found (Jupyter only; checked once)
        self._receiver = None   # rank 0: other ranks' lines (ember/callbacks/rank_output.py)
        self._forwarder = None  # other ranks: stdout and warnings sent to rank 0
        self._failed = False

    # -- output ----------------------------------------------------------------------
    @property
    def console(self):
        """The rich Console this bar draws on."""
        if self._console is None:
            from ember.checkpoint.rng import keep_rng_states
            with keep_rng_states():   # a first import leaves the user's random streams as they were
                from rich.console import Console
            self._console = Console(file=sys.stderr)
        return self._console

    @property
    def is_live(self) -> bool:
        """Whether rich's live display is drawn now (on a terminal or in Jupyter)."""
        return self._progress is not None

    def _live(self) -> bool:
        c = self.console
        if getattr(c, "is_jupyter", False):
            return self._jupyter_widgets()
        return bool(c.is_terminal)

    def _jupyter_widgets(self) -> bool:
        """rich draws its live display in a notebook as an ipywidgets ``Output`` (redrawn in
        place). Without ipywidgets it would draw nothing: say so once, and print plain lines."""
        if self._widgets is None:
            import importlib.util
            self._widgets = importlib.util.find_spec("ipywidgets") is not None
            if not self._widgets:
                import warnings
                warnings.warn("RichProgressBar: the live bar in Jupyter needs ipywidgets (pip install ipywidgets); "
                              f"printing a plain line every plain_interval={self.plain_interval} s and at each "
                              "epoch end instead", stacklevel=2)
        return self._widgets

    def print(self, *objects: Any) -> None:
        """Print above the live bar (rich keeps the bar at the bottom)."""
        self.console.print(*objects, highlight=False, soft_wrap=True, markup=False)

    # -- other ranks' output -------------------------------------------------------------
    def setup(self, trainer, module, stage):
        """Under several processes, while rank 0's bar is live, the other ranks of its host
        print above it (see :mod:`ember.callbacks.rank_output`): one broadcast, here."""
        self._failed = False
        if trainer.world_size <= 1:
            return
        from ember.callbacks import rank_output
        # every rank takes part in the broadcast whatever it holds already (a rank-local
        # early return here would leave the others waiting in it)
        address = None
        if trainer.is_global_zero and self._receiver is None and self._live():
            try:
                self._receiver = rank_output.LineReceiver(self.print, peers=trainer.world_size - 1)
            except OSError:   # no loopback socket: the other ranks print as before
                self._receiver = None
        if trainer.is_global_zero and self._receiver is not None:
            address = self._receiver.address
        address = trainer.strategy.broadcast(address)
        if address is not None and not trainer.is_global_zero and self._forwarder is None:
            self._forwarder = rank_output.connect(tuple(address), trainer.global_rank)

    def _stop_forwarding(self) -> None:
        if self._forwarder is not None:
            from ember.callbacks.rank_output import disconnect
            disconnect(self._forwarder)
            self._forwarder = None
        if self._receiver is not None:   # after a failure, never wait on the other ranks
            self._receiver.close(wait=0 if self._failed else 5)
            self._receiver = None

    # -- fit lifecycle ---------------------------------------------------------------
    def on_train_start(self, trainer, module):
        if not trainer.is_global_zero:
            return
        self._trainer = trainer
        self._epoch, self._done, self._in_epoch = trainer.current_epoch, trainer.batches_done, False
        self._total = _epoch_total(trainer)
        if self._live():
            self._start_rich()
            self._task = self._progress.add_task(self._describe(), total=self._task_total(), rate="")
        else:
            self._stop.clear()
            self._thread = threading.Thread(target=self._plain_loop, name="ember-progress", daemon=True)
            self._thread.start()

    def on_train_epoch_start(self, trainer, module):
        if not trainer.is_global_zero:
            return
        self._t0 = time.monotonic()
        self._start_batch = self._done = trainer.batches_done
        self._epoch = trainer.current_epoch
        self._total = _epoch_total(trainer)
        self._in_epoch = True
        if self._progress is not None and self._task is not None:
            self._progress.reset(self._task, total=self._task_total(), completed=self._start_batch,
                                 description=self._describe(), rate="")

    def on_train_epoch_end(self, trainer, module):
        if not trainer.is_global_zero:
            return
        self._done = trainer.batches_done   # an epoch cut short (max_steps, should_stop) shows where
        self._in_epoch = False
        if self._progress is None:
            self._print_line(trainer)
        else:
            self._sync()

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero and self._in_epoch:   # stopped mid-epoch: freeze (and show) where it was
            self._done, self._in_epoch = trainer.batches_done, False
            if self._progress is None:
                self._print_line(trainer)
            else:
                self._sync()
        self._shutdown()

    def on_exception(self, trainer, module, exception):
        self._in_epoch, self._failed = False, True
        self._shutdown()

    def teardown(self, trainer, module, stage):
        self._shutdown()
        self._stop_forwarding()

    # -- validation / test / predict -------------------------------------------------
    def _eval_start(self, trainer, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        if not self._live():
            self._plain_eval_start(trainer, stage)
            return
        if self._progress is None:      # trainer.validate()/test()/predict(): a bar of its own
            self._trainer = trainer
            self._start_rich(transient=True)
            self._owns_progress = True
        self._eval_stage, self._eval_done = stage, 0
        total = _eval_total(trainer, stage)
        self._eval_task = self._progress.add_task(_EVAL_LABEL[stage], total=total, rate="")

    def _eval_end(self, trainer) -> None:
        if self._plain_eval is not None:
            self._plain_eval_end()
            return
        if self._progress is None or self._eval_task is None:
            return
        self._progress.remove_task(self._eval_task)
        self._eval_task = self._eval_stage = None
        if self._owns_progress:
            self._owns_progress = False
            self._shutdown()

    def on_validation_start(self, trainer, module):
        self._eval_start(trainer, "validate")

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_done += 1

    def on_validation_end(self, trainer, module):
        self._eval_end(trainer)

    def on_test_start(self, trainer, module):
        self._eval_start(trainer, "test")

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_done += 1

    def on_test_end(self, trainer, module):
        self._eval_end(trainer)

    def on_predict_start(self, trainer, module):
        self._eval_start(trainer, "predict")

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_done += 1

    def on_predict_end(self, trainer, module):
        self._eval_end(trainer)

    # -- rich ------------------------------------------------------------------------
    def _start_rich(self, transient: bool | None = None) -> None:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn
            from rich.text import Text

        bar = self

        class _Progress(Progress):
            def get_renderables(self):
                bar._sync()
                yield self.make_tasks_table(self.tasks)
                line = bar._metrics_line()
                if line:
                    yield Text(line, style="dim", overflow="fold")

        self._progress = _Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=None), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("<"), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"),
            console=self.console, refresh_per_second=self.refresh_per_second, expand=True,
            transient=(not self.leave) if transient is None else transient)
        self._progress.start()

    def _task_total(self):
        return None if self._total == float("inf") else self._total

    def _describe(self) -> str:
        t = self._trainer
        me = getattr(t, "max_epochs", None)
        return f"Epoch {self._epoch}" + (f"/{me - 1}" if isinstance(me, int) and me > 0 else "")

    def _sync(self) -> None:
        """Runs on rich's refresh thread: copy the trainer's counters into the tasks."""
        t, p = self._trainer, self._progress
        if t is None or p is None:
            return
        if self._task is not None:
            if self._in_epoch:
                self._done = t.batches_done
            el = max(time.monotonic() - self._t0, 1e-9)
            rate = (self._done - self._start_batch) / el
            p.update(self._task, completed=self._done, description=self._describe(),
                     rate=f"{rate:.1f} it/s" if self._t0 else "")
        if self._eval_task is not None:
            p.update(self._eval_task, completed=self._eval_done)

    def _metrics_line(self) -> str:
        t = self._trainer
        if t is None:
            return ""
        text = metrics_text(self._metrics(t))
        step = f"step {t.global_step}" if self._task is not None else ""
        return (step + " " + text).strip()

    @staticmethod
    def _metrics(t) -> dict[str, float]:
        try:
            return t.progress_bar_metrics
        except Exception:  # a tensor freed mid-read: skip this refresh
            return {}

    def _shutdown(self) -> None:
        self._stop.set()
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
            self._progress = None
            self._task = self._eval_task = None
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    # -- plain lines (no terminal) ---------------------------------------------------------
    def _plain_loop(self) -> None:
        while not self._stop.wait(self.plain_interval):
            self._print_line(self._trainer)

    def _plain_eval_start(self, trainer, stage: str) -> None:
        """No terminal: the timer's lines name the evaluation while it runs (a validation
        inside fit, or a standalone validate/test/predict, which starts a timer of its own)."""
        label = "Sanity check" if trainer.sanity_checking else _EVAL_LABEL[stage]
        if trainer.stage == "fit" and stage == "validate" and not trainer.sanity_checking:
            label = f"{self._describe()}, validation" if self._trainer is not None else label
        self._eval_stage, self._eval_done = stage, 0
        self._plain_eval = (label, _eval_total(trainer, stage), time.monotonic())
        if self._thread is None:
            self._trainer = trainer
            self._stop.clear()
            self._owns_thread = True
            self._thread = threading.Thread(target=self._plain_loop, name="ember-progress", daemon=True)
            self._thread.start()

    def _plain_eval_end(self) -> None:
        self._plain_eval = self._eval_stage = None
        if self._owns_thread:
            self._owns_thread = False
            self._shutdown()

    def _print_eval_line(self, label: str, total, t0: float) -> None:
        done = self._eval_done
        el = time.monotonic() - t0
        rate = done / max(el, 1e-9)
        known = isinstance(total, (int, float)) and total != float("inf")
        eta = f", eta {(total - done) / rate:.0f}s" if known and rate > 0 else ""
        line = f"{label}: {done}/{int(total) if known else '?'} batches, {rate:.1f} it/s, elapsed {el:.0f}s{eta}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def _print_line(self, t) -> None:
        if t is None:
            return
        ev = self._plain_eval
        if ev is not None:   # an evaluation is running: say so, not the frozen training line
            self._print_eval_line(*ev)
            return
        done = t.batches_done if self._in_epoch else self._done
        el = time.monotonic() - self._t0
        rate = (done - self._start_batch) / max(el, 1e-9)
        total = self._total
        known = total != float("inf")
        # no eta for an epoch of unknown length (an IterableDataset without a length)
        eta = f", eta {(total - done) / rate:.0f}s" if known and rate > 0 else ""
        tot = total if known else "?"
        line = (f"{self._describe()}: {done}/{tot} batches, step {t.global_step}, {rate:.1f} it/s, "
                f"elapsed {el:.0f}s{eta} {metrics_text(self._metrics(t))}")
        err = sys.stderr
        err.write(line.rstrip() + "\n")   # one write: the timer thread and the epoch end may print at once
        err.flush()
