"""Train the run of resume_common.py in this process (used by the subprocess tests).

    python resume_train.py ROOT [--resume] [--out FILE] [--kill-at EPOCH BATCH]
                                [--ready-at EPOCH BATCH --slow SECONDS] [--epochs N] [--every N]

--resume          fit(ckpt_path="last")
--out FILE        torch.save the end-of-fit snapshot to FILE
--kill-at E B     SIGKILL this process at the start of batch B of epoch E
--ready-at E B    print "ready" at the start of that batch, then sleep --slow seconds per
                  batch (time for the parent to send a signal)
Prints "start <global_step> <ckpt_path>" when training starts and "done" at the end.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from resume_common import fit, snapshot  # noqa: E402


class Control(Callback):
    def __init__(self, kill_at=None, ready_at=None, slow=0.0):
        self.kill_at, self.ready_at, self.slow = kill_at, ready_at, slow
        self.slowing = False

    def on_train_start(self, trainer, module):
        print(f"start {trainer.global_step} {getattr(trainer, 'ckpt_path', None)}", flush=True)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        at = (trainer.current_epoch, batch_idx)
        if at == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if at == self.ready_at:
            print("ready", flush=True)
            self.slowing = True
        if self.slowing:
            time.sleep(self.slow)


def run(root, resume=False, out=None, kill_at=None, ready_at=None, slow=0.0, epochs=None, every=2, top_k=2):
    kw = {} if epochs is None else {"max_epochs": epochs}
    ckpt = ModelCheckpoint(every_n_train_steps=every, save_last=True, save_top_k=top_k)
    module, trainer = fit(root, ckpt_path="last" if resume else None, checkpoint=ckpt,
                          callbacks=[Control(kill_at, ready_at, slow)], **kw)
    if out:
        torch.save(snapshot(module, trainer), out)
    print("done", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out")
    p.add_argument("--kill-at", nargs=2, type=int)
    p.add_argument("--ready-at", nargs=2, type=int)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--epochs", type=int)
    p.add_argument("--every", type=int, default=2)
    a = p.parse_args(argv)
    run(a.root, a.resume, a.out, tuple(a.kill_at) if a.kill_at else None,
        tuple(a.ready_at) if a.ready_at else None, a.slow, a.epochs, a.every)


if __name__ == "__main__":
    main()
