"""Resume on another number of processes (issue: "Change the number of processes and keep
going exactly"): the runs shared by tests/checkpoint/test_reshard.py (one process, in the
test's own process) and this script's process groups (gloo, the Trainer's own launcher).

    python reshard_ddp.py WORLD ROOT MODE[,MODE...]

Every run trains the same tiny regressor with SGD + momentum and a per-step scheduler on
192 samples that carry their index, for 24 optimizer steps (two epochs of 12) with a
global batch of 16 samples per optimizer step: 2 processes x batch 8 (``ref2``), 1
process x batch 8 x accumulate_grad_batches=2 (``ref1``). The data is shuffled by ember's
sampler (``map``), grouped by length (``grouped``) or read as a stream without state
(``stream``: replayed on a resume). The references save at step 6 (and
``ref1`` also inside the accumulation window of step 7). Modes, each in ROOT/<mode>/:

``ref2_map``, ``ref2_grouped``, ``ref2_stream``   the 2-process references (WORLD 2)
``from1``                             resume ROOT/ref1_map/mid (1 process, saved mid-window) on 2
``grow4``                             resume ROOT/ref2_map's step 6 on 4 processes x batch 4
``to1_map``, ``to1_grouped``, ``to1_stream``      resume the 2-process references' step 6 on 1 process
``refused``                           resume it on 3 processes x batch 8 (16 vs 24: refused)
``explicit``                          the same with accumulate_grad_batches=1 given: one epoch
``state1_<case>``, ``state2_<case>``  a stateful loader of tests/scripts/stateful_cases.py (``stateful``,
                                      ``sdl_stateful``: refused; ``hf_iter``, a Hugging Face stream of 4
                                      shards: carried) saved mid-epoch on 1 process, resumed on 2
``hf2``                               a Hugging Face IterableDataset of 64 samples in 8 shards, 2 processes x
                                      batch 4, one epoch, a checkpoint at every step (WORLD 2)
``hf4_even``, ``hf4_uneven``          its step 4 / step 3 resumed on 4 processes x batch 2, to the epoch's end
                                      (``hf4_uneven`` saves at every step)
``hf4_again``                         ``hf4_uneven``'s step 5 resumed on 4 processes (the same number)
``hfsdl2``, ``hfsdl4``                the same stream in torchdata's StatefulDataLoader: ``hf2``, then its
                                      step 3 resumed on 4 processes as ``hf4_uneven``
``hf1_twice``                         ``hf4_uneven``'s step 5 resumed on 1 process (refused)

Each rank writes ROOT/<mode>/rank<R>.json (the error, seconds to it, the global step, the
sample indices of every batch it trained, accumulate_grad_batches) and rank 0 the weights
(ROOT/<mode>/weights.pt).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint

N, BATCH, STEPS, EVERY = 192, 8, 24, 6


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    y = torch.tanh(x @ torch.tensor([[0.5], [-1.0], [0.25], [2.0]])) + 0.1 * torch.randn(N, 1, generator=g)
    return TensorDataset(x, y, torch.arange(N))


def lengths() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(1, 60, (N,), generator=g).tolist()


class Stream(IterableDataset):
    """The samples in their order as a stream without state (replayed on a resume)."""

    def __iter__(self):
        yield from dataset()


HF_N, HF_SHARDS, HF_BATCH = 64, 8, 4


def hf_stream():
    """The first 64 samples as a Hugging Face IterableDataset of 8 shards of 8."""
    import datasets
    x, y, idx = dataset()[:HF_N]
    return datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist(), "idx": idx.tolist()}) \
        .with_format("torch").to_iterable_dataset(num_shards=HF_SHARDS)


def loader(kind: str, batch_size: int = BATCH) -> DataLoader:
    if kind == "stream":
        return DataLoader(Stream(), batch_size=batch_size)
    if kind == "grouped":
        return DataLoader(dataset(), batch_size=batch_size,
                          sampler=ember.data.LengthGroupedSampler(lengths(), batch_size))
    return DataLoader(dataset(), batch_size=batch_size, shuffle=True)


class Net(ember.TrainModule):
    """A 4-8-1 tanh MLP; records the sample indices of each batch it trains."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = (batch["x"], batch["y"], batch["idx"]) if isinstance(batch, dict) else batch   # (a HF stream's)
        self.seen.append(idx.tolist())
        return F.mse_loss(self.net(x.float()), y.float().view(-1, 1))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.97 ** s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SaveMidWindow(Callback):
    """Save ROOT/mid after ``batches`` batches (inside an accumulation window)."""

    def __init__(self, path: str, batches: int):
        self.path, self.batches = path, batches

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx + 1 == self.batches:
            trainer.save_checkpoint(self.path)


