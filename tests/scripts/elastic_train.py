"""A 2-process DDP fit for tests/launch/test_elastic.py, run under ``ember launch``.

    ember launch --num_processes 2 --max_restarts 1 elastic_train.py OUT TAG [--kill-at STEP]

Checkpoints every 2 optimizer steps. With --kill-at, rank 1 SIGKILLs itself after
that step in the first attempt (TORCHELASTIC_RESTART_COUNT == 0); the elastic agent
restarts the group, which resumes from the newest checkpoint by itself (no
ckpt_path in this script). Rank 0 writes OUT/TAG.safetensors (final weights) and
appends the attempt's first step to OUT/TAG.attempts.
"""
from __future__ import annotations

import os
import signal

from torch.utils.data import DataLoader

from common import AttemptLog, SineNet, ddp_trainer, out_tag_parser, restart_count, save_weights, sine_data
import ember
from ember.callbacks import ModelCheckpoint


class KillAt(AttemptLog):
    def __init__(self, step: int, out: str, tag: str):
        super().__init__(out, tag)
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        if restart_count() == 0 and trainer.global_step == self.step and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = out_tag_parser()
    p.add_argument("--kill-at", type=int, default=-1)
    a = p.parse_args()
    ember.seed_everything(0)
    loader = DataLoader(sine_data(), batch_size=4, shuffle=True)
    ckpt = ModelCheckpoint(dirpath=os.path.join(a.out, a.tag), every_n_train_steps=2, save_top_k=-1)
    trainer = ddp_trainer(os.path.join(a.out, a.tag), timeout=60, max_epochs=2,
                          callbacks=[ckpt, KillAt(a.kill_at, a.out, a.tag)])
    module = SineNet()
    trainer.fit(module, loader)
    save_weights(trainer, module, os.path.join(a.out, f"{a.tag}.safetensors"))


if __name__ == "__main__":
    main()
