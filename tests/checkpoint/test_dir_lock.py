"""The checkpoint-folder lock: a lock whose owner is gone is taken over, even when its
file is empty or unreadable (a process killed between creating and writing it), and of
several processes taking over one stale lock at once exactly one wins."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from ember.checkpoint.lock import LOCK_NAME, DirLock
from ember.errors import CheckpointError

import ember

ROOT = Path(ember.__file__).resolve().parents[1]     # the ember under test, for the subprocesses


@pytest.mark.parametrize("content", [b"", b"\x00\xff not json", b'{"pid": "x"'])
def test_an_empty_or_unreadable_lock_is_taken_over_with_a_warning(tmp_path, content):
    (tmp_path / LOCK_NAME).write_bytes(content)
    lock = DirLock(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lock.acquire()
    try:
        assert lock.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert any("empty or unreadable" in str(x.message) and "taking it over" in str(x.message) for x in w)
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


_TAKER = """
import os, sys, time
from ember.checkpoint.lock import DirLock
from ember.errors import CheckpointError
print("ready", flush=True)
start, rounds = float(sys.stdin.readline()), int(sys.argv[2])
held = []
for r in range(rounds):                   # one stale lock per round, all processes at once
    while time.time() < start + 0.3 * r:
        pass
    lock = DirLock(os.path.join(sys.argv[1], str(r)))
    try:
        lock.acquire()
        held.append(lock)
        print("won", flush=True)
    except CheckpointError as err:
        print("refused", flush=True)
sys.stdin.read()
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_concurrent_take_overs_of_one_stale_lock_have_one_winner(tmp_path):
    """Rounds of 6 processes taking over one stale lock at the same moment: a dead owner's
    lock (even rounds) or an empty one (odd rounds)."""
    import socket
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    rounds, n = 12, 6
    for r in range(rounds):
        (tmp_path / str(r)).mkdir()
        content = json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "token": "old"}) \
            if r % 2 == 0 else ""
        (tmp_path / str(r) / LOCK_NAME).write_text(content)
    procs = [subprocess.Popen([sys.executable, "-c", _TAKER, str(tmp_path), str(rounds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * n
        start = time.time() + 0.5          # every process spins until then
        for p in procs:
            p.stdin.write(f"{start!r}\n")
            p.stdin.flush()
        outcomes = [[p.stdout.readline().strip() for _ in range(rounds)] for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(30)
    winners = [sum(o[r] == "won" for o in outcomes) for r in range(rounds)]
    assert winners == [1] * rounds, outcomes


def _lock_of(tmp_path, pid) -> None:
    import socket
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "token": "old"}))


def test_a_lock_whose_pid_now_belongs_to_a_live_unrelated_process_is_taken_over(tmp_path):
    """The flock is the truth: after a kill -9 the pid may be reused by any live process."""
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        _lock_of(tmp_path, other.pid)
        lock = DirLock(tmp_path)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            lock.acquire()
        assert lock.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert any(f"the process it names ({other.pid}) now belongs to another live process" in str(x.message)
                   and "taking it over" in str(x.message) for x in w), [str(x.message) for x in w]
        lock.release()
    finally:
        other.stdin.close()
        other.wait(30)


@pytest.mark.parametrize("pid", [10**30, 2**63, -1, 0])
def test_a_lock_naming_an_impossible_pid_is_taken_over(tmp_path, pid):
    _lock_of(tmp_path, pid)
    lock = DirLock(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lock.acquire()
    assert lock.held and any("is gone; taking it over" in str(x.message) for x in w)
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_folder_named_like_the_lock_is_a_clear_error(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    (tmp_path / LOCK_NAME / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=rf"{LOCK_NAME} is a directory, not ember's lock file; ember never "
                                              "replaces it: remove or rename it"):
        DirLock(tmp_path).acquire("ModelCheckpoint(dirpath=...)")
    assert (tmp_path / LOCK_NAME / "keep.txt").read_text() == "mine"


def test_a_symlink_named_like_the_lock_is_never_written_through(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("my notes")
    (tmp_path / "ck").mkdir()
    os.symlink(target, tmp_path / "ck" / LOCK_NAME)
    with pytest.raises(CheckpointError, match="is a symlink .*not ember's lock file"):
        DirLock(tmp_path / "ck").acquire()
    assert target.read_text() == "my notes"
