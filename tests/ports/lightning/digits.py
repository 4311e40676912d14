"""Stand-in for ``lightning.pytorch.demos.mnist_datamodule`` (``MNIST``,
``MNISTDataModule``): scikit-learn's bundled 8x8 digits (1,797 images, no
download), scaled to [0, 1] and shaped ``(1, 8, 8)`` like a one-channel image.
Only plain torch and ember/Lightning's DataModule are used, so the ports run
unchanged on both libraries. The training loader shuffles under DDP only
(``common.SHUFFLE_TRAIN``)."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, random_split

from common import SHUFFLE_TRAIN

from ember import DataModule  # (from lightning.pytorch import LightningDataModule)

IMG_SHAPE = (1, 8, 8)
N_TRAIN = 1500   # the first 1,500 images are the "train" file, the last 297 the "test" file


def _load() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).div_(16.0).view(-1, *IMG_SHAPE)
    return x, torch.tensor(d.target, dtype=torch.long)


class Digits(Dataset):
    """``MNIST(root, train=...)`` with the digits: ``(image[1, 8, 8], label)`` pairs."""

    def __init__(self, train: bool = True, limit: int | None = None) -> None:
        x, y = _load()
        sl = slice(0, N_TRAIN) if train else slice(N_TRAIN, None)
        self.data, self.targets = x[sl][:limit], y[sl][:limit]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[idx], self.targets[idx]


class DigitsDataModule(DataModule):
    """``MNISTDataModule``: train/val split of the train file, test file for testing."""

    def __init__(self, batch_size: int = 32, val_size: int = 200) -> None:
        super().__init__()
        self.batch_size, self.val_size = batch_size, val_size

    def setup(self, stage: str) -> None:
        full = Digits(train=True)
        self.train_set, self.val_set = random_split(full, [len(full) - self.val_size, self.val_size],
                                                    generator=torch.Generator().manual_seed(42))
        self.test_set = Digits(train=False)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=SHUFFLE_TRAIN)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)
