"""``if accelerator.is_main_process: accelerator.save_state(dir)`` under 2 processes
(the usual Accelerate pattern). Each rank writes ``OUT/<mode>_rank<r>.json``.

    python -m ember launch --num-processes 2 tests/scripts/acc_main_only_save.py OUT ddp
    python -m ember launch --num-processes 2 tests/scripts/acc_main_only_save.py OUT fsdp

ddp: the main process writes the checkpoint alone (no collective) and both ranks go
on training; a later save on every rank adds each rank's RNG state; both load back.
fsdp: the state is sharded, so a main-process-only call raises on that rank at once
(and one hidden in a helper raises once the strategy's timeout has passed); a target
that rank 0 refuses ends every rank at once with rank 0's verdict.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Accelerator
from ember.errors import MisconfigurationError
from ember.strategies import DDPStrategy, FSDPStrategy

OUT, MODE = sys.argv[1], sys.argv[2]


def build(strategy):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(1, keepdim=True)
    acc = Accelerator(strategy=strategy)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt, dl = acc.prepare(net, opt, DataLoader(TensorDataset(x, y), batch_size=8))
    return acc, net, opt, dl


def train(acc, net, opt, batches):
    for xb, yb in batches:
        acc.backward(F.mse_loss(net(xb), yb))
        opt.step()
        opt.zero_grad()


def params(net):
    return [p.detach().clone() for p in net.parameters()]


res: dict = {}
if MODE == "ddp":
    acc, net, opt, dl = build(DDPStrategy(timeout=30))
    it = iter(dl)
    train(acc, net, opt, [next(it) for _ in range(2)])
    torch.manual_seed(100 + acc.process_index)   # per-rank RNG streams
    saved, t0 = params(net), time.monotonic()
    if acc.is_main_process:
        acc.save_state(os.path.join(OUT, "main_only"))
    res["main_only_s"] = time.monotonic() - t0
    train(acc, net, opt, [next(it) for _ in range(2)])   # DDP all-reduces: both ranks go on together
    acc.wait_for_everyone()
    res["after_main_only"] = [p.sum().item() for p in params(net)]
    torch.manual_seed(100 + acc.process_index)
    acc.save_state(os.path.join(OUT, "every_rank"))   # every rank: each adds its own RNG state
    res["files_every_rank"] = sorted(os.listdir(os.path.join(OUT, "every_rank")))
    acc.load_state(os.path.join(OUT, "main_only"))
    res["restored_equal"] = all(torch.equal(a, b) for a, b in zip(params(net), saved))
    acc.load_state(os.path.join(OUT, "every_rank"))
    res["rng_after_load"] = torch.rand(3).tolist()
    torch.manual_seed(100 + acc.process_index)
    res["rng_expected"] = torch.rand(3).tolist()
    res["files_main_only"] = sorted(os.listdir(os.path.join(OUT, "main_only")))
else:
    acc, net, opt, dl = build(FSDPStrategy(timeout=5))
    # a target only rank 0 refuses (a folder that is not a checkpoint, as rank 0's node sees
    # it; rank 1's node would see nothing there): rank 0 decides, every rank ends at once
    target = os.path.join(OUT, "users_folder")
    if acc.process_index == 0:
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, "notes.txt"), "w") as f:
            f.write("the user's\n")
    else:
        import ember.checkpoint.trust as trust
        trust.check_save_target = lambda *a, **k: None   # what a rank on another node finds: nothing
        while not os.path.exists(os.path.join(target, "notes.txt")):
            time.sleep(0.05)
    t0 = time.monotonic()
    try:
        acc.save_state(target)
    except Exception as e:
        res["refused"] = f"{type(e).__name__}: {e}"
    res["refused_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    if acc.is_main_process:
        try:
            acc.save_state(os.path.join(OUT, "fsdp_main_only"))
        except MisconfigurationError as e:
            res["error"] = str(e)
    res["error_s"] = time.monotonic() - t0

    def helper():   # the guard is not visible at the call: the arrival check bounds the wait
        acc.save_state(os.path.join(OUT, "fsdp_helper"))
    t0 = time.monotonic()
    if acc.process_index == 0:
        try:
            helper()
        except MisconfigurationError as e:
            res["helper_error"] = str(e)
    res["helper_error_s"] = time.monotonic() - t0
    res["exists"] = os.path.exists(os.path.join(OUT, "fsdp_main_only"))
with open(os.path.join(OUT, f"{MODE}_rank{acc.process_index}.json.tmp"), "w") as f:
    json.dump(res, f)
os.replace(os.path.join(OUT, f"{MODE}_rank{acc.process_index}.json.tmp"),
           os.path.join(OUT, f"{MODE}_rank{acc.process_index}.json"))
while not os.path.exists(os.path.join(OUT, f"{MODE}_rank0.json")):   # rank 0 may still wait out its timeout
    time.sleep(0.05)
