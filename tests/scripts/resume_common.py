"""The setup every resume test uses, in one place so that the in-process tests and
the subprocess scripts train exactly the same run.

A tiny regression net with dropout, AdamW, a per-step scheduler (LambdaLR or
OneCycleLR), precision "16-mixed" (a GradScaler, also on CPU),
accumulate_grad_batches=3, shuffled data with an uneven last batch (50 samples,
batch size 8: 7 batches per epoch, the last one of 2 samples; accumulation windows
of 3, 3 and 1 batches: 3 optimizer steps per epoch), and a loss that also draws
from Python's and NumPy's global generators, so every RNG stream matters.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint

SEED = 1234
N, DIM, BATCH = 50, 4, 8
ACC = 3
EPOCHS = 3
BATCHES_PER_EPOCH = 7
STEPS_PER_EPOCH = 3


def dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, DIM, generator=g)
    y = x @ torch.linspace(-1, 1, DIM).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loaders():
    train = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    val = DataLoader(dataset(24), batch_size=12)
    return train, val


class ResumeNet(ember.TrainModule):
    def __init__(self, lr: float = 0.05, scheduler: str = "lambda", hidden: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Dropout(0.25), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        # python + numpy draws: their generators must be restored too
        wobble = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
        loss = F.mse_loss(self.net(x).float(), y) * wobble
        self.log("train/loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        if self.hparams.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr,
                                                        total_steps=self.trainer.estimated_stepping_batches)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Interrupt(Callback):
    """Raise at the start of batch ``batch_idx`` of epoch ``epoch`` (that batch never runs)."""

    def __init__(self, epoch: int, batch_idx: int, exc=RuntimeError):
        self.at, self.exc = (epoch, batch_idx), exc

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == self.at:
            raise self.exc(f"interrupted at epoch {self.at[0]} batch {self.at[1]}")


def make_trainer(root, callbacks=(), checkpoint: ModelCheckpoint | None = None, **kw) -> ember.Trainer:
    args = dict(max_epochs=EPOCHS, precision="16-mixed", accumulate_grad_batches=ACC, log_every_n_steps=2,
                default_root_dir=str(root), logger=False, enable_progress_bar=False, enable_model_summary=False)
    args.update(kw)
    if checkpoint is None:
        checkpoint = ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=2)
    return ember.Trainer(callbacks=[*callbacks, checkpoint], **args)


def fit(root, ckpt_path=None, callbacks=(), checkpoint=None, scheduler: str = "lambda", module_kw=None, **kw):
    """Seed, build a fresh module and Trainer, fit; returns (module, trainer)."""
    ember.seed_everything(SEED)
    module = ResumeNet(scheduler=scheduler, **(module_kw or {}))
    trainer = make_trainer(root, callbacks, checkpoint, **kw)
    train, val = loaders()
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return module, trainer


def snapshot(module, trainer) -> dict:
    """Everything that must match an uninterrupted run, as plain tensors/containers."""
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": {k: v for k, v in trainer.lr_scheduler_configs[0]["scheduler"].state_dict().items()
                      if k not in ("lr_lambdas", "anneal_func")},
        "scaler": trainer.strategy.precision.state_dict(),
    }


def differences(a, b, where: str = "") -> list[str]:
    """Paths where two snapshots differ (empty: bit-identical)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
