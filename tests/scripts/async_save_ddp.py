"""Background checkpoint writes under DDP (2 CPU processes, gloo, a 30 s process-group
timeout), run by tests/strategies/test_async_save.py.

    python async_save_ddp.py ROOT

1. The same run with ModelCheckpoint every step, synchronous and with
   DDPStrategy(async_save=True): both ranks record whether they hold a background
   write after each save (only rank 0 writes) and the final parameters.
2. A write that fails on rank 0 raises on both ranks at the next save.
3. ModelCheckpoint(save_top_k=1, save_last=True) with rank 0's step-2 write held (a gate
   in its trainer state) until step 3: before each save, every rank records the complete
   checkpoints and where 'last' points; the superseded checkpoint must stay, and 'last'
   name it, until the new one is committed.
Every rank writes ROOT/result_<rank>.json.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402
from resume_common import fit  # noqa: E402
from shard_common import CommittedWatch, committed_steps, last_step  # noqa: E402

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


class Gate:
    """A trainer-state entry whose pickling (on rank 0's writer thread) waits for ``opened``."""
    opened = None

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        assert Gate.opened.wait(30), "the gate was never opened"
        return (Gate, ())


class HoldStep2(CommittedWatch):
    """Holds rank 0's step-2 write until step 3's observation is made."""

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if trainer.global_step == 2:
            checkpoint["gate"] = Gate()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        if trainer.global_step == 3:
            Gate.opened.set()


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
    import threading
    Gate.opened = threading.Event()
    torch.serialization.add_safe_globals([Gate])
    ckdir = os.path.join(root, "topk", "checkpoints")
    watch = HoldStep2(ckdir)
    fit(os.path.join(root, "topk"), callbacks=[watch], devices=2, strategy=DDPStrategy(timeout=30, async_save=True),
        checkpoint=ModelCheckpoint(dirpath=ckdir, every_n_train_steps=1, save_top_k=1, save_last=True,
                                   filename="{step}"), max_epochs=None, max_steps=4)
    torch.distributed.barrier()   # rank 0 (the writer) has finished its deletions before anyone lists the folder
    out["topk"] = {"seen": watch.seen, "final": committed_steps(ckdir), "last": last_step(ckdir)}
    rank = int(os.environ.get("RANK", 0))
    write_result(root, f"result_{rank}", out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
