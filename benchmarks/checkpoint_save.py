"""Cost of ember's checkpoint writer against plain safetensors + torch.save.

Saves a ~100 MB model (fp32) and its AdamW state (2 x 100 MB) repeatedly, the
methods interleaved, and reports medians:

  plain        safetensors.torch.save_file(weights) + torch.save(state) into a fresh dir
  plain+fsync  the same, then fsync both files and the directory
  ember        ember.checkpoint.io.write_checkpoint (staging dir, fsync, atomic rename, meta.json)
  ember-nosync write_checkpoint with fsync disabled (EMBER_CHECKPOINT_FSYNC=0)

fsync makes the data durable against power loss and is dominated by the disk;
"ember / plain+fsync" is the like-for-like ratio (target <= 1.2x), and
"ember-nosync / plain" is the overhead of ember's own work.

    python benchmarks/checkpoint_save.py [--size-mb 100] [--reps 5] [--dir DIR]

``--blocked`` measures instead how long the training thread is blocked by
``Strategy.save_checkpoint`` (one device), synchronous against ``async_save=True``
(copy to CPU memory, then a background writer), and how long until the async
checkpoint is committed (``wait_for_checkpoint``):

    python benchmarks/checkpoint_save.py --blocked [--size-mb 100] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

from ember.checkpoint import io as cio


def build(size_mb: int):
    torch.manual_seed(0)
    width = 2048
    n_layers = max(1, round(size_mb * 2**20 / 4 / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain(path, weights, state, sync: bool):
    from safetensors.torch import save_file
    os.makedirs(path)
    save_file(weights, os.path.join(path, "model.safetensors"))
    torch.save(state, os.path.join(path, "trainer_state.pt"))
    if sync:
        _fsync(os.path.join(path, "model.safetensors"))
        _fsync(os.path.join(path, "trainer_state.pt"))
        _fsync(path, directory=True)


def ember(path, weights, state, sync: bool):
    cio.FSYNC = sync
    try:
        cio.write_checkpoint(path, weights, state, {"strategy": "single"})
    finally:
        cio.FSYNC = True


def blocked(args, model, opt) -> None:
    """Training-thread time of a save: sync vs async_save (and async until committed)."""
    from ember.strategies.base import SingleDeviceStrategy
    strategies = {"sync": SingleDeviceStrategy("cpu"), "async": SingleDeviceStrategy("cpu", async_save=True)}
    state = {"loop": {"global_step": 1, "epoch": 0}}
    root = tempfile.mkdtemp(prefix="ember-bench-", dir=args.dir)
    times = {"sync": [], "async": [], "async-committed": []}
    try:
        for rep in range(args.reps + 1):            # rep 0: warm-up, untimed
            for name in (("sync", "async") if rep % 2 else ("async", "sync")):
                s, out = strategies[name], os.path.join(root, f"{name}-{rep}")
                t0 = time.perf_counter()
                s.save_checkpoint(out, model, [opt], dict(state), {"strategy": "single"})
                t1 = time.perf_counter()
                s.wait_for_checkpoint()
                t2 = time.perf_counter()
                if rep:
                    times[name].append(t1 - t0)
                    if name == "async":
                        times["async-committed"].append(t2 - t0)
                shutil.rmtree(out)
                if hasattr(os, "sync"):
                    os.sync()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model {nbytes / 2**20:.0f} MiB + AdamW state, {args.reps} interleaved reps, torch {torch.__version__}")
    for k, v in med.items():
        print(f"  {k:16s} median {v * 1000:8.1f} ms  all: {', '.join(f'{x * 1000:.0f}' for x in times[k])}")
    print("| save of a model + AdamW state | training thread blocked, sync | blocked, async_save=True "
          "| async until committed |")
    print("|---|---|---|---|")
    print(f"| {nbytes / 2**20:.0f} MiB model + AdamW, one device (CPU) | {med['sync'] * 1000:.0f} ms | "
          f"{med['async'] * 1000:.0f} ms ({med['async'] / med['sync']:.2f}x) | {med['async-committed'] * 1000:.0f} ms |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    ap.add_argument("--blocked", action="store_true", help="training-thread time: sync vs async_save")
    args = ap.parse_args()
    if args.blocked:
        return blocked(args, *build(args.size_mb))

    model, opt = build(args.size_mb)
    weights = model.state_dict()
    state = {"optimizers": [opt.state_dict()], "loop": {"global_step": 1, "epoch": 0}}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    obytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    methods = {
        "plain": lambda p: plain(p, weights, state, sync=False),
        "plain+fsync": lambda p: plain(p, weights, state, sync=True),
        "ember": lambda p: ember(p, weights, state, sync=True),
        "ember-nosync": lambda p: ember(p, weights, state, sync=False),
    }
    root = tempfile.mkdtemp(prefix="ember-bench-", dir=args.dir)
    times = {k: [] for k in methods}
    try:
        for name, fn in methods.items():  # warm-up, untimed
            fn(os.path.join(root, "warmup-" + name))
            shutil.rmtree(os.path.join(root, "warmup-" + name))
        names = list(methods)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate to interleave fairly
            for name in order:
                out = os.path.join(root, f"{name}-{rep}")
                t0 = time.perf_counter()
                methods[name](out)
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(out)
                if hasattr(os, "sync"):
                    os.sync()  # flush writeback now, so it does not land in the next timing
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    total_mb = (nbytes + obytes) / 2**20
    print(f"model {nbytes / 2**20:.0f} MiB + AdamW state {obytes / 2**20:.0f} MiB, "
          f"{args.reps} interleaved reps, torch {torch.__version__}")
    for k, v in med.items():
        print(f"  {k:13s} median {v * 1000:8.1f} ms  ({total_mb / v:7.0f} MiB/s)  "
              f"all: {', '.join(f'{x * 1000:.0f}' for x in times[k])}")
    r_sync = med["ember"] / med["plain+fsync"]
    r_nosync = med["ember-nosync"] / med["plain"]
    print(f"ratio ember / plain+fsync = {r_sync:.2f}x ; ember-nosync / plain = {r_nosync:.2f}x "
          f"; ember / plain (no fsync) = {med['ember'] / med['plain']:.2f}x")
    print("| benchmark | baseline | ember | ratio |")
    print("|---|---|---|---|")
    print(f"| checkpoint save, {nbytes / 2**20:.0f} MiB model + AdamW | "
          f"save_file+torch.save+fsync {med['plain+fsync'] * 1000:.0f} ms "
          f"(no fsync {med['plain'] * 1000:.0f} ms) | write_checkpoint {med['ember'] * 1000:.0f} ms "
          f"(no fsync {med['ember-nosync'] * 1000:.0f} ms) | {r_sync:.2f}x ({r_nosync:.2f}x without fsync) |")


if __name__ == "__main__":
    main()
