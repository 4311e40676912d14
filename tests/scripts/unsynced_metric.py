"""A 2-process DDP fit whose module logs epoch values with and without sync_dist:

    python unsynced_metric.py OUT_DIR

``val/rank`` differs per rank and is logged without sync_dist (warned once, by
name); ``val/same`` is equal on every rank and ``val/synced`` is reduced, so
neither is named. ``train/only_rank1`` is logged on rank 1 only: rank 0 emits no
training epoch value, yet the check must not hang (and names it).
"""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ember import Trainer, TrainModule
from ember.strategies import DDPStrategy


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_rank == 1:   # rank 0 has no training epoch value at all
            self.log("train/only_rank1", 1.0, on_step=False, on_epoch=True)
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val/rank", float(self.trainer.global_rank))
        self.log("val/same", 1.0)
        self.log("val/synced", float(self.trainer.global_rank), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
trainer = Trainer(max_epochs=2, strategy=DDPStrategy(timeout=45), devices=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, default_root_dir=sys.argv[1])
trainer.fit(Net(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
