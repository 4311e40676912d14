"""Decisions that read per-rank inputs (a metric logged on some ranks only, a checkpoint
folder as one node sees it) and writes only rank 0 makes are agreed, so no rank waits for
the process-group timeout (issue 12): two real gloo processes (tests/scripts/agree_paths_ddp.py)
with a 20 s process-group timeout."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SCRIPTS, child_env

pytestmark = pytest.mark.multiproc


# modes started by the Trainer's own launcher that end normally: run together, in one start of
# the two processes (each start costs seconds), the first time a test asks for one of them
TOGETHER = ("es_strict", "es_lenient", "topk_view", "weights_enospc", "lock_enospc", "nan_rank1", "uneven_batches",
            "prepare_data_fails", "uneven_stream")
_together_root = None


def _run(mode, tmp_path, launch=False):
    global _together_root
    if mode in TOGETHER:
        if _together_root is None:
            import tempfile
            root = Path(tempfile.mkdtemp(prefix="agree_paths_"))
            _start("many", root, extra=[",".join(TOGETHER)])
            _together_root = root
        return [json.loads((_together_root / mode / f"{mode}_{r}.json").read_text()) for r in (0, 1)]
    _start(mode, tmp_path, launch=launch)
    return [json.loads((tmp_path / f"{mode}_{r}.json").read_text()) for r in (0, 1)]


def _start(mode, tmp_path, launch=False, extra=()):
    env = child_env(EMBER_CHECKPOINT_FSYNC="0")
    cmd = [str(SCRIPTS / "agree_paths_ddp.py"), mode, str(tmp_path), *extra]
    cmd = [sys.executable, "-m", "ember", "launch", "--num-processes", "2", *cmd] if launch else [sys.executable, *cmd]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.mark.timeout(200)
def test_early_stopping_metric_logged_on_rank0_only_raises_on_every_rank(tmp_path):
    r0, r1 = _run("es_strict", tmp_path)
    for r in (r0, r1):
        assert r["error"] is not None and r["error"].startswith("MisconfigurationError: EarlyStopping"), r
        assert "missing on rank(s) [1]" in r["error"], r
        assert r["seconds"] < 15, r          # not the 20 s process-group timeout
    assert "it is missing on rank(s) [1]" in r0["error"]   # rank 0 has it: says where it is missing


@pytest.mark.timeout(200)
def test_early_stopping_metric_logged_on_rank0_only_is_skipped_on_every_rank(tmp_path):
    r0, r1 = _run("es_lenient", tmp_path)
    for r in (r0, r1):
        assert r["error"] is None, r
        assert r["stop_reason"] == "max_epochs" and r["epoch"] == 2, r
        assert r["wait_count"] == 0, r       # a check skipped on one rank counts on none
        assert r["seconds"] < 15, r


@pytest.mark.timeout(200)
def test_top_k_decisions_are_rank0s_when_rank1_restored_another_view(tmp_path):
    r0, r1 = _run("topk_view", tmp_path)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["epoch"] == r1["epoch"] == 3
    # the first epoch's checkpoint stays the best (the loss falls; mode="max") on both ranks
    assert r0["topk"] == r1["topk"] == [r0["first"]] and r0["best"] == r1["best"] == r0["first"]
    assert r0["files"] == [os.path.basename(r0["first"])], r0["files"]
    assert r1["rank1_files"] == []
    assert r0["seconds"] < 15 and r1["seconds"] < 15


def _disk_full_on_rank0_reached_both(r0, r1) -> None:
    """Rank 0's write failed with ENOSPC (its OSError) and both ranks ended within seconds naming it."""
    for r in (r0, r1):
        assert r["error"] is not None and os.strerror(28) in r["error"], r
        assert r["seconds"] < 15, r
    assert r0["error"].startswith("OSError")


@pytest.mark.timeout(200)
def test_failed_weights_only_save_on_rank0_reaches_every_rank(tmp_path):
    r0, r1 = _run("weights_enospc", tmp_path)
    _disk_full_on_rank0_reached_both(r0, r1)
    assert r1["error"].startswith("CheckpointError: checkpoint ") and "was not written on rank 0" in r1["error"]


