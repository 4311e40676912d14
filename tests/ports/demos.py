"""Stand-ins for ``lightning.pytorch.demos`` (``Transformer``, ``WikiText2``), which the
Lightning example ``examples/pytorch/basics/transformer.py`` and the Fabric example
``examples/fabric/language_model/train.py`` both import and ember does not ship: a small
encoder-decoder of the same shape (``nn.Transformer``, positional encoding, log-softmax
output) and a synthetic token stream cut into 35-token blocks (no downloads). Plain torch
only, so the ports run unchanged on ember and on Lightning; the ports' ``common.py`` puts
this folder on ``sys.path``."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


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

    def __init__(self, n_blocks: int = 600, block_size: int = 35, vocab_size: int = 50):
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
