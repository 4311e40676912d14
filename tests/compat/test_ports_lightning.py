"""The ports of Lightning's own examples and of the lightning-hydra-template's MNIST example
(tests/ports/lightning/) run on one process and on
2 CPU processes (DDP, gloo, 60 s process-group timeout); on one process the same file run
on Lightning itself (run_with_lightning.py maps the ``ember`` modules to
``lightning.pytorch``'s) gives the same numbers.

The comparison is exact (``==`` on float64 sums of every parameter tensor, test metrics,
prediction sums): no randomness differs (``shuffle=False``, the same seed, noise and
dropout drawn from the global RNG in the same order), both libraries run the same float32
operations in the same order on one thread, and an epoch mean is the same batch-size
weighted sum. On 2 processes the training loaders shuffle (as Lightning's DDP sampler
always does) with ember's Trainer(seed=) set to the seed_everything seed, and the
comparison is exact too."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import ROOT, clean_env

PORTS = ROOT / "tests" / "ports" / "lightning"
pytestmark = pytest.mark.slow

# metrics logged with on_step=True only (or their "_step" part): their value in callback_metrics
# is the last step's, compared on its own in test_port_step_metrics_equal_lightning
STEP_ONLY = {"autoencoder": ["train_loss"], "backbone_image_classifier": ["train_loss_step"],
             "generative_adversarial_net": ["d_loss", "g_loss"], "bug_report_model": ["train_loss"],
             "transformer": ["train_loss"], "hydra_template_mnist": []}
NAMES = sorted(STEP_ONLY)


def run(tmp_path, name: str, lightning: bool = False, devices: int = 1) -> dict:
    """Run port ``name`` in ``tmp_path`` and return what it wrote."""
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(PORTS / f"{name}.py")]
    if lightning:
        cmd.insert(1, str(PORTS / "run_with_lightning.py"))
    env = clean_env(PORT_OUT=str(out), PORT_DEVICES=str(devices), PYTHONPATH=str(ROOT))
    if lightning and name == "hydra_template_mnist":
        # Lightning's checkpoint keeps the module's hparams, here functools.partial factories and the
        # net itself, which torch.load(weights_only=True) (torch's default since 2.6) refuses; the
        # template's test(ckpt_path=best) needs full unpickling on Lightning (ember's never unpickles)
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def on_ember(tmp_path_factory):
    """``on_ember(name, devices=1)``: the port's results on ember, run once per module."""
    cache: dict = {}

    def get(name, devices=1):
        key = (name, devices)
        if key not in cache:
            cache[key] = run(tmp_path_factory.mktemp(f"ember{devices}_{name}"), name, devices=devices)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def on_lightning(tmp_path_factory):
    """``on_lightning(name, devices=1)``: the same port run on Lightning itself, once per module."""
    pytest.importorskip("lightning")
    cache: dict = {}

    def get(name, devices=1):
        key = (name, devices)
        if key not in cache:
            cache[key] = run(tmp_path_factory.mktemp(f"lightning{devices}_{name}"), name, lightning=True,
                             devices=devices)
        return cache[key]
    return get


def without(metrics: dict, names: list[str]) -> dict:
    return {k: v for k, v in metrics.items() if k not in names}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", NAMES)
def test_port_on_one_process_equals_lightning(name, on_ember, on_lightning):
    ember = on_ember(name)
    assert ember["world"] == 1 and ember["params"]
    lit = on_lightning(name)
    assert ember["params"] == lit["params"]            # every weight, after fit
    assert ember.get("test") == lit.get("test")        # test(ckpt_path="best") metrics
    for key in ("prediction0_sum", "n_predictions", "test_accuracy", "grids", "images"):
        assert ember.get(key) == lit.get(key), key
    assert without(ember["fit_metrics"], STEP_ONLY[name]) == without(lit["fit_metrics"], STEP_ONLY[name])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", NAMES)
def test_port_step_metrics_equal_lightning(name, on_ember, on_lightning):
    assert on_ember(name)["fit_metrics"] == on_lightning(name)["fit_metrics"]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", NAMES)
def test_port_on_two_processes(name, on_ember):
    one, two = on_ember(name), on_ember(name, devices=2)
    assert two["world"] == 2
    assert two["params"].keys() == one["params"].keys() and two["params"] != one["params"]   # shuffled, sharded
    assert all(math.isfinite(v) for v in two["params"].values())
    assert [t.keys() for t in two.get("test", [])] == [t.keys() for t in one.get("test", [])]
    if "n_predictions" in one:
        assert two["n_predictions"] == one["n_predictions"] == 297   # the whole test set, gathered, no padding
    assert without(two["fit_metrics"], STEP_ONLY[name]).keys() == without(one["fit_metrics"], STEP_ONLY[name]).keys()


# (not the GAN and the transformer: ember's Trainer(seed=), which gives the sampler Lightning's
# seed, re-seeds the global RNG after the model is built, so their noise and dropout differ)
@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["autoencoder", "backbone_image_classifier", "bug_report_model"])
def test_port_on_two_processes_equals_lightning(name, on_ember, on_lightning):
    ember = on_ember(name, devices=2)
    lit = on_lightning(name, devices=2)
    assert lit["world"] == 2
    assert ember["params"] == lit["params"]            # same shuffled shards, same averaged gradients
    assert ember.get("test") == lit.get("test")        # rank 0's test metrics (logged without sync_dist)
    # predict: ember returns the whole test set on every rank (gathered, in order), Lightning each rank's shard
    assert ember.get("n_predictions", 297) == 297 and lit.get("n_predictions", 149) == 149
    assert without(ember["fit_metrics"], STEP_ONLY[name]) == without(lit["fit_metrics"], STEP_ONLY[name])


@pytest.mark.timeout(400)
def test_hydra_template_equals_lightning_in_every_number(on_ember, on_lightning):
    """The lightning-hydra-template's MNIST example: every fit and test metric, the best
    checkpoint's name and weights, and hparams.yaml (the hyperparameters the template logs by
    hand on trainer.loggers before fit; the module and datamodule use save_hyperparameters(
    logger=False)) equal Lightning's."""
    ember, lit = on_ember("hydra_template_mnist"), on_lightning("hydra_template_mnist")
    assert ember == lit
    assert set(ember["hparams_yaml"]) == {"model", "model/params/total", "model/params/trainable",
                                          "model/params/non_trainable", "data", "trainer", "callbacks", "extras",
                                          "task_name", "tags", "ckpt_path", "seed"}
    assert ember["epochs"] == 3 and ember["best"].startswith("epoch_")


@pytest.mark.timeout(400)
def test_dqn_port_trains_on_the_same_experiences_as_lightning(on_ember, on_lightning):
    """Lightning's DQN example (reinforce_learn_qnet.py): its replay sampling and
    epsilon-greedy policy draw from python's global ``random`` during the fit, so any draw
    by the library (a progress bar or logger imported for the first time) changes what it
    trains on. The weights of both nets, the rewards, the replay buffer and the next draw
    of python's, numpy's and torch's global generators equal Lightning's."""
    ember = on_ember("reinforce_learn_qnet")
    assert ember["world"] == 1 and ember["global_step"] == 8 * 13   # 8 epochs of 200 experiences, batches of 16
    assert ember["buffer_len"] == 1000 and all(math.isfinite(v) for v in ember["params"].values())
    lit = on_lightning("reinforce_learn_qnet")
    assert ember == lit
