"""Train a small CNN on scikit-learn's bundled 8x8 digits (real data, no download).

    python examples/digits.py            # ~20 s on 2 CPU cores, >= 95% val accuracy

Shows the rich progress bar, the model summary, validation metrics and where the
TensorBoard logs and checkpoints went; ends with the run report (an HTML page of
the curves; needs matplotlib: pip install 'ember[report]').
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import DataModule, Trainer, TrainModule, seed_everything


class DigitsData(DataModule):
    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0):
        super().__init__()
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits
        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0   # (1797, 1, 8, 8)
        y = torch.tensor(d.target)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        n_val = int(len(x) * self.val_fraction)
        self.train_set = TensorDataset(x[perm[n_val:]], y[perm[n_val:]])
        self.val_set = TensorDataset(x[perm[:n_val]], y[perm[:n_val]])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=256)


class DigitsCNN(TrainModule):
    def __init__(self, lr: float = 3e-3, channels: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.2), nn.Linear(channels * 16, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--root", default="runs/digits", help="default_root_dir for logs and checkpoints")
    p.add_argument("--precision", default="32-true")
    args = p.parse_args(argv)
    seed_everything(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    trainer = Trainer(max_epochs=args.epochs, default_root_dir=args.root, precision=args.precision,
                      log_every_n_steps=10, report=_has_matplotlib())
    trainer.fit(DigitsCNN(), datamodule=DigitsData())
    acc = float(trainer.callback_metrics["val/acc"])
    print(f"\nvalidation accuracy: {acc:.4f}")
    print(f"TensorBoard logs:    {trainer.log_dir}   (view with: tensorboard --logdir {args.root})")
    if trainer.checkpoint_callback is not None:
        print(f"checkpoint:          {trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path}")
    # (the run report's path was printed when it was written: trainer.report_path holds it)
    return acc


def _has_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


if __name__ == "__main__":
    main()
