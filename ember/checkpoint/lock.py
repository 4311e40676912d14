"""One writer per folder: :class:`DirLock`, the lock file ``.ember-lock`` that
``ModelCheckpoint`` holds on its ``dirpath`` for as long as its run lives, so two runs
never write one checkpoint folder (docs/checkpoint_format.md)."""
from __future__ import annotations

import json
import os
import stat
import warnings

from ember.checkpoint.trust import FILE_MODE, _kind
from ember.errors import CheckpointError

__all__ = ["DirLock", "LOCK_NAME"]

LOCK_NAME = ".ember-lock"


def _pid_alive(pid: int) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31:
        return False          # no process has it (os.kill would raise OverflowError, or signal a group)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by another user
        return True
    except (OSError, OverflowError):
        return False
    return True


_HELD: dict[str, "DirLock"] = {}      # lock path -> the DirLock of this process holding it


class DirLock:
    """A lock file ``dirpath/.ember-lock`` holding the owner's pid and host.

    :meth:`acquire` raises CheckpointError while another live process holds it. The
    owner holds the file with ``flock`` for as long as it runs, so the kernel frees it
    when that process ends however it ends (``kill -9``, the OOM killer). The ``flock`` is
    the truth: a lock file of this host that no process holds is taken over with a warning,
    whatever it holds: a pid that is gone, a pid that now belongs to another live process
    (pids are reused, in a container soon after a ``kill -9``), a pid no process can have,
    or nothing at all (a process killed between creating and writing it). Only one process
    can hold the ``flock``, so two processes taking over one stale lock at once cannot
    both win. A lock recorded by another host is honoured until removed by hand (its
    ``flock`` may not reach this host on every shared file system, and ember cannot tell
    whether that process lives). Where the file system has no ``flock``, a lock whose
    owner cannot be shown alive on this host (dead, or an empty or unreadable file) is
    taken over with a warning, without that guarantee."""

    def __init__(self, dirpath: str | os.PathLike):
        import socket
        import uuid
        self.path = os.path.join(os.fspath(dirpath), LOCK_NAME)
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex}
        self.held = False
        self._fd: int | None = None

    def _read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.loads(f.read(4096))
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _in_use(self, what: str, other: dict) -> CheckpointError:
        pid, host = other.get("pid"), other.get("host")
        who = f"process {pid} on host {host!r}" if pid is not None else "a process that is writing it now"
        return CheckpointError(
            f"{what}: {os.path.dirname(self.path)} is in use by another run ({who}, see {self.path}); two runs "
            "writing one checkpoint folder would overwrite each other's checkpoints. Give this run another "
            "dirpath / logger version, or remove the lock file if that process is gone")

    def acquire(self, what: str = "ModelCheckpoint") -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        mine = _HELD.get(os.path.realpath(self.path))
        if mine is not None and mine.held and mine is not self and mine._fd is not None:   # this process's earlier run
            self._fd, mine._fd, mine.held = mine._fd, None, False
            self._write()
            return
        try:
            import fcntl
        except ImportError:       # no flock (Windows): the file's content decides
            return self._acquire_by_content(what)
        nofollow = getattr(os, "O_NOFOLLOW", 0)
        for _ in range(20):
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, FILE_MODE), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, os.O_RDWR | nofollow), False
                except FileNotFoundError:
                    continue              # released meanwhile
                except OSError as err:    # a folder, a symlink, no permission...
                    raise self._not_a_lock(what, err) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise self._not_a_lock(what, None)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:       # a live process holds it
                os.close(fd)
                raise self._in_use(what, self._read() or {}) from None
            except OSError:               # this file system has no flock
                os.close(fd)
                if created:
                    os.remove(self.path)
                return self._acquire_by_content(what)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:                  # its owner released it (removed the file) meanwhile
                os.close(fd)
                continue
            if not created:               # left behind: nobody holds its flock
                other = self._read() or {}
                pid, host = other.get("pid"), other.get("host")
                if isinstance(host, str) and host != self.owner["host"]:
                    os.close(fd)          # another host's lock: honoured
                    raise self._in_use(what, other)
                if not (isinstance(pid, int) and isinstance(host, str)):
                    self._warn_stale(other)
                elif pid != os.getpid():  # the flock is the truth, whatever the pid is now
                    self._warn_taken_over(pid)
            self._fd = fd
            self._write()
            return
        raise CheckpointError(f"{what}: could not take the lock {self.path}")

    def _warn_stale(self, other) -> None:
        warnings.warn(f"{self.path}: the lock file is empty or unreadable ({other!r}) and no process holds it "
                      "(its owner was killed while taking it?); taking it over", UserWarning, stacklevel=4)

    def _warn_taken_over(self, pid: int) -> None:
        now = ("now belongs to another live process, which is not an ember run holding it (the pid was reused "
               "after its owner ended)") if _pid_alive(pid) else "is gone"
        warnings.warn(f"{self.path}: no process holds this lock (its flock is free); the process it names ({pid}) "
                      f"{now}; taking it over", UserWarning, stacklevel=4)

    def _not_a_lock(self, what: str, err: "OSError | None") -> CheckpointError:
        try:
            kind = _kind(os.lstat(self.path).st_mode) if not os.path.islink(self.path) else "a symlink"
        except OSError:
            kind = "not a file"
        why = f" ({err.strerror or err})" if err is not None and not isinstance(err, IsADirectoryError) else ""
        return CheckpointError(f"{what}: {self.path} is {kind}{why}, not ember's lock file; ember never replaces "
                               f"it: remove or rename it, or give this run another dirpath")

    def _write(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.owner).encode(), 0)
        self.held = True
        _HELD[os.path.realpath(self.path)] = self

    def _acquire_by_content(self, what: str) -> None:
        """Without flock: the pid and host in the file decide."""
        import time
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
            except FileExistsError:
                other = self._read()
                if other is None:
                    continue   # released meanwhile
                if not other:   # empty or unreadable: maybe being written right now
                    time.sleep(1.0)
                    other = self._read()
                    if other is None:
                        continue
                pid, host = other.get("pid"), other.get("host")
                if not isinstance(pid, int) or not isinstance(host, str):
                    self._warn_stale(other)
                    self._take_over()
                    return
                if host == self.owner["host"] and (pid == os.getpid() or not _pid_alive(pid)):
                    self._take_over()   # a dead process of this host, or this process's earlier run
                    return
                raise self._in_use(what, other) from None
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            return
        raise CheckpointError(f"{what}: could not take the lock {self.path}")

    def _take_over(self) -> None:
        tmp = f"{self.path}.{self.owner['token'][:8]}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.owner, f)
        os.replace(tmp, self.path)
        self.held = True

    def release(self) -> None:
        if self.held and (self._read() or {}).get("token") == self.owner["token"]:
            try:
                os.remove(self.path)      # before the flock goes: a waiter then finds no file
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if _HELD.get(os.path.realpath(self.path)) is self:
            del _HELD[os.path.realpath(self.path)]
        self.held = False
