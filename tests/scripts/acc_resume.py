"""save_state / load_state round trip (1 or N processes).

    python tests/scripts/acc_resume.py OUT full    # uninterrupted run, then a run stopped mid-epoch + save_state
    python tests/scripts/acc_resume.py OUT resume  # new process, new objects: load_state, finish the run

Two models with their own optimizers, a scheduler, dropout, a shuffled
dataloader, gradient accumulation, a registered custom object and (with
``--precision 16-mixed``) a GradScaler. The main process writes
``OUT/final_<run>.pt`` with every parameter, optimizer state, the scaler scale
and the counter; the test compares them bit for bit.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Accelerator

EPOCHS = 2
STOP_EPOCH, STOP_BATCH = 1, 4


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self):
        self.batches = 0
        self.skipped = 0
        self.loss_sum = torch.zeros(())

    def state_dict(self):
        return {"batches": self.batches, "skipped": self.skipped, "loss_sum": self.loss_sum.clone()}

    def load_state_dict(self, state):
        self.batches = int(state["batches"])
        self.skipped = int(state["skipped"])
        self.loss_sum = state["loss_sum"].clone()


def build(args):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 6, generator=g)
    y = (x[:, :2].sum(1) > 0).long()
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    aux = nn.Linear(6, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    aux_opt = torch.optim.SGD(aux.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    acc = Accelerator(precision=args.precision, gradient_accumulation_steps=args.gas,
                      project_dir=args.out)
    if acc.scaler is not None:   # grow the loss scale quickly so that some steps overflow and are skipped
        acc.scaler.set_growth_interval(2)
        acc.scaler.set_growth_factor(16.0)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    net, opt, loader, aux, sched, aux_opt = acc.prepare(net, opt, loader, aux, sched, aux_opt)
    return acc, net, aux, opt, aux_opt, sched, loader, counter


def train(args, run: str, stop: bool = False):
    acc, net, aux, opt, aux_opt, sched, loader, counter = build(args)
    if run == "resume":
        acc.load_state(os.path.join(args.out, "ckpt"))
    while loader.epoch < EPOCHS:
        for x, y in loader:
            with acc.accumulate(net, aux):
                loss = F.cross_entropy(net(x), y) + 0.1 * aux(x).pow(2).mean()
                acc.backward(loss)
                acc.clip_grad_norm_(net.parameters(), 1.0)
                acc.clip_grad_norm_(net.parameters(), 1.0)   # a second call must not unscale twice
                acc.clip_grad_value_(aux.parameters(), 0.5)
                opt.step()
                if acc.sync_gradients:
                    counter.skipped += int(opt.step_was_skipped)
                aux_opt.step()
                sched.step()
                opt.zero_grad()
                aux_opt.zero_grad()
            counter.batches += 1
            counter.loss_sum += loss.detach().float()
            if stop and loader.epoch == STOP_EPOCH and loader.batches_done == STOP_BATCH:
                acc.save_state(os.path.join(args.out, "ckpt"))
                return
    if acc.is_main_process:
        final = {f"net.{k}": v for k, v in acc.unwrap_model(net).state_dict().items()}
        final.update({f"aux.{k}": v for k, v in acc.unwrap_model(aux).state_dict().items()})
        for name, o in (("opt", opt), ("aux_opt", aux_opt)):
            for i, st in o.state_dict()["state"].items():
                final.update({f"{name}.{i}.{k}": torch.as_tensor(v) for k, v in st.items()})
        final["lr"] = torch.tensor(sched.get_last_lr())
        final["sched_epoch"] = torch.tensor(sched.last_epoch)
        final["scale"] = torch.tensor(acc.scaler.get_scale() if acc.scaler is not None else 1.0)
        final["skipped"] = torch.tensor(counter.skipped)
        final["batches"] = torch.tensor(counter.batches)
        final["loss_sum"] = counter.loss_sum
        final["rng"] = torch.rand(3)   # RNG streams continue identically too
        torch.save(final, os.path.join(args.out, f"final_{run}.pt"))
    acc.wait_for_everyone()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("mode", choices=("full", "resume"))
    p.add_argument("--precision", default="32-true")
    p.add_argument("--gas", type=int, default=2)
    args = p.parse_args()
    if args.mode == "full":
        train(args, "full")
        train(args, "part", stop=True)
    else:
        train(args, "resume")


if __name__ == "__main__":
    main()
