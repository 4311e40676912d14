"""Trainer(profiler=...): the simple profiler's table covers the fit time; the
PyTorch profiler writes traces where TensorBoard's profiler plugin reads them;
profiler=None wraps nothing."""
from __future__ import annotations

import glob
import json
import os
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback
from ember.errors import MisconfigurationError
from ember.loggers import CSVLogger
from ember.trainer.profiler import PyTorchProfiler


class Wide(ember.TrainModule):
    """An MLP big enough that the steps, not the loop, take the time."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _loaders(n=128 * 40, bs=128):
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(ds, batch_size=bs, shuffle=True), DataLoader(ds, batch_size=512)


def _trainer(tmp_path, **kw):
    args = dict(max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, devices="cpu", log_every_n_steps=10,
                limit_val_batches=2)
    return ember.Trainer(**{**args, **kw})


def test_simple_profiler_phases_sum_to_fit_time(tmp_path, capsys):
    # long enough that what fit does once outside the phases (about 6 ms quiet: the report's
    # files, teardown) stays a few percent of the fit under a loaded machine's slowdown
    train, val = _loaders(n=128 * 90)
    trainer = _trainer(tmp_path, profiler="simple")
    module = Wide(width=512)
    t0 = time.perf_counter()
    trainer.fit(module, train, val)
    fit_time = time.perf_counter() - t0
    s = trainer.profiler.summary()
    phases = s["phases"]
    for name in ("train dataloader next", "training_step", "backward", "optimizer_step", "zero_grad",
                 "validation", "sanity check", "setup", "ModelCheckpoint.on_train_epoch_end"):
        assert name in phases, name
    assert phases["training_step"]["calls"] == phases["backward"]["calls"] == phases["optimizer_step"]["calls"] == 90
    assert phases["train dataloader next"]["calls"] == 91   # 90 batches and the final StopIteration
    # the phases' self times add up to the fit time measured outside
    assert abs(s["profiled_s"] - fit_time) / fit_time < 0.10, (s["profiled_s"], fit_time)
    out = capsys.readouterr().out
    assert "Simple profiler" in out and "training_step" in out and "backward" in out
    text = open(os.path.join(trainer.log_dir, "profile-simple-rank0.txt")).read()
    assert text.strip() == trainer.profiler.text.strip()
    saved = json.load(open(os.path.join(trainer.log_dir, "profile-simple-rank0.json")))
    assert saved["phases"]["backward"]["calls"] == 90
    # nothing was patched: the loop built its callables through the profiler for that fit only
    assert "training_step" not in module.__dict__
    assert "backward" not in trainer.strategy.__dict__ and "optimizer_step" not in trainer.strategy.__dict__
    assert type(train) is DataLoader


def test_pytorch_profiler_writes_tensorboard_trace(tmp_path):
    train, _ = _loaders(n=128 * 8)
    prof = PyTorchProfiler(wait=1, warmup=1, active=2)
    trainer = _trainer(tmp_path, profiler=prof, enable_checkpointing=False)
    trainer.fit(Wide(width=64), train)
    run_dirs = glob.glob(os.path.join(trainer.log_dir, "plugins", "profile", "*"))
    assert len(run_dirs) == 1 and prof.trace_dir == run_dirs[0]
    traces = glob.glob(os.path.join(run_dirs[0], "*.pt.trace.json"))
    assert len(traces) == 1 and os.path.basename(traces[0]).startswith("rank0")
    with open(traces[0]) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"training_step", "backward", "optimizer_step"} <= names
    assert "ProfilerStep#2" in names and "ProfilerStep#3" in names   # the 2 active steps
    assert "ProfilerStep#4" not in names
    try:   # TensorBoard's PyTorch profiler plugin (torch-tb-profiler), where installed, lists the run
        from torch_tb_profiler.plugin import TorchProfilerPlugin
    except ImportError:
        return
    from types import SimpleNamespace
    assert list(TorchProfilerPlugin._get_run_dirs(SimpleNamespace(logdir=trainer.log_dir))) == run_dirs


def test_profiler_off_wraps_nothing(tmp_path):
    seen = {}

    class Look(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen["step"] = "training_step" in module.__dict__
            seen["backward"] = "backward" in trainer.strategy.__dict__
            seen["loader"] = type(trainer.train_dataloader)

    train, _ = _loaders(n=256)
    trainer = _trainer(tmp_path, callbacks=[Look()], enable_checkpointing=False)
    trainer.fit(Wide(width=16), train)
    assert trainer.profiler is None
    assert seen == {"step": False, "backward": False, "loader": DataLoader}
    with pytest.raises(MisconfigurationError, match="profiler"):
        ember.Trainer(profiler="fancy")
