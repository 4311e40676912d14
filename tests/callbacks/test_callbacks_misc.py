"""EarlyStopping, LearningRateMonitor and Timer."""
from __future__ import annotations

import csv
import datetime
import math
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.checkpoint import io as cio
from ember.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, Timer
from ember.callbacks.timer import parse_duration
from ember.errors import MisconfigurationError
from ember.loggers import CSVLogger

BATCHES = 4


def data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Scripted(ember.TrainModule):
    """val/metric at the validation after ``global_step`` s is ``values[s // every]``."""

    def __init__(self, values=(1.0,), every=BATCHES, opt="sgd", scheduler=None):
        super().__init__()
        self.values, self.every, self.opt, self.scheduler = values, every, opt, scheduler
        self.net = nn.Linear(4, 1)
        self.extra = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x) + 0 * self.extra(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        i = min(self.trainer.global_step // self.every - 1, len(self.values) - 1)
        self.log("val/metric", torch.tensor(self.values[i]))

    def configure_optimizers(self):
        groups = [{"params": self.net.parameters()}, {"params": self.extra.parameters(), "lr": 0.01}]
        if self.opt == "named":
            groups[1]["name"] = "head"
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-4)
        if self.scheduler == "step":
            s = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step", "name": "my-lr"}}
        if self.scheduler == "epoch":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
            return {"optimizer": opt, "lr_scheduler": s}
        return opt


def fit(root, module, callbacks=(), ckpt_path=None, **kw):
    args = dict(max_epochs=8, default_root_dir=root, logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False)
    args.update(kw)
    ember.seed_everything(0)
    t = ember.Trainer(callbacks=list(callbacks), **args)
    t.fit(module, DataLoader(data(), batch_size=8, shuffle=True), DataLoader(data(8), batch_size=8),
          ckpt_path=ckpt_path)
    return t


class StopAt(Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("interrupted")


# -- EarlyStopping -------------------------------------------------------------------------
PLATEAU = (5.0, 4.0, 4.5, 4.2, 4.1, 3.0, 2.0, 1.0)   # best at epoch 1, then 3 epochs without improvement


def test_early_stopping_patience(tmp_path):
    es = EarlyStopping("val/metric", patience=3)
    t = fit(tmp_path, Scripted(PLATEAU), [es])
    assert es.stopped_epoch == 4 and es.wait_count == 3 and es.best_score == 4.0
    assert t.current_epoch == 5 and t.global_step == 5 * BATCHES
    assert "did not improve in the last 3 records" in es.stopping_reason


def test_early_stopping_patience_carries_across_resume(tmp_path):
    ck = dict(save_last=True, every_n_epochs=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(tmp_path, Scripted(PLATEAU), [EarlyStopping("val/metric", patience=3), StopAt(3),
                                          ModelCheckpoint(**ck)], enable_checkpointing=True)
    saved = cio.read_checkpoint(tmp_path / "checkpoints" / "last")[1]["callbacks"]
    assert saved["EarlyStopping{monitor='val/metric', mode='min'}"]["wait_count"] == 1
    es = EarlyStopping("val/metric", patience=3)
    t = fit(tmp_path, Scripted(PLATEAU), [es, ModelCheckpoint(**ck)], ckpt_path="last", enable_checkpointing=True)
    # without the restored wait count and best score it would not stop at epoch 4
    assert es.stopped_epoch == 4 and t.global_step == 5 * BATCHES and es.best_score == 4.0


@pytest.mark.parametrize("kwargs,values,stop_epoch,reason", [
    (dict(min_delta=0.2), (5.0, 4.9, 4.7, 4.6, 4.55, 4.5), 4, "did not improve"),
    (dict(stopping_threshold=2.5), (5.0, 4.0, 3.0, 2.0, 1.0, 0.5), 3, "Stopping threshold reached"),
    (dict(divergence_threshold=10.0, patience=10), (5.0, 4.0, 12.0, 1.0), 2, "Divergence threshold reached"),
    (dict(patience=10), (5.0, 4.0, float("nan"), 1.0), 2, "is not finite"),
    (dict(mode="max", patience=1), (1.0, 2.0, 3.0, 2.5, 4.0), 3, "did not improve"),
])
def test_early_stopping_criteria(tmp_path, kwargs, values, stop_epoch, reason):
    es = EarlyStopping("val/metric", **{"patience": 2, **kwargs})
    fit(tmp_path, Scripted(values), [es])
    assert es.stopped_epoch == stop_epoch and reason in es.stopping_reason


def test_early_stopping_after_every_validation(tmp_path):
    # validation after every 2 batches; the metric stops improving after the 2nd one
    es = EarlyStopping("val/metric", patience=2, check_on_train_epoch_end=False)
    t = fit(tmp_path, Scripted((3.0, 2.0, 2.5, 2.4, 1.0), every=2), [es], val_check_interval=0.5)
    assert t.global_step == 8 and es.wait_count == 2


def test_early_stopping_missing_metric(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"could not find the metric: 'val/acc' was never logged.*available now: \['train/loss', 'val/metric'\]"):
        fit(tmp_path, Scripted(), [EarlyStopping("val/acc")])
    t = fit(tmp_path, Scripted(), [EarlyStopping("val/acc", strict=False)], max_epochs=2)
    assert t.current_epoch == 2


def test_early_stopping_arguments():
    with pytest.raises(MisconfigurationError, match="mode"):
        EarlyStopping("x", mode="lowest")
    with pytest.raises(MisconfigurationError, match="patience"):
        EarlyStopping("x", patience=-1)


# -- LearningRateMonitor ----------------------------------------------------------------------
def _csv(logger):
    logger.save()
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def _column(rows, name):
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]


def test_lr_monitor_step_interval_names_and_values(tmp_path):
    logger = CSVLogger(tmp_path)
    mon = LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True)
    fit(tmp_path, Scripted(scheduler="step"), [mon], max_epochs=2, logger=logger, log_every_n_steps=2)
    rows = _csv(logger)
    # the rate step k used (0.1 * 0.5 ** (k - 1)), logged at every 2nd step with that step's metrics
    assert _column(rows, "my-lr/pg1") == [(k, 0.1 * 0.5 ** (k - 1)) for k in (2, 4, 6, 8)]
    assert _column(rows, "my-lr/pg2") == [(k, 0.01 * 0.5 ** (k - 1)) for k in (2, 4, 6, 8)]
    assert _column(rows, "my-lr/pg1-momentum") == [(k, 0.9) for k in (2, 4, 6, 8)]
    assert _column(rows, "my-lr/pg2-weight_decay") == [(k, 1e-4) for k in (2, 4, 6, 8)]
    assert [s for s, _ in _column(rows, "train/loss")] == [2, 4, 6, 8]
    assert mon.lrs["my-lr/pg1"] == [0.1 * 0.5 ** (k - 1) for k in (2, 4, 6, 8)]


def test_lr_monitor_epoch_interval_and_group_names(tmp_path):
    mon = LearningRateMonitor(logging_interval="epoch")
    t = fit(tmp_path, Scripted(opt="named", scheduler="epoch"), [mon], max_epochs=3)
    assert set(mon.lrs) == {"lr-SGD/pg1", "lr-SGD/head"}
    assert mon.lrs["lr-SGD/pg1"] == pytest.approx([0.1, 0.01, 0.001])
    assert mon.lrs["lr-SGD/head"] == pytest.approx([0.01, 0.001, 0.0001])
    assert float(t.callback_metrics["lr-SGD/head"]) == pytest.approx(0.0001)


def test_lr_monitor_default_interval_follows_the_scheduler(tmp_path):
    mon = LearningRateMonitor()
    fit(tmp_path, Scripted(scheduler="epoch"), [mon], max_epochs=2, log_every_n_steps=1)
    assert mon.lrs["lr-SGD/pg1"] == pytest.approx([0.1, 0.01])   # epoch scheduler: once per epoch


class TwoAdams(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt, layer in zip(self.optimizers(), (self.a, self.b)):
            opt.zero_grad()
            self.manual_backward(F.mse_loss(layer(x), y))
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.a.parameters(), lr=0.01), torch.optim.Adam(self.b.parameters(), lr=0.02)]


