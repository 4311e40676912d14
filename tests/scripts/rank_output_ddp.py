"""Other ranks' prints above rank 0's live bar (2 CPU processes, gloo, 30 s timeout),
run by tests/test_rank_output.py.

    python rank_output_ddp.py ROOT

Rank 0 draws on a recording rich Console (a terminal, 100 columns); rank 1 prints a
long line, a line written in two pieces, and a warning in the middle of the fit. Rank 0
writes the raw terminal stream of its console to ROOT/console_0.txt.
"""
import io
import os
import sys
import time
import warnings

import torch
from rich.console import Console
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import RichProgressBar
from ember.strategies import DDPStrategy

LONG = "hello from rank 1: " + " ".join(f"word{i}" for i in range(30))


class Net(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.03)   # let the bar refresh between steps
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == 3:
            print(LONG)
            sys.stdout.write("partial ")
            sys.stdout.write("line\n")
            warnings.warn("rank one warns")
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(root):
    console = Console(width=100, force_terminal=True, color_system=None, file=io.StringIO())
    bar = RichProgressBar(console=console, refresh_per_second=20)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    t = ember.Trainer(devices=2, strategy=DDPStrategy(timeout=30), max_epochs=2, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=2,
                      callbacks=[bar])
    t.fit(Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    if t.is_global_zero:
        with open(os.path.join(root, "console_0.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(console.file.getvalue())   # the raw terminal stream
    print(f"rank {t.global_rank} done; stdout restored: {sys.stdout is sys.__stdout__}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
