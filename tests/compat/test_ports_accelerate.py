"""The ports of Accelerate's example patterns (tests/ports/accelerate/by_feature.py) and of
transformers' run_clm_no_trainer.py on a streaming dataset (clm_streaming.py) run on one
process and under ``ember launch --num_processes 2 --cpu``; on one process the same files
run on Accelerate itself print the same metrics."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import PORTS, ROOT, clean_env

PORT = PORTS / "accelerate" / "by_feature.py"
pytestmark = pytest.mark.slow


def run(tmp_path, name, *prefix, port=PORT, **env):
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, *prefix, str(port), str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=400, env=clean_env(PORT_CKPT_DIR=str(tmp_path / f"ck_{name}"), **env))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def ember_one(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ember1"), "ember1")


@pytest.mark.timeout(450)
def test_ports_on_one_process_equal_accelerate(ember_one, tmp_path):
    pytest.importorskip("accelerate")
    acc = run(tmp_path, "accelerate", str(PORTS / "accelerate" / "run_with_accelerate.py"))
    # find_executable_batch_size: 10% off after each out-of-memory error, as Accelerate
    assert ember_one["memory"]["tried"] == [32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]
    assert ember_one == acc
    # shuffle=True, set_seed after Accelerator(), each pass left at a step limit: Accelerate's order
    shuffled = ember_one["shuffled_passes"]
    assert shuffled["same_twice"] and len({tuple(r) for r in shuffled["first_rows"]}) == 3
    assert ember_one["checkpointing"]["resumed"] == ember_one["checkpointing"]["uninterrupted"]


@pytest.mark.multiproc
@pytest.mark.timeout(450)
def test_ports_on_two_processes(tmp_path):
    two = run(tmp_path, "ember2", "-m", "ember", "launch", "--num_processes", "2", "--cpu",
              "--num_cpu_threads_per_process", "1")
    assert two["nlp_example"]["world"] == 2
    for name in ("nlp_example", "gradient_accumulation", "tracking", "multi_process_metrics", "memory",
                 "automatic_gradient_accumulation", "local_sgd"):
        assert two[name]["n_eval"] == 36, name        # exactly the evaluation set, no padding duplicates
    assert two["checkpointing"]["resumed"] == two["checkpointing"]["uninterrupted"]
    assert two["early_stopping"]["stopped_after"] == 3 and two["cross_validation"]["n_test"] == 20
    assert two["shuffled_passes"]["same_twice"] and len({tuple(r) for r in two["shuffled_passes"]["first_rows"]}) == 3
    assert two["memory"]["tried"] == [32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8] and two["automatic_gradient_accumulation"]["gas"] == 2


CLM = PORTS / "accelerate" / "clm_streaming.py"
LAUNCH2 = ("-m", "ember", "launch", "--num_processes", "2", "--cpu", "--num_cpu_threads_per_process", "1")


@pytest.mark.timeout(450)
def test_clm_streaming_on_one_process_equals_accelerate(tmp_path):
    """A Hugging Face stream (4 shards, tokenised and grouped with .map, shuffled through a
    buffer), accumulate, get_scheduler, gather_for_metrics, save_state every 3 steps: every
    loss, perplexity and weight equals Accelerate's; resumed from step_3 (load_state, then
    skip_first_batches), ember continues the uninterrupted run to the last bit."""
    pytest.importorskip("accelerate")
    ember = run(tmp_path, "clm_ember", port=CLM)
    acc = run(tmp_path, "clm_accelerate", str(PORTS / "accelerate" / "run_with_accelerate.py"), port=CLM)
    done = ember["uninterrupted"]
    assert done["world"] == 1 and done["completed_steps"] == 12 and len(done["train_losses"]) == 16 + 8
    assert done["eval_counts"] == [16, 16] and done["perplexities"][1] < done["perplexities"][0]
    assert done == acc["uninterrupted"]
    resumed = ember["resumed"]
    assert resumed["train_losses"] == done["train_losses"][6:]   # step_3: 3 steps of 2 batches were done
    assert resumed["params"] == done["params"] and resumed["perplexities"] == done["perplexities"]


@pytest.mark.multiproc
@pytest.mark.timeout(450)
def test_clm_streaming_on_two_processes(tmp_path):
    """Each process reads two of the four shards (8 batches an epoch, 4 steps); the
    evaluation gathers exactly the 16 blocks; the resume from step_3 is exact."""
    two = run(tmp_path, "clm_ember2", *LAUNCH2, port=CLM)
    done = two["uninterrupted"]
    assert done["world"] == 2 and done["completed_steps"] == 8 and len(done["train_losses"]) == 2 * 8
    assert done["eval_counts"] == [16, 16]
    assert two["resumed"]["train_losses"] == done["train_losses"][6:]
    assert two["resumed"]["params"] == done["params"] and two["resumed"]["perplexities"] == done["perplexities"]
