"""A run's state is one object: a fit (and validate, test, predict) with every built-in
callback (the run record and the profiler included) binds or rebinds exactly the Trainer attributes listed in docs/architecture.md
("What a run rebinds on the Trainer"); everything else that changes lives in
``trainer.state`` (ember/trainer/state.py)."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

import ember
from ember.callbacks import (BackboneFinetuning, BasePredictionWriter, EarlyStopping, GatherMetrics,
                             LearningRateMonitor, ModelCheckpoint, ModelSummary, RichProgressBar,
                             ThroughputMonitor, Timer)

from helpers import regression_data

#: the Trainer attributes a run binds or rebinds: the run's components (docs/architecture.md)
REBOUND = {"module", "model", "datamodule", "optimizers", "events"}
#: also rebound, only in the runs that need it: ``_precision`` (the module's choice, at the first
#: run, when the Trainer was given no precision) and ``accumulate_grad_batches`` (a resume on
#: another number of processes that keeps the global batch)


class Backboned(ember.TrainModule):
    """A linear regressor split into a backbone and a head (for BackboneFinetuning), with a
    step-interval scheduler (for LearningRateMonitor) and step outputs for GatherMetrics."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x)
        self.log("val/loss", nn.functional.mse_loss(pred, y))
        return {"preds": pred.squeeze(-1), "target": y.squeeze(-1)}

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.head.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                                                   "interval": "step"}}


class Data(ember.DataModule):
    def __init__(self):
        super().__init__()
        self.data = regression_data(32)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=16)


class Writer(BasePredictionWriter):
    def __init__(self, path):
        super().__init__("epoch")
        self.path = path

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        self.save(trainer, {"predictions": predictions}, self.path)


def _rebound(before: dict, trainer: ember.Trainer) -> set:
    after = vars(trainer)
    return {k for k in before.keys() | after.keys()
            if k not in before or k not in after or after[k] is not before[k]}


def test_a_run_rebinds_only_the_listed_trainer_attributes(tmp_path):
    torch.manual_seed(0)
    dm = Data()
    val = dm.val_dataloader()
    mse = lambda preds, target: torch.mean((preds - target) ** 2)   # noqa: E731
    callbacks = [ModelCheckpoint(monitor="val/loss", save_last=True), EarlyStopping("val/loss", patience=5),
                 LearningRateMonitor("step"), RichProgressBar(), Timer({"hours": 1}), ModelSummary(),
                 GatherMetrics({"mse": mse}), ThroughputMonitor(batch_size_fn=len, measure_flops=False),
                 BackboneFinetuning(unfreeze_backbone_at_epoch=1), Writer(str(tmp_path / "preds.pt"))]
    trainer = ember.Trainer(max_epochs=2, log_every_n_steps=2, callbacks=callbacks, logger="csv", report=True,
                            profiler="simple", default_root_dir=tmp_path, num_sanity_val_steps=1)
    module = Backboned()
    before = dict(vars(trainer))
    trainer.fit(module, datamodule=dm)
    # every built-in callback ran, and wrote what it keeps into its own object or the state
    assert trainer.state.status == "finished" and trainer.stop_reason == "max_epochs"
    assert trainer.global_step == 8 and trainer.current_epoch == 2 and not trainer.interrupted
    assert trainer.report_path is not None and trainer.report_path.endswith("report.html")
    assert trainer.report_path == trainer.state.report_path
    assert trainer.lr_scheduler_configs is trainer.state.lr_scheduler_configs
    assert trainer.lr_scheduler_configs[0]["scheduler"].last_epoch == 8   # stepped at each optimizer step
    assert not (tmp_path / "preds.pt").exists()   # predict has not run yet
    assert "mse" in trainer.callback_metrics and "lr-SGD" in trainer.callback_metrics
    assert trainer.checkpoint_callback.best_model_path
    assert len(trainer.optimizers[0].param_groups) == 2   # BackboneFinetuning unfroze the backbone
    assert _rebound(before, trainer) == REBOUND, "a run bound or rebound other Trainer attributes"

    # validate / test / predict rebind no other attribute; a second fit neither
    before = dict(vars(trainer))
    trainer.validate(module, val, verbose=False)
    trainer.test(module, val, verbose=False)
    trainer.predict(module, val)
    assert (tmp_path / "preds.pt").exists()
    assert _rebound(before, trainer) <= REBOUND
    trainer.max_epochs = 3
    before = dict(vars(trainer))
    trainer.fit(module, datamodule=Data(), ckpt_path="last")
    assert _rebound(before, trainer) == REBOUND - {"module", "model"}   # the same module: its model is kept
    assert trainer.state.resumed and trainer.global_step == 12 and trainer.stop_reason == "max_epochs"


def test_the_run_state_that_moved_reads_through_the_trainer(make_trainer, data):
    """``interrupted``, ``step_rules``, ``step_optimizers``, ``lr_scheduler_configs``,
    ``report_path`` and ``metrics`` are read-through properties of ``trainer.state``."""
    trainer = make_trainer(max_steps=2, num_sanity_val_steps=0)
    st = trainer.state
    assert trainer.step_rules is None and not trainer.interrupted and trainer.report_path is None
    assert trainer.metrics is st.metrics
    module = Backboned()
    trainer.fit(module, data(32))
    assert trainer.step_rules is st.step_rules is not None
    assert trainer.step_optimizers is st.step_optimizers and len(trainer.step_optimizers) == 1
    assert trainer.lr_scheduler_configs is st.lr_scheduler_configs and len(st.lr_scheduler_configs) == 1
    for name in ("interrupted", "step_rules", "step_optimizers", "report_path"):
        assert name not in vars(trainer)


class _CtrlC(Backboned):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.trainer.state.fn == "validate":
            raise KeyboardInterrupt
        return super().validation_step(batch, batch_idx)


def test_interrupted_is_read_from_the_state(make_trainer, data, monkeypatch):
    """``trainer.interrupted``: the last run ended on Ctrl-C (a fit, or validate/test/predict),
    False again once another run starts and ends normally."""
    import ember.trainer.summary as summary
    monkeypatch.setattr(summary, "on_keyboard_interrupt", lambda t: None)   # no SystemExit(130)
    trainer = make_trainer(max_steps=4, num_sanity_val_steps=0)
    module, loader = _CtrlC(), data(32)
    try:
        trainer.fit(module, loader)
    except KeyboardInterrupt:
        pass
    assert trainer.interrupted and trainer.stop_reason == "interrupted" and trainer.state.status == "interrupted"
    trainer.test(module, loader, verbose=False)   # (test_step is validation_step: only validate raises)
    assert not trainer.interrupted and trainer.state.status == "finished"
    try:
        trainer.validate(module, loader, verbose=False)
    except KeyboardInterrupt:
        pass
    assert trainer.interrupted and trainer.stop_reason == "interrupted"
    trainer.fit(Backboned(), loader)
    assert not trainer.interrupted and trainer.stop_reason == "max_steps" and trainer.state.exception is None
