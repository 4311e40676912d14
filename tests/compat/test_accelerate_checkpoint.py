"""Accelerator.load_state reads a folder written by Accelerate's save_state (a real
one, written here by accelerate): weights, optimizer, scheduler, registered object,
RNG streams; continuing the run equals continuing it under Accelerate."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")


class Counter:
    def __init__(self):
        self.n = torch.zeros(())

    def state_dict(self):
        return {"n": self.n.clone()}

    def load_state_dict(self, sd):
        self.n = sd["n"].clone()


def objects():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    aux = nn.Linear(2, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 3, generator=g)
    return net, aux, opt, sched, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=6)


def steps(acc, net, opt, sched, loader, counter, n):
    out = []
    for i, (x, y) in enumerate(loader):
        if i == n:
            break
        loss = ((net(x) - y) ** 2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        out.append(loss.item())
    return out, (random.random(), float(np.random.rand()), torch.rand(2).tolist())


@pytest.mark.parametrize("safe", [True, False])
def test_load_state_reads_an_accelerate_checkpoint(tmp_path, safe):
    from accelerate import Accelerator as AccAccelerator
    acc = AccAccelerator(cpu=True)
    net, aux, opt, sched, dl = objects()
    counter = Counter()
    acc.register_for_checkpointing(counter)
    net, aux, opt, sched, dl = acc.prepare(net, aux, opt, sched, dl)
    steps(acc, net, opt, sched, dl, counter, 3)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    acc.save_state(str(tmp_path / "ck"), safe_serialization=safe)
    expected = steps(acc, net, opt, sched, dl, counter, 4)   # Accelerate continues
    want = [p.detach().clone() for p in net.parameters()]

    from ember import Accelerator
    eacc = Accelerator(devices="cpu")
    net2, aux2, opt2, sched2, dl2 = objects()
    counter2 = Counter()
    eacc.register_for_checkpointing(counter2)
    net2, aux2, opt2, sched2, dl2 = eacc.prepare(net2, aux2, opt2, sched2, dl2)
    eacc.load_state(str(tmp_path / "ck"))
    assert counter2.n.item() == 3 and sched2.scheduler.last_epoch == 3
    got = steps(eacc, net2, opt2, sched2, dl2, counter2, 4)
    assert got == expected   # same losses (dropout from the restored RNG), same draws afterwards
    assert all(torch.equal(a, b) for a, b in zip(want, net2.parameters()))
