"""Port of the loop patterns of Lightning Fabric's ``examples/fabric/build_your_own_trainer``
and of litgpt's ``pretrain.py`` (reduced to a tiny model), written against ember's names
with ``import ember as L`` in place of ``import lightning as L``.

Same API usage as the originals: ``L.fabric.Fabric(precision="bf16-mixed", loggers=...)``
with ``L.fabric.loggers.CSVLogger(root_dir=...)``, ``L.fabric.seed_everything`` after it,
``fabric.init_module(empty_init=True)`` then the script's own initialisation
(litgpt's ``initialize_weights``), a shuffled training loader left after
``limit_train_batches`` batches each epoch (build_your_own_trainer's limit), the step taken
through ``model.training_step(batch)`` on the set-up model, ``ThroughputMonitor(fabric)``
with ``measure_flops`` on a meta-device copy, ``_unwrap_objects``, and ``fabric.save``.

Changed from the originals, and why: a two-layer model on random tokens (no download); 3
epochs of at most 6 batches; the numbers are written to ``PORT_OUT`` for the comparison.

Features used: init_module(empty_init=True), bf16-mixed (forward autocast, outputs in
float32), a pass left early (a new order next pass), Fabric loggers (root_dir),
ThroughputMonitor(fabric), measure_flops, utilities.types.Optimizable,
wrappers._unwrap_objects, save.

    python tests/ports/fabric/trainer_loop.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import fabric_kwargs, param_sums, write

import ember as L  # (import lightning as L)
from ember.fabric.loggers import CSVLogger  # (from lightning.fabric.loggers import CSVLogger)
from ember.fabric.utilities import ThroughputMonitor, measure_flops  # (lightning.fabric.utilities)
from ember.fabric.utilities.types import Optimizable  # (lightning.fabric.utilities.types)
from ember.fabric.wrappers import _unwrap_objects  # (lightning.fabric.wrappers)

VOCAB, DIM, SEQ = 32, 16, 8


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.mlp(x))

    def training_step(self, batch):
        (idx,) = batch
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), idx[:, 1:].reshape(-1))


def initialize_weights(model: nn.Module) -> None:
    """litgpt's explicit initialisation after ``init_module(empty_init=True)``."""
    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.Linear)):
            nn.init.normal_(mod.weight, mean=0.0, std=0.02)
            if getattr(mod, "bias", None) is not None:
                nn.init.zeros_(mod.bias)


def main(root_dir: str = "logs", epochs: int = 3, limit_train_batches: int = 6) -> None:
    logger = CSVLogger(root_dir=root_dir, name="tiny")
    fabric = L.fabric.Fabric(precision="bf16-mixed", loggers=logger, **fabric_kwargs())
    fabric.launch()
    L.fabric.seed_everything(42)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (96, SEQ + 1), generator=g)
    train_loader = fabric.setup_dataloaders(DataLoader(TensorDataset(tokens), batch_size=8, shuffle=True))

    with fabric.init_module(empty_init=True):
        model = TinyLM()
    initialize_weights(model)
    with torch.device("meta"):
        meta_model = TinyLM()
        x = torch.randint(0, VOCAB, (8, SEQ))
        flops_per_batch = measure_flops(meta_model, lambda: meta_model(x), lambda y: y.sum())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    assert isinstance(optimizer, Optimizable)
    model, optimizer = fabric.setup(model, optimizer)
    throughput = ThroughputMonitor(fabric, window_size=2)

    losses, first_batches, out_dtypes = [], [], set()
    t0, step = time.perf_counter(), 0
    for epoch in range(epochs):
        for batch_idx, batch in enumerate(train_loader):
            if batch_idx == 0:
                first_batches.append(batch[0][0].tolist())
            loss = model.training_step(batch)   # through the set-up model, as build_your_own_trainer
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out_dtypes.add(str(model(batch[0][:, :-1]).dtype))
            losses.append(loss.item())
            step += 1
            throughput.update(time=time.perf_counter() - t0 + step, batches=step, samples=step * 8,
                              flops=flops_per_batch)
            fabric.log_dict({"loss": loss.item(), "epoch": epoch}, step=step)
            if batch_idx + 1 >= limit_train_batches:   # the limit: the pass is left here
                break
    metrics = throughput.compute_and_log(step=step)
    state = {"model": model, "optimizer": optimizer, "step": step}
    fabric.save("ckpt", state)
    unwrapped = _unwrap_objects(state)
    write(fabric, train_losses=losses, first_batches=first_batches, params=param_sums(model),
          out_dtypes=sorted(out_dtypes), flops_per_batch=flops_per_batch,
          throughput_keys=sorted(k for k in metrics if k != "time"),
          unwrapped=[type(unwrapped["model"]).__name__, type(unwrapped["optimizer"]).__name__],
          log_dir_parts=logger.log_dir.split("/")[-3:])


if __name__ == "__main__":
    main()
