"""Ray Train's ``TorchTrainer`` running an ember Trainer and an Accelerator on Ray's own
process group (2 CPU workers), checkpoints reported to Ray by ``ember.integrations.ray``,
and a resume from a Ray checkpoint passed through ``train_loop_config`` (Ray Train V2
refuses ``resume_from_checkpoint``). Skipped without ``ray[train]``."""
from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray Train is an optional extra: pip install \"ray[train]\"")
pytest.importorskip("ray.train.torch", reason="Ray Train is an optional extra: pip install \"ray[train]\"")

pytestmark = pytest.mark.multiproc


SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


@pytest.fixture(scope="module")
def ray_local():
    path = os.pathsep.join(filter(None, [SCRIPTS, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def _fit(loop, root, name, storage, **config):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    os.makedirs(root, exist_ok=True)
    trainer = TorchTrainer(loop, train_loop_config={"root": str(root), **config},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(name=name, storage_path=str(storage)))
    return trainer.fit()


def _final(root):
    from safetensors.torch import load_file
    return load_file(os.path.join(root, "final.safetensors"))


def _equal(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("loop, names, middle, info", [
    ("trainer_loop", [f"epoch={s // 9}-step={s}" for s in range(2, 17, 2)], "epoch=0-step=8", ["2", "ddp"]),
    ("accelerator_loop", ["epoch_0", "epoch_1"], "epoch_0", ["2", "MULTI_CPU"]),
], ids=["trainer", "accelerator"])
def test_ray_train_reports_checkpoints_and_resumes_from_one(ray_local, tmp_path, loop, names, middle, info):
    """Every committed checkpoint reaches Ray under its own name; a second run resumes from
    a reported checkpoint (not the last one) handed over through train_loop_config (Train V2
    refuses TorchTrainer(resume_from_checkpoint=...)) and ends with the same weights."""
    import sys
    from ray.train import Checkpoint
    sys.path.insert(0, SCRIPTS)
    try:
        import ray_loops
    finally:
        sys.path.remove(SCRIPTS)
    loop = getattr(ray_loops, loop)
    storage = tmp_path / "ray"
    result = _fit(loop, tmp_path / "a", "a", storage)
    assert result.error is None
    assert (tmp_path / "a" / "info.txt").read_text().split() == info     # Ray's 2 workers are 2 ranks
    reported = [os.path.basename(c.path) for c, _ in result.best_checkpoints]
    assert sorted(reported) == sorted(names)
    assert os.path.basename(result.checkpoint.path) == names[-1]
    assert "loss" in result.metrics
    start = Checkpoint(os.path.join(str(storage), "a", middle))
    result = _fit(loop, tmp_path / "b", "b", storage, resume_from=start)
    assert result.error is None
    assert _equal(_final(tmp_path / "b"), _final(tmp_path / "a"))


@pytest.mark.timeout(400)
def test_ray_train_reports_background_saves_once_committed(ray_local, tmp_path):
    """DDPStrategy(async_save=True): ModelCheckpoint keeps a checkpoint before its background
    write commits; RayTrainReport waits for the commit (it failed the fit with
    'report(checkpoint_dir=...): not a folder'), and every checkpoint still reaches Ray."""
    import sys
    sys.path.insert(0, SCRIPTS)
    try:
        import ray_loops
    finally:
        sys.path.remove(SCRIPTS)
    result = _fit(ray_loops.trainer_loop, tmp_path / "a", "a", tmp_path / "ray", async_save=True)
    assert result.error is None, result.error
    names = [f"epoch={s // 9}-step={s}" for s in range(2, 17, 2)]
    assert sorted(os.path.basename(c.path) for c, _ in result.best_checkpoints) == sorted(names)
    assert os.path.basename(result.checkpoint.path) == names[-1]
