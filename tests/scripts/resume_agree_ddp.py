"""Resume checks that see different inputs on different ranks (2 CPU processes, gloo,
the Trainer's own launcher), run by tests/checkpoint/test_resume_agree.py.

    python resume_agree_ddp.py MODE ROOT

Each mode first trains 2 steps of a 4-batch epoch and saves a mid-epoch checkpoint
ROOT/ckpt, then resumes under a 20 s process-group timeout:

MODE ``data_len``: rank 1's train dataset has 48 samples, rank 0's the saved 32.
MODE ``allow_rank0`` / ``allow_rank1``: both ranks' datasets have 48 samples and only
rank 0 (rank 1) has ``EMBER_ALLOW_DATA_CHANGE=1`` in its environment.
MODE ``swapped_state``: rank 1 resumes from ROOT/ckpt_rank1, a copy of the checkpoint
whose ``trainer_state.pt`` has one byte changed (same size), as a node whose copy of
the files is corrupted; rank 0 from the original.
MODE ``missing_rank1``: rank 1 does not see the checkpoint at all (a path that does
not exist there); DDP reads it on every rank, so its load fails and every rank refuses.
MODE ``acc_swapped`` (under ``ember launch``): the same with ``Accelerator.save_state`` /
``load_state`` of ``model.safetensors``, then one training step.
MODE ``acc_auto`` (under ``ember launch``): ``load_state()`` without a directory where
rank 1's view of the project folder holds no ``checkpoint_N``: both load rank 0's pick.
Every rank writes ROOT/<MODE>_<rank>.json: its error, the seconds from the resume
call to it, its global step. ``python resume_agree_ddp.py many ROOT m1,m2,...`` runs several
Trainer modes in the same two processes, each in ROOT/<mode>/.
"""
import functools
import os
import shutil
import sys
import time

import torch
from torch.nn import functional as F

import ember
from ember.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, ddp_trainer, loader, write_result  # noqa: E402

# two processes, a 20 s process-group timeout, two epochs, no checkpoint unless a case asks
trainer = functools.partial(ddp_trainer, devices=2, timeout=20, max_epochs=2, enable_checkpointing=False)


def flip_one_byte(fp):
    """Change one byte in the middle of ``fp`` (its size stays)."""
    with open(fp, "r+b") as f:
        f.seek(os.path.getsize(fp) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def rank1_copy(strategy, root, src, name):
    """ROOT/<src>_rank1: a copy of checkpoint ``src`` with one file corrupted, made by rank 0."""
    dst = os.path.join(root, os.path.basename(src) + "_rank1")
    if strategy.global_rank == 0:
        shutil.copytree(src, dst)
        flip_one_byte(os.path.join(dst, name))
    strategy.barrier("copy")
    return dst


def saved_mid_epoch(root):
    t = trainer(root, timeout=20, max_steps=2)   # the process group (and its timeout) stays for the resume
    t.fit(Regressor(), loader())
    path = os.path.join(root, "ckpt")
    t.save_checkpoint(path)
    return t, path


def resume(mode, root):
    t, path = saved_mid_epoch(root)
    rank = t.global_rank
    n = 32
    if mode == "data_len":
        n = 48 if rank == 1 else 32
    elif mode in ("allow_rank0", "allow_rank1"):
        n = 48
        if rank == int(mode[-1]):
            os.environ["EMBER_ALLOW_DATA_CHANGE"] = "1"
    elif mode == "swapped_state":
        copy = rank1_copy(t.strategy, root, path, "trainer_state.pt")
        path = copy if rank == 1 else path
    elif mode == "missing_rank1":     # rank 1's node does not have the folder; DDP reads on every rank
        path = os.path.join(root, "not_on_rank1") if rank == 1 else path
    t2 = trainer(root, timeout=20)
    start = time.monotonic()
    try:
        t2.fit(Regressor(), loader(n), ckpt_path=path)
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start, "rank": rank, "global_step": t2.global_step}


def load_and_step(acc, model, opt, path=None):
    """``acc.load_state(path)`` and one training step (DDP's all-reduce): (the error as
    "Type: message" or None, the seconds from the load call to it)."""
    start = time.monotonic()
    try:
        acc.load_state(path)
        x = torch.randn(4, 4)
        acc.backward(F.mse_loss(model(x), x.sum(1, keepdim=True)))   # DDP's all-reduce
        opt.step()
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return err, time.monotonic() - start


def acc_swapped(root):
    acc = ember.Accelerator(strategy=DDPStrategy(timeout=20))
    net = Regressor()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    path = os.path.join(root, "state")
    acc.save_state(path)
    from ember.checkpoint import io as cio
    copy = rank1_copy(acc.strategy, root, path, cio.WEIGHTS_NAME)
    rank = acc.process_index
    err, seconds = load_and_step(acc, model, opt, copy if rank == 1 else path)
    return {"error": err, "seconds": seconds, "rank": rank, "global_step": None}


def acc_auto(root):
    acc = ember.Accelerator(strategy=DDPStrategy(timeout=20), project_dir=root)
    net = Regressor()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc.save_state()                      # root/checkpoints/checkpoint_0
    rank = acc.process_index
    if rank == 1:   # a node whose view of the project folder has no checkpoint yet
        acc.project_dir = os.path.join(root, "rank1_view")
        os.makedirs(acc.project_dir)
    acc.wait_for_everyone()
    err, seconds = load_and_step(acc, model, opt)
    return {"error": err, "seconds": seconds, "rank": rank, "global_step": acc.save_iteration}


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    # ``many ROOT m1,m2,...``: several Trainer modes in the same two processes (one start), each
    # in ROOT/<mode>/; a mode's EMBER_ALLOW_DATA_CHANGE stays in that mode
    for m in (sys.argv[3].split(",") if mode == "many" else [mode]):
        d = os.path.join(root, m) if mode == "many" else root
        os.makedirs(d, exist_ok=True)
        try:
            out = {"acc_swapped": acc_swapped, "acc_auto": acc_auto}.get(m, lambda r: resume(m, r))(d)
        finally:
            os.environ.pop("EMBER_ALLOW_DATA_CHANGE", None)
        write_result(d, f"{m}_{out['rank']}", out)
