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

from ember.checkpoint.trust import LOCK_NAME, DirLock
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
from ember.checkpoint.trust import DirLock
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
