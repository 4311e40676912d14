"""A sync_dist metric logged on one rank only (2 CPU processes, gloo, a 10 s
process-group timeout so a hang fails fast), run by tests/trainer/test_logging_ddp.py.

    python sync_keys_ddp.py ROOT

1. ``step``: training_step logs ``only_rank0`` with sync_dist=True on rank 0 only
   (rank 1 logs nothing at all), emitted at the step log point.
2. ``epoch``: validation_step logs ``only_rank1`` with sync_dist=True on rank 1 only,
   emitted at the validation epoch end.
3. ``late``: rank 0 alone logs ``late_rank0`` (no sync_dist) in on_train_epoch_end, a
   common pattern that must not hang; each rank logs ``v`` = 10 * rank per step with
   sync_dist=True, and records ``callback_metrics["v"]`` in on_train_epoch_end: the
   reduced value of the last log point (5.0), not its own.
4. ``eval_step``: validation_step logs ``val_v`` = 10 * rank with on_step=True,
   on_epoch=True, sync_dist=True: the per-batch values are each rank's own (warned once,
   on rank 0), the epoch value is the reduced one (5.0).
Every rank records the error it raised (or None) in ROOT/result_<rank>.json.
"""
import os
import sys
import time
import warnings

from torch.utils.data import DataLoader


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, ddp_trainer, noise_data, write_result  # noqa: E402


class Net(Regressor):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def on_fit_start(self):
        self.fit_started = time.monotonic()   # every rank is up and in the process group

    def training_step(self, batch, batch_idx):
        if self.where == "step" and self.global_rank == 0:
            self.log("only_rank0", 1.0, on_step=True, sync_dist=True)
        if self.where == "late":
            self.log("v", 10.0 * self.global_rank, on_step=True, on_epoch=False, sync_dist=True)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        if self.where == "late":
            self.seen_v = float(self.trainer.callback_metrics["v"])
            if self.global_rank == 0:
                self.log("late_rank0", 1.0)

    def validation_step(self, batch, batch_idx):
        if self.where == "epoch" and self.global_rank == 1:
            self.log("only_rank1", 1.0, sync_dist=True)
        if self.where == "eval_step":
            self.log("val_v", 10.0 * self.global_rank, on_step=True, on_epoch=True, sync_dist=True)


def main(root):
    data = noise_data(64)
    out = {}
    for where in ("step", "epoch", "late", "eval_step"):
        trainer = ddp_trainer(root, devices=2, timeout=10, max_epochs=1, enable_checkpointing=False, log_every_n_steps=2)
        start = time.monotonic()
        net = Net(where)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(net, DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
            out[where] = None
        except Exception as err:   # noqa: BLE001 - recorded for the test
            out[where] = f"{type(err).__name__}: {err}"
        out[where + "_warned"] = [str(w.message) for w in caught if "rank 0's own" in str(w.message)]
        out[where + "_logged"] = {k: v for k, v in trainer.logged_metrics.items() if k.startswith("val_v")}
        # from the start of fit on every rank (the first fit also starts rank 1, slow on a busy machine)
        out[where + "_seconds"] = time.monotonic() - getattr(net, "fit_started", start)
        out[where + "_seen_v"] = getattr(net, "seen_v", None)
        out["rank"] = trainer.global_rank
    write_result(root, f"result_{out['rank']}", out)


if __name__ == "__main__":
    main(sys.argv[1])
