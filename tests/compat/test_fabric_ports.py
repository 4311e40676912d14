"""The ports of Lightning Fabric's own examples (tests/ports/fabric/) run on one process
and on 2 CPU processes (DDP, gloo, 60 s process-group timeout), and the same files run on
Lightning Fabric itself (run_with_fabric.py maps the ``ember`` names to
``lightning.fabric``'s) give the same numbers: every weight, every printed loss, the
test losses and accuracies, to the last bit (``==`` on float64 sums)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import ROOT, clean_env

PORTS = ROOT / "tests" / "ports" / "fabric"
NAMES = ["image_classifier", "language_model", "trainer_loop", "dcgan"]
pytestmark = pytest.mark.slow


def run(tmp_path, name: str, fabric: bool = False, devices: int = 1) -> dict:
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(PORTS / f"{name}.py")]
    if fabric:
        cmd.insert(1, str(PORTS / "run_with_fabric.py"))
    if name == "image_classifier":
        cmd.append("--save-model")
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                       env=clean_env(PORT_OUT=str(out), PORT_DEVICES=str(devices), PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(name, devices=1, fabric=False)``: a port's numbers, each run once per module."""
    cache: dict = {}

    def get(name, devices=1, fabric=False):
        key = (name, devices, fabric)
        if fabric:
            pytest.importorskip("lightning")
        if key not in cache:
            cache[key] = run(tmp_path_factory.mktemp(f"{'fabric' if fabric else 'ember'}{devices}_{name}"), name,
                             fabric=fabric, devices=devices)
        return cache[key]
    return get


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", NAMES)
def test_port_on_one_process_equals_lightning_fabric(name, results):
    ember = results(name)
    assert ember["world"] == 1 and ember["params"] and len(ember["train_losses"]) >= 3
    assert ember == results(name, fabric=True)


@pytest.mark.timeout(500)
def test_save_and_load_restore_the_model_in_place(results):
    ember = results("image_classifier")
    assert ember["reloaded"] == {"params": ember["params"], "epoch": 1, "lr": ember["reloaded"]["lr"]}
    assert ember["reloaded"]["lr"] == pytest.approx(1.0 * 0.7)   # the StepLR-decayed rate, restored


@pytest.mark.multiproc
@pytest.mark.timeout(500)
def test_image_classifier_on_two_processes_equals_lightning_fabric(results):
    ember = results("image_classifier", devices=2)
    assert ember["world"] == 2 and ember["n_train_batches"] == 12   # 1500 samples over 2 ranks, batches of 64
    assert ember["reloaded"]["params"] == ember["params"]
    assert ember == results("image_classifier", devices=2, fabric=True)


@pytest.mark.multiproc
@pytest.mark.timeout(500)
def test_language_model_on_two_processes(results):
    one, two = results("language_model"), results("language_model", devices=2)
    assert two["world"] == 2 and two["params"].keys() == one["params"].keys() and two["params"] != one["params"]
    assert all(math.isfinite(v) for v in two["params"].values()) and two["val_losses"][-1] < two["val_losses"][0]
    # shuffled under DDP: each epoch's order is Fabric's DistributedSampler permutation (seed 42 + epoch),
    # and the loader draws from the global RNG what Fabric's does (the dropout after it is the same)
    fabric = results("language_model", devices=2, fabric=True)
    assert two["first_batches"] == fabric["first_batches"] and len(set(two["first_batches"])) == 2
    assert two == fabric


@pytest.mark.multiproc
@pytest.mark.timeout(500)
def test_trainer_loop_on_two_processes_equals_lightning_fabric(results):
    """build_your_own_trainer's and litgpt's patterns under DDP: a shuffled pass left early (a new
    order each pass), init_module(empty_init=True), training_step through the wrapped model
    (through DDP's forward, autocast, outputs in float32), ThroughputMonitor(fabric), save."""
    ember = results("trainer_loop", devices=2)
    assert ember["world"] == 2 and len(set(map(tuple, ember["first_batches"]))) == 3
    assert ember["out_dtypes"] == ["torch.float32"] and ember["unwrapped"] == ["DistributedDataParallel", "AdamW"]
    assert ember == results("trainer_loop", devices=2, fabric=True)


@pytest.mark.multiproc
@pytest.mark.timeout(500)
def test_dcgan_on_two_processes_equals_lightning_fabric(results):
    """Two set-up models and optimizers, three backward calls per iteration (one through both
    models), BatchNorm buffers broadcast by DDP, a shuffled loader read once before setup."""
    ember = results("dcgan", devices=2)
    assert ember["world"] == 2 and ember["n_train_batches"] == 15   # 1797 samples over 2 ranks, batches of 64
    assert len(ember["train_losses"]) == 30 and ember["params"] != results("dcgan")["params"]
    assert ember == results("dcgan", devices=2, fabric=True)
