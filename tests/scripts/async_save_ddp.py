"""Background checkpoint writes under DDP (2 CPU processes, gloo, a 30 s process-group
timeout), run by tests/strategies/test_async_save.py.

    python async_save_ddp.py ROOT

1. The same run with ModelCheckpoint every step, synchronous and with
   DDPStrategy(async_save=True): both ranks record whether they hold a background
   write after each save (only rank 0 writes) and the final parameters.
2. A write that fails on rank 0 raises on both ranks at the next save.
Every rank writes ROOT/result_<rank>.json.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resume_common import fit  # noqa: E402

from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.strategies import DDPStrategy  # noqa: E402


class Writers(Callback):
    def __init__(self):
        self.pending = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.pending.append(trainer.strategy._pending_save is not None)


class BadStateAt(Callback):
    def on_save_checkpoint(self, trainer, module, checkpoint):
        if trainer.global_step == 2:
            checkpoint["bad"] = object()


def main(root):
    out = {}
    for mode in ("sync", "async"):
        rec = Writers()
        module, trainer = fit(os.path.join(root, mode), callbacks=[rec],
                              checkpoint=ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, filename="{step}"),
                              devices=2, strategy=DDPStrategy(timeout=30, async_save=mode == "async"))
        out[mode] = {"pending": rec.pending, "rank": trainer.global_rank,
                     "params": {n: p.detach().tolist() for n, p in module.named_parameters()}}
    try:
        fit(os.path.join(root, "fail"), callbacks=[BadStateAt()], devices=2,
            checkpoint=ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, filename="{step}"),
            strategy=DDPStrategy(timeout=30, async_save=True))
        out["fail"] = None
    except Exception as err:
        out["fail"] = f"{type(err).__name__}: {err}"
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(root, f"result_{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
