"""The tiny regressor the subprocess scripts share, and its data.

``Regressor``: one ``nn.Linear(4, 1)`` (``self.net``) trained with the MSE loss and SGD,
nothing logged; a script that needs more (hooks, logging, a value that differs per rank)
subclasses it. ``sum_data`` / ``loader``: 4 features drawn from a generator seeded 0, the
target their sum (a task the regressor learns); ``noise_data``: the target drawn too.
Neither touches the global RNG (only the ``nn.Linear`` initialisation does).
``sine_data`` / ``SineNet``: the launcher scripts' task (6 features, the target the sine
of their sum) and model (a seeded 6-16-1 Tanh MLP, AdamW). ``worker_context``: the
DataLoader keywords a rank's worker processes start with (a forkserver where forking them
can hang).

A script imports it as ``from common import Regressor, loader``: Python puts the
script's own folder first on ``sys.path``, also in the processes that ember's launcher,
``ember launch`` and ``torchrun`` start. A test imports it with ``SCRIPTS`` (tests/helpers.py)
on ``sys.path``.
"""
from __future__ import annotations

import os
import sys

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


def sine_data(n: int = 64) -> TensorDataset:
    """``n`` samples of 6 features drawn from a generator seeded 0, the target
    ``sin(sum(x))``; the global RNG is not touched."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


class SineNet(ember.TrainModule):
    """A 6-16-1 Tanh MLP built from ``torch.manual_seed(0)`` (the same weights on every
    rank and in every attempt), MSE loss, ``AdamW(lr=0.01)``; with ``log_loss``, the loss
    is logged as ``loss`` (``sync_dist=True``)."""

    def __init__(self, log_loss: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.log_loss = log_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.log_loss:
            self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def forking_can_hang() -> bool:
    """CPython before 3.11.8 (and 3.12.0) can deadlock a child forked while another thread
    holds the thread-list lock (gh-112275): a DataLoader worker forked by a rank (gloo's
    threads, ember's SIGTERM watcher) hung in ``os.fork`` about once in 30 runs of
    stateful_ddp.py on a loaded machine."""
    v = sys.version_info[:3]
    return v < (3, 11, 8) or v == (3, 12, 0)


def worker_context(*preload: str, main: bool = True) -> dict:
    """``DataLoader`` keywords for worker processes started by a rank: on a Python where
    forking can hang (``forking_can_hang``) and with more than one process, a forkserver
    with torch, ``preload`` and, with ``main``, the script itself (``__main__``, whose
    dataset classes the workers unpickle) imported once; otherwise nothing (forked workers)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not forking_can_hang():
        return {}
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload, *(["__main__"] if main else [])])
    return {"multiprocessing_context": ctx}
