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

import os
import signal

from torch.utils.data import DataLoader

from common import AttemptLog, SineNet, ddp_trainer, out_tag_parser, restart_count, save_weights, sine_data, \
    wait_for_signal
from ember.callbacks import ModelCheckpoint


class Record(AttemptLog):
    def __init__(self, a, resumed: bool):
        super().__init__(a.out, a.tag)
        self.a, self.resumed = a, resumed

    def line(self, trainer) -> str:
        return f"{restart_count('SLURM_RESTART_COUNT')} {trainer.global_step} {trainer.world_size}"

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.a.wait_at and not self.resumed:
            if trainer.is_global_zero:
                with open(os.path.join(self.a.out, f"{self.a.tag}.ready"), "w") as f:
                    f.write("ready\n")
            wait_for_signal(90.0, (signal.SIGUSR1, signal.SIGTERM))


def main() -> None:
    p = out_tag_parser()
    p.add_argument("--wait-at", type=int, default=-1)
    a = p.parse_args()
    loader = DataLoader(sine_data(), batch_size=4, shuffle=True)
    ckpt_dir = os.path.join(a.out, a.tag, "checkpoints")
    resumed = os.path.exists(os.path.join(ckpt_dir, "last"))   # the requeued job, or a second srun
    trainer = ddp_trainer(os.path.join(a.out, a.tag), max_epochs=2, seed=7,
                          callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1),
                                     Record(a, resumed)])
    module = SineNet()
    trainer.fit(module, loader, ckpt_path="last" if resumed else None)
    save_weights(trainer, module, os.path.join(a.out, f"{a.tag}.safetensors"))


if __name__ == "__main__":
    main()
