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

import os
import signal

from torch.utils.data import DataLoader

from common import AttemptLog, SineNet, ddp_trainer, out_tag_parser, restart_count, save_weights, sine_data, \
    wait_for_signal, write_result
import ember
from ember.callbacks import ModelCheckpoint
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


class Events(AttemptLog):
    """Records the attempt; kills a rank of one node and keeps the other node busy."""

    def __init__(self, a):
        super().__init__(a.out, a.tag)
        self.a = a

    def on_fit_start(self, trainer, module):
        write_result(os.environ["NODE_DIR"], f"rank{trainer.global_rank}", {
            "attempt": restart_count(), "agent_restarts": os.environ.get("EMBER_AGENT_RESTART_COUNT"),
            "node": os.environ.get("GROUP_RANK"), "world": trainer.world_size})

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        # after optimizer step `global_step` and everything at its end (the checkpoint included)
        if restart_count() != 0:
            return
        node, step = int(os.environ["GROUP_RANK"]), trainer.global_step
        last_local = int(os.environ["LOCAL_RANK"]) == int(os.environ["LOCAL_WORLD_SIZE"]) - 1
        if step == self.a.kill_at and node == self.a.kill_node and last_local:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.a.busy_at and node != self.a.kill_node and self.a.busy:
            # computing, not in a collective (the agent sees healthy workers), until the
            # agent's SIGTERM, which ember's handler takes as a preemption request
            wait_for_signal(self.a.busy)


def main() -> None:
    p = out_tag_parser()
    p.add_argument("--strategy", choices=("ddp", "hsdp"), default="ddp")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-node", type=int, default=1)
    p.add_argument("--busy", type=float, default=0.0)
    p.add_argument("--busy-at", type=int, default=None)
    a = p.parse_args()
    a.busy_at = a.kill_at if a.busy_at is None else a.busy_at
    from ember.strategies import FSDPStrategy
    world = int(os.environ["WORLD_SIZE"])
    root = os.path.join(a.out, a.tag)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), every_n_train_steps=2, save_top_k=-1)
    trainer = ddp_trainer(root, strategy=FSDPStrategy(hsdp=(2, 2), timeout=30) if a.strategy == "hsdp" else None,
                          max_epochs=EPOCHS, seed=7, callbacks=[ckpt, Events(a)], logger=CSVLogger(root),
                          log_every_n_steps=2)
    module = SineNet(log_loss=True)
    trainer.fit(module, datamodule=Data(64 // (STEPS_PER_EPOCH * world)))
    save_weights(trainer, module, os.path.join(a.out, f"{a.tag}.safetensors"))   # gathers HSDP's shards


if __name__ == "__main__":
    main()