@pytest.mark.timeout(200)
def test_a_disk_error_taking_the_checkpoint_folder_lock_on_rank0_reaches_every_rank(tmp_path):
    """ModelCheckpoint's setup on rank 0 fails with an OSError (not a CheckpointError) while
    writing its lock file: rank 1 does not wait in the setup's broadcast for the timeout."""
    r0, r1 = _run("lock_enospc", tmp_path)
    for r in (r0, r1):
        assert r["error"] is not None and os.strerror(28) in r["error"], r
        assert r["seconds"] < 15, r
    assert r0["error"].startswith("OSError")
    assert r1["error"].startswith("CheckpointError: ModelCheckpoint(dirpath=") and "rank 0 could not" in r1["error"]


@pytest.mark.timeout(200)
def test_an_export_folder_rank0_refuses_at_setup_ends_every_rank_before_training(tmp_path):
    """ExportBestPretrained's folder check is rank 0's (it writes the export): a refusal
    there reaches rank 1 at setup, not as a process-group timeout in the first step."""
    r0, r1 = _run("export_refused", tmp_path)
    for r in (r0, r1):
        assert r["error"] is not None and r["seconds"] < 15 and r["step"] == 0, r
    assert r0["error"].startswith("MisconfigurationError: ExportBestPretrained(") and "is a file" in r0["error"]
    assert r1["error"].startswith("CheckpointError: ExportBestPretrained(dirpath=") and "is a file" in r1["error"]


@pytest.mark.timeout(200)
def test_failed_save_model_on_the_main_process_reaches_every_process(tmp_path):
    r0, r1 = _run("save_model_enospc", tmp_path, launch=True)
    _disk_full_on_rank0_reached_both(r0, r1)
    assert r1["error"].startswith("CheckpointError: save_model(") and "failed on the main process" in r1["error"]


@pytest.mark.timeout(200)
def test_find_executable_batch_size_ranks_retry_together(tmp_path):
    r0, r1 = _run("find_bs_sym", tmp_path, launch=True)
    assert r0["batch_size"] == r1["batch_size"] == 8
    assert r0["tried"] == r1["tried"] == [32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]   # Accelerate's -10%


@pytest.mark.timeout(200)
def test_find_executable_batch_size_oom_on_one_rank_ends_the_run(tmp_path):
    """Rank 1 alone runs out of memory at 32: it must not retry at 16 while rank 0 trains
    at 32 (their collectives would pair up across batch sizes); it raises, naming itself,
    after the process-group timeout (10 s here) at most, and the launcher ends rank 0."""
    import time
    env = child_env()
    cmd = [sys.executable, "-m", "ember", "launch", "--num-processes", "2", str(SCRIPTS / "agree_paths_ddp.py"),
           "find_bs_asym", str(tmp_path)]
    start = time.monotonic()
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode != 0, p.stderr[-4000:]
    assert ("find_executable_batch_size: rank 1 ran out of memory at batch size 32, but only 1 of 2 ranks did "
            "within 10 s") in p.stderr, p.stderr[-4000:]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32 MiB (rank 1)" in p.stderr
    assert not (tmp_path / "find_bs_asym_0.json").exists() and not (tmp_path / "find_bs_asym_1.json").exists()
    assert time.monotonic() - start < 90


@pytest.mark.timeout(200)
def test_elastic_restart_resumes_rank0s_checkpoint_on_every_rank(tmp_path):
    """After an elastic restart each rank looked for the run's newest checkpoint itself:
    a rank whose node does not see it started afresh while rank 0 resumed (and waited
    for it in the broadcast of the resolved path). Now rank 0's answer is every rank's."""
    r0, r1 = _run("elastic_view", tmp_path)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["resumed"] == r1["resumed"] and r0["resumed"].endswith("last"), (r0["resumed"], r1["resumed"])
    assert r0["global_step"] == r1["global_step"] == 5
    assert r0["weights"] == r1["weights"]
    assert r0["seconds"] < 15 and r1["seconds"] < 15


