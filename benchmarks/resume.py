"""Time from ``trainer.fit(ckpt_path=...)`` to the first resumed training step, for
mid-epoch checkpoints at several positions of a 100k-sample epoch.

Resuming skips sampler *indices*, so this time must not grow with the number of
batches already done in the epoch. For contrast, the last column is what a resume
that re-iterates the loader to skip the done batches would add.

    .venv/bin/python benchmarks/resume.py [--samples 100000] [--batch-size 32] [--skips 10 500 1500] [--repeats 3]

Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ember  # noqa: E402
from ember.callbacks import Callback  # noqa: E402


class Synthetic(Dataset):
    """100k samples built on access (a little work per sample, like decoding would be)."""

    def __init__(self, n: int, dim: int = 32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.w = torch.randn(dim, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] * 1.0
        return x, x @ self.w


class Net(ember.TrainModule):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SaveAt(Callback):
    def __init__(self, positions, root):
        self.positions, self.root, self.paths = set(positions), root, {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx + 1 in self.positions:
            path = os.path.join(self.root, f"skip-{batch_idx + 1}")
            trainer.save_checkpoint(path)
            self.paths[batch_idx + 1] = path


class FirstStep(Callback):
    def __init__(self):
        self.t = None
        self.batch_idx = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.t is None:
            self.t, self.batch_idx = time.perf_counter(), batch_idx


def trainer(root, callbacks, **kw):
    return ember.Trainer(max_epochs=1, default_root_dir=root, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--skips", type=int, nargs="+", default=[10, 500, 1500])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    os.environ.setdefault("EMBER_CHECKPOINT_FSYNC", "0")
    ds = Synthetic(a.samples)

    def loader():
        return DataLoader(ds, batch_size=a.batch_size, shuffle=True)

    with tempfile.TemporaryDirectory() as root:
        ember.seed_everything(0)
        saver = SaveAt(a.skips, root)
        trainer(root, [saver], max_steps=max(a.skips)).fit(Net(), loader())
        rows = []
        for skip in sorted(a.skips):
            times = []
            for _ in range(a.repeats):
                first = FirstStep()
                t = trainer(root, [first], max_steps=skip + 1)
                module = Net()
                t0 = time.perf_counter()
                t.fit(module, loader(), ckpt_path=saver.paths[skip])
                assert first.batch_idx == skip, (first.batch_idx, skip)
                times.append(first.t - t0)
            # what iterating past the done batches would cost on top
            it = iter(loader())
            t0 = time.perf_counter()
            for _ in range(skip):
                next(it)
            naive = time.perf_counter() - t0
            rows.append((skip, statistics.median(times), min(times), naive))
    n_batches = -(-a.samples // a.batch_size)
    print(f"resume to first step, {a.samples} samples, batch size {a.batch_size} ({n_batches} batches/epoch), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {a.repeats}\n")
    print("| batches skipped | fit(ckpt_path) -> first step, median (ms) | min (ms) | re-iterating them instead would add (ms) |")
    print("|---:|---:|---:|---:|")
    for skip, med, lo, naive in rows:
        print(f"| {skip} | {med * 1e3:.1f} | {lo * 1e3:.1f} | {naive * 1e3:.1f} |")


if __name__ == "__main__":
    main()
