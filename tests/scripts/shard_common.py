"""Shared by the sharded-strategy test scripts (shard_fsdp.py, shard_deepspeed.py):
a small model, fixed data, the single-process fp32 reference, per-rank memory
and result files."""
from __future__ import annotations

import copy
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback

D_IN, D, N_CLASSES, N = 8, 16, 4, 64
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class Block(nn.Module):
    calls = 0      # forward calls (activation checkpointing recomputes in backward)

    def __init__(self, d: int = D):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        Block.calls += 1
        return x + torch.tanh(self.lin(x))


class Net(ember.TrainModule):
    """inp -> 2 Blocks -> head; AdamW (+ an optional per-step StepLR). With
    ``late_blocks`` the blocks are built in configure_model (meta device under FSDP)."""

    def __init__(self, lr: float = 0.05, late_blocks: bool = False, sched: bool = False, opt: str = "adamw",
                 loss_mult: float = 1.0):
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = None if late_blocks else nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, N_CLASSES)

    def configure_model(self):
        if self.blocks is None:
            self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y) * self.hparams.loss_mult
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self):
        opt = make_optimizer(self)
        if not self.hparams.sched:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_optimizer(net: Net) -> torch.optim.Optimizer:
    if net.hparams.opt == "sgd":
        return torch.optim.SGD(net.parameters(), lr=net.hparams.lr)
    return torch.optim.AdamW(net.parameters(), lr=net.hparams.lr, weight_decay=0.01)


