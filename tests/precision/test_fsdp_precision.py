"""FSDP's one precision path on CPU with gloo (2 processes): under "bf16-mixed" and
"16-mixed" the parameters are all-gathered in the low dtype by FSDP2's
MixedPrecisionPolicy and no autocast runs on top; "32-true" is unchanged."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ember.precision import MixedPrecision, Precision, ShardedMixedPrecision
from helpers import SCRIPTS, quiet_env

pytestmark = pytest.mark.multiproc

SCRIPT = str(SCRIPTS / "fsdp_precision.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdp_precision"))
    env = quiet_env()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        SCRIPT, out], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"

    def get(rank):
        with open(os.path.join(out, f"precision.rank{rank}.json")) as f:
            return json.load(f)
    return get


def test_bf16_mixed_under_fsdp_runs_without_autocast(results):
    for rank in (0, 1):
        r = results(rank)["bf16-mixed"]
        assert r["precision_type"] == "ShardedMixedPrecision" and r["trainer_precision"] == "bf16-mixed"
        assert r["steps"] == 4 and len(r["seen"]) == 4
        for s in r["seen"]:
            assert s["enabled"] is False                      # no autocast inside training_step
            assert s["weights"] == ["torch.bfloat16"]         # FSDP2 all-gathered the blocks in bf16
            assert s["out"] == "torch.bfloat16"
    r = results(0)["bf16-mixed"]
    assert r["equal"], r["max_diff"]      # == fully_shard(mp_policy=bf16/fp32) by hand, no autocast


def test_32_true_under_fsdp_unchanged(results):
    r = results(0)["32-true"]
    assert r["precision_type"] == "Precision"
    assert all(not s["enabled"] and s["weights"] == ["torch.float32"] for s in r["seen"])
    assert r["equal"], r["max_diff"]


def test_16_mixed_keeps_sharded_loss_scaling_without_autocast(results):
    r = results(0)["16-mixed"]
    assert r["precision_type"] == "ShardedMixedPrecision" and r["scaler"] == "ShardedGradScaler"
    assert all(not s["enabled"] and s["weights"] == ["torch.float16"] for s in r["seen"])


def test_accelerator_fsdp_forward_has_no_autocast(results):
    r = results(0)["accelerator"]
    assert r["precision_type"] == "ShardedMixedPrecision" and r["mixed_precision"] == "bf16"
    assert r["autocast_ctx"]["enabled"] is False     # accelerator.autocast() is a no-op under FSDP
    assert r["weights"] == ["torch.bfloat16"] and r["out"] == "torch.bfloat16"


def test_for_sharding_builds_a_new_precision():
    shared = Precision.from_string("bf16-mixed")
    own = shared.for_sharding()
    assert isinstance(own, ShardedMixedPrecision) and own is not shared
    assert own.autocast_dtype is None and own.compute_dtype is torch.bfloat16 and own.name == "bf16-mixed"
    assert shared.autocast_dtype is torch.bfloat16 and type(shared) is MixedPrecision   # left as it was
    with own.forward_context():
        assert not torch.is_autocast_enabled("cpu")
    assert own.for_sharding() is own
