"""Starting the other ranks from a plain ``python script.py``, and ending every
rank promptly and cleanly.

:class:`SubprocessLauncher` runs in the original process (it becomes rank 0):
it starts ranks 1..N-1 as subprocesses that re-run ``sys.argv`` with the
variables ``torchrun`` would set, then returns so rank 0 joins the job.

- A watcher thread in rank 0 polls the children. When one exits with an error
  (its traceback is already on stderr), rank 0 prints one line, terminates the
  other ranks and exits with that code, even if rank 0 itself is blocked in a
  collective.
- When rank 0 fails, its children are terminated (exception path and atexit).
- A child exits when rank 0 dies (``PR_SET_PDEATHSIG`` on Linux, plus a thread
  that notices the parent changing).

:func:`install_exit_handlers` (every rank, every launch method) makes the end
of a distributed run deterministic. On a normal exit (atexit) all ranks meet at
a barrier, let the backend's worker threads drop their finished works (which
may take the GIL: see :func:`ember.distributed.failures.shutdown_process_group`) and destroy the process
group while the interpreter is fully alive; the process then ends at C
``exit()`` with Python's exit status, without native teardown
(:func:`_skip_native_teardown`). Either step missing, a few to twenty percent of
processes abort (``terminate called without an active exception``). After an
unhandled exception the rank runs the atexit handlers itself and leaves with
``os._exit``, so that a broken process group cannot abort or hang the exit. A
communication error that only reports that *another* rank went away is
condensed to one line, so that the failing rank's traceback is the one shown.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time

from ember.distributed.failures import (is_comm_error, is_peer_lost_error, is_timeout_error,  # noqa: F401
                                       never_arrived_message, ranks_never_arrived, shutdown_process_group)
from ember.strategies.environments import LAUNCH_MARKER, ClusterEnvironment

_TERMINATE_GRACE_S = 3.0
_POLL_S = 0.1

#: the launcher of this process (rank 0 of a locally launched job), if any
_LAUNCHER: "SubprocessLauncher | None" = None
_report_lock = threading.Lock()
_reported = False


def _stderr(msg: str) -> None:
    try:
        sys.stderr.write(msg.rstrip("\n") + "\n")
        sys.stderr.flush()
    except Exception:  # stderr closed
        pass


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def relaunch_command() -> list[str]:
    """The command line that re-runs this program (``python script.py ...`` or
    ``python -m package.module ...``)."""
    import __main__
    from ember.errors import MisconfigurationError
    spec = getattr(__main__, "__spec__", None)
    script = sys.argv[0] if sys.argv else ""
    # argv[0] is pytest's own __main__.py under `python -m pytest`: that holds also when a shell
    # (IPython's) replaced sys.modules["__main__"] and with it the spec
    # a pytest-xdist worker runs under `python -c` (execnet) with xdist imported
    xdist_worker = script == "-c" and "xdist" in sys.modules and bool(os.environ.get("PYTEST_XDIST_WORKER"))
    if "pytest" in os.path.basename(script) or f"{os.sep}pytest{os.sep}" in script \
            or (spec is not None and spec.name.startswith("pytest")) or xdist_worker:
        raise MisconfigurationError(
            "devices>1 with strategy='ddp' cannot start its ranks from inside pytest (they would re-run "
            "the test session); run the training in a script started as a subprocess")
    if spec is not None and spec.name not in ("__main__", None):
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name] + sys.argv[1:]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise MisconfigurationError(
            "devices>1 with strategy='ddp' starts the other ranks by re-running the program, but this "
            f"program has no script to re-run (sys.argv[0]={script!r}). Run a script (`python train.py`), "
            "or launch with `torchrun --nproc_per_node N train.py` / `ember launch`")
    return [sys.executable, os.path.abspath(script)] + sys.argv[1:]


class SubprocessLauncher:
    """Start ranks 1..N-1 of a single-node job as subprocesses of rank 0."""

    def __init__(self, env: ClusterEnvironment):
        self.env = env
        self.procs: dict[int, subprocess.Popen] = {}
        self._stopping = False
        self._failure: tuple[int, int] | None = None  # (rank, code) of the first failed child
        self._watcher: threading.Thread | None = None

    @property
    def failure(self) -> "tuple[int, int] | None":
        return self._failure

    def launch(self, cmd: list[str] | None = None) -> None:
        global _LAUNCHER
        cmd = cmd or relaunch_command()
        env = self.env
        for rank in range(1, env.world_size):
            child_env = dict(os.environ)
            child_env.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(env.world_size),
                "LOCAL_WORLD_SIZE": str(env.world_size), "GROUP_RANK": "0", "NODE_RANK": "0",
                "MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port),
                LAUNCH_MARKER: str(os.getpid()),
            })
            self.procs[rank] = subprocess.Popen(cmd, env=child_env)
        _LAUNCHER = self
        atexit.register(self._atexit)
        self._watcher = threading.Thread(target=self._watch, name="ember-launcher-watch", daemon=True)
        self._watcher.start()

    # -- rank 0 side --------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in list(self.procs.items()):
                code = proc.poll()
                if code is not None and code != 0 and not self._stopping:
                    self._failure = (rank, code)
                    self._abort_for_child(rank, code)
                    return
            if all(p.poll() is not None for p in self.procs.values()):
                return
            time.sleep(_POLL_S)

    def _abort_for_child(self, rank: int, code: int) -> None:
        """A child failed: say so once, stop everyone, leave with its code."""
        global _reported
        with _report_lock:
            if not _reported:
                _reported = True
                what = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
                _stderr(f"ember: rank {rank} {what}; stopping the other ranks")
        self.terminate()
        _flush_stdio()
        os._exit(code if code > 0 else 1)

    def wait_for_child_failure(self, timeout: float) -> "tuple[int, int] | None":
        """After rank 0 hit an error: did a child fail first? (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None and code != 0:
                    return rank, code
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    def terminate(self) -> None:
        """SIGTERM every live child, SIGKILL those still alive after a grace period."""
        self._stopping = True
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            try:
                p.terminate()
            except OSError:
                pass
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    p.kill()
                    p.wait(1.0)
                except (OSError, subprocess.TimeoutExpired):
                    pass

    def wait_children(self) -> int:
        """Rank 0 is done: wait for the others; the worst exit code among them."""
        worst = 0
        for rank, p in self.procs.items():
            code = p.wait()
            if code != 0 and worst == 0:
                worst = code if code > 0 else 1
        self._stopping = True
        return worst

    def _atexit(self) -> None:
        # reached when rank 0 leaves without going through the exit handlers below
        # (e.g. no process group was ever created): never leave orphans behind
        if any(p.poll() is None for p in self.procs.values()):
            if _EXIT.failed:
                self.terminate()
            else:
                code = self.wait_children()
                if code:
                    _flush_stdio()
                    os._exit(code)


# -- child side -------------------------------------------------------------------

def watch_parent() -> None:
    """In a rank started by :class:`SubprocessLauncher`: exit when rank 0 dies."""
    parent = int(os.environ.get(LAUNCH_MARKER, "0") or 0)
    if not parent:
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass
    if os.getppid() != parent:  # died before we got here
        os._exit(1)

    def poll():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                _flush_stdio()
                os._exit(1)

    threading.Thread(target=poll, name="ember-parent-watch", daemon=True).start()


# -- exit handling, every rank ------------------------------------------------------

class _ExitState:
    installed = False
    failed = False


_EXIT = _ExitState()


def _excepthook(exc_type, exc, tb):
    """An unhandled exception on a rank: report it once, stop the local ranks, and
    leave without finalising the interpreter around a broken process group."""
    global _reported
    _EXIT.failed = True
    code = 1
    launcher = _LAUNCHER
    peer_lost = is_peer_lost_error(exc)
    child = None
    if launcher is not None:  # did one of our ranks fail first? (then this is a consequence)
        child = launcher.wait_for_child_failure(3.0 if is_comm_error(exc) else 0.0)
    with _report_lock:
        first = not _reported
        _reported = True
    if child is not None:
        if first:
            what = f"exited with code {child[1]}" if child[1] > 0 else f"was killed by signal {-child[1]}"
            _stderr(f"ember: rank {child[0]} {what}; stopping the other ranks")
        code = child[1] if child[1] > 0 else 1
    elif peer_lost:
        rank = os.environ.get("RANK", "?")
        text = str(exc).strip()
        line = text.splitlines()[0] if text else ""
        _stderr(f"ember: rank {rank} lost contact with another rank, which probably failed "
                f"(its error is reported above or in its log): {exc_type.__name__}: {line[:300]}")
    else:
        _PREV_EXCEPTHOOK(exc_type, exc, tb)
        missing = ranks_never_arrived() if is_timeout_error(exc) else []
        if missing:      # name the ranks this one waited for, here and in the launcher's report
            from ember.errors import DistributedOperationError
            report = DistributedOperationError(never_arrived_message(exc, missing))
            _stderr(f"ember: {report}")
            _record_for_torchrun(report)
        else:
            _record_for_torchrun(exc)
    if launcher is not None:
        launcher.terminate()
    try:  # what the interpreter would run at exit (loggers, ...), then leave
        atexit._run_exitfuncs()
    except BaseException:
        pass
    _flush_stdio()
    os._exit(code)


_PREV_EXCEPTHOOK = sys.excepthook


def _record_for_torchrun(exc: BaseException) -> None:
    """Under torchrun / ``ember launch``: write the agent's error file for this rank's own
    error (not for a rank that only lost its peer), so the launcher names the rank that
    failed first rather than one stopped because of it."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(exc)
    except Exception:  # never let the report hide the error
        pass


def _exit_handler() -> None:
    """atexit, normal end of a distributed run: every rank meets at a barrier and
    the process group is destroyed while the interpreter is fully alive (gloo can
    abort the process when it is left to interpreter finalisation)."""
    if _EXIT.failed:
        return
    shutdown_process_group(barrier=True)
    if _LAUNCHER is not None:
        code = _LAUNCHER.wait_children()
        if code:
            _flush_stdio()
            os._exit(code)
    _skip_native_teardown()


def _skip_native_teardown() -> None:
    """End the process at C ``exit(status)`` with that status, skipping native teardown.

    ``destroy_process_group()`` does not free a gloo group that a DDP wrapper was built
    on (torch keeps it alive from C++), so gloo's sockets and threads outlive Python,
    and processes abort in C ``exit()`` (``terminate called without an active
    exception``, SIGABRT: a fifth of a raw DDP script's processes in
    ``benchmarks/ddp.py exit-loop``, none with this step). glibc's ``on_exit`` calls
    ``_exit(status, arg)`` after Python has finalised (atexit handlers, flushed files,
    finalizers), so the exit status is exactly the one Python chose and only the
    native exit handlers and static destructors are skipped. C stdio buffers are
    flushed first. No-op where ``on_exit`` does not exist."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        on_exit, _exit = getattr(libc, "on_exit", None), getattr(libc, "_exit", None)
        if on_exit is None or _exit is None:
            return
        libc.fflush(None)
        on_exit(_exit, None)
    except Exception:  # no libc to speak to: the ordinary exit
        pass


def install_exit_handlers() -> None:
    """Install the excepthook and atexit handler of a distributed rank. Call it after
    ``init_process_group`` (which installs a hook that prefixes the lines of a
    traceback with the rank; ours wraps it)."""
    global _PREV_EXCEPTHOOK
    if sys.excepthook is not _excepthook:
        _PREV_EXCEPTHOOK = sys.excepthook
        sys.excepthook = _excepthook
    if not _EXIT.installed:
        _EXIT.installed = True
        atexit.register(_exit_handler)
