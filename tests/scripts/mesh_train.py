"""N-D parallelism runs for tests/strategies/test_model_parallel.py.

    python mesh_train.py OUT ref                       # one process, plain strategy: the reference
    torchrun --nproc_per_node 4 mesh_train.py OUT 2x2  # data 2 x tensor 2, checkpoints every epoch
    torchrun --nproc_per_node 4 mesh_train.py OUT 4x1  # resumes 2x2's epoch-0 checkpoint on 4 x 1
    python mesh_train.py OUT 1x1                       # resumes it on one process
    torchrun --nproc_per_node 2 mesh_train.py OUT hsdp # HSDP (replicate 2, shard 1) and FSDP (1, 2)

24 samples, global batch 8 (3 steps an epoch), 2 epochs, AdamW. Every run writes
OUT/<run>.json on rank 0: the global loss per step (mean over the data-parallel
ranks), the full final weights, and per-rank local sizes.
"""
from __future__ import annotations

import glob
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint

D_IN, D, H, N_CLASSES, N, GLOBAL_BATCH = 8, 16, 32, 4, 24, 8
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
             max_epochs=2)


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class TPNet(ember.TrainModule):
    """inp -> 2 MLP blocks -> head. configure_model applies the Megatron MLP plan
    (up: column-parallel, down: row-parallel) over the tensor-parallel mesh dimension."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([MLPBlock(), MLPBlock()])
        self.head = nn.Linear(D, N_CLASSES)

    def configure_model(self):
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for block in self.blocks:
            parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class Record(Callback):
    """Global loss per step (a test-only collective per step), local sizes at the end."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(ember.distributed.reduce(loss.detach(), "mean", strategy=trainer.strategy)))


def data(dp: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D_IN, generator=g)
    y = torch.randint(0, N_CLASSES, (N,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // dp, shuffle=False)


def local_numel(module: nn.Module, opt) -> int:
    from torch.distributed.tensor import DTensor
    loc = [t.to_local() if isinstance(t, DTensor) else t for t in module.parameters()]
    n = sum(t.numel() for t in loc)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                n += (v.to_local() if isinstance(v, DTensor) else v).numel()
    return n


class PendingAtEpochStart(Callback):
    """Whether the epoch-end checkpoint was still being written when the next epoch began."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_start(self, trainer, module):
        self.seen.append(getattr(trainer.strategy, "_pending_save", None) is not None)


def fit(out: str, run: str, strategy, dp: int, ckpt_path=None, checkpoints=None, extra=(), clip=None) -> None:
    torch.manual_seed(0)
    module = TPNet()
    rec = Record()
    cbs = [rec, *extra]
    if checkpoints:
        cbs.append(ModelCheckpoint(dirpath=checkpoints, save_top_k=-1))
    trainer = ember.Trainer(strategy=strategy, devices="cpu" if strategy == "single" else "auto",
                            callbacks=cbs, enable_checkpointing=bool(checkpoints), gradient_clip_val=clip, **QUIET)
    trainer.fit(module, data(dp), ckpt_path=ckpt_path)
    weights = trainer.strategy.module_state_dict(trainer.model) if strategy != "single" else \
        {k: v.detach().clone() for k, v in module.state_dict().items()}
    mesh = module.device_mesh
    result = {"losses": rec.losses, "global_step": trainer.global_step, "world": trainer.world_size,
              "local_numel": local_numel(trainer.model, trainer.optimizers[0]),
              "mesh": list(mesh.mesh.shape) if mesh is not None else None,
              "fsdp_units": sorted(n or "<root>" for n, m in trainer.model.named_modules()
                                   if type(m).__name__.startswith("FSDP")),
              "mesh_dims": list(mesh.mesh_dim_names or ()) if mesh is not None else None,
              "weights": {k: v.tolist() for k, v in weights.items()}}
    sizes = trainer.strategy.all_gather_object(result["local_numel"])
    if trainer.is_global_zero:
        result["local_numel_per_rank"] = sizes
        with open(os.path.join(out, f"{run}.json"), "w") as f:
            json.dump(result, f)


def epoch0_checkpoint(out: str) -> str:
    found = sorted(glob.glob(os.path.join(out, "ckpt", "epoch=0-*")))
    assert found, os.listdir(os.path.join(out, "ckpt"))
    return found[0]


#: small enough that every step clips
CLIP = 0.05


def main() -> None:
    """``mesh_train.py OUT RUN[,RUN...]``: the runs one after the other in this launch."""
    out = sys.argv[1]
    for run in sys.argv[2].split(","):
        one_run(out, run)


def one_run(out: str, run: str) -> None:
    from ember.strategies import FSDPStrategy, ModelParallelStrategy
    short = dict(timeout=60)
    if run == "ref":
        fit(out, run, "single", 1)
        fit(out, "ref_clip", "single", 1, clip=CLIP)
    elif run == "2x2":
        fit(out, run, ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, **short), 2,
            checkpoints=os.path.join(out, "ckpt"))
        # clipping: tensor-parallel (2-D mesh) parameters beside FSDP-only ones, one total norm
        fit(out, "2x2_clip", ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, **short), 2,
            clip=CLIP)
    elif run == "4x1":
        fit(out, run, ModelParallelStrategy(tensor_parallel_size=1, **short), 4, ckpt_path=epoch0_checkpoint(out))
    elif run == "1x1":
        fit(out, run, ModelParallelStrategy(**short), 1, ckpt_path=epoch0_checkpoint(out))
    elif run == "tp_async":      # 1 x 2 (tensor parallel), DCP checkpoints written in the background
        pending = PendingAtEpochStart()
        fit(out, run, ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, async_save=True, **short),
            1, checkpoints=os.path.join(out, "ckpt_async"), extra=[pending])
        full = PendingAtEpochStart()   # FSDP, full state: rank 0's writer thread
        fit(out, "full_async", FSDPStrategy(state_dict_type="full", async_save=True, **short), 2,
            checkpoints=os.path.join(out, "ckpt_full_async"), extra=[full])
        if int(os.environ["RANK"]) == 0:
            with open(os.path.join(out, "tp_async_pending.json"), "w") as f:
                json.dump({"tp": pending.seen, "full": full.seen}, f)
    elif run == "hsdp":
        fit(out, "hsdp_2x1", FSDPStrategy(hsdp=(2, 1), **short), 2)
        fit(out, "fsdp_1x2", FSDPStrategy(hsdp=(1, 2), **short), 2)
    else:
        raise SystemExit(f"unknown run {run}")


if __name__ == "__main__":
    main()
