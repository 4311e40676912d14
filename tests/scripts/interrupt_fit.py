"""A fit that a test stops with a real SIGINT (Ctrl-C):

    python interrupt_fit.py OUT_DIR

Prints READY on stdout once a checkpoint exists; then it is slow enough to be
interrupted. The test checks the exit status (130), the message on stderr, that
the on_exception hook ran and that the CSV logger flushed its buffered rows.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ember import Trainer, TrainModule
from ember.callbacks import Callback, ModelCheckpoint
from ember.loggers import CSVLogger

out = sys.argv[1]


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train/loss", loss)
        if self.trainer.global_step >= 4:
            if self.trainer.global_step == 4:
                print("READY", flush=True)
            time.sleep(0.05)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Mark(Callback):
    def on_exception(self, trainer, module, exception):
        with open(os.path.join(out, "on_exception.txt"), "w") as f:
            f.write(type(exception).__name__)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
trainer = Trainer(max_epochs=10_000, logger=CSVLogger(save_dir=out, flush_logs_every_n_steps=1000),
                  callbacks=[Mark(), ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=2, save_last=True)],
                  log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, devices="cpu",
                  default_root_dir=out)
trainer.fit(Net(), DataLoader(data, batch_size=8))
print("fit returned", flush=True)