@pytest.mark.timeout(200)
def test_automatic_checkpoint_names_are_rank0s(tmp_path):
    """Each process counted the checkpoint_N folders itself when its Accelerator was built:
    rank 1, built before the main process's save was in place, named its next save
    checkpoint_0 while the main process wrote checkpoint_1 (and rank 1 waited the timeout
    for it). Now rank 0's count is every rank's."""
    r0, r1 = _run("acc_auto_dir", tmp_path, launch=True)
    assert r0["first"] == "checkpoint_0"
    assert r0["second"] == r1["second"] == "checkpoint_1", (r0["second"], r1["second"])
    assert "rng_state_1.pt" in r1["files"], r1["files"]     # rank 1's RNG state joined rank 0's save
    assert r1["seconds"] < 15, r1


@pytest.mark.timeout(200)
def test_non_finite_loss_on_one_rank_stops_every_rank_at_the_log_point(tmp_path):
    r0, r1 = _run("nan_rank1", tmp_path)
    assert r1["error"].startswith("NonFiniteLossError: the training loss is nan on rank 1 at global step 4"), r1
    assert r0["error"].startswith("NonFiniteLossError: the training loss is not finite on rank(s) [1] at global "
                                  "step 4"), r0
    assert r0["global_step"] == r1["global_step"] == 3
    assert r0["seconds"] < 15 and r1["seconds"] < 15


@pytest.mark.timeout(200)
def test_prepare_data_failing_on_local_rank0_reaches_every_rank(tmp_path):
    r0, r1 = _run("prepare_data_fails", tmp_path)
    assert r0["error"] == "OSError: [Errno 28] No space left on device: '/data/cache'", r0
    assert r1["error"] == ("DistributedOperationError: prepare_data failed on rank 0 (that node's local rank 0): "
                           "OSError: [Errno 28] No space left on device: '/data/cache'"), r1
    assert r0["seconds"] < 15 and r1["seconds"] < 15      # not the 20 s process-group timeout


@pytest.mark.timeout(200)
def test_lr_find_out_of_memory_on_one_rank_ends_the_run(tmp_path):
    """The learning-rate finder does not retry: an out-of-memory error on rank 1 alone is
    raised there, and the run ends within seconds with that error, not after the timeout."""
    import time
    env = child_env()
    p = subprocess.run([sys.executable, str(SCRIPTS / "agree_paths_ddp.py"), "lr_find_oom", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    ended = time.time()
    assert p.returncode == 1, p.stderr[-4000:]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (rank 1)" in p.stderr
    assert "ember: rank 1 exited with code 1; stopping the other ranks" in p.stderr, p.stderr[-4000:]
    assert ended - float((tmp_path / "failed_at").read_text()) < 15   # not the 20 s process-group timeout
    assert not list(tmp_path.glob("lr_find_oom_*.json"))


@pytest.mark.timeout(200)
def test_train_batches_per_epoch_are_agreed_when_the_loaders_differ(tmp_path):
    """Rank 0's own loader has 8 batches, rank 1's 6 (no distributed sampler): the epoch
    end and the validation points were counted per rank, so rank 0 ran steps 7 and 8
    against rank 1's epoch-end collectives. Now every rank runs the smallest count."""
    r0, r1 = _run("uneven_batches", tmp_path)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["batches"] == r1["batches"] == 6
    assert r0["global_step"] == r1["global_step"] == 12
    assert r0["val_batches"] == r1["val_batches"] == 2 * 2 * 2   # 2 validations per epoch, 2 batches each
    assert r0["weights"] == r1["weights"]
    assert len(r0["warnings"]) == 1 and "rank 0: 8, rank 1: 6" in r0["warnings"][0] and not r1["warnings"]
    assert r0["seconds"] < 15 and r1["seconds"] < 15


@pytest.mark.timeout(200)
def test_a_stream_whose_shards_are_uneven_trains_the_smallest_count_on_every_rank(tmp_path):
    """A Hugging Face stream split over the ranks by whole shards of different lengths:
    the ranks' batches per epoch follow from the shards' lengths, so every rank trains the
    smallest count (before, the rank with more batches waited in a step's all-reduce for
    one that had gone on to the epoch's end)."""
    pytest.importorskip("datasets")
    r0, r1 = _run("uneven_stream", tmp_path)
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r0["batches"] == r1["batches"] == 3 and r0["global_step"] == r1["global_step"] == 6
    assert r0["weights"] == r1["weights"]
    assert len(r0["warnings"]) == 1 and "rank 0: 4, rank 1: 3" in r0["warnings"][0] and not r1["warnings"]
