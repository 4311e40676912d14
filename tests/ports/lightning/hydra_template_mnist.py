"""Port of the lightning-hydra-template's MNIST example (``src/train.py`` with
``configs/train.yaml``, ``src/models/mnist_module.py``, ``src/models/components/
simple_dense_net.py``, ``src/data/mnist_datamodule.py`` and ``log_hyperparameters`` of
``src/utils/logging_utils.py``), written against ember's names.

Same structure and API usage as the original: ``MNISTLitModule(net, optimizer, scheduler,
compile)`` with ``save_hyperparameters(logger=False)``, the optimizer and scheduler given
as factories (``functools.partial``: hydra's ``_partial_: true``) and built in
``configure_optimizers`` on ``self.trainer.model.parameters()``, ReduceLROnPlateau on
``val/loss``, torchmetrics objects (``Accuracy``, ``MeanMetric``, ``MaxMetric``) passed to
``self.log``, ``val/acc_best`` logged with ``sync_dist=True`` in
``on_validation_epoch_end``; a datamodule with ``save_hyperparameters(logger=False)``
that splits train+test with a seeded ``random_split`` and divides the batch size by the
world size; the callbacks of ``configs/callbacks/default.yaml`` (ModelCheckpoint on
``val/acc`` with ``save_last`` and ``filename="epoch_{epoch:03d}"``, EarlyStopping,
``ModelSummary(max_depth=-1)``, RichProgressBar); a CSV logger; ``seed_everything(seed,
workers=True)``; hyperparameters logged by hand on ``trainer.loggers`` before ``fit``;
``fit`` then ``test(ckpt_path=best_model_path)``.

Changed from the original, and why: ember's names (``TrainModule``, ``DataModule`` ...);
no hydra: the config values are written in ``CFG`` and the objects built from it in
code; MNIST is scikit-learn's 8x8 digits (``digits.Digits``, no download: 64 inputs, a
split of [1297, 250, 250] for [55000, 5000, 10000]); 3 epochs; the training loader
shuffles under DDP only (``common.SHUFFLE_TRAIN``); the numbers are written to
``PORT_OUT``.

Features used: save_hyperparameters(logger=False), trainer.loggers before fit,
torchmetrics objects in self.log, ReduceLROnPlateau with a monitor, ModelCheckpoint
(save_last, filename template), ModelSummary(max_depth=-1), test(ckpt_path=best).

    python tests/ports/lightning/hydra_template_mnist.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional, Tuple

import torch
import yaml
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, random_split
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy

from common import SHUFFLE_TRAIN, param_sums, trainer_kwargs, write
from digits import Digits

from ember import DataModule, TrainModule, Trainer, seed_everything  # (from lightning import ...)
from ember.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, RichProgressBar
from ember.loggers import CSVLogger  # (from lightning.pytorch.loggers import CSVLogger)
from ember.utilities import rank_zero_only

CFG = {
    "task_name": "train", "tags": ["dev"], "seed": 12345, "ckpt_path": None,
    "data": {"batch_size": 128, "train_val_test_split": [1297, 250, 250], "num_workers": 0, "pin_memory": False},
    "model": {"optimizer": {"lr": 0.001, "weight_decay": 0.0},
              "scheduler": {"mode": "min", "factor": 0.1, "patience": 10},
              "net": {"input_size": 64, "lin1_size": 64, "lin2_size": 128, "lin3_size": 64, "output_size": 10},
              "compile": False},
    "trainer": {"min_epochs": 1, "max_epochs": 3, "check_val_every_n_epoch": 1, "deterministic": False},
}


class SimpleDenseNet(nn.Module):
    def __init__(self, input_size: int = 784, lin1_size: int = 256, lin2_size: int = 256, lin3_size: int = 256,
                 output_size: int = 10) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size), nn.BatchNorm1d(lin1_size), nn.ReLU(),
            nn.Linear(lin1_size, lin2_size), nn.BatchNorm1d(lin2_size), nn.ReLU(),
            nn.Linear(lin2_size, lin3_size), nn.BatchNorm1d(lin3_size), nn.ReLU(),
            nn.Linear(lin3_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()
        x = x.view(batch_size, -1)
        return self.model(x)


class MNISTDataModule(DataModule):
    def __init__(self, data_dir: str = "data/", train_val_test_split: Tuple[int, int, int] = (55_000, 5_000, 10_000),
                 batch_size: int = 64, num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.data_train = self.data_val = self.data_test = None
        self.batch_size_per_device = batch_size

    @property
    def num_classes(self) -> int:
        return 10

    def prepare_data(self) -> None:
        pass   # (MNIST(self.hparams.data_dir, train=True, download=True), ...)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.trainer is not None:
            if self.hparams.batch_size % self.trainer.world_size != 0:
                raise RuntimeError(f"Batch size ({self.hparams.batch_size}) is not divisible by the number of "
                                   f"devices ({self.trainer.world_size}).")
            self.batch_size_per_device = self.hparams.batch_size // self.trainer.world_size
        if not self.data_train and not self.data_val and not self.data_test:
            trainset = Digits(train=True)
            testset = Digits(train=False)
            dataset = ConcatDataset(datasets=[trainset, testset])
            self.data_train, self.data_val, self.data_test = random_split(
                dataset=dataset, lengths=self.hparams.train_val_test_split,
                generator=torch.Generator().manual_seed(42))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset=self.data_train, batch_size=self.batch_size_per_device,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory,
                          shuffle=SHUFFLE_TRAIN)   # (shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset=self.data_val, batch_size=self.batch_size_per_device,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset=self.data_test, batch_size=self.batch_size_per_device,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory, shuffle=False)


class MNISTLitModule(TrainModule):
    def __init__(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler, compile: bool) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.val_acc = Accuracy(task="multiclass", num_classes=10)
        self.test_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch):
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        preds = torch.argmax(logits, dim=1)
        return loss, preds, y

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        pass

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        self.val_acc_best(acc)
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True, prog_bar=True)

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self) -> Dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is not None:
            scheduler = self.hparams.scheduler(optimizer=optimizer)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch",
                                     "frequency": 1}}
        return {"optimizer": optimizer}


@rank_zero_only
def log_hyperparameters(object_dict: Dict[str, Any]) -> None:
    hparams = {}
    cfg = object_dict["cfg"]
    model = object_dict["model"]
    trainer = object_dict["trainer"]
    if not trainer.logger:
        print("Logger not found! Skipping hyperparameter logging...")
        return
    hparams["model"] = cfg["model"]
    hparams["model/params/total"] = sum(p.numel() for p in model.parameters())
    hparams["model/params/trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hparams["model/params/non_trainable"] = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    hparams["data"] = cfg["data"]
    hparams["trainer"] = cfg["trainer"]
    hparams["callbacks"] = cfg.get("callbacks")
    hparams["extras"] = cfg.get("extras")
    hparams["task_name"] = cfg.get("task_name")
    hparams["tags"] = cfg.get("tags")
    hparams["ckpt_path"] = cfg.get("ckpt_path")
    hparams["seed"] = cfg.get("seed")
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def train(cfg: Dict[str, Any], out_dir: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    if cfg.get("seed"):
        seed_everything(cfg["seed"], workers=True)
    datamodule = MNISTDataModule(**cfg["data"])
    m = cfg["model"]
    model = MNISTLitModule(net=SimpleDenseNet(**m["net"]),
                           optimizer=functools.partial(torch.optim.Adam, **m["optimizer"]),
                           scheduler=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, **m["scheduler"]),
                           compile=m["compile"])
    callbacks = [ModelCheckpoint(dirpath=os.path.join(out_dir, "checkpoints"), filename="epoch_{epoch:03d}",
                                 monitor="val/acc", mode="max", save_last=True, auto_insert_metric_name=False),
                 EarlyStopping(monitor="val/acc", patience=100, mode="max"),
                 ModelSummary(max_depth=-1), RichProgressBar()]
    logger = [CSVLogger(save_dir=out_dir, name="csv/")]
    trainer = Trainer(default_root_dir=out_dir, callbacks=callbacks, logger=logger, **cfg["trainer"],
                      **trainer_kwargs())
    object_dict = {"cfg": cfg, "datamodule": datamodule, "model": model, "callbacks": callbacks, "logger": logger,
                   "trainer": trainer}
    log_hyperparameters(object_dict)
    trainer.fit(model=model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    train_metrics = dict(trainer.callback_metrics)
    ckpt_path = trainer.checkpoint_callback.best_model_path
    tested = trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt_path)
    test_metrics = dict(trainer.callback_metrics)
    results = {"fit_metrics": train_metrics, "test": tested, "params": param_sums(model),   # the best checkpoint's
               "best": os.path.basename(ckpt_path).split(".")[0], "epochs": trainer.current_epoch}
    if trainer.is_global_zero:
        with open(os.path.join(trainer.logger.log_dir, "hparams.yaml")) as f:
            results["hparams_yaml"] = yaml.safe_load(f)
    write(trainer, **results)
    return train_metrics, test_metrics


if __name__ == "__main__":
    train(CFG, os.path.abspath("logs"))
