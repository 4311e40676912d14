"""ThroughputMonitor (rates, FLOPs, MFU), BasePredictionWriter and `ember predict --output`."""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import ember
from ember.callbacks import BasePredictionWriter, Callback, ThroughputMonitor
from ember.callbacks.throughput import compute_dtype, peak_flops_for
from ember.cli import main as cli_main
from ember.errors import MisconfigurationError

from conftest import LinearModule, regression_data
from helpers import EXAMPLES


class MLP(ember.TrainModule):
    def __init__(self, sleep: float = 0.0):
        super().__init__()
        self.sleep = sleep
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        if self.sleep:
            time.sleep(self.sleep)
        x, y = batch["x"], batch["y"]
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _dict_loader(n, bs, seq=None):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)

    def collate(items):
        out = {"x": torch.stack([i[0] for i in items]), "y": torch.stack([i[1] for i in items])}
        if seq:
            out["input_ids"] = torch.zeros(len(items), seq, dtype=torch.long)
        return out
    return DataLoader(TensorDataset(x, y), batch_size=bs, collate_fn=collate)


class Stamps(Callback):
    def __init__(self):
        self.t = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.t.append(time.perf_counter())


def test_throughput_rates_match_an_outside_measurement(make_trainer):
    bs, n_batches = 16, 41
    mon, stamps = ThroughputMonitor(log_every_n_steps=10, peak_flops=1e12), Stamps()
    trainer = make_trainer(max_epochs=1, callbacks=[stamps, mon])
    trainer.fit(MLP(sleep=0.02), _dict_loader(bs * n_batches, bs, seq=7))
    assert [h["step"] for h in mon.history] == [10, 20, 30, 40]
    # outside: batches 2..41 between the end of batch 1 and the end of batch 41; the first
    # window (after the FLOP-counted batch 1) holds batches 2..10, the others 10 batches each
    t = stamps.t
    outside = bs * (n_batches - 1) / (t[-1] - t[0])
    ends = [0, 9, 19, 29, 39]
    windows = [bs * (b - a) / (t[b] - t[a]) for a, b in zip(ends, ends[1:])]
    counts = [bs * (b - a) for a, b in zip(ends, ends[1:])]
    inside = sum(counts) / sum(c / h["throughput/samples_per_sec"] for c, h in zip(counts, mon.history))
    assert inside == pytest.approx(outside, rel=0.10)
    for h, w in zip(mon.history, windows):
        assert h["throughput/samples_per_sec"] == pytest.approx(w, rel=0.10)
        assert h["throughput/batches_per_sec"] == pytest.approx(h["throughput/samples_per_sec"] / bs)
        assert h["throughput/tokens_per_sec"] == pytest.approx(7 * h["throughput/samples_per_sec"])
        assert h["throughput/mfu"] == pytest.approx(h["throughput/flops_per_sec"] / 1e12)
    assert float(trainer.callback_metrics["throughput/samples_per_sec"]) == pytest.approx(
        mon.history[-1]["throughput/samples_per_sec"])
    # the FLOP-counting hook left the hook list after the first batch
    assert all(getattr(h, "__self__", None) is not mon for h in trainer.events.handlers("on_train_batch_start"))


def test_throughput_flops_equal_flop_counter_mode(make_trainer):
    bs = 16
    mon = ThroughputMonitor(log_every_n_steps=2)
    module = MLP()
    ref = MLP()
    ref.load_state_dict(module.state_dict())
    batch = next(iter(_dict_loader(bs, bs)))
    with FlopCounterMode(display=False) as fc:
        ref.training_step(batch, 0).backward()
    trainer = make_trainer(max_epochs=1, callbacks=[mon])
    trainer.fit(module, _dict_loader(bs * 6, bs))
    assert mon.flops_per_batch == fc.get_total_flops()
    # 2 FLOPs per multiply-add: forward 2*B*(32*64 + 64*10); backward: the first layer's weight
    # gradient only (the input needs none), the second layer's weight and input gradients
    assert mon.flops_per_batch == 2 * bs * (32 * 64 + 64 * 10) + 2 * bs * 32 * 64 + 4 * bs * 64 * 10
    h = mon.history[-1]
    assert h["throughput/flops_per_sec"] == pytest.approx(mon.flops_per_batch * h["throughput/batches_per_sec"])
    assert "throughput/mfu" not in h and "throughput/tokens_per_sec" not in h   # CPU, no peak given; no tokens


def test_peak_flops_table():
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops_for("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops_for("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak_flops_for("NVIDIA A10", "bf16") == 125e12 and peak_flops_for("NVIDIA L40S", "bf16") == 362.1e12
    assert peak_flops_for("Tesla V100-SXM2-16GB", "bf16") is None and peak_flops_for("Unknown GPU", "fp32") is None
    assert compute_dtype("bf16-mixed") == "bf16" and compute_dtype("16-mixed") == "fp16"
    with pytest.raises(MisconfigurationError, match="peak_flops"):
        ThroughputMonitor(peak_flops=0)


class ListWriter(BasePredictionWriter):
    def __init__(self, interval):
        super().__init__(interval)
        self.batches, self.epochs = [], []

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((prediction.clone(), batch_indices, batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


def test_prediction_writer_intervals(make_trainer):
    data = regression_data(n=40)
    loader = DataLoader(data, batch_size=16)
    module = LinearModule()
    for interval in ("batch", "epoch", "batch_and_epoch"):
        w = ListWriter(interval)
        out = make_trainer(callbacks=[w]).predict(module, loader)
        assert len(w.batches) == (3 if "batch" in interval else 0)
        assert len(w.epochs) == (1 if "epoch" in interval else 0)
        if w.batches:
            assert [b[1] for b in w.batches] == [list(range(0, 16)), list(range(16, 32)), list(range(32, 40))]
            assert all(torch.equal(b[0], o) for b, o in zip(w.batches, out))
        if w.epochs:
            (preds,), (idx,) = w.epochs[0]
            assert all(torch.equal(p, o) for p, o in zip(preds, out)) and idx[2] == list(range(32, 40))
    with pytest.raises(MisconfigurationError, match="write_interval"):
        BasePredictionWriter("step")
    with pytest.raises(NotImplementedError, match="write_on_batch_end"):
        make_trainer(callbacks=[BasePredictionWriter()]).predict(module, loader)


def test_ember_predict_writes_predictions(tmp_path, monkeypatch, capsys):
    cfg = EXAMPLES / "cli" / "config.yaml"
    monkeypatch.syspath_prepend(str(cfg.parent))   # toy.py importable, as PYTHONPATH=examples/cli in the docs
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "preds" / "p.pt"
    assert cli_main(["predict", "-c", str(cfg), "--trainer.logger", "false", "--output", str(out)]) == 0
    assert f"predictions: {out}" in capsys.readouterr().out
    preds = torch.load(out)
    assert len(preds) == 8 and all(p.shape == (16, 1) for p in preds)   # 128 samples, batch 16
    assert cli_main(["predict", "-c", str(cfg), "--trainer.logger", "false"]) == 0
    assert os.path.isfile(tmp_path / "runs" / "toy" / "predictions.pt")
