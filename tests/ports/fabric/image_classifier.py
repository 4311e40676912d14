"""Port of Lightning Fabric's ``examples/fabric/image_classifier/train_fabric.py`` (a CNN
on MNIST with Adadelta, StepLR, torchmetrics' Accuracy), written against ember's names.

Same structure and API usage as the original: ``Fabric()``, ``seed_everything`` after it,
``fabric.rank_zero_first`` around the data, ``setup_dataloaders``, ``setup(model,
optimizer)``, a StepLR built on the set-up optimizer, ``fabric.backward``, an evaluation
whose summed loss is combined with ``fabric.all_gather``, torchmetrics' Accuracy on
``fabric.device``, and ``fabric.save`` of the model at the end (``--save-model``).

Changed from the original, and why: ``from ember import Fabric, seed_everything`` (for
``lightning.fabric``); MNIST is scikit-learn's 8x8 digits (``common.Digits``, no
download; the 28x28 layer sizes become those of 8x8: ``fc1`` takes 64*2*2); 1 epoch;
``Fabric(**fabric_kwargs())`` names the processes (the original takes them from ``fabric
run``) and ``fabric.launch()`` is called (needed for several processes); the numbers are
written to ``PORT_OUT`` for the comparison, and with ``--save-model`` the checkpoint is
loaded back into a fresh model (``fabric.load``) and compared.

Features used: setup, setup_dataloaders, backward, all_gather, rank_zero_first,
is_global_zero, device, save, load, seed_everything; dropout (global RNG).

    python tests/ports/fabric/image_classifier.py   (PORT_OUT=results.json PORT_DEVICES=2)
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torchmetrics.classification import Accuracy

from common import Digits, fabric_kwargs, param_sums, write

from ember import Fabric, seed_everything  # (from lightning.fabric import Fabric, seed_everything)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)   # (9216 for 28x28 images)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def run(hparams):
    fabric = Fabric(**fabric_kwargs())
    fabric.launch()

    seed_everything(hparams.seed)  # instead of torch.manual_seed(...)

    # Let rank 0 download the data first, then everyone will load MNIST
    with fabric.rank_zero_first(local=False):
        train_dataset = Digits(train=True)
        test_dataset = Digits(train=False)

    train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=hparams.batch_size,
    )
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=hparams.batch_size)

    # don't forget to call `setup_dataloaders` to prepare for dataloaders for distributed training.
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net()  # remove call to .to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=hparams.lr)

    # don't forget to call `setup` to prepare for model / optimizer for distributed training.
    model, optimizer = fabric.setup(model, optimizer)

    scheduler = StepLR(optimizer, step_size=1, gamma=hparams.gamma)

    # use torchmetrics instead of manually computing the accuracy
    test_acc = Accuracy(task="multiclass", num_classes=10).to(fabric.device)

    train_losses, test_losses, accuracies = [], [], []
    for epoch in range(1, hparams.epochs + 1):
        # TRAINING LOOP
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            fabric.backward(loss)  # instead of loss.backward()

            optimizer.step()
            if (batch_idx == 0) or ((batch_idx + 1) % hparams.log_interval == 0):
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}"
                    f" ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )
                train_losses.append(loss.item())

        scheduler.step()

        # TESTING LOOP
        model.eval()
        test_loss = 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_acc(output, target)

        # all_gather is used to aggregated the value across processes
        test_loss = fabric.all_gather(test_loss).sum() / len(test_loader.dataset)
        accuracy = test_acc.compute()
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: ({100 * accuracy:.0f}%)\n")
        test_losses.append(test_loss.item())
        accuracies.append(accuracy.item())
        test_acc.reset()

    results = {"train_losses": train_losses, "test_losses": test_losses, "accuracies": accuracies,
               "params": param_sums(model), "n_train_batches": len(train_loader)}
    # When using distributed training, use `fabric.save`
    # to ensure the current process is allowed to save a checkpoint
    if hparams.save_model:
        fabric.save(path="mnist_cnn.pt", state={"model": model, "optimizer": optimizer, "epoch": hparams.epochs})
        fresh, fresh_opt = fabric.setup(Net(), optim.Adadelta(Net().parameters(), lr=hparams.lr))
        fresh_opt = fabric.setup_optimizers(optim.Adadelta(fresh.parameters(), lr=hparams.lr))
        state = {"model": fresh, "optimizer": fresh_opt, "epoch": 0}
        fabric.load("mnist_cnn.pt", state)
        results["reloaded"] = {"params": param_sums(fresh), "epoch": state["epoch"],
                               "lr": fresh_opt.param_groups[0]["lr"]}
    write(fabric, **results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fabric MNIST Example")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N")
    parser.add_argument("--epochs", type=int, default=1, metavar="N")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M")
    parser.add_argument("--seed", type=int, default=1, metavar="S")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N")
    parser.add_argument("--save-model", action="store_true", default=False)
    hparams = parser.parse_args()

    run(hparams)
