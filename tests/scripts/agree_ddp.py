"""Cross-rank decisions made once and agreed (2 CPU processes, gloo, a 30 s process-group
timeout so a disagreement fails fast instead of hanging), run by tests/distributed/test_agree.py.

    python agree_ddp.py ROOT

1. should_stop set on rank 0 only, in a batch hook: both ranks stop at the same step
   (the next log point), recorded mid-epoch, stop_reason "should_stop" on both.
2. max_time with rank 1 slower: both ranks stop at the same step, no hang.
3. ModelCheckpoint(monitor=..., save_top_k=2) on a metric logged without sync_dist whose
   value differs per rank: no deadlock, the same top-k bookkeeping on both ranks.
4. The logger version: rank 1 reaches setup late, after rank 0 created version_0's
   checkpoint folder; both use rank 0's version (equal trainer.log_dir).
5. ckpt_path="last" restores the same checkpoint on both ranks (rank 0's resolution).
Every rank writes ROOT/result_<rank>.json.
"""
import functools
import os
import sys
import time

from torch.nn import functional as F

from ember.callbacks import Callback, ModelCheckpoint
from ember.loggers import CSVLogger

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, ddp_trainer, loader, write_result  # noqa: E402


class Net(Regressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        # deliberately NOT synced: each rank sees its own value (rank 1's ranks checkpoints the other way)
        v = F.mse_loss(self.net(x), y) * (1.0 if self.global_rank == 0 else -1.0)
        self.log("val_own", v)


class OnRank(Callback):
    def __init__(self, rank, fn, at=None):
        self.rank, self.fn, self.at = rank, fn, at

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and (self.at is None or (trainer.current_epoch, batch_idx) == self.at):
            self.fn(trainer)


class LateSetup(Callback):
    def setup(self, trainer, module, stage):
        if trainer.global_rank == 1:
            time.sleep(1.0)


# two processes, a 30 s process-group timeout, two epochs, a log point every 2 steps
trainer = functools.partial(ddp_trainer, devices=2, timeout=30, max_epochs=2, log_every_n_steps=2)


def main(root):
    out = {}
    # 1. should_stop on rank 0 only, at epoch 0 batch 2 (log points: every 2 steps)
    t = trainer(os.path.join(root, "s"), callbacks=[OnRank(0, lambda t: setattr(t, "should_stop", True), (0, 2))],
                enable_checkpointing=False)
    t.fit(Net(), loader(64))
    out["should_stop"] = [t.stop_reason, t.global_step, t.current_epoch, t.batches_done]
    # 2. max_time, rank 1 slower on every batch
    t = trainer(os.path.join(root, "t"), callbacks=[OnRank(1, lambda t: time.sleep(0.05))], max_time=0.5,
                max_epochs=50, enable_checkpointing=False)
    t.fit(Net(), loader(64))
    out["max_time"] = [t.stop_reason, t.global_step]
    # 3. top-k on a metric that differs per rank; 4. the run folder; 5. ckpt_path="last"
    root3 = os.path.join(root, "k")
    ck = ModelCheckpoint(monitor="val_own", save_top_k=2, save_last=True)
    t = trainer(root3, callbacks=[LateSetup(), ck], logger=CSVLogger(root3), max_epochs=4, val_check_interval=4)
    t.fit(Net(), loader(64), loader(16))
    out["topk"] = sorted(os.path.basename(p) for p in ck.best_k_models)
    out["best"] = os.path.basename(ck.best_model_path)
    out["log_dir"] = t.log_dir
    t2 = trainer(root3, callbacks=[ModelCheckpoint(monitor="val_own", save_top_k=2, save_last=True)],
                 logger=CSVLogger(root3, version=0), max_epochs=5, val_check_interval=4)
    t2.fit(Net(), loader(64), loader(16), ckpt_path="last")
    out["resumed"] = t2.ckpt_path
    write_result(root, f"result_{t.global_rank}", out)


if __name__ == "__main__":
    main(sys.argv[1])
