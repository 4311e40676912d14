"""Port of Lightning Fabric's ``examples/fabric/language_model/train.py`` (a word-level
Transformer language model trained with SGD), written against ember's names.

Same structure and API usage as the original: ``import ... as L``, ``L.seed_everything(42)``
then ``L.Fabric()``, ``random_split`` with a seeded generator, ``fabric.setup(model,
optimizer)``, ``setup_dataloaders``, ``fabric.backward``, ``fabric.clip_gradients(model,
optimizer, clip_val=0.25)``, ``fabric.print``, and a validation loop with ``model.eval()`` /
``model.train()``; dropout draws from the global RNG during training.

Changed from the original, and why: ``import ember as L`` (for ``import lightning as L``);
``lightning.pytorch.demos.Transformer`` and ``WikiText2`` are demos ember does not ship: a
small encoder-decoder of the same shape and a synthetic token stream (as the Lightning
port ``tests/ports/lightning/transformer.py``) stand in (no downloads); fewer samples and
2 epochs; ``L.Fabric(**fabric_kwargs())`` names the processes and ``fabric.launch()`` is
called; the numbers are written to ``PORT_OUT``, with the token sum of each epoch's first
batch (the shuffled order, and the random draws after it, equal Fabric's on one process and
under DDP: see docs/porting.md, "Data order").

Features used: setup, setup_dataloaders, backward, clip_gradients(clip_val), print,
seed_everything; dropout (global RNG).

    python tests/ports/fabric/language_model.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, random_split

from common import SHUFFLE_TRAIN, fabric_kwargs, param_sums, write

import ember as L  # (import lightning as L)


class PositionalEncoding(nn.Module):
    def __init__(self, dim: int, dropout: float, max_len: int = 64):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        pe = torch.zeros(max_len, dim)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return self.dropout(x + self.pe[: x.size(1)])


class Transformer(nn.Module):
    """Stand-in for ``lightning.pytorch.demos.Transformer``: ``forward(input, target)``
    returns log-probabilities of shape ``(batch * seq, vocab)``."""

    def __init__(self, vocab_size: int, ninp: int = 32, nhead: int = 2, nhid: int = 64, nlayers: int = 1,
                 dropout: float = 0.2):
        super().__init__()
        self.ninp, self.vocab_size = ninp, vocab_size
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.transformer = nn.Transformer(d_model=ninp, nhead=nhead, num_encoder_layers=nlayers,
                                          num_decoder_layers=nlayers, dim_feedforward=nhid, dropout=dropout,
                                          batch_first=True)
        self.decoder = nn.Linear(ninp, vocab_size)

    def forward(self, inputs, target):
        mask = nn.Transformer.generate_square_subsequent_mask(target.size(1), device=target.device)
        src = self.pos_encoder(self.embedding(inputs) * math.sqrt(self.ninp))
        tgt = self.pos_encoder(self.embedding(target) * math.sqrt(self.ninp))
        out = self.decoder(self.transformer(src, tgt, tgt_mask=mask))
        return F.log_softmax(out, dim=-1).view(-1, self.vocab_size)


class SyntheticText(Dataset):
    """Stand-in for ``WikiText2``: a token stream where each token follows from the two
    before it (with some noise), cut into (input, next-token target) blocks of 35."""

    def __init__(self, n_blocks: int = 400, block_size: int = 35, vocab_size: int = 50):
        g = torch.Generator().manual_seed(7)
        n = n_blocks + block_size + 1
        tokens = torch.zeros(n, dtype=torch.long)
        tokens[:2] = torch.tensor([1, 2])
        noise = torch.randint(0, vocab_size, (n,), generator=g)
        keep = torch.rand(n, generator=g) < 0.8
        for i in range(2, n):
            tokens[i] = (tokens[i - 1] + tokens[i - 2]) % vocab_size if keep[i] else noise[i]
        self.data, self.block_size, self.vocab_size, self.n_blocks = tokens, block_size, vocab_size, n_blocks

    def __len__(self):
        return self.n_blocks

    def __getitem__(self, index):
        chunk = self.data[index:index + self.block_size + 1]
        return chunk[:-1], chunk[1:]


ORDER = []   # (port) the token sum of each epoch's first batch on this rank


def main():
    L.seed_everything(42)

    fabric = L.Fabric(**fabric_kwargs())
    fabric.launch()

    # Data
    dataset = SyntheticText()
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
