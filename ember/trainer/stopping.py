"""How a fit stops: stop requests, signals, and the one decision every rank agrees on.

**Requests** (``trainer.should_stop = True``, EarlyStopping, Timer, ``max_time``) are
recorded in ``trainer.state.stop_request`` and decided at check points only
(:func:`agree_stop` says where).

**Signals**, while ``fit`` runs in the main thread, are ember's:

- SIGTERM / SIGUSR1 (a preemption): the handler records the signal; the ranks agree on
  it at the next check point, save ``last`` (:func:`save_for_preemption`), requeue under
  SLURM (SIGUSR1) and end the process with status 0 (``EMBER_PREEMPTION_EXIT=0``: ``fit``
  returns instead).
- SIGINT (Ctrl-C): the handler only records the press. Inside the loop the loop raises
  ``KeyboardInterrupt`` itself at the next batch boundary (a training or evaluation
  batch, an epoch end), where no library is half-way through an operation. Python's
  default handler raises wherever the main thread happens to be, and a single Ctrl-C
  then looks lost under load: raised inside ``threading.Condition.notify`` of
  TensorBoard's event queue (logging a step's scalars), after the writer thread was
  woken and before its waiter was removed, it leaves a stale waiter that swallows the
  next wake-up; the exception path's ``SummaryWriter.close()`` then waits for the
  writer's 120 s flush interval (a gap in CPython's fix of gh-92530;
  tests/scripts/ctrl_c_tensorboard.py reproduces it). Outside the loop (setup,
  teardown), and at a second press anywhere, the handler raises at once. Either way the
  Trainer then runs the ``on_exception`` hooks, finalises the loggers, prints where the
  last checkpoint is and exits with status 130 (outside interactive sessions). A process
  started with SIGINT ignored (a command run with ``&`` from a non-interactive shell
  inherits that) keeps it ignored: ember only replaces Python's default handler.

The previous handlers are put back when ``fit`` ends.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ember.trainer.state import REQUEST_CODE, REQUESTS

#: set EMBER_PREEMPTION_EXIT=0 to make ``fit`` return after a preemption save instead
#: of ending the process with ``SystemExit(0)``
EXIT_ENV = "EMBER_PREEMPTION_EXIT"

PREEMPTION_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None))
                           if s is not None)


class SignalHandlers:
    """The signal handlers of one ``fit`` (installed by :meth:`install`, removed by
    :meth:`uninstall`); records into ``trainer.state``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.previous: dict = {}
        self.watcher: Any = None

    def install(self) -> None:
        state = self.trainer.state
        state.signal, state.signal_pending, state.preempted, state.interrupt = None, False, False, 0
        if threading.current_thread() is not threading.main_thread():
            return
        for s in PREEMPTION_SIGNALS:
            self._set(s, self._on_preemption)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not one the user installed
            self._set(signal.SIGINT, self._on_interrupt)
        from ember.trainer import peer_stop   # under torchrun: the launcher's SIGTERM after a failed rank
        self.watcher = peer_stop.start()

    def _set(self, signum: int, handler: Any) -> None:
        try:
            self.previous[signum] = signal.signal(signum, handler)
        except (ValueError, OSError):
            pass

    def _on_preemption(self, signum: int, frame: Any) -> None:
        state = self.trainer.state
        state.signal, state.signal_pending = signum, True

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        state = self.trainer.state
        state.interrupt += 1
        if state.interrupt > 1 or not state.in_loop:   # in the loop: acted on at its next batch boundary
            raise KeyboardInterrupt

    def uninstall(self) -> None:
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.stop()
        for s, h in self.previous.items():
            try:
                signal.signal(s, h)
            except (ValueError, OSError, TypeError):
                pass
        self.previous = {}
        self.trainer.state.in_loop = self.trainer.state.signal_pending = False


def raise_interrupt(trainer: Any) -> None:
    """The loop's side of Ctrl-C: called at a batch boundary when ``state.interrupt`` is set."""
    trainer.state.interrupt = 0
    raise KeyboardInterrupt


def agree_stop(t: Any, force: bool = False) -> bool:
    """Decide, once for every rank, whether the fit stops here; True when it does.

    Called by the loop at check points only: on one process after an optimizer step
    where a stop was asked for (and at epoch ends); under several processes at log
    points, after a validation and at epoch ends, where one all-reduce
    (``strategy.agree``) of ``[stop request, signal]`` makes every rank take the same
    decision at the same step. A preemption signal wins over a request (the fit saves
    ``last`` and ends); otherwise the highest request any rank made wins.
    """
    st = t.state
    req = st.stop_request
    if req is None and st.deadline is not None and time.monotonic() >= st.deadline:
        req = "max_time"
    code, signum = REQUEST_CODE.get(req, 0), st.signal or 0
    if t.world_size > 1:
        code, signum = t.strategy.agree([code, signum], "max")
    if signum:
        st.stop_reason = "preempted"   # recorded in the checkpoint saved now
        save_for_preemption(t, int(signum))
        return True
    if code:
        req = REQUESTS[int(code) - 1]
        if req in ("should_stop", "early_stopping") and not min_reached(t):
            st.stop_request, st.stop_agreed = req, False   # min_epochs / min_steps: the request waits
            return False
        st.stop_request = st.stop_reason = req
        return True
    return False


def min_reached(t: Any) -> bool:
    """``min_epochs`` / ``min_steps`` reached: until then a stop request (``should_stop``,
    EarlyStopping) waits; limits (max_*, max_time, a signal) still stop."""
    st = t.state
    return (t.min_epochs is None or st.epoch >= t.min_epochs) and \
        (t.min_steps is None or st.global_step >= t.min_steps)


def save_for_preemption(t: Any, received: int) -> None:
    """Act on SIGTERM/SIGUSR1 once every rank agreed on it (at an optimizer step): save
    ``last``, say so, requeue on SLURM, and mark the fit to end."""
    from ember.trainer.checkpoint import save_checkpoint
    name = signal.Signals(received).name
    cb = t.checkpoint_callback
    if cb is not None and hasattr(cb, "save_last_now"):
        path = cb.save_last_now(t)
    else:
        path = os.path.join(t.log_dir, "checkpoints", "last")
        save_checkpoint(t, path)
    exits = os.environ.get(EXIT_ENV, "1") != "0"
    if t.is_global_zero:
        print(f"ember: received {name} at step {t.global_step}; saved checkpoint {path}. Resume with "
              f"trainer.fit(..., ckpt_path='last'). " + ("Exiting with code 0." if exits else "Stopping the fit."),
              file=sys.stderr, flush=True)
        job = os.environ.get("SLURM_JOB_ID")
        if received == getattr(signal, "SIGUSR1", None) and job:
            try:
                subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)
            except (OSError, subprocess.SubprocessError) as err:
                print(f"ember: scontrol requeue {job} failed: {err}", file=sys.stderr, flush=True)
    t.state.preempted = True   # (trainer.interrupted)


def exit_if_preempted(t: Any) -> None:
    """After teardown: end the process with code 0 when the fit stopped for a
    preemption signal (the checkpoint is saved), unless EMBER_PREEMPTION_EXIT=0."""
    st = t.state
    if st.preempted and sys.exc_info()[1] is None and os.environ.get(EXIT_ENV, "1") != "0":
        st.preempted = False
        raise SystemExit(0)
