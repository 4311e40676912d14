"""Profilers for ``Trainer(profiler=...)``: ``"simple"`` (:class:`SimpleProfiler`, a table
of time per phase) and ``"pytorch"`` (:class:`PyTorchProfiler`, ``torch.profiler`` traces).
With ``profiler=None`` nothing is wrapped: no cost at all.
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from typing import Any, Callable

from ember.callbacks.base import Callback
from ember.errors import MisconfigurationError

class Profiler(Callback):
    """Base class: times the phases of ``fit``; subclasses implement :meth:`start` /
    :meth:`stop` of a named region.

    The Trainer drives it through public calls only: :meth:`begin` and :meth:`end` around
    each run, and, during a fit, the loop builds its per-epoch callables through
    :meth:`wrap` (``training_step``, ``backward``, ``optimizer_step``, ``zero_grad``,
    validation, metric logging, every callback and module hook through the event
    dispatcher) and iterates the train loader through :meth:`iterate`. Nothing of the
    Trainer is patched; without a profiler none of this exists."""

    state_key = "Profiler"

    def __init__(self, dirpath: str | None = None, filename: str | None = None):
        self.dirpath, self.filename = dirpath, filename
        self.active = False

    # ------------------------------------------------------------ region API
    def start(self, name: str) -> None:
        """Enter the region ``name``."""

    def stop(self, name: str) -> None:
        """Leave the region ``name``."""

    def on_batch_fetched(self) -> None:
        """Called after each train batch was fetched (the ``"pytorch"`` profiler steps its schedule here)."""

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed as region ``name``."""
        start, stop = self.start, self.stop

        def timed(*args, **kwargs):
            start(name)
            try:
                return fn(*args, **kwargs)
            finally:
                stop(name)
        timed.__wrapped__ = fn
        return timed

    def iterate(self, loader: Any) -> Any:
        """``loader`` with each ``next`` timed as ``"train dataloader next"``."""
        return _Timed(loader, self)

    def _fetch(self, make_iter):
        it = iter(make_iter())
        name, start, stop = "train dataloader next", self.start, self.stop
        while True:
            start(name)
            try:
                batch = next(it)
            except StopIteration:
                stop(name)
                return
            stop(name)
            self.on_batch_fetched()
            yield batch

    def _out_dir(self, trainer) -> str:
        return os.fspath(self.dirpath) if self.dirpath is not None else trainer.log_dir

    # ------------------------------------------------------------ run boundaries (called by the Trainer)
    def begin(self, trainer, stage: str) -> None:
        """A run starts (before its setup): the clock of a fit starts here."""
        self.active = stage == "fit"
        if self.active:
            self._begin(trainer)

    def end(self, trainer, stage: str) -> None:
        """The run ended (after its teardown), normally or not."""
        if self.active:
            self._end(trainer)
            self.active = False

    def _begin(self, trainer) -> None: ...
    def _end(self, trainer) -> None: ...


class _Timed:
    """A train loader iterated through :meth:`Profiler._fetch` (length passed through)."""

    def __init__(self, loader, prof: Profiler):
        self._loader, self._prof = loader, prof

    def __iter__(self):
        return self._prof._fetch(lambda: iter(self._loader))

    def __len__(self):
        return len(self._loader)


