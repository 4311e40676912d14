"""Lightning Trainer arguments under 2 CPU processes (gloo, a 30 s process-group
timeout), run by tests/trainer/test_lightning_args_multiproc.py.

    python lightning_args_ddp.py ROOT

1. use_distributed_sampler=False: every rank reads the whole loader as given;
   True (default): each rank reads its half.
2. min_epochs=2 with should_stop set on rank 0 at the first batch: both ranks train
   two epochs, then stop together ("should_stop").
3. sync_batchnorm=True with BatchNorm on CPU processes: a clear error on both ranks.
4. trainer.num_devices / device_ids / num_nodes / state; trainer.print prints on rank 0 only.
Every rank writes ROOT/result_<rank>.json.
"""
import functools
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ember.callbacks import Callback
from ember.errors import MisconfigurationError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, ddp_trainer, write_result  # noqa: E402


class Net(Regressor):
    """Records the first feature of each batch it trains on; with ``bn``, a BatchNorm
    before the linear layer."""

    def __init__(self, bn=False):
        super().__init__()
        self.bn = nn.BatchNorm1d(4) if bn else nn.Identity()
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(int(x[0, 0].mul(1000).round()))
        return F.mse_loss(self.net(self.bn(x)), y)


def loader(n=16):
    x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) / 1000
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class StopOnRank0(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            trainer.should_stop = True


# two processes, a 30 s process-group timeout, one epoch, no checkpoint
trainer = functools.partial(ddp_trainer, devices=2, timeout=30, max_epochs=1, log_every_n_steps=1,
                            enable_checkpointing=False)


def main(root):
    out = {}
    for flag in (False, True):
        m = Net()
        trainer(root, use_distributed_sampler=flag).fit(m, loader())
        out[f"sampler_{flag}"] = m.seen
    t = trainer(root, max_epochs=5, min_epochs=2, callbacks=[StopOnRank0()])
    t.fit(Net(), loader())
    out["min_epochs"] = [t.stop_reason, t.current_epoch, t.global_step]
    out["helpers"] = [t.num_devices, t.device_ids, t.num_nodes, t.world_size, str(t.state.status.value)]
    t.print(f"trainer.print from rank {t.global_rank}", flush=True)
    try:
        trainer(root, sync_batchnorm=True).fit(Net(bn=True), loader())
        out["sync_bn"] = None
    except MisconfigurationError as e:
        out["sync_bn"] = str(e)
    write_result(root, f"result_{t.global_rank}", out)


if __name__ == "__main__":
    main(sys.argv[1])
