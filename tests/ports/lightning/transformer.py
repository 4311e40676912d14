"""Port of Lightning's ``examples/pytorch/basics/transformer.py`` (a word-level
language model), written against ember's names.

Same structure and API usage as the original: ``import ... as L``,
``L.seed_everything``, a module whose steps log with ``prog_bar=True``,
``random_split`` from the seeded global RNG, ``Trainer(gradient_clip_val=0.25)``,
``fit(model, train, val)`` then ``test(model, test)``; dropout draws from the
global RNG during training.

Changed from the original, and why: ``import ember as L`` (``L.TrainModule`` for
``L.LightningModule``); ``lightning.pytorch.demos.Transformer`` and ``WikiText2``
are demos ember does not ship: a small encoder-decoder of the same shape
(``nn.Transformer``, positional encoding, log-softmax output) and a synthetic
token stream cut into 35-token blocks stand in (``tests/ports/demos.py``, no downloads); fewer samples,
1 epoch, and ``shuffle=SHUFFLE_TRAIN`` for the training loader (the original
shuffles; ember's order comes from (seed, epoch), Lightning's from the global
RNG, so the comparison needs an unshuffled loader; see docs/porting.md).

Features used: gradient_clip_val, self.log(prog_bar=True), dropout (global RNG).

    python tests/ports/lightning/transformer.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split

from common import SHUFFLE_TRAIN, param_sums, trainer_kwargs, write
from demos import SyntheticText, Transformer  # (from lightning.pytorch.demos import Transformer, WikiText2)

import ember as L  # (import lightning as L)


class LanguageModel(L.TrainModule):
    def __init__(self, vocab_size):
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def training_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("test_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    L.seed_everything(42)

    # Data
    dataset = SyntheticText()

    # Split data in to train, val, test
    n = len(dataset)
    train_dataset, val_dataset, test_dataset = random_split(dataset, [n - 200, 100, 100])
    train_dataloader = DataLoader(train_dataset, batch_size=20, shuffle=SHUFFLE_TRAIN)
    val_dataloader = DataLoader(val_dataset, batch_size=20, shuffle=False)
    test_dataloader = DataLoader(test_dataset, batch_size=20, shuffle=False)

    # Model
    model = LanguageModel(vocab_size=dataset.vocab_size)

    # Trainer
    trainer = L.Trainer(gradient_clip_val=0.25, max_epochs=1, **trainer_kwargs())
    trainer.fit(model, train_dataloader, val_dataloader)
    fit_metrics = dict(trainer.callback_metrics)
    tested = trainer.test(model, test_dataloader)
    write(trainer, fit_metrics=fit_metrics, params=param_sums(model), test=tested)


if __name__ == "__main__":
    main()
