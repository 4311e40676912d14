"""Data scenarios under two processes (gloo, CPU), run by tests/data/test_data_multiproc.py:

    python -m torch.distributed.run --nproc_per_node 2 data_ddp.py SCENARIO OUT_DIR

Every rank writes OUT_DIR/<scenario>_rank<R>.json. The single-process references
come from the functions of this file, imported by the tests.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from common import worker_context
from ember import Accelerator, Trainer, TrainModule
from ember.callbacks import GatherMetrics
from ember.strategies import DDPStrategy

TIMEOUT_S = 45      # process-group timeout: a hang fails in seconds
GATHER_COMBOS = [(1001, 10), (7, 3), (5, 4), (8, 4), (1, 4)]   # (size, batch): uneven and even
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def strategy(devices):
    return DDPStrategy(timeout=TIMEOUT_S) if devices > 1 else "auto"


def eval_set(size):
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(size, 3, generator=g), torch.arange(size))


def values(size):
    """The single-process values, in dataset order: the module's output per sample."""
    with torch.no_grad():
        return GatherModule().net(eval_set(size).tensors[0]).squeeze(-1)


class GatherModule(TrainModule):
    """gather_for_metrics per batch in validation_step (as Accelerate users write it) and
    once at epoch end on the concatenation; also returns preds/target for GatherMetrics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)

    def on_validation_epoch_start(self):
        self.per_batch, self.local = [], []

    def validation_step(self, batch, batch_idx):
        x, i = batch
        v = self.net(x).squeeze(-1)
        self.per_batch.append(self.gather_for_metrics({"ids": i, "v": v}))
        self.local.append((i, v))
        return {"preds": v, "target": i}

    def on_validation_epoch_end(self):
        ids, v = (torch.cat(t) for t in zip(*self.local))
        self.epoch_end = self.gather_for_metrics({"ids": ids, "v": v})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lists(g):
    return {"ids": g["ids"].tolist(), "v": g["v"].tolist()}


def run_gather(devices, root):
    res = {}
    for size, batch in GATHER_COMBOS:
        seen = {}

        def keep(p, t):
            seen.update(ids=t.tolist(), v=p.tolist())
            return float(t.numel())

        trainer = Trainer(devices=devices, strategy=strategy(devices), callbacks=[GatherMetrics({"n": keep})],
                          default_root_dir=root, **QUIET)
        module = GatherModule()
        trainer.validate(module, DataLoader(eval_set(size), batch_size=batch))
        per_batch = {k: torch.cat([g[k] for g in module.per_batch]) for k in ("ids", "v")}
        res[f"{size}_{batch}"] = {"per_batch": _lists(per_batch), "epoch_end": _lists(module.epoch_end),
                                  "callback": seen}
    # a pass cut short (limit_val_batches=2) never reaches the padding: nothing dropped
    trainer = Trainer(devices=devices, strategy=strategy(devices), limit_val_batches=2, default_root_dir=root,
                      **QUIET)
    module = GatherModule()
    trainer.validate(module, DataLoader(eval_set(1001), batch_size=10))
    res["partial"] = {"per_batch": torch.cat([g["ids"] for g in module.per_batch]).tolist(),
                      "epoch_end": module.epoch_end["ids"].tolist()}
    # the Accelerator, per batch and once after the pass
    acc = Accelerator(strategy=strategy(devices), seed=0)
    for size, batch in GATHER_COMBOS:
        loader = acc.prepare(DataLoader(eval_set(size), batch_size=batch))
        net, per_batch, local = GatherModule().net, [], []
        for x, i in loader:
            with torch.no_grad():
                v = net(x).squeeze(-1)
            per_batch.append(acc.gather_for_metrics({"ids": i, "v": v}))
            local.append((i, v))
        ids, v = (torch.cat(t) for t in zip(*local))
        res[f"acc_{size}_{batch}"] = {
            "per_batch": _lists({k: torch.cat([g[k] for g in per_batch]) for k in ("ids", "v")}),
            "epoch_end": _lists(acc.gather_for_metrics({"ids": ids, "v": v})),
            "other_after_pass": acc.gather_for_metrics(ids[:1]).tolist()}   # not the pass: gathered whole
    return trainer, res


class Stream(IterableDataset):
    """n regression samples as a stream (no __len__), the same on every rank: (x, y, index)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(64, 4, generator=g)[:n]     # the first n of the same 64 samples
        self.y = self.x.sum(1, keepdim=True) * 0.3 + 0.1

    def __iter__(self):
        return iter(zip(self.x, self.y, range(len(self.x))))