def trainer(root: str, devices: int, save: bool = False, callbacks=(), every: int = EVERY, **kw) -> ember.Trainer:
    from ember.strategies import DDPStrategy
    cbs = list(callbacks)
    if save:
        cbs.append(ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=every, save_top_k=-1))
    args = dict(default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, callbacks=cbs, seed=0, accelerator="cpu", devices=devices,
                strategy=DDPStrategy(timeout=20) if devices > 1 else "auto", enable_checkpointing=save,
                max_steps=STEPS)
    args.update(kw)
    return ember.Trainer(**args)


def step6(root: str) -> str:
    return os.path.join(root, "ck", "epoch=0-step=6")


def run(mode: str, root: str, world: int, **trainer_kw) -> dict:
    """One mode on this process group (or on one process); returns this rank's record."""
    d = os.path.join(root, mode)
    os.makedirs(d, exist_ok=True)
    kind = next((k for k in ("grouped", "stream") if mode.endswith(k)), "map")
    module, kw, ckpt, bs, cbs = Net(), dict(trainer_kw), None, BATCH, []
    if mode.startswith("ref1"):
        kw["accumulate_grad_batches"] = 2
        cbs.append(SaveMidWindow(os.path.join(d, "mid"), 13))   # 6 steps and one micro-batch of the 7th
    elif mode == "from1":
        ckpt = os.path.join(root, "ref1_map", "mid")
    elif mode.startswith("to1"):
        ckpt = step6(os.path.join(root, f"ref2_{kind}"))
    elif mode == "grow4":
        ckpt, bs = step6(os.path.join(root, "ref2_map")), BATCH // 2
    elif mode in ("refused", "explicit"):
        ckpt = step6(os.path.join(root, "ref2_map"))
        if mode == "explicit":
            kw.update(accumulate_grad_batches=1, max_steps=-1, max_epochs=1)
    if mode.startswith("hf"):   # one epoch of the 8-shard stream
        kw.update(max_steps=-1, max_epochs=1, every=1)
        bs = {"hf2": HF_BATCH, "hfsdl2": HF_BATCH, "hf1_twice": 4 * HF_BATCH // 2}.get(mode, HF_BATCH // 2)
        if mode in ("hf4_again", "hf1_twice"):
            ckpt = os.path.join(root, "hf4_uneven", "ck", "epoch=0-step=5")
        elif mode == "hfsdl4":
            ckpt = os.path.join(root, "hfsdl2", "ck", "epoch=0-step=3")
        elif mode not in ("hf2", "hfsdl2"):
            ckpt = os.path.join(root, "hf2", "ck", f"epoch=0-step={4 if mode == 'hf4_even' else 3}")
    data = loader(kind, bs) if not mode.startswith(("state", "hf")) else None
    if mode.startswith("hfsdl"):
        import stateful_cases
        data = stateful_cases.stateful_dataloader(hf_stream(), batch_size=bs)
    elif mode.startswith("hf"):
        data = DataLoader(hf_stream(), batch_size=bs)
    if mode.startswith("state"):
        import stateful_cases
        data = stateful_cases.loader(mode.split("_", 1)[1])
        if mode.startswith("state1"):
            kw.update(max_steps=3, every=3, accumulate_grad_batches=2)   # the global batch of 2 x 4
        else:
            ckpt = os.path.join(root, "state1_" + mode.split("_", 1)[1], "ck", "epoch=0-step=3")
    save = mode.startswith(("ref", "state1")) or mode in ("hf2", "hf4_uneven", "hfsdl2")
    t = trainer(d, world, save=save, callbacks=cbs, **kw)
    start, error = time.monotonic(), None
    try:
        t.fit(module, data, ckpt_path=ckpt)
    except Exception as err:   # recorded: the test checks every rank refused alike
        error = f"{type(err).__name__}: {err}"
    out = {"error": error, "seconds": time.monotonic() - start, "global_step": t.global_step, "seen": module.seen,
           "accumulate_grad_batches": t.accumulate_grad_batches, "rank": t.global_rank}
    with open(os.path.join(d, f"rank{t.global_rank}.json"), "w") as f:
        json.dump(out, f)
    if t.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, os.path.join(d, "weights.pt"))
    return out


if __name__ == "__main__":
    world, root = int(sys.argv[1]), sys.argv[2]
    for m in sys.argv[3].split(","):
        run(m, root, world)
