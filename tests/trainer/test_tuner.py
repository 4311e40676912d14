"""ember.tuner: the learning-rate finder (exact restore, DDP agreement) and the
batch-size finder."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import ember
import ember.tuner
from ember.errors import MisconfigurationError
from ember.loggers import CSVLogger

from conftest import LinearModule, regression_data
from helpers import rank_results, run_ranks


class MomentumLinear(LinearModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _good_lr(ds) -> float:
    """1 / largest eigenvalue of the MSE loss's Hessian for a linear model with bias."""
    x = torch.cat([ds.tensors[0], torch.ones(len(ds), 1)], 1)
    return 1.0 / torch.linalg.eigvalsh(2.0 / len(ds) * x.T @ x).max().item()


def test_lr_find_suggests_a_good_lr_and_restores_everything(tmp_path, make_trainer):
    ember.seed_everything(0)
    ds = regression_data(n=512, dim=8)
    loader = DataLoader(ds, batch_size=32, shuffle=True)
    # plain SGD on a fresh linear regression: the best lr is 1 / (largest Hessian eigenvalue)
    result = ember.tuner.lr_find(make_trainer(), LinearModule(dim=8), loader, min_lr=1e-5, max_lr=10.0,
                                 num_training=80)
    good = _good_lr(ds)
    sug = result.suggestion()
    assert good / 10 <= sug <= good * 10, (sug, good)
    assert len(result.lrs) == len(result.losses) == len(result.raw_losses) > 20
    assert result.lrs[0] == pytest.approx(1e-5) and result.lrs[1] / result.lrs[0] == pytest.approx(10 ** (6 / 79))
    png = result.plot(str(tmp_path / "lr.png"))
    assert open(png, "rb").read(4) == b"\x89PNG"

    # after a fit (momentum state, logs, a checkpoint), lr_find leaves everything as it was
    trainer = ember.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                            enable_model_summary=False, devices="cpu", default_root_dir=tmp_path, log_every_n_steps=4)
    module = MomentumLinear(dim=8, lr=0.01)
    trainer.fit(module, loader)   # optimizer with momentum state, logs, a checkpoint
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    opt = trainer.optimizers[0]
    opt_state = {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}
    groups = [dict(g) for g in opt.state_dict()["param_groups"]]
    attrs = dict(trainer.__dict__)
    metrics = dict(trainer.callback_metrics)
    csv_before = (Path(trainer.log_dir) / "metrics.csv").read_text()
    rng = torch.get_rng_state()

    result = ember.tuner.lr_find(trainer, module, loader, min_lr=1e-5, max_lr=10.0, num_training=40)
    assert result.suggestion() is not None
    # bit-identical weights, optimizer state, RNG; the trainer's attributes are the same objects
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())
    assert opt is trainer.optimizers[0]
    assert all(torch.equal(opt_state[k], v["momentum_buffer"]) for k, v in opt.state_dict()["state"].items())
    assert opt.state_dict()["param_groups"] == groups
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in attrs.items():
        assert trainer.__dict__[k] is v, k
    assert set(trainer.__dict__) == set(attrs)
    assert trainer.callback_metrics == metrics and trainer.global_step == 16
    assert (Path(trainer.log_dir) / "metrics.csv").read_text() == csv_before   # nothing logged


def test_lr_find_stops_when_the_loss_diverges(make_trainer):
    ember.seed_everything(0)
    loader = DataLoader(regression_data(n=256, dim=8), batch_size=32, shuffle=True)
    result = ember.tuner.lr_find(make_trainer(), LinearModule(dim=8), loader, min_lr=1e-3, max_lr=1e3,
                                 num_training=100)
    assert result.diverged and len(result.lrs) < 100 and len(result.lrs) % 10 == 0
    with pytest.raises(MisconfigurationError, match="mode"):
        ember.tuner.lr_find(make_trainer(), LinearModule(), loader, mode="cosine")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_lr_find_same_suggestion_on_every_rank(tmp_path):
    run_ranks("tuner_ddp.py", tmp_path, timeout=150)
    r0, r1 = rank_results(tmp_path, name="lr_rank{}")
    assert r0["suggestion"] is not None and r0["suggestion"] == r1["suggestion"]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) > 20
    assert r0["local_first_loss"] != r1["local_first_loss"]   # the ranks saw different data
    assert r0["restored"] and r1["restored"]
    assert r0["fit_steps"] == r1["fit_steps"] == 512 // 16 // 2   # a full epoch after lr_find


class SizedModule(LinearModule):
    """Its train_dataloader reads ``self.batch_size``; a batch above ``limit`` raises an OOM error."""

    def __init__(self, limit=None):
        super().__init__(dim=4)
        self.batch_size, self.limit, self.seen = 2, limit, []

    def train_dataloader(self):
        return DataLoader(regression_data(n=512), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        n = len(batch[0])
        self.seen.append(n)
        if self.limit is not None and n > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return super().training_step(batch, batch_idx)


def test_scale_batch_size_power_and_binsearch(make_trainer, frozen_heap):
    trainer, module = make_trainer(max_epochs=1), SizedModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    # CPU: a user-given bound; the largest power of two within it
    assert ember.tuner.scale_batch_size(trainer, module, max_val=100) == 64
    assert module.batch_size == 64 and sorted(set(module.seen)) == [2, 4, 8, 16, 32, 64]
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert trainer.global_step == 0 and trainer.optimizers == []
    # an out-of-memory error ends the doubling; binsearch then bisects
    module = SizedModule(limit=48)
    assert ember.tuner.scale_batch_size(trainer, module, mode="power") == 32
    module = SizedModule(limit=48)
    assert ember.tuner.scale_batch_size(trainer, module, mode="binsearch") == 48
    assert {48, 49, 56, 64} <= set(module.seen) and max(module.seen) == 64 and module.batch_size == 48
    # other errors are not swallowed; the attribute goes back
    module = SizedModule(limit=0)
    module.training_step = lambda batch, idx: 1 / 0
    with pytest.raises(ZeroDivisionError):
        ember.tuner.scale_batch_size(trainer, module)
    assert module.batch_size == 2
    with pytest.raises(MisconfigurationError, match="even batch size 2"):
        ember.tuner.scale_batch_size(trainer, SizedModule(limit=1))
    assert ember.tuner.is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert not ember.tuner.is_oom_error(ValueError("out of memory"))
