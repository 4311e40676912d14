"""A Trainer fit on two simulated machines, for tests/launch/test_multinode.py.

Run by two torchrun agents (or ``ember launch`` on two "machines", or ``srun``), each
in its own process group so that a test can kill a whole node:

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d ... multinode_train.py OUT TAG [options]

``NODE_DIR`` (set per agent by the test) stands for the node's local disk:
``prepare_data`` appends to NODE_DIR/prepared and every rank writes
NODE_DIR/rank<R>.json (its attempt as it saw it). Checkpoints go to OUT/TAG (the
shared folder). Rank 0 writes OUT/TAG.safetensors (final weights) and appends the
first step of each attempt to OUT/TAG.attempts.

Options:
  --strategy ddp|hsdp      DDP over 4 ranks, or FSDP with hsdp=(2, 2) (one replica per node)
  --kill-at STEP           in the first attempt, the last local rank of node --kill-node SIGKILLs
                           itself after optimizer step STEP (and its checkpoint)
  --busy SECONDS           ... while the other node's ranks are busy that long (not in a
                           collective) after the same step (or after --busy-at STEP), so
                           that their agent restarts them for the waiting node without
                           counting a restart
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

from safetensors.torch import save_file
from torch.utils.data import DataLoader

from common import SineNet, sine_data
import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.loggers import CSVLogger

STEPS_PER_EPOCH = 4     # 64 samples, global batch 16
EPOCHS = 2


class Data(ember.DataModule):
    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size

    def prepare_data(self):
        with open(os.path.join(os.environ["NODE_DIR"], "prepared"), "a") as f:
            f.write(f"{os.environ.get('RANK', '0')}\n")

    def train_dataloader(self):
        return DataLoader(sine_data(), batch_size=self.batch_size, shuffle=True)


class Events(Callback):
    """Records the attempt; kills a rank of one node and keeps the other node busy."""

    def __init__(self, a):
        self.a, self.first = a, True

    def on_fit_start(self, trainer, module):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        with open(os.path.join(os.environ["NODE_DIR"], f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"attempt": attempt, "agent_restarts": os.environ.get("EMBER_AGENT_RESTART_COUNT"),
                       "node": os.environ.get("GROUP_RANK"), "world": trainer.world_size}, f)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.first and trainer.is_global_zero:
            with open(os.path.join(self.a.out, f"{self.a.tag}.attempts"), "a") as f:
                f.write(f"{trainer.global_step}\n")
        self.first = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        # after optimizer step `global_step` and everything at its end (the checkpoint included)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
            return
        node, step = int(os.environ["GROUP_RANK"]), trainer.global_step
        last_local = int(os.environ["LOCAL_RANK"]) == int(os.environ["LOCAL_WORLD_SIZE"]) - 1
        if step == self.a.kill_at and node == self.a.kill_node and last_local:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.a.busy_at and node != self.a.kill_node and self.a.busy:
            busy(self.a.busy)


def busy(seconds: float) -> None:
    """Compute (not in a collective: the agent sees healthy workers) for ``seconds``, or
    until the agent's SIGTERM, which ember's handler takes as a preemption request."""
    stopped = []
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        stopped.append(signum)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)
    try:
        end = time.monotonic() + seconds
        while not stopped and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--strategy", choices=("ddp", "hsdp"), default="ddp")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-node", type=int, default=1)
    p.add_argument("--busy", type=float, default=0.0)
    p.add_argument("--busy-at", type=int, default=None)
    a = p.parse_args()
    a.busy_at = a.kill_at if a.busy_at is None else a.busy_at
    from ember.strategies import DDPStrategy, FSDPStrategy
    strategy = DDPStrategy(timeout=30) if a.strategy == "ddp" else FSDPStrategy(hsdp=(2, 2), timeout=30)
    world = int(os.environ["WORLD_SIZE"])
    root = os.path.join(a.out, a.tag)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), every_n_train_steps=2, save_top_k=-1)
    trainer = ember.Trainer(max_epochs=EPOCHS, devices="cpu", strategy=strategy, seed=7,
                            callbacks=[ckpt, Events(a)], logger=CSVLogger(root),
                            log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=root)
    module = SineNet(log_loss=True)
    trainer.fit(module, datamodule=Data(64 // (STEPS_PER_EPOCH * world)))
    # the whole tensors (an all-gather of the shards under HSDP, on every rank)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
             for k, v in module.state_dict().items()}
    if trainer.is_global_zero:
        save_file(state, os.path.join(a.out, f"{a.tag}.safetensors"))


if __name__ == "__main__":
    main()