class SimpleProfiler(Profiler):
    """Wall-clock time per phase of ``fit``.

    Each region records its total time and its *self* time (total minus the
    regions nested in it, e.g. callback hooks run during validation), so the self
    times add up to the profiled time without double counting. At teardown the
    table is printed (rank 0) and written to ``<dirpath or log_dir>/<filename>``
    (``profile-simple-rank<R>.txt`` and ``.json``) at the end of fit (from the start of
    its setup to ``on_fit_end``). :meth:`summary` returns it as a dict.

    CUDA kernels run asynchronously, so on GPU the time of a phase is the time its
    Python call took to *launch* work; a later phase that waits on the device
    (``.item()``, a copy to host) carries the wait.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "profile-simple"):
        super().__init__(dirpath, filename)
        self.total = defaultdict(float)
        self.self_time = defaultdict(float)
        self.calls = defaultdict(int)
        self._stack: list = []
        self._finished = False
        self.fit_time = 0.0
        self.text = ""

    def start(self, name: str) -> None:
        self._stack.append([time.perf_counter(), 0.0])

    def stop(self, name: str) -> None:
        t0, child = self._stack.pop()
        if self._finished:   # after on_fit_end: the table is closed
            return
        dt = time.perf_counter() - t0
        self.total[name] += dt
        self.self_time[name] += dt - child
        self.calls[name] += 1
        if self._stack:
            self._stack[-1][1] += dt

    def _begin(self, trainer) -> None:
        self._finished = False
        self.total.clear(), self.self_time.clear(), self.calls.clear()
        self._t0 = time.perf_counter()
        self.start("setup")

    def on_fit_start(self, trainer, module):
        if self.active:
            self.stop("setup")

    def on_fit_end(self, trainer, module):
        # the table is final here, so a report written at the end of fit (report=True) shows it
        if self.active:
            self._finish(trainer)

    def on_sanity_check_start(self, trainer, module):
        if self.active:
            self.start("sanity check")

    def on_sanity_check_end(self, trainer, module):
        if self.active:
            self.stop("sanity check")

    def _end(self, trainer) -> None:
        if not self._finished:   # fit ended by an exception
            self._finish(trainer)

    def _finish(self, trainer) -> None:
        while self._stack:   # an exception left regions open
            self.stop("(interrupted)")
        self._finished = True
        self.fit_time = time.perf_counter() - self._t0
        self.text = self.table()
        out = self._out_dir(trainer)
        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, f"{self.filename}-rank{trainer.global_rank}")
        with open(base + ".txt", "w", encoding="utf-8") as f:
            f.write(self.text + "\n")
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(self.summary(), f, indent=1)
        if trainer.is_global_zero:
            print(self.text)

    def summary(self) -> dict:
        """``{"fit_time_s": ..., "phases": {name: {"calls", "total_s", "self_s", "mean_ms"}}}``."""
        phases = {n: {"calls": self.calls[n], "total_s": self.total[n], "self_s": self.self_time[n],
                      "mean_ms": 1e3 * self.total[n] / max(1, self.calls[n])}
                  for n in sorted(self.total, key=lambda n: -self.self_time[n])}
        return {"fit_time_s": self.fit_time, "profiled_s": sum(self.self_time.values()), "phases": phases}

    def table(self) -> str:
        """The summary as a fixed-width text table."""
        s = self.summary()
        fit = s["fit_time_s"] or 1e-12
        w = max([len(n) for n in s["phases"]] + [24])
        lines = [f"{'phase':<{w}}  {'calls':>7}  {'total s':>9}  {'self s':>9}  {'mean ms':>9}  {'% fit':>6}",
                 "-" * (w + 50)]
        for n, p in s["phases"].items():
            lines.append(f"{n:<{w}}  {p['calls']:>7}  {p['total_s']:>9.4f}  {p['self_s']:>9.4f}  "
                         f"{p['mean_ms']:>9.3f}  {100 * p['self_s'] / fit:>5.1f}%")
        other = s["fit_time_s"] - s["profiled_s"]
        lines += ["-" * (w + 50),
                  f"{'(loop, between phases)':<{w}}  {'':>7}  {other:>9.4f}  {other:>9.4f}  {'':>9}  {100 * other / fit:>5.1f}%",
                  f"{'fit (setup to on_fit_end)':<{w}}  {'':>7}  {s['fit_time_s']:>9.4f}"]
        return "Simple profiler: time per phase of fit\n" + "\n".join(lines)


class PyTorchProfiler(Profiler):
    """``torch.profiler`` over a schedule of training batches.

    The first ``skip_first`` batches are skipped, then ``wait`` batches idle,
    ``warmup`` batches warm up and ``active`` batches are recorded (``repeat``
    cycles; 1 by default). Phases appear as named ranges (``training_step``,
    ``backward``, ``optimizer_step``, callback hooks...). Traces go to
    ``<dirpath or log_dir>/plugins/profile/<run>/*.pt.trace.json``; view them with
    TensorBoard's profiler plugin (``tensorboard --logdir <log_dir>``) or
    chrome://tracing / Perfetto. :attr:`trace_dir` holds the folder after fit.

    Args:
        wait, warmup, active, repeat, skip_first: the ``torch.profiler.schedule``.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
    """

    def __init__(self, dirpath: str | None = None, wait: int = 1, warmup: int = 1, active: int = 3,
                 repeat: int = 1, skip_first: int = 0, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False):
        super().__init__(dirpath)
        for k, v in (("wait", wait), ("warmup", warmup), ("active", active), ("repeat", repeat), ("skip_first", skip_first)):
            if not isinstance(v, int) or v < (1 if k == "active" else 0):
                raise MisconfigurationError(f"PyTorchProfiler({k}={v!r}) is not valid; use an int >= "
                                            f"{1 if k == 'active' else 0}")
        self.schedule = dict(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)
        self.kwargs = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.trace_dir: str | None = None
        self._prof = None
        self._ranges: list = []

    def start(self, name: str) -> None:
        if self._prof is not None:
            import torch
            r = torch.profiler.record_function(name)
            r.__enter__()
            self._ranges.append(r)

    def stop(self, name: str) -> None:
        if self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def on_batch_fetched(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def on_train_start(self, trainer, module):
        if not self.active:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        run = time.strftime("%Y_%m_%d_%H_%M_%S")
        if trainer.world_size > 1:   # one run folder for all ranks (decided once, at train start)
            run = trainer.strategy.broadcast(run)
        self.trace_dir = os.path.join(self._out_dir(trainer), "plugins", "profile", run)
        os.makedirs(self.trace_dir, exist_ok=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts, schedule=schedule(**self.schedule),
                             on_trace_ready=tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{trainer.global_rank}"),
                             **self.kwargs)
        self._prof.start()

    def _end(self, trainer) -> None:
        while self._ranges:
            self._ranges.pop().__exit__(None, None, None)
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
            if trainer.is_global_zero:
                print(f"PyTorch profiler traces: {self.trace_dir}")


def build_profiler(profiler: Any) -> Profiler | None:
    """``Trainer(profiler=...)``: ``None``, ``"simple"``, ``"pytorch"`` or a :class:`Profiler`
    (the Trainer puts it first among its callbacks)."""
    if profiler is None:
        return None
    if not isinstance(profiler, Profiler):
        if profiler not in ("simple", "pytorch"):
            from ember.errors import invalid_choice
            raise invalid_choice("profiler", profiler, [None, "simple", "pytorch"])
        profiler = SimpleProfiler() if profiler == "simple" else PyTorchProfiler()
    return profiler
