"""Error paths that must not wait for the process-group timeout, and decisions rank 0
alone makes (2 CPU processes, gloo, ember's own launcher), run by tests/test_fail_fast.py.

    python failfast_ddp.py MODE ROOT

MODE ``save_enospc``: rank 0's checkpoint write fails with ENOSPC; every rank must raise
the real error within seconds (process-group timeout 60 s).
MODE ``ckpt_last``: ``ckpt_path="last"`` where rank 1's view of the run folder (its
``default_root_dir``, a separate folder) holds no checkpoint: both ranks restore rank 0's.
Every rank writes ROOT/<MODE>_<rank>.json.
"""
import errno
import json
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies import DDPStrategy


class Net(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def trainer(root, timeout=60, **kw):
    args = dict(max_epochs=1, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                default_root_dir=root, logger=False, enable_checkpointing=False)
    args.update(kw)
    return ember.Trainer(devices=2, strategy=DDPStrategy(timeout=timeout), **args)


def save_enospc(root):
    t = trainer(root)
    t.fit(Net(), loader())
    if t.global_rank == 0:
        from ember import checkpoint_io as cio
        real_save = cio.save_torch

        def full_disk(obj, f, *a, **kw):   # what the kernel answers when the disk fills mid-write
            real_save(obj, f, *a, **kw)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        cio.save_torch = full_disk
    start = time.monotonic()
    try:
        t.save_checkpoint(os.path.join(root, "ckpt"))
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start, "rank": t.global_rank}


def ckpt_last(root):
    from ember.callbacks import ModelCheckpoint
    t = trainer(root, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)], max_steps=3,
                max_epochs=5)
    t.fit(Net(), loader())
    # rank 1 sees a run folder without any checkpoint (as a node whose view of a shared
    # filesystem lags); rank 0 sees the real one
    rank = t.global_rank
    mine = root if rank == 0 else os.path.join(root, "empty_view")
    os.makedirs(mine, exist_ok=True)
    t2 = trainer(mine, enable_checkpointing=True, callbacks=[ModelCheckpoint(save_last=True)], max_steps=5,
                 max_epochs=5)
    try:
        t2.fit(Net(), loader(), ckpt_path="last")
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "resumed": getattr(t2, "ckpt_path", None), "global_step": t2.global_step, "rank": rank,
            "weights": [p.detach().flatten().tolist() for p in t2.module.parameters()]}


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    out = {"save_enospc": save_enospc, "ckpt_last": ckpt_last}[mode](root)
    with open(os.path.join(root, f"{mode}_{out['rank']}.json"), "w") as f:
        json.dump(out, f)
