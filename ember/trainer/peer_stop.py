"""SIGTERM under ``ember launch`` / torchrun: a preemption, or the agent stopping the
ranks that survive a failed one.

ember treats SIGTERM as a preemption request (the ranks agree at the next log point,
save ``last`` and exit). But torchrun's agent also sends SIGTERM to the surviving ranks
when one rank failed, then waits 30 s before SIGKILL; a rank blocked in a collective
(or any call that does not return to Python) cannot even run the Python-level handler,
so the job lingered for the whole grace period. While a fit runs under torchrun, a
watcher thread reads the signals as they arrive (``signal.set_wakeup_fd``: the C-level
handler writes the signal number at once, whatever the main thread is doing) and,
on SIGTERM, ends the process with the default SIGTERM action when a rank on this node
has recorded its error (its torchrun error file exists): the SIGTERM is then the agent
stopping the job, not a preemption.

A local rank that died without recording an error (SIGKILL, the OOM killer, a segfault)
is found too: on Linux, fewer live processes beside this one under the agent (this
process's parent) than ``LOCAL_WORLD_SIZE - 1`` means a peer is gone, and a preemption
cannot be saved without it anyway. A second SIGTERM is deliberately not a reason: under
SLURM a preempted step's workers get SIGTERM both from SLURM and from the agent
forwarding its own, and they must still save. A peer on another node that died without
recording an error leaves the agent's grace period as the bound. ``EMBER_SIGTERM_FAIL_FAST=0`` turns the watcher off
(every SIGTERM is then only a preemption request). Outside torchrun nothing is installed.
"""
from __future__ import annotations

import ctypes
import glob
import os
import signal
import socket
import sys
import threading

ENV = "EMBER_SIGTERM_FAIL_FAST"


def peer_failed() -> "str | None":
    """The error file of another local rank of this torchrun job that recorded its error,
    or None (each rank's file is ``<attempt dir>/<local rank>/error.json``)."""
    mine = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not mine:
        return None
    attempt = os.path.dirname(os.path.dirname(os.path.abspath(mine)))
    for path in glob.glob(os.path.join(attempt, "*", os.path.basename(mine))):
        if os.path.abspath(path) != os.path.abspath(mine) and os.path.getsize(path) > 0:
            return path
    return None


def peer_gone() -> "str | None":
    """Linux: how many other local ranks of this torchrun job are no longer running (the
    agent, this process's parent, started ``LOCAL_WORLD_SIZE`` of them), as a sentence, or
    None (all there, or no ``/proc`` to tell)."""
    n = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if n < 2 or not os.path.isdir("/proc"):
        return None
    parent, me, alive = os.getppid(), os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == parent and state not in ("Z", "X"):
            alive += 1
    gone = n - 1 - alive
    return f"{gone} of the other {n - 1} local rank(s) ended without recording an error" if gone > 0 else None


def _die(why: str) -> None:
    print(f"ember: rank {os.environ.get('RANK', '?')} stops now: {why}", file=sys.stderr, flush=True)
    try:   # the default action, set from this (non-main) thread through libc
        set_handler = ctypes.CDLL(None).signal
        set_handler.argtypes, set_handler.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
        set_handler(int(signal.SIGTERM), None)   # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        os._exit(128 + int(signal.SIGTERM))


def _watch(sock: socket.socket) -> None:
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        if int(signal.SIGTERM) in data:
            failed = peer_failed()
            if failed:
                _die(f"SIGTERM from the launcher after another rank failed (its error: {failed})")
            gone = peer_gone()
            if gone:
                _die(f"SIGTERM from the launcher after another rank ended ({gone}: killed?)")


class Watcher:
    """The watcher of one fit (:func:`start`); :meth:`stop` ends it."""

    def __init__(self, read: socket.socket, write: socket.socket):
        self._read, self._write = read, write
        self._thread = threading.Thread(target=_watch, args=(read,), name="ember-sigterm-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
        self._write.close()    # the thread's recv returns b"": it ends
        self._thread.join(timeout=1.0)
        self._read.close()


def start() -> "Watcher | None":
    """Start watching SIGTERM (main thread, under torchrun only, unless ``EMBER_SIGTERM_FAIL_FAST=0``
    or another wakeup fd is in use, e.g. an asyncio loop): a Watcher, or None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(ENV, "1") == "0":
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    read, write = socket.socketpair()
    write.setblocking(False)
    try:
        old = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        read.close()
        write.close()
        return None
    if old != -1:   # someone else listens there: leave it to them
        signal.set_wakeup_fd(old)
        read.close()
        write.close()
        return None
    return Watcher(read, write)
