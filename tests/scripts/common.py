"""The tiny regressor the subprocess scripts share, and its data.

``Regressor``: one ``nn.Linear(4, 1)`` (``self.net``) trained with the MSE loss and SGD,
nothing logged; a script that needs more (hooks, logging, a value that differs per rank)
subclasses it. ``sum_data`` / ``loader``: 4 features drawn from a generator seeded 0, the
target their sum (a task the regressor learns); ``noise_data``: the target drawn too.
Neither touches the global RNG (only the ``nn.Linear`` initialisation does).
``sine_data`` / ``SineNet``: the launcher scripts' task (6 features, the target the sine
of their sum) and model (a seeded 6-16-1 Tanh MLP, AdamW). ``worker_context``: the
DataLoader keywords a rank's worker processes start with (a forkserver where forking them
can hang).

What a script run by a launcher sets up (multinode_train.py, slurm_train.py,
elastic_train.py, and the two-process scripts): ``out_tag_parser`` (its OUT folder and
run TAG), ``restart_count`` (which attempt the launcher's agent started), ``ddp_trainer``
(a quiet Trainer on CPU whose process group times out in seconds), ``AttemptLog`` (rank 0
records the step each attempt starts from), ``wait_for_signal`` (compute until the
launcher or SLURM signals), ``save_weights`` (rank 0 writes the final weights) and
``write_result`` (a rank's results as JSON for the test; tests/helpers.py's
``rank_results`` reads them).

A script imports it as ``from common import Regressor, loader``: Python puts the
script's own folder first on ``sys.path``, also in the processes that ember's launcher,
``ember launch`` and ``torchrun`` start. A test imports it with ``SCRIPTS`` (tests/helpers.py)
on ``sys.path``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback


class Regressor(ember.TrainModule):
    """``nn.Linear(4, 1)`` trained with ``F.mse_loss`` and ``SGD(lr=lr)``."""

    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def sum_data(n: int = 32) -> TensorDataset:
    """``n`` rows of 4 normal features (generator seeded 0); the target is their sum."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def noise_data(n: int = 32) -> TensorDataset:
    """``n`` rows of 4 normal features and a normal target, drawn in that order from one
    generator seeded 0."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int = 32, batch_size: int = 4) -> DataLoader:
    """``sum_data(n)`` in order, ``batch_size`` rows a batch."""
    return DataLoader(sum_data(n), batch_size=batch_size)


def sine_data(n: int = 64) -> TensorDataset:
    """``n`` samples of 6 features drawn from a generator seeded 0, the target
    ``sin(sum(x))``; the global RNG is not touched."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


class SineNet(ember.TrainModule):
    """A 6-16-1 Tanh MLP built from ``torch.manual_seed(0)`` (the same weights on every
    rank and in every attempt), MSE loss, ``AdamW(lr=0.01)``; with ``log_loss``, the loss
    is logged as ``loss`` (``sync_dist=True``)."""

    def __init__(self, log_loss: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.log_loss = log_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.log_loss:
            self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def forking_can_hang() -> bool:
    """CPython before 3.11.8 (and 3.12.0) can deadlock a child forked while another thread
    holds the thread-list lock (gh-112275): a DataLoader worker forked by a rank (gloo's
    threads, ember's SIGTERM watcher) hung in ``os.fork`` about once in 30 runs of
    stateful_ddp.py on a loaded machine."""
    v = sys.version_info[:3]
    return v < (3, 11, 8) or v == (3, 12, 0)


def worker_context(*preload: str, main: bool = True) -> dict:
    """``DataLoader`` keywords for worker processes started by a rank: on a Python where
    forking can hang (``forking_can_hang``) and with more than one process, a forkserver
    with torch, ``preload`` and, with ``main``, the script itself (``__main__``, whose
    dataset classes the workers unpickle) imported once; otherwise nothing (forked workers)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or not forking_can_hang():
        return {}
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload, *(["__main__"] if main else [])])
    return {"multiprocessing_context": ctx}


def out_tag_parser() -> argparse.ArgumentParser:
    """A parser of the two arguments every launcher script takes: ``out`` (the folder the
    results go to, shared by every rank) and ``tag`` (this run's name in it); a script
    adds its own options."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    return p


def restart_count(var: str = "TORCHELASTIC_RESTART_COUNT") -> int:
    """The attempt a launcher's agent started this process in (0: the first), from ``var``
    (``SLURM_RESTART_COUNT`` for a requeued SLURM job)."""
    return int(os.environ.get(var, "0"))


def ddp_trainer(root: str, *, timeout: float = 30, strategy=None, devices="cpu", **kw) -> ember.Trainer:
    """A Trainer on CPU for a process group: ``strategy`` (by default DDP over gloo with a
    ``timeout``-second process-group timeout: a rank left waiting fails in seconds, never
    hangs), the ``devices`` the launcher gave (``"cpu"``) or that ember starts (2), in
    ``root``; no logger, progress bar, summary or sanity check. ``kw`` overrides any of them."""
    from ember.strategies import DDPStrategy
    args = dict(devices=devices, strategy=strategy or DDPStrategy(timeout=timeout), logger=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root)
    args.update(kw)
    return ember.Trainer(**args)


class AttemptLog(Callback):
    """Rank 0 appends ``line(trainer)`` (by default the global step) to ``OUT/TAG.attempts``
    after the first training batch of each attempt (the first run and every restart): the
    step each attempt started from."""

    def __init__(self, out: str, tag: str):
        self.path, self.first = os.path.join(out, f"{tag}.attempts"), True

    def line(self, trainer) -> str:
        return str(trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.first and trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(f"{self.line(trainer)}\n")
        self.first = False


def wait_for_signal(seconds: float, signals=(signal.SIGTERM,)) -> None:
    """Compute (not in a collective: the launcher's agent sees a healthy worker) for up to
    ``seconds``, until one of ``signals`` arrives; the handler it replaced (ember's, which
    takes the signal as a preemption request at the next optimizer step) still gets it."""
    got = []
    previous = {s: signal.getsignal(s) for s in signals}

    def handler(signum, frame):
        got.append(signum)
        if callable(previous[signum]):
            previous[signum](signum, frame)

    for s in previous:
        signal.signal(s, handler)
    try:
        end = time.monotonic() + seconds
        while not got and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def save_weights(trainer: ember.Trainer, module: nn.Module, path: str) -> None:
    """The module's whole tensors (sharded ones gathered: every rank calls it) written by rank
    0 to ``path`` (safetensors)."""
    from safetensors.torch import save_file
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
             for k, v in module.state_dict().items()}
    if trainer.is_global_zero:
        save_file(state, path)


def write_result(folder: str, name: str, result) -> None:
    """``result`` as JSON in ``folder/NAME.json``: what a rank hands the test that started it
    (by default named ``result_<rank>``, which tests/helpers.py's ``rank_results`` reads)."""
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(result, f)
