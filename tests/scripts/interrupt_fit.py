"""A fit that a test stops with a real SIGINT (Ctrl-C):

    python interrupt_fit.py OUT_DIR

Prints READY on stdout once a checkpoint exists; then it is slow enough to be
interrupted. The test checks the exit status (130), the message on stderr, that
the on_exception hook ran and that the CSV logger flushed its buffered rows.
"""
import os
import signal
import sys
import time

# a test runner started with '&' from a non-interactive shell has SIGINT ignored, and an ignored
# signal stays ignored across exec: give this process Python's default Ctrl-C handling
signal.signal(signal.SIGINT, signal.default_int_handler)

from torch.utils.data import DataLoader

from ember import Trainer
from ember.callbacks import Callback, ModelCheckpoint
from ember.loggers import CSVLogger

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, noise_data  # noqa: E402

out = sys.argv[1]


class Net(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        if self.trainer.global_step >= 4:
            if self.trainer.global_step == 4:
                print("READY", flush=True)
            time.sleep(0.05)
        return loss


class Mark(Callback):
    def on_exception(self, trainer, module, exception):
        with open(os.path.join(out, "on_exception.txt"), "w") as f:
            f.write(type(exception).__name__)


data = noise_data(64)
trainer = Trainer(max_epochs=10_000, logger=CSVLogger(save_dir=out, flush_logs_every_n_steps=1000),
                  callbacks=[Mark(), ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=2, save_last=True)],
                  log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, devices="cpu",
                  default_root_dir=out)
trainer.fit(Net(lr=0.1), DataLoader(data, batch_size=8))
print("fit returned", flush=True)
