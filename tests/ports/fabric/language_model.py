"""Port of Lightning Fabric's ``examples/fabric/language_model/train.py`` (a word-level
Transformer language model trained with SGD), written against ember's names.

Same structure and API usage as the original: ``import ... as L``, ``L.seed_everything(42)``
then ``L.Fabric()``, ``random_split`` with a seeded generator, ``fabric.setup(model,
optimizer)``, ``setup_dataloaders``, ``fabric.backward``, ``fabric.clip_gradients(model,
optimizer, clip_val=0.25)``, ``fabric.print``, and a validation loop with ``model.eval()`` /
``model.train()``; dropout draws from the global RNG during training.

Changed from the original, and why: ``import ember as L`` (for ``import lightning as L``);
``lightning.pytorch.demos.Transformer`` and ``WikiText2`` are demos ember does not ship: a
small encoder-decoder of the same shape and a synthetic token stream (``tests/ports/demos.py``,
shared with the Lightning port ``tests/ports/lightning/transformer.py``) stand in (no downloads); fewer samples and
2 epochs; ``L.Fabric(**fabric_kwargs())`` names the processes and ``fabric.launch()`` is
called; the numbers are written to ``PORT_OUT``, with the token sum of each epoch's first
batch (the shuffled order, and the random draws after it, equal Fabric's on one process and
under DDP: see docs/porting.md, "Data order").

Features used: setup, setup_dataloaders, backward, clip_gradients(clip_val), print,
seed_everything; dropout (global RNG).

    python tests/ports/fabric/language_model.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split

from common import SHUFFLE_TRAIN, fabric_kwargs, param_sums, write
from demos import SyntheticText, Transformer  # (from lightning.pytorch.demos import Transformer, WikiText2)

import ember as L  # (import lightning as L)


ORDER = []   # (port) the token sum of each epoch's first batch on this rank


def main():
    L.seed_everything(42)

    fabric = L.Fabric(**fabric_kwargs())
    fabric.launch()

    # Data
    dataset = SyntheticText(n_blocks=400)
    train_dataloader, val_dataloader, _ = get_dataloaders(dataset)

    # Model
    model = Transformer(vocab_size=dataset.vocab_size)

    # Optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    model, optimizer = fabric.setup(model, optimizer)
    train_dataloader, val_dataloader = fabric.setup_dataloaders(train_dataloader, val_dataloader)
    val_losses, train_losses = train(fabric, model, optimizer, train_dataloader, val_dataloader)
    write(fabric, val_losses=val_losses, train_losses=train_losses, params=param_sums(model), first_batches=ORDER)


def train(fabric, model, optimizer, train_dataloader, val_dataloader, max_epochs=2):
    val_losses, train_losses = [], []
    for epoch in range(max_epochs):
        train_losses += train_epoch(fabric, model, optimizer, train_dataloader, epoch)
        val_loss = validate(fabric, model, val_dataloader)
        fabric.print(f"val loss {val_loss.item():.4f}")
        val_losses.append(val_loss.item())
    return val_losses, train_losses


def train_epoch(fabric, model, optimizer, train_dataloader, epoch):
    losses = []
    for batch_idx, batch in enumerate(train_dataloader):
        input, target = batch
        if batch_idx == 0:   # (port: which samples came first, for the comparison of the data order)
            ORDER.append(int(input.sum()))
        output = model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, clip_val=0.25)
        optimizer.step()
        optimizer.zero_grad()

        if batch_idx % 5 == 0:
            fabric.print(f"epoch: {epoch} - iteration: {batch_idx} - loss {loss.item():.4f}")
            losses.append(loss.item())
    return losses


@torch.no_grad()
def validate(fabric, model, val_dataloader):
    fabric.print("Validating ...")
    model.eval()
    losses = torch.zeros(len(val_dataloader))
    for k, batch in enumerate(val_dataloader):
        input, target = batch
        output = model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        losses[k] = loss.item()
    out = losses.mean()
    model.train()
    return out


def get_dataloaders(dataset):
    n = len(dataset)
    generator = torch.Generator().manual_seed(42)
    train_dataset, val_dataset, test_dataset = random_split(dataset, [n - 200, 100, 100], generator=generator)
    train_dataloader = DataLoader(train_dataset, batch_size=20, shuffle=SHUFFLE_TRAIN)
    val_dataloader = DataLoader(val_dataset, batch_size=20, shuffle=False)
    test_dataloader = DataLoader(test_dataset, batch_size=20, shuffle=False)
    return train_dataloader, val_dataloader, test_dataloader


if __name__ == "__main__":
    main()
