"""Port of Lightning's ``examples/pytorch/domain_templates/generative_adversarial_net.py``
(a GAN trained with manual optimization), written against ember's names.

Same structure and API usage as the original: ``automatic_optimization = False``,
two optimizers from ``configure_optimizers``, ``self.optimizers()``,
``toggle_optimizer``/``untoggle_optimizer``, ``manual_backward``, ``log_dict``,
``example_input_array``, ``save_hyperparameters``/``hparams``, noise drawn with
``torch.randn`` in ``training_step(self, batch)`` (no ``batch_idx``), and images
sent to every logger's ``experiment.add_image`` at the end of each epoch.

Changed from the original, and why: ``ember`` imports; scikit-learn's 8x8
digits (``DigitsDataModule``) for ``MNISTDataModule`` (no downloads), so
``img_shape=(1, 8, 8)``; ``Trainer(accelerator="gpu", devices=1)`` becomes the
CPU (no GPU here), one epoch of 8 batches, and under DDP
``find_unused_parameters=True`` (Lightning refuses the original under DDP without
it: each optimizer's step leaves the other network without gradients); no torchvision: the grid is built
with torch (``common.make_grid``).

Features used: manual optimization with two optimizers, toggle_optimizer,
manual_backward, log_dict, example_input_array (model summary),
``training_step(self, batch)`` without ``batch_idx``, self.loggers /
logger.experiment.add_image.

    python tests/ports/lightning/generative_adversarial_net.py [--lr ...]   (PORT_OUT=results.json PORT_DEVICES=2)
"""
import math
from argparse import ArgumentParser, Namespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import make_grid, param_sums, trainer_kwargs, write
from digits import IMG_SHAPE, DigitsDataModule

from ember import TrainModule, Trainer, seed_everything  # (from lightning.pytorch.core/.trainer import ...)


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(TrainModule):
    def __init__(self, img_shape: tuple = IMG_SHAPE, lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999,
                 latent_dim: int = 100):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)
        self.images_logged = []

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch

        opt_g, opt_d = self.optimizers()

        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # train the generator: make the discriminator call its images real
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # train the discriminator: real images as real, generated ones as fake
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        # the discriminator's loss is the mean of both
        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d

    def on_train_epoch_end(self):
        z = self.validation_z.type_as(self.generator.model[0].weight)

        # log sampled images
        sample_imgs = self(z)
        grid = make_grid(sample_imgs)
        for logger in self.loggers:
            logger.experiment.add_image("generated_images", grid, self.current_epoch)
        self.images_logged.append(grid.double().sum().item())


def main(args: Namespace) -> None:
    seed_everything(0)
    model = GAN(lr=args.lr, b1=args.b1, b2=args.b2, latent_dim=args.latent_dim)
    dm = DigitsDataModule()
    # under DDP: each optimizer's step leaves the other network's parameters without
    # gradients, which DDP accepts with find_unused_parameters=True only (Lightning says so)
    trainer = Trainer(max_epochs=1, limit_train_batches=8, **trainer_kwargs(find_unused_parameters=True))
    trainer.fit(model, dm)
    write(trainer, fit_metrics=dict(trainer.callback_metrics), params=param_sums(model), images=model.images_logged)


if __name__ == "__main__":
    parser = ArgumentParser()

    # Hyperparameters
    parser.add_argument("--lr", type=float, default=0.0002, help="adam: learning rate")
    parser.add_argument("--b1", type=float, default=0.5, help="adam: decay of first order momentum of gradient")
    parser.add_argument("--b2", type=float, default=0.999, help="adam: decay of second order momentum of gradient")
    parser.add_argument("--latent_dim", type=int, default=100, help="dimensionality of the latent space")
    args = parser.parse_args()

    main(args)