class StreamRegressor(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y, i = batch
        self.seen += i.tolist()
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_stream(devices, root, n, batch_size, accumulate=2):
    trainer = Trainer(devices=devices, strategy=strategy(devices), max_epochs=2, accumulate_grad_batches=accumulate,
                      seed=3, default_root_dir=root, **QUIET)
    module = StreamRegressor()
    trainer.fit(module, DataLoader(Stream(n), batch_size=batch_size))
    return trainer, {"weights": {k: v.tolist() for k, v in module.state_dict().items()}, "seen": module.seen,
                     "steps": trainer.global_step}


class Noisy(torch.utils.data.Dataset):
    """Each sample draws from torch, numpy and python random, as augmentation would."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        import random

        import numpy as np
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()])


class DrawRecorder(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.draws = []

    def training_step(self, batch, batch_idx):
        self.draws += batch[:, 1:].tolist()
        return self.net(batch[:, 1:2]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StreamEval(StreamRegressor):
    per_batch = False

    def validation_step(self, batch, batch_idx):
        x, y, i = batch
        if self.per_batch:
            self.gather_for_metrics(i)
        return {"preds": i, "target": i}


def run_iterable(devices, root):
    res = {}
    # 55 items: 27 per rank (the last, odd one left out, so the ranks end together): 7 batches of
    # at most 4, accumulation windows of 2, the last of 1
    trainer, res["fit"] = fit_stream(devices, root, 55, 4)
    # DataLoader workers (2 per rank) draw different numbers on every rank
    trainer = Trainer(devices=devices, strategy=strategy(devices), max_epochs=1, seed=3, default_root_dir=root,
                      **QUIET)
    module = DrawRecorder()
    trainer.fit(module, DataLoader(Noisy(), batch_size=2, num_workers=2, **worker_context()))
    res["draws"] = module.draws
    # evaluation keeps every item of a stream (55 over 2 ranks: 28 + 27); gathered once at epoch end
    seen = {}
    metric = GatherMetrics({"n": lambda p, t: (seen.update(ids=sorted(t.tolist())), t.numel())[1]})
    trainer = Trainer(devices=devices, strategy=strategy(devices), callbacks=[metric], default_root_dir=root, **QUIET)
    trainer.validate(StreamEval(), DataLoader(Stream(55), batch_size=4))
    res["eval_ids"] = seen["ids"]
    module = StreamEval()
    module.per_batch = True
    try:   # a per-batch gather could wait for a batch the other rank does not have: refused
        trainer.validate(module, DataLoader(Stream(55), batch_size=4))
    except Exception as e:
        res["per_batch_error"] = str(e)
    return trainer, res


GEN_SIZE, GEN_BATCH = 20, 2


class IdRecorder(TrainModule):
    """Records the sample ids it trains on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, i = batch
        self.seen += i.tolist()
        return self.net(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def gen_order(seed):
    """The order one process draws from DataLoader(shuffle=True, generator=seed) in its first pass."""
    g = torch.Generator().manual_seed(seed)
    dl = DataLoader(eval_set(GEN_SIZE), batch_size=GEN_BATCH, shuffle=True, generator=g)
    return [int(i) for _, ids in dl for i in ids]


def _generator_warnings(caught):
    return [str(w.message) for w in caught if "generator" in str(w.message) and "rank 0" in str(w.message)]


def run_generator(devices, root):
    """A user's generator= seeded per rank (100 + rank) or alike (100), under the Trainer
    (one epoch) and the Accelerator (one pass): the sample ids each rank saw, and the
    warnings about differing generator states."""
    import warnings
    rank = int(os.environ.get("RANK", "0"))
    res = {}
    for name, seed in (("per_rank", 100 + rank), ("alike", 100)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = Trainer(devices=devices, strategy=strategy(devices), max_epochs=1, default_root_dir=root,
                              **QUIET)
            module = IdRecorder()
            g = torch.Generator().manual_seed(seed)
            trainer.fit(module, DataLoader(eval_set(GEN_SIZE), batch_size=GEN_BATCH, shuffle=True, generator=g))
        res[f"trainer_{name}"] = {"seen": module.seen, "warnings": _generator_warnings(caught)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc = Accelerator(strategy=strategy(devices))
            g = torch.Generator().manual_seed(seed)
            loader = acc.prepare(DataLoader(eval_set(GEN_SIZE), batch_size=GEN_BATCH, shuffle=True, generator=g))
            seen = [int(i) for _, ids in loader for i in ids]
        res[f"acc_{name}"] = {"seen": seen, "warnings": _generator_warnings(caught)}
    # per-rank seeds, two epochs: uninterrupted, and stopped after epoch 0 then resumed
    # (the checkpoint holds rank 0's generator state, which every rank then uses)
    runs = {}
    for name, epochs, ckpt in (("full", 2, None), ("first", 1, None), ("resumed", 2, os.path.join(root, "gen.ckpt"))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(devices=devices, strategy=strategy(devices), max_epochs=epochs, default_root_dir=root,
                              **QUIET)
            module = IdRecorder()
            g = torch.Generator().manual_seed(100 + rank)
            trainer.fit(module, DataLoader(eval_set(GEN_SIZE), batch_size=GEN_BATCH, shuffle=True, generator=g),
                        ckpt_path=ckpt)
        if name == "first":
            trainer.save_checkpoint(os.path.join(root, "gen.ckpt"))
        runs[name] = module.seen
    res["resume"] = runs
    return trainer, res


def run_generator_workers(devices, root):
    """A user's generator= (alike on both ranks) with two persistent DataLoader workers,
    under the Trainer: three epochs uninterrupted (a checkpoint at every step), then resumed
    from the checkpoints in the middle of epoch 1 and after its last batch: the ids each
    rank trained and its final weights."""
    import warnings

    from ember.callbacks import ModelCheckpoint
    res = {}
    for name, ckpt in (("full", None), ("mid", "epoch=1-step=7"), ("last_batch", "epoch=1-step=10")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet = {**QUIET, "enable_checkpointing": ckpt is None}
            cbs = [ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=1, save_top_k=-1)] \
                if ckpt is None else []
            trainer = Trainer(devices=devices, strategy=strategy(devices), max_epochs=3, default_root_dir=root,
                              callbacks=cbs, **quiet)
            module = IdRecorder()
            g = torch.Generator().manual_seed(100)
            trainer.fit(module, DataLoader(eval_set(GEN_SIZE), batch_size=GEN_BATCH, shuffle=True, generator=g,
                                           num_workers=2, persistent_workers=True, **worker_context()),
                        ckpt_path=os.path.join(root, "ck", ckpt) if ckpt else None)
        res[name] = {"seen": module.seen, "weights": [p.detach().tolist() for p in module.parameters()]}
    return trainer, res


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    devices = int(os.environ.get("EMBER_TEST_DEVICES", "2"))
    if scenario == "gather":
        trainer, res = run_gather(devices, out)
    elif scenario == "iterable":
        trainer, res = run_iterable(devices, out)
    elif scenario == "generator":
        trainer, res = run_generator(devices, out)
    elif scenario == "generator_workers":
        trainer, res = run_generator_workers(devices, out)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    res["rank"], res["world"] = trainer.global_rank, trainer.world_size
    with open(os.path.join(out, f"{scenario}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
