"""Other ranks' prints above rank 0's live bar (2 CPU processes, gloo, 30 s timeout),
run by tests/callbacks/test_rank_output.py.

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

from rich.console import Console

import ember
from ember.callbacks import RichProgressBar
from ember.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, loader  # noqa: E402

LONG = "hello from rank 1: " + " ".join(f"word{i}" for i in range(30))


class Net(Regressor):
    def training_step(self, batch, batch_idx):
        time.sleep(0.03)   # let the bar refresh between steps
        if self.global_rank == 1 and self.current_epoch == 0 and batch_idx == 3:
            print(LONG)
            sys.stdout.write("partial ")
            sys.stdout.write("line\n")
            warnings.warn("rank one warns")
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, prog_bar=True)
        return loss


def main(root):
    console = Console(width=100, force_terminal=True, color_system=None, file=io.StringIO())
    bar = RichProgressBar(console=console, refresh_per_second=20)
    t = ember.Trainer(devices=2, strategy=DDPStrategy(timeout=30), max_epochs=2, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=2,
                      callbacks=[bar])
    t.fit(Net(), loader(64))
    if t.is_global_zero:
        with open(os.path.join(root, "console_0.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(console.file.getvalue())   # the raw terminal stream
    print(f"rank {t.global_rank} done; stdout restored: {sys.stdout is sys.__stdout__}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