def test_lr_monitor_two_optimizers_of_one_class_manual_optimization(tmp_path):
    mon = LearningRateMonitor(log_momentum=True)
    ember.seed_everything(0)
    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path, log_every_n_steps=4, callbacks=[mon])
    t.fit(TwoAdams(), DataLoader(data(), batch_size=8))
    # two optimizer steps per batch: global steps 2, 4, 6, 8; logged at 4 and 8
    assert mon.lrs == {"lr-Adam": [0.01, 0.01], "lr-Adam-1": [0.02, 0.02],
                       "lr-Adam-momentum": [0.9, 0.9], "lr-Adam-1-momentum": [0.9, 0.9]}


def test_lr_monitor_arguments():
    with pytest.raises(MisconfigurationError, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")


# -- Timer -----------------------------------------------------------------------------------
def test_parse_duration():
    assert parse_duration("01:02:03:04") == ((24 + 2) * 60 + 3) * 60 + 4
    assert parse_duration(datetime.timedelta(minutes=2)) == 120
    assert parse_duration({"hours": 1, "seconds": 5}) == 3605
    assert parse_duration(None) is None and parse_duration(7) == 7.0
    for bad in ("1:2:3", "soon", {"fortnights": 1}, -1):
        with pytest.raises(MisconfigurationError, match="Timer"):
            parse_duration(bad)


def test_timer_stops_after_the_step_that_used_up_the_budget(tmp_path):
    timer = Timer(duration=1e-9, verbose=False)
    t = fit(tmp_path, Scripted(), [timer])
    # a stop mid-epoch is recorded as mid-epoch: no epoch-end work, the epoch is not counted
    assert t.global_step == 1 and t.current_epoch == 0 and t.batches_done == 1
    assert t.stop_reason == "timer" and t.should_stop


def test_timer_with_no_budget_left_does_not_train(tmp_path):
    t = fit(tmp_path, Scripted(), [Timer(duration=0, verbose=False)])
    assert t.global_step == 0


def test_timer_epoch_interval(tmp_path):
    timer = Timer(duration={"microseconds": 1}, interval="epoch", verbose=False)
    t = fit(tmp_path, Scripted(), [timer])
    assert t.global_step == BATCHES and t.current_epoch == 1


def test_timer_measures_stages(tmp_path):
    timer = Timer(duration={"days": 1})
    t = fit(tmp_path, Scripted(), [timer], max_epochs=2)
    assert t.global_step == 2 * BATCHES
    assert timer.start_time("train") < timer.end_time("train")
    assert timer.start_time("train") <= timer.start_time("validate") <= timer.end_time("validate")
    assert 0 < timer.time_elapsed("validate") <= timer.time_elapsed("train")
    assert timer.start_time("test") is None and timer.time_elapsed("test") == 0
    assert timer.time_remaining() == pytest.approx(86400 - timer.time_elapsed("train"))
    with pytest.raises(MisconfigurationError, match="Timer stage"):
        timer.time_elapsed("lunch")


def test_timer_elapsed_time_is_restored_on_resume(tmp_path):
    ck = ModelCheckpoint(save_last=True)
    with pytest.raises(RuntimeError):
        fit(tmp_path, Scripted(), [Timer(), StopAt(2), ck], enable_checkpointing=True)
    saved = cio.read_checkpoint(tmp_path / "checkpoints" / "last")[1]["callbacks"]["Timer"]["time_elapsed"]["train"]
    assert saved > 0
    # a budget of half the time already spent: the resumed fit stops before any step
    timer = Timer(duration=saved / 2, interval="epoch", verbose=False)
    seen = {}

    class Peek(Callback):
        def on_fit_start(self, trainer, module):
            seen["elapsed"] = timer.time_elapsed("train")

    t = fit(tmp_path, Scripted(), [timer, Peek(), ModelCheckpoint(save_last=True)], ckpt_path="last",
            enable_checkpointing=True)
    assert seen["elapsed"] == saved and t.global_step == 2 * BATCHES
    assert not math.isnan(timer.time_elapsed())


def test_timer_arguments():
    with pytest.raises(MisconfigurationError, match="interval"):
        Timer(interval="batch")
