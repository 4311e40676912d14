"""Accelerator with two real processes (gloo, CPU), started by torchrun and by
``ember launch``: training equals one process with the global batch, exact
gather_for_metrics, collectives, process ordering, debug mode, a bit-identical
resume, the GAN example. The scripts live in tests/scripts/acc_*.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ember.strategies.environments import find_free_port
from helpers import ROOT, SCRIPTS, clean_env, compare_finals

pytestmark = pytest.mark.multiproc
TIMEOUT = 240   # a hang guard; a healthy launch takes seconds


def launch(how, script, *args, tmp_path, check=True, **env):
    if how == "torchrun":
        cmd = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(find_free_port())]
    else:
        cmd = ["-m", "ember", "launch", "--num-processes", "2"]
    out = subprocess.run([sys.executable, *cmd, str(script), *map(str, args)], cwd=ROOT, capture_output=True,
                         text=True, timeout=TIMEOUT,
                         env=clean_env(XDG_CONFIG_HOME=str(tmp_path / "xdg"), **env))
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out


def ranks(out_dir):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_processes_torchrun(tmp_path):
    launch("torchrun", SCRIPTS / "acc_ddp.py", tmp_path, tmp_path=tmp_path)
    r0, r1 = ranks(tmp_path)
    for r, res in enumerate((r0, r1)):
        assert res["rank"] == r and res["world"] == 2 and res["local_rank"] == r
        assert res["main"] == res["local_main"] == (r == 0)
        # per-rank batch 8 on 2 processes == one process with batch 16 (also accumulating 2 batches)
        for gas in (1, 2):
            assert res[f"max_diff_gas{gas}"] < 1e-5
            assert res[f"syncs_gas{gas}"] == 4 // gas
            # the scheduler advances num_processes times per optimizer step
            assert res[f"sched_steps_gas{gas}"] == res[f"ref_sched_steps_gas{gas}"] == 2 * 4 // gas
        # exactly the 1001 samples, in dataset order (the sampler's padding sample dropped)
        assert res["gfm_shuffleFalse"] == list(range(1001))
        assert sorted(res["gfm_shuffleTrue"]) == list(range(1001)) and res["gfm_shuffleTrue"] != list(range(1001))
        first, second = res["gfm_rank_seeds"]   # seeded differently per rank: still one order, new each pass
        assert sorted(first) == sorted(second) == list(range(1001)) and first != second
        assert res["gfm_dict_pred"] == [2 * i for i in range(1001)]
        assert res["gfm_dict_ids"] == [f"s{i}" for i in range(1001)]
        assert res["reduce_sum"] == [3.0] and res["reduce_mean"] == [1.5] and res["reduce_max"] == [6.0]
        assert res["reduce_scale"] == [1.5]
        assert res["gather_ragged"] == [[0, 0], [1, 1], [1, 1]] and res["gather_scalar"] == [0, 10]
        assert res["broadcast_tensor"] == [5.0] and res["broadcast_obj"] == {"from": 1}
        assert res["gather_object"] == ["r0", "r1"]
        assert res["trigger"] is True and res["trigger_again"] is False
        assert res["marker_seen_in_body"] and res["local_marker_seen_in_body"]
        assert res["tracker_null"]
    assert r0["pad"] == [[1.0, 1.0, -1.0]] * 2 and r1["pad"] == [[1.0, 1.0, 1.0]] * 2
    assert r0["pad_first"] == [0.0, 1.0] and r1["pad_first"] == [1.0, 1.0]
    assert r0["split_list"] == [0, 1, 2] and r1["split_list"] == [3, 4]
    assert r0["split_tensor_padded"] == [0, 1, 2] and r1["split_tensor_padded"] == [3, 4, 4]
    assert r0["split_dict"] == {"a": [1, 2], "b": [4, 5]} and r1["split_dict"] == {"a": [3], "b": [6]}
    assert (r0["on_main"], r1["on_main"]) == ("ran", None)
    assert (r0["on_local_main"], r1["on_local_main"]) == ("ran", None)
    # save_model: sharded by the main process only; trackers: one CSV run written by the main process
    assert len(r0["saved_files"]) == 3 and r1["saved_files"] == []
    from ember.checkpoint import io as cio
    assert set(cio.load_model_sharded(tmp_path / "export")) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert os.listdir(tmp_path / "proj") == ["version_0"]
    assert (tmp_path / "proj" / "version_0" / "metrics.csv").read_text().splitlines()[1].startswith("3,")


def test_debug_mode_reports_mismatched_collectives_instead_of_hanging(tmp_path):
    launch("torchrun", SCRIPTS / "acc_debug.py", tmp_path, tmp_path=tmp_path, EMBER_DEBUG="1")
    r0, r1 = ranks(tmp_path)
    assert r0["debug"] and r1["debug"]
    assert r0["errors"] == r1["errors"]   # every rank raises the same error
    errs = r0["errors"]
    assert "rank 0: gather(float32[3, 4])" in errs["gather_shape"]
    assert "rank 1: gather(float32[3, 5])" in errs["gather_shape"]
    assert "rank 1: gather(int64[3])" in errs["gather_dtype"]
    assert "different operations" in errs["different_ops"] and "rank 1: reduce:sum(float32[2])" in errs["different_ops"]
    assert "rank 1: reduce:sum(float32[3])" in errs["reduce_shape"]
    assert "rank 1: broadcast(float32[2])" in errs["broadcast_shape"]
    assert "except in dimension 1" in errs["pad_other_dim"]
    assert "rank 0: wait_for_everyone()" in errs["barrier_vs_gather"]
    assert r0["gather_ragged"] == 3 and r0["pad_ok"] == [2, 2] and r0["gfm"] == ["x0", "x1"]
    # uncaught: the run ends promptly with the error (the timeout above guards against a hang)
    out = launch("ember", SCRIPTS / "acc_debug.py", tmp_path, "--uncaught", tmp_path=tmp_path, check=False,
                 EMBER_DEBUG="1")
    assert out.returncode != 0
    assert "DistributedOperationError" in out.stderr and "rank 1: gather(float32[3, 5])" in out.stderr


def test_resume_two_processes_16_mixed_ember_launch(tmp_path):
    launch("ember", SCRIPTS / "acc_resume.py", tmp_path, "full", "--precision", "16-mixed", tmp_path=tmp_path)
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    # the main process's RNG state inside, the other rank's beside it (no collective in save_state)
    assert len(state["rng"]) == 1 and state["dataloaders"][0]["batches_done"] == 4
    assert (tmp_path / "ckpt" / "rng_state_1.pt").is_file()
    launch("ember", SCRIPTS / "acc_resume.py", tmp_path, "resume", "--precision", "16-mixed", tmp_path=tmp_path)
    final = compare_finals(tmp_path)
    assert final["batches"] == 2 * 7 and final["skipped"] > 0


def test_gan_example_two_processes(tmp_path):
    out = launch("ember", ROOT / "examples" / "gan_digits.py", "--steps", "20", "--log-every", "10",
                 tmp_path=tmp_path)
    assert "2 process(es)" in out.stdout
    assert [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("step")] == ["10", "20"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_save_state_on_the_main_process_only(tmp_path, mode):
    """``if accelerator.is_main_process: accelerator.save_state(dir)``: under DDP the main
    process writes the checkpoint without any collective and both ranks go on (a save on
    every rank adds each rank's RNG state); under FSDP the main process raises at once
    (a call whose guard is hidden in a helper raises after the 5 s strategy timeout)."""
    launch("ember", SCRIPTS / "acc_main_only_save.py", tmp_path, mode, tmp_path=tmp_path)
    r0, r1 = (json.loads((tmp_path / f"{mode}_rank{r}.json").read_text()) for r in (0, 1))
    if mode == "ddp":
        assert r0["after_main_only"] == r1["after_main_only"]
        assert r0["main_only_s"] < 10
        assert r0["files_main_only"] == ["meta.json", "model.safetensors", "trainer_state.pt"]
        assert "rng_state_1.pt" in r1["files_every_rank"]
        for r in (r0, r1):
            assert r["restored_equal"] and r["rng_after_load"] == r["rng_expected"]
        assert r0["rng_expected"] != r1["rng_expected"]
    else:
        assert "must be called on every process" in r0["error"] and r0["error_s"] < 2
        assert "1 of 2 called it within 5 s" in r0["helper_error"] and r0["helper_error_s"] < 30
        assert not r0["exists"] and "error" not in r1
        # the target check is rank 0's: its refusal reaches rank 1, which would not refuse alone
        assert r0["refused"].startswith("CheckpointError: ") and "is not an ember checkpoint" in r0["refused"]
        assert r1["refused"].startswith("CheckpointError: checkpoint ") and "rank 0" in r1["refused"], r1
        assert r0["refused_s"] < 4 and r1["refused_s"] < 4   # not the 5 s timeout
