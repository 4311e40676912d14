"""The tiny regressor the subprocess scripts share, and its data.

``Regressor``: one ``nn.Linear(4, 1)`` (``self.net``) trained with the MSE loss and SGD,
nothing logged; a script that needs more (hooks, logging, a value that differs per rank)
subclasses it. ``sum_data`` / ``loader``: 4 features drawn from a generator seeded 0, the
target their sum (a task the regressor learns); ``noise_data``: the target drawn too.
Neither touches the global RNG (only the ``nn.Linear`` initialisation does).

A script imports it as ``from common import Regressor, loader``: Python puts the
script's own folder first on ``sys.path``, also in the processes that ember's launcher,
``ember launch`` and ``torchrun`` start. A test imports it with ``SCRIPTS`` (tests/helpers.py)
on ``sys.path``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember


class Regressor(ember.TrainModule):
    """``nn.Linear(4, 1)`` trained with ``F.mse_loss`` and ``SGD(lr=lr)``."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def sum_data(n: int = 32) -> TensorDataset:
    """``n`` rows of 4 normal features (generator seeded 0); the target is their sum."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def noise_data(n: int = 32) -> TensorDataset:
    """``n`` rows of 4 normal features and a normal target, drawn in that order from one
    generator seeded 0."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int = 32, batch_size: int = 4) -> DataLoader:
    """``sum_data(n)`` in order, ``batch_size`` rows a batch."""
    return DataLoader(sum_data(n), batch_size=batch_size)