def data(n: int = N, seed: int = 0) -> TensorDataset:
    """The first ``n`` samples of one fixed data set."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(n, N), D_IN, generator=g)
    y = (x[:, :N_CLASSES] + 0.3 * torch.randn(max(n, N), N_CLASSES, generator=g)).argmax(1)
    return TensorDataset(x[:n], y[:n])


def loader(batch_size: int = 4, shuffle: bool = False, n: int = N) -> DataLoader:
    return DataLoader(data(n), batch_size=batch_size, shuffle=shuffle)


def make_net(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def reference(net: Net, steps: int, window: int, clip: float | None, sched: bool = False) -> dict:
    """Single-process fp32 training: each optimizer step sees the ``window`` samples that
    all ranks' micro-batches of one accumulation window hold (unshuffled data)."""
    ref = copy.deepcopy(net)
    x, y = data().tensors
    opt = make_optimizer(ref)
    s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if sched else None
    for k in range(steps):
        xb, yb = x[k * window:(k + 1) * window], y[k * window:(k + 1) * window]
        (F.cross_entropy(ref(xb), yb) * ref.hparams.loss_mult).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if s is not None:
            s.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def accelerator_loop(acc: ember.Accelerator, clip: float | None = None):
    """``Accelerator.prepare(model, optimizer)`` (the optimizer built before sharding) and a
    custom loop with gradient accumulation (``acc.accumulate``, ``acc.backward``, with
    ``clip`` ``acc.clip_grad_norm_``) over ``loader()``; returns the prepared model and
    optimizer and the single-process reference of the same 4 optimizer steps."""
    net = make_net()
    ref = reference(net, 4, window=4 * 2 * acc.gradient_accumulation_steps, clip=clip)
    opt = make_optimizer(net)
    model, opt, dl = acc.prepare(net, opt, loader())
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            if clip is not None:
                acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, opt, ref


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` as this rank holds them
    (a DTensor's local shard; flat buffers counted once)."""
    from torch.distributed.tensor import DTensor
    seen = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.device.type == "meta" or t.numel() == 0:
            continue
        st = t.untyped_storage()
        seen[(st.data_ptr(), t.device.type)] = st.nbytes()
    return sum(seen.values())


def optimizer_tensors(opt) -> list:
    """Parameters the optimizer updates and its state tensors."""
    out = [p for g in opt.param_groups for p in g["params"]]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def ds_optimizer_tensors(ds_opt) -> list:
    """A DeepSpeed ZeRO optimizer's fp32 master partitions, plus the wrapped optimizer's
    states (stage 3 detaches the masters from its param_groups between steps)."""
    out = optimizer_tensors(ds_opt.optimizer)
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        out += list(getattr(ds_opt, name, None) or [])
    return out


def full_param_bytes(net: nn.Module) -> int:
    return sum(p.numel() * 4 for p in net.parameters())


class Snapshot(Callback):
    """At on_fit_start (after a restore): the full weights and full optimizer state."""

    def __init__(self):
        self.weights = self.optim = None

    def on_fit_start(self, trainer, module):
        s = trainer.strategy   # deep copies: on one rank the full state may alias live tensors
        self.weights = copy.deepcopy(s.module_state_dict(trainer.model))
        if s.name == "fsdp":
            self.optim = copy.deepcopy(s.optimizer_state_dict(trainer.optimizers[0], trainer.model))


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss.detach().float()))


def optim_states_equal(a: dict, b: dict) -> bool:
    """Full (name-keyed) optimizer states: every tensor equal."""
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    for k, sa in a["state"].items():
        sb = b["state"][k]
        for key, v in sa.items():
            w = sb[key]
            if isinstance(v, torch.Tensor):
                if not torch.equal(v.float().cpu(), w.float().cpu()):
                    return False
            elif v != w:
                return False
    return True


def export_result(strategy, net: Net, folder: str, rank: int) -> dict:
    """``strategy.export_full(folder)`` of the trained, wrapped ``net``: the files written
    and, on rank 0, how far a plain ``Net`` loaded from them is from ``net``'s outputs."""
    from ember.checkpoint import io as cio
    path = strategy.export_full(folder)
    x = data().tensors[0][:8]
    with torch.no_grad():
        y = net(x)
    res = {"files": sorted(os.listdir(path))}
    if rank == 0:
        plain = Net()
        plain.load_state_dict(cio.load_model_sharded(path))
        with torch.no_grad():
            res["max_out_diff"] = (plain(x) - y).abs().max().item()
    return res


def commit_result(dropping, complete, out_dir: str) -> dict:
    """A one-step fit and save with the Trainer ``dropping()`` makes (its strategy loses one
    rank's file before the commit), then with ``complete()``'s: the error the first save
    raised (or None), whether it was committed, and the files the second's meta.json lists."""
    res = {}
    t = dropping()
    t.fit(make_net(), loader())
    try:
        t.save_checkpoint(os.path.join(out_dir, "dropped_ckpt"))
        res["error"] = None
    except Exception as err:
        res["error"] = f"{type(err).__name__}: {err}"
    res["committed"] = os.path.exists(os.path.join(out_dir, "dropped_ckpt"))
    t = complete()
    t.fit(make_net(), loader())
    t.save_checkpoint(os.path.join(out_dir, "listed_ckpt"))
    with open(os.path.join(out_dir, "listed_ckpt", "meta.json")) as f:
        res["listed"] = sorted(json.load(f)["files"])
    return res


def write_result(out_dir: str, name: str, result: dict, rank: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def deepspeed_dropping_rank1_file():
    """``(cls, dropped)``: a DeepSpeedStrategy whose commit finds rank 1's first ZeRO file
    removed (rank 1 deletes it just before the commit's check; its name goes in ``dropped``),
    for the tests of the rule that a commit checks every rank's files."""
    from ember.checkpoint import io as cio
    from ember.strategies import DeepSpeedStrategy
    dropped: list = []

    class DropsRank1File(DeepSpeedStrategy):
        def _commit(self, path, state, meta, mine):
            self.barrier()
            if self.global_rank == 1 and isinstance(mine, dict):
                os.remove(os.path.join(cio.tmp_path(path), "model", sorted(mine)[0]))
                dropped.append(sorted(mine)[0])
            super()._commit(path, state, meta, mine)
    return DropsRank1File, dropped


class CommittedWatch(Callback):
    """At each step's ``on_train_batch_end`` (before ModelCheckpoint's save of that step):
    the global steps of the complete checkpoints in ``dirpath`` and the step ``last``
    resolves to (None: missing or not a complete checkpoint)."""

    def __init__(self, dirpath):
        self.dirpath, self.seen = dirpath, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append((trainer.global_step, committed_steps(self.dirpath), last_step(self.dirpath)))


def _meta_step(path):
    from ember.checkpoint import io as cio
    try:
        with open(os.path.join(path, cio.META_NAME)) as f:
            return json.load(f)["global_step"]
    except (OSError, ValueError, KeyError):
        return None


def committed_steps(dirpath) -> list:
    """global_step of each complete checkpoint directory under ``dirpath`` (``last`` not counted)."""
    from ember.checkpoint import io as cio
    return sorted(_meta_step(p) for p in cio.list_checkpoints(dirpath) if os.path.basename(p) != "last")


def last_step(dirpath):
    """The global step of the complete checkpoint ``dirpath/last`` names, or None."""
    from ember.checkpoint import io as cio
    last = os.path.join(dirpath, "last")
    return _meta_step(last) if cio.is_checkpoint(os.path.realpath(last)) else None

