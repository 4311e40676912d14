"""Shared fixtures for the core tests: tiny data sets and modules, and quiet
Trainer arguments. Kept small and generic on purpose."""
from __future__ import annotations

import os

# The suite's checkpoints are throwaway: no fsync (a busy disk stalled fsync for tens of
# seconds and made timing-bound tests flaky). Subprocesses inherit it.
# tests/test_checkpoint_io.py::test_fsync_reaches_every_file_and_folder keeps that path tested.
os.environ.setdefault("EMBER_CHECKPOINT_FSYNC", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ember  # noqa: E402


def reseal(ckpt) -> None:
    """Record the current size and content digest of every file ``meta.json`` lists, as a
    crafter of a consistent (but malicious or mismatched) checkpoint would."""
    import json

    from ember.checkpoint.trust import file_digest
    meta_file = os.path.join(ckpt, "meta.json")
    with open(meta_file) as f:
        meta = json.load(f)
    for name in meta.get("files", {}):
        fp = os.path.join(ckpt, name)
        meta["files"][name] = os.path.getsize(fp)
        if name in meta.get("digests", {}):
            meta["digests"][name] = file_digest(fp, meta["digests"][name].split(":")[0])
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def regression_data(n: int = 64, dim: int = 4, seed: int = 0) -> TensorDataset:
    """y = x @ w + 0.5 with a fixed w: an easy task every precision can learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.arange(1, dim + 1, dtype=torch.float32).unsqueeze(1) / dim
    return TensorDataset(x, x @ w + 0.5)


class LinearModule(ember.TrainModule):
    """Linear regression trained with SGD; logs ``train/loss`` per step and
    ``val/loss`` per epoch."""

    def __init__(self, dim: int = 4, lr: float = 0.1):
        super().__init__()
        self.lr = lr
        self.net = nn.Linear(dim, 1)

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.fixture
def quiet(tmp_path) -> dict:
    """Trainer arguments without logger, checkpoints, progress bar or summary, on CPU
    (the core tests compare against plain CPU loops, also on a machine with a GPU)."""
    return dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, devices="cpu")


@pytest.fixture
def make_trainer(quiet):
    """``make_trainer(**kw)`` -> a quiet Trainer (``kw`` overrides)."""
    def make(**kw):
        return ember.Trainer(**{**quiet, **kw})
    return make


@pytest.fixture
def linear_module():
    return LinearModule


@pytest.fixture
def data():
    """``data(n=64, batch_size=8, shuffle=False, dim=4, seed=0)`` -> DataLoader of regression_data."""
    def make(n: int = 64, batch_size: int = 8, shuffle: bool = False, dim: int = 4, seed: int = 0):
        return DataLoader(regression_data(n, dim, seed), batch_size=batch_size, shuffle=shuffle)
    return make


@pytest.fixture(autouse=True)
def _restore_global_torch_state():
    """Trainer(seed=..., deterministic=True) and some precisions change process-wide
    settings; put them back after every test."""
    seed_env = os.environ.get("EMBER_GLOBAL_SEED")
    workers_env = os.environ.get("EMBER_SEED_WORKERS")
    dtype = torch.get_default_dtype()
    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    if seed_env is None:
        os.environ.pop("EMBER_GLOBAL_SEED", None)
    else:
        os.environ["EMBER_GLOBAL_SEED"] = seed_env
    if workers_env is None:
        os.environ.pop("EMBER_SEED_WORKERS", None)
    else:
        os.environ["EMBER_SEED_WORKERS"] = workers_env
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(det, warn_only=det_warn)
