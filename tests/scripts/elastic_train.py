"""A 2-process DDP fit for tests/launch/test_elastic.py, run under ``ember launch``.

    ember launch --num_processes 2 --max_restarts 1 elastic_train.py OUT TAG [--kill-at STEP]

Checkpoints every 2 optimizer steps. With --kill-at, rank 1 SIGKILLs itself after
that step in the first attempt (TORCHELASTIC_RESTART_COUNT == 0); the elastic agent
restarts the group, which resumes from the newest checkpoint by itself (no
ckpt_path in this script). Rank 0 writes OUT/TAG.safetensors (final weights) and
appends the attempt's first step to OUT/TAG.attempts.
"""
from __future__ import annotations

import argparse
import os
import signal

from safetensors.torch import save_file
from torch.utils.data import DataLoader

from common import SineNet, sine_data
import ember
from ember.strategies import DDPStrategy
from ember.callbacks import Callback, ModelCheckpoint


class KillAt(Callback):
    def __init__(self, step: int, out: str, tag: str):
        self.step, self.out, self.tag, self.first = step, out, tag, True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.first and trainer.is_global_zero:
            with open(os.path.join(self.out, f"{self.tag}.attempts"), "a") as f:
                f.write(f"{trainer.global_step}\n")
        self.first = False
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restarts == 0 and trainer.global_step == self.step and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--kill-at", type=int, default=-1)
    a = p.parse_args()
    ember.seed_everything(0)
    loader = DataLoader(sine_data(), batch_size=4, shuffle=True)
    ckpt = ModelCheckpoint(dirpath=os.path.join(a.out, a.tag), every_n_train_steps=2, save_top_k=-1)
    trainer = ember.Trainer(max_epochs=2, devices="cpu", strategy=DDPStrategy(timeout=60),
                            callbacks=[ckpt, KillAt(a.kill_at, a.out, a.tag)], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            default_root_dir=os.path.join(a.out, a.tag))
    module = SineNet()
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  os.path.join(a.out, f"{a.tag}.safetensors"))


if __name__ == "__main__":
    main()
