"""Exact resume under DDP (2 CPU processes, gloo), run by tests/checkpoint/test_resume.py. Each rank
sees 25 samples per epoch: 4 batches (8, 8, 8, 1), accumulation windows of 3 and 1.

    python resume_ddp.py ROOT

A: a checkpoint saved inside an accumulation window (each rank's pending gradients
   differ) resumes bit-exactly;
B: SIGTERM delivered to rank 1 only: the ranks agree at the next log point, all save
   'last' and stop (EMBER_PREEMPTION_EXIT=0: fit returns), and the resume is exact.
Rank 0 writes ROOT/result.json.
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["EMBER_PREEMPTION_EXIT"] = "0"
os.environ.setdefault("EMBER_CHECKPOINT_FSYNC", "0")

from ember.checkpoint import io as cio  # noqa: E402
from ember.callbacks import Callback  # noqa: E402
from resume_common import differences, fit, snapshot  # noqa: E402

DDP = dict(devices=2, strategy="ddp")


class SaveAt(Callback):
    def __init__(self, epoch, batch_idx, path):
        self.at, self.path = (epoch, batch_idx), path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == self.at:
            trainer.save_checkpoint(self.path)


class SignalOneRank(Callback):
    def __init__(self, rank, epoch, batch_idx):
        self.rank, self.at = rank, (epoch, batch_idx)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_rank == self.rank and (trainer.current_epoch, batch_idx) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def main(root):
    m, t = fit(os.path.join(root, "ref"), **DDP)
    ref, rank = snapshot(m, t), t.global_rank
    # A
    inside = os.path.join(root, "a", "inside")
    fit(os.path.join(root, "a"), callbacks=[SaveAt(1, 1, inside)], max_steps=3, **DDP)
    state = cio.read_checkpoint(inside)[1]
    a = differences(ref, snapshot(*fit(os.path.join(root, "a"), ckpt_path=inside, **DDP)))
    # B
    b_root = os.path.join(root, "b")
    _, tb = fit(b_root, callbacks=[SignalOneRank(1, 1, 0)], log_every_n_steps=2, **DDP)
    stopped = (tb.global_step, tb.interrupted)
    b = differences(ref, snapshot(*fit(b_root, ckpt_path="last", log_every_n_steps=2, **DDP)))
    if rank == 0:
        last = cio.read_checkpoint(os.path.join(b_root, "checkpoints", "last"))[1]
        with open(os.path.join(root, "result.json"), "w") as f:
            json.dump({"a": a, "b": b, "grads_ranks": len(state["grads"] or []),
                       "grads_differ": any(not (state["grads"][0][k] == state["grads"][1][k]).all()
                                           for k in state["grads"][0]),
                       "rng_ranks": len(state["rng"]), "stopped": stopped,
                       "last_step_after_resume": last["loop"]["global_step"]}, f)


if __name__ == "__main__":
    main(sys.argv[1])
