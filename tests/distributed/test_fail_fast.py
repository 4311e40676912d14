"""Error paths end every rank within seconds, and rank 0 alone makes the decisions it
broadcasts (issue 12 items 5 and 9): two real gloo processes (tests/scripts/failfast_ddp.py)
with a 60 s process-group timeout, so waiting for it shows as a failure."""
import json
import subprocess
import sys
import time

import pytest

from helpers import SCRIPTS, child_env

pytestmark = pytest.mark.multiproc


def _env():
    env = child_env(EMBER_CHECKPOINT_FSYNC="0")
    return env


def _run(mode, tmp_path, timeout=150, launch=False):
    """The script's MODE in 2 processes: started by the Trainer itself, or by `ember launch`
    (both processes start together, so a short process-group timeout is not spent waiting
    for a slower start)."""
    cmd = [str(SCRIPTS / "failfast_ddp.py"), mode, str(tmp_path)]
    cmd = [sys.executable, "-m", "ember", "launch", "--num-processes", "2", *cmd] if launch else [sys.executable, *cmd]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((tmp_path / f"{mode}_{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(200)
def test_failed_write_on_rank0_reaches_every_rank(tmp_path):
    r0, r1 = _run("save_enospc", tmp_path)
    for r in (r0, r1):
        assert r["error"] is not None and "the disk is full" in r["error"], r
        assert r["seconds"] < 20, r          # not the 60 s process-group timeout
    assert r0["error"].startswith("CheckpointError")
    assert r1["error"].startswith("CheckpointError: checkpoint ") and "was not written on rank 0" in r1["error"]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.timeout(200)
def test_ckpt_path_last_is_resolved_by_rank0_only(tmp_path):
    r0, r1 = _run("ckpt_last", tmp_path)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["resumed"] == r1["resumed"] and r0["resumed"].endswith("last")
    assert r0["global_step"] == r1["global_step"] == 5
    assert r0["weights"] == r1["weights"]


@pytest.mark.timeout(200)
def test_agreement_timeout_names_the_rank_that_did_not_arrive(tmp_path):
    r0, r1 = _run("agree_timeout", tmp_path, launch=True)
    assert r0["error"] is not None and r0["error"].startswith("DistributedOperationError"), r0
    assert "rank(s) 1 never arrived at a point where the ranks agree" in r0["error"] and "(4 s)" in r0["error"], r0
    assert r0["seconds"] < 30 and r1["error"] is not None


@pytest.mark.timeout(200)
def test_launcher_sigterm_after_a_failed_rank_stops_a_blocked_rank_at_once(tmp_path):
    """Rank 1 raises while rank 0 is blocked in a call that never returns to Python: the
    agent's SIGTERM ends rank 0 at once (not after the agent's 30 s grace), and rank 1's
    traceback is the error shown and named."""
    cmd = [sys.executable, "-m", "ember", "launch", "--num-processes", "2", str(SCRIPTS / "failfast_ddp.py"),
           "peer_fails", str(tmp_path)]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150)
    ended = time.time()
    assert p.returncode == 1, p.stderr[-4000:]
    failed_at = float((tmp_path / "failed_at").read_text())
    assert ended - failed_at < 15, ended - failed_at          # was 30+ s (the agent's grace, then SIGKILL)
    assert "RuntimeError: boom on rank 1" in p.stderr and "Traceback" in p.stderr
    assert "ember: rank 0 stops now: SIGTERM from the launcher after another rank failed" in p.stderr
    assert "ember: error: launch: rank 1 (local rank 1) exited with code 1" in p.stderr


@pytest.mark.timeout(200)
def test_launcher_sigterm_after_a_killed_rank_stops_a_blocked_rank_at_once(tmp_path):
    """Rank 1 is SIGKILLed (the OOM killer's way: no Python error, no error file) while rank
    0 is blocked outside Python: the agent's SIGTERM still ends rank 0 at once."""
    cmd = [sys.executable, "-m", "ember", "launch", "--num-processes", "2", str(SCRIPTS / "failfast_ddp.py"),
           "peer_killed", str(tmp_path)]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=150)
    ended = time.time()
    assert p.returncode != 0, p.stderr[-4000:]
    failed_at = float((tmp_path / "failed_at").read_text())
    assert ended - failed_at < 15, ended - failed_at          # was 30+ s (the agent's grace, then SIGKILL)
    assert ("ember: rank 0 stops now: SIGTERM from the launcher after another rank ended (1 of the other 1 "
            "local rank(s) ended without recording an error: killed?)") in p.stderr, p.stderr[-4000:]


@pytest.mark.timeout(200)
def test_no_sync_is_left_when_the_step_raises(tmp_path):
    """Issue 12 item 9: no_sync is exception-safe in the Trainer's step and in
    Accelerator.accumulate (DDP's gradient sync is back on after the exception)."""
    for r in _run("no_sync_exception", tmp_path, launch=True):
        assert r["error"] == "raised under no_sync" and r["trainer_sync"] is True, r
        assert r["acc_error"] == "raised in accumulate" and r["acc_sync"] is True, r


@pytest.mark.timeout(200)
def test_ranks_that_choose_different_precisions_all_raise_at_setup(tmp_path):
    """A Trainer given no precision asks the module on each rank's device; machines that
    differ in bfloat16 hardware would train one model in two formats: every rank raises."""
    r0, r1 = _run("precision_differs", tmp_path)
    for r in (r0, r1):
        assert r["error"] is not None and r["error"].startswith("MisconfigurationError"), r
        assert "'bf16-mixed' on rank(s) 0" in r["error"] and "'32-true' on rank(s) 1" in r["error"], r
        assert "Trainer(precision=...)" in r["error"] and r["seconds"] < 20, r
        assert r["agreed"] == "bf16-mixed" and r["agreed_step"] == 2, r   # the same choice everywhere: trains
