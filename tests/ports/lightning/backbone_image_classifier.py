"""Port of Lightning's ``examples/pytorch/basics/backbone_image_classifier.py``
(a classifier around a backbone ``nn.Module``), written against ember's names.

Same structure and API usage as the original: ``save_hyperparameters(ignore=["backbone"])``,
``self.log("train_loss", on_epoch=True)``, ``self.log("valid_loss", on_step=True)``,
``test_step``/``predict_step``, a DataModule that builds its datasets in
``__init__``, then ``fit``, ``test(ckpt_path="best")``, ``predict(ckpt_path="best")``.

Changed from the original, and why: ``ember`` imports; scikit-learn's 8x8 digits
for MNIST (no downloads; 64 inputs instead of 784); ``LightningCLI(...,
seed_everything_default=1234, run=False)`` becomes ``seed_everything(1234)`` and
the CLI's defaults; the training loader shuffles under DDP only
(``common.SHUFFLE_TRAIN``: Lightning's DDP sampler shuffles whatever the loader
says); 2 epochs and ``learning_rate=1e-3`` so 2 short epochs move the loss (the
original trains longer at 1e-4).

Features used: save_hyperparameters(ignore=...), hparams, self.log(on_step/on_epoch),
fit/test/predict with ckpt_path="best".

    python tests/ports/lightning/backbone_image_classifier.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""
from typing import Optional

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, random_split

from common import SHUFFLE_TRAIN, param_sums, trainer_kwargs, write
from digits import Digits

from ember import DataModule, TrainModule, Trainer, seed_everything  # (from lightning.pytorch import ...)


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim=128):
        super().__init__()
        self.l1 = torch.nn.Linear(8 * 8, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(TrainModule):
    def __init__(self, backbone: Optional[Backbone] = None, learning_rate: float = 1e-3):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    def forward(self, x):
        # use forward for inference/predictions
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("valid_loss", loss, on_step=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        # self.hparams available because we called self.save_hyperparameters()
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


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
    model, datamodule = LitClassifier(), MyDataModule()
    trainer = Trainer(max_epochs=2, **trainer_kwargs())
    trainer.fit(model, datamodule=datamodule)
    fit_metrics = dict(trainer.callback_metrics)
    params = param_sums(model)
    tested = trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    print(predictions[0])
    n, targets = sum(len(p) for p in predictions), datamodule.mnist_test.targets
    # (accuracy where the predictions cover the test set: Lightning's DDP predict returns each rank's shard)
    accuracy = (torch.cat(predictions).argmax(-1) == targets).double().mean() if n == len(targets) else None
    write(trainer, fit_metrics=fit_metrics, params=params, test=tested, prediction0_sum=predictions[0].double().sum(),
          n_predictions=n, test_accuracy=accuracy)


if __name__ == "__main__":
    cli_main()
