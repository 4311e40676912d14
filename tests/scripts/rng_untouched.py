"""The user's random streams after ``Trainer.fit`` are those of the same loop written by
hand (run by tests/trainer/test_rng_untouched.py in a fresh process, so that every
library ember imports lazily is imported for the first time during the fit):

    python rng_untouched.py OUT_DIR

The module draws from python ``random``, numpy's global generator and torch (dropout), as
a DQN's replay buffer and exploration do. Both runs start from the same seeds; the script
prints, for each global generator, whether its state after the fit equals its state after
the hand-written loop, as JSON: first with a train loader without shuffling (the same
batches in both runs: the weights are compared too; the first fit imports rich, the
TensorBoard writer, ...), then shuffled (its order comes from ember's data seed, not from
the draws, which ember still takes as the user's DataLoader would)."""
import json
import random
import sys

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def data(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def net():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def step_loss(model, batch):
    x, y = batch
    eps = random.random()                       # exploration (python random)
    noise = float(np.random.rand())             # replay-buffer sampling (numpy)
    return F.mse_loss(model(x), y) * (1.0 + 0.01 * (eps + noise))


def seed(s=123):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def states():
    return random.getstate(), np.random.get_state(), torch.get_rng_state().clone()


def hand_loop(epochs, shuffle):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train, val = DataLoader(data(32), batch_size=8, shuffle=shuffle), DataLoader(data(16), batch_size=8)
    for _ in range(epochs):
        model.train()
        for batch in train:
            loss = step_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for batch in val:
                F.mse_loss(model(batch[0]), batch[1])
    return model


def fit(epochs, root, shuffle):
    import ember

    class Module(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.model = net()

        def training_step(self, batch, batch_idx):
            loss = step_loss(self.model, batch)
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", F.mse_loss(self.model(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    module = Module()
    # the defaults: a TensorBoard logger, the model summary (rich), the progress bar, checkpoints,
    # the sanity check
    trainer = ember.Trainer(max_epochs=epochs, default_root_dir=root, log_every_n_steps=1)
    trainer.fit(module, DataLoader(data(32), batch_size=8, shuffle=shuffle), DataLoader(data(16), batch_size=8))
    return module.model


def compare(shuffle, out):
    seed()
    ref_model = hand_loop(2, shuffle)
    ref = states()
    seed()
    model = fit(2, out, shuffle)
    got = states()
    return {"python": got[0] == ref[0],
            "numpy": all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(got[1], ref[1])),
            "torch": torch.equal(got[2], ref[2]),
            "weights": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                             ref_model.state_dict().values()))}


if __name__ == "__main__":
    out = sys.argv[1]
    fresh = "rich" not in sys.modules
    result = {"ordered": compare(False, out + "/ordered"), "shuffled": compare(True, out + "/shuffled")}
    result["rich_first_imported_by_fit"] = fresh and "rich" in sys.modules
    print(json.dumps(result))
