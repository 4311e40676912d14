"""FSDPStrategy (FSDP2) on CPU with gloo: real process groups, real DCP checkpoints.

One module-scoped fixture runs tests/scripts/shard_fsdp.py three times (world 1,
world 2 under torchrun, world 1 again); the tests read the per-check results."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ember.errors import MisconfigurationError
from helpers import SCRIPTS, quiet_env

pytestmark = pytest.mark.multiproc

SCRIPT = str(SCRIPTS / "shard_fsdp.py")


def _run(args, timeout=240):
    r = subprocess.run(args, env=quiet_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp"))
    _run([sys.executable, SCRIPT, out, "w1"])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          SCRIPT, out, "w2"])
    _run([sys.executable, SCRIPT, out, "w1b"])

    def get(name, rank=0):
        with open(os.path.join(out, f"{name}.rank{rank}.json")) as f:
            return json.load(f)
    get.dir = out
    return get


def test_training_matches_single_process_reference(results):
    r0, r1 = results("reference", 0), results("reference", 1)
    assert r0["world"] == 2
    assert r0["param_types"] == ["DTensor"]
    assert r0["local_numel"] + r1["local_numel"] == r0["full_numel"]     # each parameter split over ranks
    assert r0["max_diff"] < 1e-5
    assert r0["val_loss"] == pytest.approx(r0["val_expected"], rel=1e-5)     # validation loop under FSDP


def test_commit_checks_every_ranks_shard(results):
    for rank in (0, 1):
        r = results("shard_commit", rank)
        assert r["error"] is not None and "rank 1's shard __1_0.distcp is missing" in r["error"], r
        assert r["committed"] is False
    assert results("shard_commit")["listed"] == ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp",
                                                 "trainer_state.pt"]


def test_exception_drops_a_pending_async_save(results):
    for rank in (0, 1):
        r = results("async_dropped", rank)
        assert r["error"] == "boom after the save started"
        assert r["committed"] is False and r["warned"] is True


def test_async_save_with_top_k_keeps_a_complete_checkpoint(results):
    """A save's commit waits for the next save: until then the checkpoint it supersedes
    stays and 'last' names it (it used to be deleted, and 'last' moved, at once)."""
    r = results("async_topk")
    seen = {step: (complete, last) for step, complete, last in r["seen"]}
    assert seen[2] == ([], None)                       # the step-1 save is not committed yet
    for step in (3, 4):                                # the step-(k-2) save is committed, k-1 pending
        assert seen[step] == ([step - 2], step - 2), r["seen"]
    assert r["final"] == [4] and r["last"] == 4


def test_accumulation_keeps_gradients_sharded_by_default(results):
    r = results("accumulation")
    # mid-window, every parameter already holds its reduce-scattered shard of the gradient
    assert r["sharded"]["grad_numel_mid_window"] == r["local_numel"]
    assert r["unsharded"]["grad_numel_mid_window"] == 0     # full gradients stay inside FSDP
    assert r["sharded"]["max_diff"] < 1e-5 and r["unsharded"]["max_diff"] < 1e-5


def test_activation_checkpointing_and_cpu_offload(results):
    r = results("ac_offload")
    assert r["max_diff"] < 1e-5
    assert r["block_calls_per_micro_batch"] == 4         # 2 blocks, each recomputed in backward
    assert r["plain_block_calls_per_micro_batch"] == 2


def test_resume_from_sharded_checkpoint_is_bit_identical(results):
    r = results("resume")
    assert r["bit_identical"] and r["optim_identical"]
    assert r["global_step"] == 6
    assert r["files"] == ["meta.json", "model", "trainer_state.pt"]
    assert ".metadata" in r["dcp_files"] and len([f for f in r["dcp_files"] if f.endswith(".distcp")]) == 2
    assert r["leftover_tmp"] == []
    assert r["meta"] == {"strategy": "fsdp", "world_size": 2, "module_class": "shard_common.Net",
                         "sharded": True, "state_dict_type": "sharded"}


def test_load_from_checkpoint_consolidates_a_sharded_checkpoint(results):
    """Module.load_from_checkpoint on an FSDP (DCP) checkpoint, in this process: the
    hparams rebuild the module and the weights equal the ones the two ranks trained
    (gathered by the strategy at the end of fit, independently of the checkpoint)."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import shard_common as sc
    finally:
        sys.path.pop(0)
    trained = torch.load(os.path.join(results.dir, "resume_final_full.pt"), weights_only=True)
    final = os.path.join(results.dir, "resume_ckpts", "step=6")
    module = sc.Net.load_from_checkpoint(final, lr=0.5)
    assert module.hparams.lr == 0.5 and module.hparams.opt == "adamw"
    state = module.state_dict()
    assert set(state) == set(trained) and all(torch.equal(state[k], trained[k]) for k in trained)
    # and a mid-run checkpoint is a different point of the run
    mid = sc.Net.load_from_checkpoint(os.path.join(results.dir, "resume_ckpts", "step=3")).state_dict()
    assert not all(torch.equal(mid[k], trained[k]) for k in trained)


def test_world1_checkpoint_resumes_at_world2(results):
    r = results("from_world1")
    assert r["world"] == 2 and r["weights_equal"] and r["optim_equal"]
    assert r["global_step"] == 3


