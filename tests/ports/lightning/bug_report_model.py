"""Port of Lightning's ``examples/pytorch/bug_report/bug_report_model.py`` (the
BoringModel template for bug reports), written against ember's names.

Same structure and API usage as the original: a random dataset, ``training_step``
returning ``{"loss": loss}``, ``self.log`` in the train/validation/test steps,
``Trainer(limit_train_batches=1, limit_val_batches=1, limit_test_batches=1,
num_sanity_val_steps=0, max_epochs=1, enable_model_summary=False)``, ``fit`` then
``test``.

Changed from the original, and why: ``ember`` imports; ``seed_everything(0)``
first so the random dataset and weights are the same on both libraries; the
numbers are written out for the comparison; the training loader shuffles under
DDP only (``common.SHUFFLE_TRAIN``: Lightning's DDP sampler shuffles whatever the
loader says).

Features used: Trainer(limit_test_batches=...), a dict returned by training_step,
self.log in every step.

    python tests/ports/lightning/bug_report_model.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import os

import torch
from torch.utils.data import DataLoader, Dataset

from common import SHUFFLE_TRAIN, param_sums, trainer_kwargs, write

from ember import TrainModule, Trainer, seed_everything  # (from lightning.pytorch import LightningModule, Trainer)


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class BoringModel(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("valid_loss", loss)

    def test_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("test_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def run():
    seed_everything(0)
    train_data = DataLoader(RandomDataset(32, 64), batch_size=2, shuffle=SHUFFLE_TRAIN)
    val_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    test_data = DataLoader(RandomDataset(32, 64), batch_size=2)

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=os.getcwd(),
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        max_epochs=1,
        enable_model_summary=False,
        **trainer_kwargs(),
    )
    trainer.fit(model, train_dataloaders=train_data, val_dataloaders=val_data)
    fit_metrics = dict(trainer.callback_metrics)
    tested = trainer.test(model, dataloaders=test_data)
    write(trainer, fit_metrics=fit_metrics, params=param_sums(model), test=tested)


if __name__ == "__main__":
    run()
