"""A 2-process DDP fit whose module logs epoch values with and without sync_dist:

    python unsynced_metric.py OUT_DIR

``val/rank`` differs per rank and is logged without sync_dist (warned once, by
name); ``val/same`` is equal on every rank and ``val/synced`` is reduced, so
neither is named. ``train/only_rank1`` is logged on rank 1 only: rank 0 emits no
training epoch value, yet the check must not hang (and names it).
"""
import os
import sys

from torch.utils.data import DataLoader

from ember import Trainer
from ember.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, noise_data  # noqa: E402


class Net(Regressor):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1:   # rank 0 has no training epoch value at all
            self.log("train/only_rank1", 1.0, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val/rank", float(self.trainer.global_rank))
        self.log("val/same", 1.0)
        self.log("val/synced", float(self.trainer.global_rank), sync_dist=True)


data = noise_data(32)
trainer = Trainer(max_epochs=2, strategy=DDPStrategy(timeout=45), devices=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, default_root_dir=sys.argv[1])
trainer.fit(Net(lr=0.1), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
