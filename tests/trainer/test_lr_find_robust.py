"""lr_find on the docs' own example (docs/tools.md), over several seeds: a diverging loss
ends the sweep where Lightning's early_stop_threshold would, a loss that turns NaN between
two checks ends it too (it raised NonFiniteLossError in 2 of 4 seeds), the suggestion is
stable and inside the swept range, and the plot's y axis shows the descent, not the 1e20
losses of the last steps."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
import ember.tuner


class Net(ember.TrainModule):   # the docs' toy module
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _sweep(seed: int, **kw):
    torch.manual_seed(seed)
    x = torch.randn(2048, 16)
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=64, shuffle=True)
    trainer = ember.Trainer(max_epochs=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            devices="cpu")
    module = Net()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    result = ember.tuner.lr_find(trainer, module, train, min_lr=1e-6, max_lr=1.0, num_training=100, **kw)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())   # put back
    assert trainer.global_step == 0
    return result


@pytest.fixture(scope="module")
def results():
    return [_sweep(seed) for seed in range(4)]


def test_diverging_sweeps_end_where_lightning_stops(results):
    from ember.tuner import _smooth, _stop_index
    for r in results:
        assert r.diverged and 10 < len(r.lrs) < 100
        assert _stop_index(r.raw_losses, 4.0) == len(r.raw_losses) - 1   # the step that crossed it, and no later
        assert r.losses == _smooth(r.raw_losses)


def test_suggestion_is_stable_and_inside_the_swept_range(results):
    sugg = [r.suggestion() for r in results]
    for r, s in zip(results, sugg):
        assert s in r.lrs and r.lrs[0] <= s <= r.lrs[-1]
        lowest = min(range(len(r.losses)), key=lambda i: r.losses[i])
        assert s <= r.lrs[lowest]                  # on the descent, before the minimum
    assert max(sugg) / min(sugg) < 2, sugg        # was 4e-6 in some seeds, 0.08 in others


def test_plot_shows_the_region_that_matters(results, tmp_path):
    pytest.importorskip("matplotlib")
    r = max(results, key=lambda r: max(r.losses))
    assert max(r.losses) > 100 * r.losses[0]      # the last steps' losses dwarf the rest
    fig = r.plot()
    bottom, top = fig.axes[0].get_ylim()
    assert top < 2 * max(r.losses[:10]) and bottom < min(r.losses)
    assert r.plot(str(tmp_path / "lr.png")) == str(tmp_path / "lr.png") and (tmp_path / "lr.png").stat().st_size


def test_without_threshold_a_nan_loss_still_ends_the_sweep():
    r = _sweep(1, early_stop_threshold=None)
    assert r.diverged and not math.isfinite(r.raw_losses[-1])
    assert all(math.isfinite(v) for v in r.raw_losses[:-1])
    assert r.suggestion() is not None
