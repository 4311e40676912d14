"""Lightning's keyword arguments of ``save_hyperparameters`` (``logger``, ``ignore``,
``frame``) and its one-dict / Namespace form, as real Lightning modules use them
(the lightning-hydra-template's modules call ``save_hyperparameters(logger=False)``)."""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os

import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

import ember
from ember.loggers import CSVLogger
from tests.conftest import LinearModule, regression_data


class TemplateLike(LinearModule):
    """The lightning-hydra-template's MNISTLitModule signature: a net, an optimizer factory
    (functools.partial, as hydra's ``_partial_: true``), a flag."""

    def __init__(self, net: nn.Module, optimizer, compile: bool = False):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net

    def configure_optimizers(self):
        return self.hparams.optimizer(params=self.parameters())


def _fit(tmp_path, module, datamodule=None):
    dl = DataLoader(regression_data(32), batch_size=8)
    t = ember.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, devices="cpu", default_root_dir=tmp_path,
                      log_every_n_steps=1)
    if datamodule is None:
        t.fit(module, dl)
    else:
        t.fit(module, datamodule=datamodule)
    return t


def test_logger_false_keeps_hparams_out_of_the_loggers_only(tmp_path):
    opt = functools.partial(torch.optim.SGD, lr=0.05)
    m = TemplateLike(nn.Linear(4, 1), opt, compile=False)
    assert set(m.hparams) == {"optimizer", "compile"}        # the net is a module: not a hyperparameter
    assert m.hparams.optimizer is opt and m.hparams_initial["compile"] is False
    t = _fit(tmp_path, m)
    assert isinstance(t.optimizers[0], torch.optim.SGD) and t.optimizers[0].param_groups[0]["lr"] == 0.05
    assert not os.path.exists(os.path.join(t.logger.log_dir, "hparams.yaml"))   # nothing was sent
    last = t.checkpoint_callback.last_model_path or t.checkpoint_callback.best_model_path
    meta = json.loads(open(os.path.join(last, "meta.json")).read())
    assert meta["hparams"]["compile"] is False                # still saved with the checkpoint


def test_ignore_frame_and_one_mapping(tmp_path):
    class Ignoring(LinearModule):
        def __init__(self, dim: int = 4, lr: float = 0.1, secret: str = "x"):
            super().__init__(dim, lr)
            self.save_hyperparameters(ignore="secret")

    assert dict(Ignoring().hparams) == {"dim": 4, "lr": 0.1}

    def record(obj):   # a helper: the frame to read is its caller's
        obj.save_hyperparameters(ignore=["lr"], frame=inspect.currentframe().f_back)

    class Helped(LinearModule):
        def __init__(self, dim: int = 4, lr: float = 0.1):
            super().__init__(dim, lr)
            record(self)

    assert dict(Helped(dim=3).hparams) == {"dim": 3}

    class FromNamespace(LinearModule):
        def __init__(self, args):
            super().__init__(args.dim, args.lr)
            self.save_hyperparameters(args)

    m = FromNamespace(argparse.Namespace(dim=4, lr=0.2))
    assert dict(m.hparams) == {"dim": 4, "lr": 0.2}
    t = _fit(tmp_path, m)
    assert yaml.safe_load(open(os.path.join(t.logger.log_dir, "hparams.yaml"))) == {"dim": 4, "lr": 0.2}


def test_datamodule_logger_false(tmp_path):
    class Data(ember.DataModule):
        def __init__(self, batch_size: int = 8, root: str = "data"):
            super().__init__()
            self.save_hyperparameters(logger=False)

        def train_dataloader(self):
            return DataLoader(regression_data(32), batch_size=self.hparams.batch_size)

    class Logged(LinearModule):
        def __init__(self, dim: int = 4, lr: float = 0.1):
            super().__init__(dim, lr)
            self.save_hyperparameters()

    t = _fit(tmp_path, Logged(), datamodule=Data())
    assert yaml.safe_load(open(os.path.join(t.logger.log_dir, "hparams.yaml"))) == {"dim": 4, "lr": 0.1}
