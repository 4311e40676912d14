"""Port of Lightning's ``examples/pytorch/basics/autoencoder.py`` (the digits
autoencoder), written against ember's names.

Same structure and API usage as the original: an ``ImageSampler`` callback
(``rank_zero_only`` ``on_train_epoch_end``, reads ``trainer.datamodule``, runs
the module in eval mode), a module with ``save_hyperparameters``,
``hparams.learning_rate``, ``self.log(..., on_step=True)`` in the train,
validation and test steps, ``predict_step``, a DataModule that builds its
datasets in ``__init__``, then ``fit``, ``test(ckpt_path="best")`` and
``predict(ckpt_path="best")``.

Changed from the original, and why:
- imports: ``ember`` names where it imports ``lightning.pytorch``
  (``TrainModule``/``DataModule`` for ``LightningModule``/``LightningDataModule``);
- data: scikit-learn's 8x8 digits (``digits.py``) for MNIST (no downloads), so
  the input is 64 pixels instead of 784;
- ``LightningCLI(..., seed_everything_default=1234, run=False)`` becomes
  ``seed_everything(1234)`` and the objects built with the CLI's defaults
  (ember's CLI is the ``ember fit`` command, see docs/cli.md);
- no torchvision here: the grid is built with torch and saved with ``torch.save``;
- 2 epochs; the training loader shuffles under DDP only (``common.SHUFFLE_TRAIN``:
  Lightning's DDP sampler shuffles whatever the loader says).

Features used: Callback.on_train_epoch_end, trainer.datamodule, module.device,
save_hyperparameters/hparams, self.log(on_step=True), fit/test/predict with
ckpt_path="best", rank_zero_only.

    python tests/ports/lightning/autoencoder.py          (PORT_OUT=results.json PORT_DEVICES=2)
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, random_split

from common import SHUFFLE_TRAIN, make_grid, param_sums, trainer_kwargs, write
from digits import Digits

from ember import DataModule, TrainModule, Trainer, callbacks, seed_everything  # (from lightning.pytorch import ...)
from ember.utilities import rank_zero_only  # (from lightning.pytorch.utilities import rank_zero_only)


class ImageSampler(callbacks.Callback):
    def __init__(self, num_samples: int = 3, nrow: int = 8, padding: int = 2, normalize: bool = True,
                 value_range: Optional[tuple[int, int]] = None, scale_each: bool = False, pad_value: int = 0) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.nrow = nrow
        self.padding = padding
        self.normalize = normalize
        self.value_range = value_range
        self.scale_each = scale_each
        self.pad_value = pad_value
        self.grids: list[float] = []

    def _to_grid(self, images):
        return make_grid(images, nrow=self.nrow, padding=self.padding, normalize=self.normalize,
                         value_range=self.value_range, scale_each=self.scale_each, pad_value=self.pad_value)

    @rank_zero_only
    def on_train_epoch_end(self, trainer: Trainer, pl_module: TrainModule) -> None:
        images, _ = next(iter(DataLoader(trainer.datamodule.mnist_val, batch_size=self.num_samples)))
        images_flattened = images.view(images.size(0), -1)

        # generate images
        with torch.no_grad():
            pl_module.eval()
            images_generated = pl_module(images_flattened.to(pl_module.device))
            pl_module.train()

        if trainer.current_epoch == 0:
            torch.save(self._to_grid(images), f"grid_ori_{trainer.current_epoch}.pt")
        grid = self._to_grid(images_generated.reshape(images.shape))
        torch.save(grid, f"grid_generated_{trainer.current_epoch}.pt")
        self.grids.append(grid.double().sum().item())


class LitAutoEncoder(TrainModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(8 * 8, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 8 * 8))

    def forward(self, x):
        z = self.encoder(x)
        return self.decoder(z)

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(DataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        dataset = Digits(train=True)
        self.mnist_test = Digits(train=False)
        self.mnist_train, self.mnist_val = random_split(dataset, [1300, 200], generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size, shuffle=SHUFFLE_TRAIN)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def cli_main():
    seed_everything(1234)
    model, datamodule, sampler = LitAutoEncoder(), MyDataModule(), ImageSampler()
    trainer = Trainer(callbacks=sampler, max_epochs=2, **trainer_kwargs())
    trainer.fit(model, datamodule=datamodule)
    fit_metrics = dict(trainer.callback_metrics)
    params = param_sums(model)
    tested = trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    print(predictions[0])
    write(trainer, fit_metrics=fit_metrics, params=params, test=tested, grids=sampler.grids,
          n_predictions=sum(len(p) for p in predictions), prediction0_sum=predictions[0].double().sum())


if __name__ == "__main__":
    cli_main()