def test_world2_checkpoint_resumes_at_world1(results):
    r = results("from_world2")
    assert r["world"] == 1 and r["weights_equal"] and r["optim_equal"]
    assert r["global_step"] == 4


def test_single_device_checkpoint_loads_into_fsdp(results):
    r = results("from_single")
    assert r["weights_equal"] and r["optim_equal"]          # index-keyed optimizer state mapped to names
    assert r["optim_step"] == r["single_step"] == [2.0]


def test_mixed_precision_trains(results):
    for prec, r in results("mixed").items():
        assert r["finite"], prec
        assert r["last"] < 0.8 * r["first"], (prec, r)
        # mixed: the sharded (master) weights stay fp32; true: the module is converted
        assert r["param_dtypes"] == (["torch.bfloat16"] if prec == "bf16-true" else ["torch.float32"]), prec


def test_full_state_dict_type_checkpoint(results):
    r = results("full_type")
    assert r["files"] == ["meta.json", "model.safetensors", "trainer_state.pt"]
    assert r["weights_equal"] and r["optim_equal"]


def test_full_export_loads_into_plain_module(results):
    r = results("export")
    assert r["files"] == ["model.safetensors"]
    assert r["max_out_diff"] < 1e-6
    assert r["weights_only_matches_export"]


def test_each_rank_holds_half_of_params_and_optimizer_state(results):
    for rank in (0, 1):
        r = results("memory", rank)
        assert r["param_bytes"] == pytest.approx(r["full_param_bytes"] / 2, rel=0.05)
        assert r["optim_bytes"] == pytest.approx(2 * r["full_param_bytes"] / 2, rel=0.05)   # AdamW: 2 states


def test_accelerator_prepare_remaps_optimizer_and_async_save(results):
    r = results("accelerator")
    assert r["type"] == "FSDPStrategy"
    assert r["opt_param_types"] == ["DTensor"]          # optimizer built before sharding now holds the shards
    assert r["max_diff"] < 1e-5
    assert r["async_was_pending"] and r["async_matches_save_time"]
    assert r["load_state_restores"]


def test_world1_fsdp_and_missing_reset_parameters(results):
    r = results("w1")
    assert r["world"] == 1 and "world_size=1" in r["strategy"]   # FSDP on one process (a 1-rank group)
    assert r["files"] == ["meta.json", "model", "trainer_state.pt"]
    assert "reset_parameters()" in r["no_reset_error"] and "blocks.1 (Scale)" in r["no_reset_error"]
    assert "init_on_meta=False" in r["no_reset_error"]


def test_configure_model_on_meta_device(results):
    r = results("meta_init")
    assert r["meta_left"] == []
    assert r["finite"] and r["inp_kept"]                 # layers built in __init__ keep their values
    assert r["max_abs"] <= 0.25 and r["bias_max_abs"] <= 0.25 and 0.1 < r["std"] < 0.2   # nn.Linear(16,16) init
    assert r["halves_differ"]                            # shards are slices of one init, not copies
    assert r["last"] < r["first"]


# -- in-process argument checks (no process group needed) -------------------------------
def test_bad_arguments_are_clear_errors():
    from ember.strategies import FSDPStrategy
    with pytest.raises(MisconfigurationError, match="state_dict_type"):
        FSDPStrategy(state_dict_type="partial")
    with pytest.raises(MisconfigurationError, match="auto_wrap_policy"):
        FSDPStrategy(auto_wrap_policy={int})
    with pytest.raises(MisconfigurationError, match="activation_checkpointing=True"):
        FSDPStrategy(auto_wrap_policy=False, activation_checkpointing=True)
    FSDPStrategy(activation_checkpointing=True)      # with the default "auto": the detected blocks
    with pytest.raises(MisconfigurationError, match="not both"):
        FSDPStrategy(hsdp=(2, 1), device_mesh=(2, 1))
    with pytest.raises(MisconfigurationError, match="hsdp=\\(2, 4\\)"):
        FSDPStrategy(hsdp=(2, 0))
    with pytest.raises(MisconfigurationError, match="auto_wrap_policy"):
        FSDPStrategy(auto_wrap_policy="blocks")
    with pytest.raises(MisconfigurationError, match="fully_shard"):
        FSDPStrategy(no_such_option=1)
    with pytest.raises(MisconfigurationError, match="MixedPrecisionPolicy"):
        FSDPStrategy(mixed_precision="bf16")


def test_launcher_environment_defaults(monkeypatch):
    from ember.strategies import FSDPStrategy, build_strategy
    monkeypatch.setenv("EMBER_FSDP_CPU_OFFLOAD", "1")
    monkeypatch.setenv("EMBER_FSDP_RESHARD_AFTER_FORWARD", "0")
    s = build_strategy("fsdp", "cpu")
    assert isinstance(s, FSDPStrategy) and s.is_sharded and s.name == "fsdp"
    assert s.cpu_offload and not s.reshard_after_forward
    s = FSDPStrategy(cpu_offload=False, reshard_after_forward=True)
    assert not s.cpu_offload and s.reshard_after_forward
