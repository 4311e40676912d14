"""Many fits in one process, each given one SIGINT at another moment after its 4th optimizer
step, while it checkpoints every 2 steps with fsync on (the case where a single Ctrl-C used
to be lost under load). Prints one JSON line per fit: how it ended and how long the stop took.

usage: sigint_timings.py OUT_DIR N_TIMINGS MAX_DELAY_S
"""
import json
import os
import signal
import sys
import threading
import time

os.environ["EMBER_CHECKPOINT_FSYNC"] = "1"   # the fsync path the lost Ctrl-C was seen in
sys.ps1 = ">>> "   # an interactive session for ember: KeyboardInterrupt propagates (no SystemExit(130))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ember  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402


class Net(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Fire(Callback):
    """After the 4th optimizer step, a thread sends SIGINT to this process ``delay`` seconds later."""

    def __init__(self, delay):
        self.delay, self.sent = delay, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 4 and self.sent is None:
            self.sent = 0.0

            def fire():
                time.sleep(self.delay)
                self.sent = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=fire, daemon=True).start()


out, n, max_delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(4096, 64, generator=g), torch.randn(4096, 1, generator=g)), batch_size=8)
for i in range(n):
    delay = max_delay * i / max(n - 1, 1)
    fire = Fire(delay)
    trainer = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[fire, ModelCheckpoint(dirpath=os.path.join(out, str(i)),
                                                             every_n_train_steps=2, save_top_k=-1)],
                            default_root_dir=os.path.join(out, str(i)))
    outcome = "finished"
    try:
        trainer.fit(Net(), data)
    except KeyboardInterrupt:
        outcome = "interrupted"
    took = time.monotonic() - fire.sent if fire.sent else None
    print(json.dumps({"delay": delay, "outcome": outcome, "stop_s": took, "step": trainer.global_step,
                      "reason": trainer.stop_reason}), flush=True)
