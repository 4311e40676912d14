"""Resume checks are agreed across ranks (issue 12, "fail fast on every error path"): a
checkpoint that one rank refuses is refused by every rank within seconds, with the
same error naming that rank, instead of the others waiting in the next collective
until the process-group timeout. Two real gloo processes (tests/scripts/resume_agree_ddp.py)
resume under a 20 s process-group timeout, so waiting for it shows as a failure."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SCRIPTS, child_env, rank_results


# the Trainer modes run together in one start of the two processes (each start costs seconds),
# the first time a test asks for one of them
TOGETHER = ("data_len", "allow_rank0", "allow_rank1", "swapped_state", "missing_rank1")
_together: dict = {}


def _run(mode, tmp_path, timeout=150, launch=False):
    """The script's MODE in 2 processes, started by the Trainer itself or by `ember launch`."""
    if mode in TOGETHER:
        if not _together:
            import tempfile
            root = Path(tempfile.mkdtemp(prefix="resume_agree_"))
            _together["stderr"] = _start("many", root, 300, False, [",".join(TOGETHER)])
            _together["root"] = root
        root = _together["root"] / mode
        return rank_results(root, name=f"{mode}_{{}}"), _together["stderr"]
    err = _start(mode, tmp_path, timeout, launch)
    return rank_results(tmp_path, name=f"{mode}_{{}}"), err


def _start(mode, tmp_path, timeout, launch, extra=()):
    env = child_env(EMBER_CHECKPOINT_FSYNC="0")
    env.pop("EMBER_ALLOW_DATA_CHANGE", None)   # the modes set it themselves, on one rank or both
    cmd = [str(SCRIPTS / "resume_agree_ddp.py"), mode, str(tmp_path), *extra]
    cmd = [sys.executable, "-m", "ember", "launch", "--num-processes", "2", *cmd] if launch else [sys.executable, *cmd]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stderr


def _same_refusal(r0, r1, rank, *needles):
    for r in (r0, r1):
        assert r["error"] is not None and r["error"].startswith(f"CheckpointError: rank {rank}: "), r
        for needle in needles:
            assert needle in r["error"], r
        assert r["seconds"] < 12, r          # not the 20 s process-group timeout
    assert r0["error"] == r1["error"]


# what one rank alone refuses: (script mode, started by `ember launch`, the refusing rank, what its error names)
REFUSED = {
    "dataset_changed_on_rank1": ("data_len", False, 1,
                                 ("was saved mid-epoch", "dataset len 32 -> 48", "EMBER_ALLOW_DATA_CHANGE=1")),
    # the pre-load check leaves a path a rank does not see to the strategy's load (FSDP's
    # full-weights load reads on rank 0 only); DDP's load fails there and is agreed after it
    "checkpoint_missing_on_rank1": ("missing_rank1", False, 1, ("not_on_rank1",)),
    # EMBER_ALLOW_DATA_CHANGE=1 on rank 1 only does not accept the change: rank 0 refuses it
    "allow_data_change_on_rank1_only": ("allow_rank1", False, 0, ("dataset len 32 -> 48",)),
    "trainer_state_corrupted_on_rank1": ("swapped_state", False, 1,
                                         (os.path.join("ckpt_rank1", "trainer_state.pt"), "does not hold the content")),
    "accelerator_load_state_corrupted_on_rank1": ("acc_swapped", True, 1, (
        os.path.join("state_rank1", "model.safetensors"), "does not hold the content")),
}


@pytest.mark.multiproc
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(REFUSED))
def test_what_one_rank_refuses_is_refused_by_every_rank(tmp_path, case):
    mode, launch, rank, needles = REFUSED[case]
    (r0, r1), _ = _run(mode, tmp_path, launch=launch)
    _same_refusal(r0, r1, rank, *needles)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_rank0s_allow_data_change_decides_for_every_rank(tmp_path):
    (r0, r1), err = _run("allow_rank0", tmp_path)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["global_step"] == r1["global_step"] == 2 + 4 + 6   # epoch 0 goes on after 2 batches of the 6 new ones; epoch 1
    assert "accepted because EMBER_ALLOW_DATA_CHANGE=1" in err


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_accelerator_load_state_without_dir_takes_rank0s_newest_checkpoint(tmp_path):
    (r0, r1), _ = _run("acc_auto", tmp_path, launch=True)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["global_step"] == r1["global_step"] == 1     # save_iteration after checkpoint_0
    assert r0["seconds"] < 12 and r1["seconds"] < 12


class _OneProcess:
    world_size, is_global_zero = 1, True


def test_one_process_raises_its_own_error_unchanged():
    from ember.checkpoint.agree import agree_outcome
    from ember.errors import CheckpointError
    err = CheckpointError("ckpt/trainer_state.pt does not hold the content ...")
    with pytest.raises(CheckpointError) as info:
        agree_outcome(_OneProcess(), err, rank0_value=True)
    assert info.value is err
    assert agree_outcome(_OneProcess(), None, rank0_value="rank 0's") == "rank 0's"


def test_collective_errors_are_not_agreed_again():
    """An error out of a collective (a gloo timeout), even wrapped as a CheckpointError by
    the restore, is raised as it is: a second collective would wait for the same peer."""
    from ember.checkpoint.agree import collective_failed
    from ember.errors import CheckpointError, DistributedOperationError
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms")
    wrapped = CheckpointError(f"ckpt does not fit this module/optimizer setup: RuntimeError: {gloo}")
    wrapped.__cause__ = gloo
    assert collective_failed(gloo) and collective_failed(wrapped)
    assert collective_failed(DistributedOperationError("rank(s) 1 never arrived"))
    assert not collective_failed(CheckpointError("ckpt/trainer_state.pt does not hold the content"))
    assert not collective_failed(ValueError("size mismatch for net.weight"))
