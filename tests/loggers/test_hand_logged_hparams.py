"""Hyperparameters a user logs by hand (``trainer.logger.log_hyperparams({...})``, before
fit as the lightning-hydra-template does, or during it) are kept next to the module's in
hparams.yaml, TensorBoard's HPARAMS tab and W&B's config: the Trainer's own call at the
start of fit merges with them instead of hiding them."""
from __future__ import annotations

import glob
import os

import pytest
import yaml
from torch.utils.data import DataLoader

import ember
from ember.loggers import CSVLogger, TensorBoardLogger
from tests.conftest import LinearModule, regression_data
from helpers import wandb_config as _config, wandb_offline, wandb_records
from helpers import tensorboard_events as _accumulator, tensorboard_hparams as _session_hparams

BY_HAND = {"model": {"net": "mlp", "params/total": 5}, "seed": 12, "tags": ["dev"]}
BY_HAND_FLAT = {"model/net": "mlp", "model/params/total": 5.0, "seed": 12.0, "tags": "['dev']"}


class Saved(LinearModule):
    def __init__(self, dim: int = 4, lr: float = 0.1):
        super().__init__(dim, lr)
        self.save_hyperparameters()


class LogsInSetup(Saved):
    def setup(self, stage):
        self.logger.log_hyperparams({"data/len": 32})   # during fit, after the Trainer's own call


def _trainer(tmp_path, logger=True):
    return ember.Trainer(max_epochs=1, logger=logger, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, devices="cpu", default_root_dir=tmp_path, log_every_n_steps=1)


def _fit(t, module):
    t.fit(module, DataLoader(regression_data(32), batch_size=8))


def test_before_fit_kept_next_to_the_modules(tmp_path):
    t = _trainer(tmp_path, logger=[TensorBoardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "csv")])
    loggers = list(t.loggers)
    assert len(loggers) == 2 and t.logger is loggers[0]     # usable before fit, as in Lightning
    for lg in t.loggers:
        lg.log_hyperparams(BY_HAND)
    _fit(t, Saved())
    assert t.loggers == loggers                              # fit logged into the same objects
    for lg in loggers:
        with open(os.path.join(lg.log_dir, "hparams.yaml")) as f:
            assert yaml.safe_load(f) == {**BY_HAND, "dim": 4, "lr": 0.1}
    hp, _ = _session_hparams(_accumulator(loggers[0].log_dir))
    assert hp == {**BY_HAND_FLAT, "dim": 4.0, "lr": 0.1}       # the HPARAMS tab shows both sets


def test_default_logger_and_during_fit(tmp_path):
    t = _trainer(tmp_path)                                   # logger=True: a TensorBoardLogger
    assert isinstance(t.logger, TensorBoardLogger)
    t.logger.log_hyperparams(BY_HAND)
    _fit(t, LogsInSetup())
    hp, _ = _session_hparams(_accumulator(t.logger.log_dir))
    assert hp == {**BY_HAND_FLAT, "dim": 4.0, "lr": 0.1, "data/len": 32.0}
    assert os.listdir(os.path.join(tmp_path, "ember_logs")) == ["version_0"]


@pytest.mark.timeout(120)
def test_wandb_config_keeps_both(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from ember.loggers import WandbLogger
    wandb_offline(monkeypatch, tmp_path)
    t = _trainer(tmp_path, logger=WandbLogger(project="ember-test", save_dir=tmp_path / "save",
                                               version="handlogged1", offline=True))
    t.logger.log_hyperparams(BY_HAND)
    _fit(t, Saved())
    import wandb
    wandb.teardown()   # flushes the offline run's records
    (run_dir,) = glob.glob(str(tmp_path / "save" / "wandb" / "offline-run-*-handlogged1"))
    cfg = _config(wandb_records(run_dir))
    assert {k: cfg[k] for k in ("model/net", "model/params/total", "seed", "dim", "lr")} == \
        {"model/net": "mlp", "model/params/total": 5, "seed": 12, "dim": 4, "lr": 0.1}
