"""A tiny regression model and its data, used by the `ember` CLI examples
(docs/cli.md) and tests: `ember fit --config examples/cli/config.yaml`.

With `PYTHONPATH=examples/cli` (or run from this folder) a config can name
these classes as `toy.ToyRegressor` and `toy.ToyData`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import DataModule, TrainModule


class ToyRegressor(TrainModule):
    """y = x @ w with a hidden layer; reports the number of optimizer steps it saw."""

    def __init__(self, hidden: int, lr: float = 0.05, in_features: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ToyData(DataModule):
    """`num_samples` random points of a fixed linear function (seeded: the same data every run)."""

    def __init__(self, batch_size: int = 16, num_samples: int = 128, in_features: int = 4,
                 seed: int = 0):
        super().__init__()
        self.batch_size, self.num_samples = batch_size, num_samples
        self.in_features, self.seed = in_features, seed

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_samples, self.in_features, generator=g)
        w = torch.randn(self.in_features, 1, generator=g)
        self.dataset = TensorDataset(x, x @ w)

    def _loader(self, shuffle: bool = False) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(shuffle=True)

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()
