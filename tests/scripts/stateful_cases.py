"""Every kind of train data, resumed mid-epoch against an uninterrupted run: the loaders,
the module and the runs shared by tests/data/test_stream_resume.py (one process) and
tests/scripts/stateful_ddp.py (two gloo processes with DataLoader workers).

A case names a train loader (:func:`loader`); :func:`fit` trains it for two epochs,
saving every 3 optimizer steps, or resumes one of those checkpoints; :func:`acc_run` does
the same with the Accelerator's save_state/load_state. Every sample carries its index,
so the samples each step trained are recorded (``seen``)."""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from common import worker_context
from ember.callbacks import ModelCheckpoint

N, BATCH, EPOCHS, EVERY = 64, 4, 2, 3


def tensors(n: int = N):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True) * 0.3 + 0.1, torch.arange(n)


class Stream(IterableDataset):
    """The n samples as a stream (no state, no length): the same items on every pass."""

    def __init__(self, n: int = N):
        self.x, self.y, self.i = tensors(n)

    def __iter__(self):
        for k in range(len(self.i)):
            yield self.x[k], self.y[k], self.i[k]


class StatefulStream(Stream):
    """A stream with ``state_dict()`` / ``load_state_dict()``: its position. A loaded state
    is where its next pass starts; ``replays`` counts passes that started at 0 after a
    load (a resume that read it again instead of loading its state would show up here)."""

    def __init__(self, n: int = N):
        super().__init__(n)
        self.pos, self._start = 0, None

    def __iter__(self):
        start, self._start = self._start or 0, None
        for k in range(start, len(self.i)):
            self.pos = k + 1
            yield self.x[k], self.y[k], self.i[k]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self._start = int(state["pos"])


def hf_dataset(n: int = N):
    import datasets
    x, y, i = tensors(n)
    return datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist(), "idx": i.tolist()}).with_format("torch")


def stateful_dataloader(*args, **kwargs):
    from torchdata.stateful_dataloader import StatefulDataLoader
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital")
        return StatefulDataLoader(*args, **kwargs)


def loader(case: str, workers: int = 0):
    """The train loader of ``case`` (a fresh one per call)."""
    kw = dict(batch_size=BATCH, num_workers=workers)
    if workers:
        kw.update(worker_context("torchdata.stateful_dataloader", "stateful_cases", main=False))
    if case == "stream":
        return DataLoader(Stream(), **kw)
    if case == "stateful":
        return DataLoader(StatefulStream(), **kw)
    if case == "sdl_stateful":        # torchdata's StatefulDataLoader over a stateful stream
        return stateful_dataloader(StatefulStream(), **kw)
    if case == "sdl_map":             # ... over a map-style dataset, shuffled
        return stateful_dataloader(TensorDataset(*tensors()), shuffle=True, **kw)
    if case == "stateful_sampler":    # a sampler with state_dict (torchdata's), in a plain DataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
        ds = TensorDataset(*tensors())
        return DataLoader(ds, sampler=StatefulDistributedSampler(ds, num_replicas=1, rank=0, seed=5), **kw)
    if case == "hf_map":
        return DataLoader(hf_dataset(), shuffle=True, **kw)
    if case == "hf_iter":
        return DataLoader(hf_dataset().to_iterable_dataset(num_shards=4), **kw)
    if case == "hf_shuffle":
        return DataLoader(hf_dataset().to_iterable_dataset(num_shards=4).shuffle(seed=3, buffer_size=16), **kw)
    if case.startswith("combined_"):  # a dict of a shuffled map-style loader and a shorter stream
        mode = case[len("combined_"):]
        from ember import CombinedLoader
        loaders = {"a": DataLoader(TensorDataset(*tensors()), shuffle=True, **kw),
                   "b": DataLoader(StatefulStream(40) if mode != "min_size" else Stream(40), **kw)}
        return loaders if mode == "max_size_cycle" else CombinedLoader(loaders, mode)
    raise ValueError(case)


def parts(batch):
    """(x, y, idx) of each loader's batch in ``batch`` (None: a loader that ran out)."""
    if batch is None:
        return []
    if isinstance(batch, dict) and "x" in batch:
        return [(batch["x"], batch["y"], batch["idx"])]
    if isinstance(batch, dict):
        return [p for v in batch.values() for p in parts(v)]
    if isinstance(batch, (list, tuple)) and len(batch) == 3 and isinstance(batch[2], torch.Tensor) \
            and batch[2].dtype == torch.int64:
        return [tuple(batch)]
    return [p for v in batch for p in parts(v)]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)


class Recorder(ember.TrainModule):
    """Dropout (the global RNG stream matters) and the sample indices of every step."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        loss, ids = 0.0, []
        for x, y, i in parts(batch):
            loss = loss + F.mse_loss(self.net(x.float()), y.float())
            ids += i.tolist()
        self.seen.append(ids)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def weights(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def trainer(root: str, save: bool, devices: int = 1, timeout: int = 45, **kw):
    from ember.strategies import DDPStrategy
    cbs = [ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=EVERY, save_top_k=-1)] if save \
        else []
    return ember.Trainer(max_epochs=EPOCHS, default_root_dir=root, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=cbs, seed=0,
                         devices=devices, strategy=DDPStrategy(timeout=timeout) if devices > 1 else "auto",
                         accelerator="cpu", **kw)


def fit(case: str, root: str, workers: int = 0, devices: int = 1, ckpt_path: str | None = None, **trainer_kw):
    """Train ``case`` for two epochs (saving every 3 steps), or resume ``ckpt_path``.
    Returns (weights, seen, the replay warnings)."""
    module = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(root, save=ckpt_path is None, devices=devices, **trainer_kw).fit(module, loader(case, workers),
                                                                               ckpt_path=ckpt_path)
    replays = [str(w.message) for w in caught if "replayed to batch" in str(w.message)]
    return weights(module), module.seen, replays


def resume_points(seen: list, every: int = EVERY) -> list[int]:
    """Two mid-epoch save steps of an uninterrupted run: the first, and one in the second epoch."""
    per_epoch = len(seen) // EPOCHS
    steps = [s for s in range(every, len(seen), every) if s % per_epoch]
    second = [s for s in steps if s > per_epoch]
    return [steps[0]] + second[:1]


def checkpoint(root: str, step: int) -> str:
    names = [n for n in os.listdir(os.path.join(root, "ck")) if n.endswith(f"-step={step}")]
    assert len(names) == 1, names
    return os.path.join(root, "ck", names[0])


# -- the Accelerator -------------------------------------------------------------------------------
def acc_run(case: str, root: str, workers: int = 0, stop: int | None = None, resume: bool = False, **acc_kw):
    """An Accelerator loop over ``case`` for two epochs: ``stop`` saves the state after that
    many steps and ends; ``resume`` loads it and runs to the end. Returns (weights, seen,
    a draw of torch.rand after the loop)."""
    from ember import Accelerator
    acc = Accelerator(seed=0, **acc_kw)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt, dl = acc.prepare(net, opt, loader(case, workers))
    if resume:
        acc.load_state(os.path.join(root, "state"))
    seen, step = [], 0
    for _ in range(dl.epoch, EPOCHS):   # a resumed loop continues in the saved epoch
        for batch in dl:
            loss, ids = 0.0, []
            for x, y, i in parts(batch):
                loss = loss + F.mse_loss(net(x.float()), y.float())
                ids += i.tolist()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            seen.append(ids)
            step += 1
            if stop is not None and step == stop:
                acc.save_state(os.path.join(root, "state"))
                return None, seen, None
    return weights(acc.unwrap_model(net)), seen, torch.rand(3)
