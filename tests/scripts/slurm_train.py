"""A 2-task DDP fit under a real ``srun``, for tests/launch/test_slurm.py.

    srun -n 2 python slurm_train.py OUT TAG [--wait-at STEP]

Each task is one rank (ember's SLURM environment). Checkpoints every 2 optimizer steps in
OUT/TAG/checkpoints; a SIGUSR1 or SIGTERM saves ``last`` there and ends the fit (on
SIGUSR1 rank 0 also runs ``scontrol requeue``). A run that finds ``last`` there (the
requeued job, or a second srun after a SIGTERM) resumes from it. Rank 0 appends
"SLURM_RESTART_COUNT first-step world" to OUT/TAG.attempts and, when the fit ends,
writes OUT/TAG.safetensors. With --wait-at, a first run writes OUT/TAG.ready after
that optimizer step and computes until a signal arrives (90 s at most), so that the test
can have one sent.
"""
from __future__ import annotations

import argparse
import os
import signal
import time

from safetensors.torch import save_file
from torch.utils.data import DataLoader

from common import SineNet, sine_data
import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.strategies import DDPStrategy


class Record(Callback):
    def __init__(self, a, resumed: bool):
        self.a, self.first, self.resumed = a, True, resumed

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.first and trainer.is_global_zero:
            with open(os.path.join(self.a.out, f"{self.a.tag}.attempts"), "a") as f:
                f.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {trainer.global_step} {trainer.world_size}\n")
        self.first = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.a.wait_at and not self.resumed:
            if trainer.is_global_zero:
                with open(os.path.join(self.a.out, f"{self.a.tag}.ready"), "w") as f:
                    f.write("ready\n")
            wait_for_signal(90.0)


def wait_for_signal(seconds: float) -> None:
    """Compute for up to ``seconds``, until SIGUSR1 or SIGTERM arrives (ember's handler,
    chained, takes it as a preemption request at the next optimizer step)."""
    got = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}

    def handler(signum, frame):
        got.append(signum)
        if callable(previous[signum]):
            previous[signum](signum, frame)

    for s in previous:
        signal.signal(s, handler)
    try:
        end = time.monotonic() + seconds
        while not got and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--wait-at", type=int, default=-1)
    a = p.parse_args()
    loader = DataLoader(sine_data(), batch_size=4, shuffle=True)
    ckpt_dir = os.path.join(a.out, a.tag, "checkpoints")
    resumed = os.path.exists(os.path.join(ckpt_dir, "last"))   # the requeued job, or a second srun
    trainer = ember.Trainer(max_epochs=2, devices="cpu", strategy=DDPStrategy(timeout=30), seed=7,
                            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1),
                                       Record(a, resumed)],
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=os.path.join(a.out, a.tag))
    module = SineNet()
    trainer.fit(module, loader, ckpt_path="last" if resumed else None)
    if trainer.is_global_zero:
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  os.path.join(a.out, f"{a.tag}.safetensors"))


if __name__ == "__main__":
    main()
