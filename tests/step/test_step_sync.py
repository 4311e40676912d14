"""16-mixed without a host sync in ember's own step code: the "no scheduler step after a
skipped optimizer step" decision reads the step's inf/NaN flag one step later (before
the next unscale), when on CUDA its copy to pinned host memory has long landed. On the
CPU the reads are counted with a wrapper around ``Tensor.item`` (a fused AdamW steps
under the GradScaler without reading the flag itself)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback
from ember.precision import Precision
from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from common import Regressor  # noqa: E402

STEPS = 6


class Reads:
    def __init__(self):
        self.n = 0


class Net(Regressor):
    """The scripts' regressor with its loss in float32, a fused AdamW and a per-step StepLR."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(Callback):
    def __init__(self, reads):
        self.reads, self.at_end, self.lr_before_step = reads, [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0:
            self.reads.n = 0     # the loader's and the run's seeds were drawn before the first step

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.lr_before_step.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.at_end.append((trainer.global_step, self.reads.n))


def test_skip_decision_is_read_a_step_later_not_at_the_step(tmp_path, monkeypatch):
    reads = Reads()
    item = torch.Tensor.item

    def counting_item(self):
        reads.n += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    torch.manual_seed(0)
    x = torch.randn(STEPS * 2, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    probe = Probe(reads)
    module = Net()
    precision = Precision.from_string("16-mixed")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)   # no overflow: every step is taken
    t = ember.Trainer(precision=precision, max_epochs=1, log_every_n_steps=100, callbacks=[probe], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    t.fit(module, data)
    # at the end of step k only the flags of steps 1..k-1 were read: none at the step itself
    assert probe.at_end == [(k, k - 1) for k in range(1, STEPS + 1)]
    # every step was taken (no inf) and the scheduler stepped after each one, the last at the end of fit
    sched = t.lr_scheduler_configs[0]["scheduler"]
    assert sched.last_epoch == STEPS and reads.n == STEPS
    # each optimizer step used the rate of its own schedule position
    assert probe.lr_before_step == pytest.approx([0.1 * 0.5 ** k for k in range(STEPS)])


class Overflow(Callback):
    """Records, per optimizer step, the weights before and after it, the learning rate it
    used, the loss scale after it and the trainer's ``global_step``."""

    def __init__(self):
        self.before, self.after, self.lr_at_step, self.scale, self.global_step = [], [], [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append([p.detach().clone() for p in module.parameters()])

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.lr_at_step.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append([p.detach().clone() for p in module.parameters()])
        self.scale.append(trainer.strategy.precision.scaler.get_scale())
        self.global_step.append(trainer.global_step)


@pytest.mark.parametrize("bad", [2, STEPS - 1])   # in the middle; the last (its decision is read at fit end)
def test_overflow_step_is_skipped_and_the_scheduler_waits(tmp_path, bad):
    torch.manual_seed(0)
    x = torch.randn(STEPS * 2, 4)
    x[2 * bad] = 1e5              # above float16's largest (65504): inf under autocast, inf/NaN gradients
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    probe = Overflow()
    module = Net()
    precision = Precision.from_string("16-mixed")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    t = ember.Trainer(precision=precision, max_epochs=1, log_every_n_steps=100, callbacks=[probe], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    t.fit(module, data)
    # the overflowing step left the weights exactly as they were; every other step moved them
    for k in range(STEPS):
        same = [torch.equal(a, b) for a, b in zip(probe.before[k], probe.after[k])]
        assert same == ([True, True] if k == bad else [False, False]), (k, same)
    opt = t.optimizers[0]
    assert all(int(s["step"]) == STEPS - 1 for s in opt.state.values())      # AdamW counted 5 steps
    # the scale was halved by the overflow (GradScaler backoff 0.5) and not grown again (interval 2000)
    assert probe.scale == [256.0] * bad + [128.0] * (STEPS - bad)
    # global_step counts every optimizer step window, the skipped one included (as Lightning)
    assert probe.global_step == list(range(1, STEPS + 1)) and t.global_step == STEPS
    # the step-interval scheduler did not step for the skipped step: the next step uses the
    # same rate, and it stepped STEPS - 1 times in all
    sched = t.lr_scheduler_configs[0]["scheduler"]
    lrs = [0.1 * 0.5 ** k for k in range(bad + 1)] + [0.1 * 0.5 ** (k - 1) for k in range(bad + 1, STEPS)]
    assert probe.lr_at_step == lrs
    assert sched.last_epoch == STEPS - 1
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5 ** (STEPS - 1)


def test_accelerator_scheduler_reads_the_skip_flag_a_step_later(monkeypatch):
    """A prepared scheduler under 16-mixed follows the same rule as the Trainer's: it does
    not step after a skipped optimizer step, and it reads the step's flag later (before the
    next step, or at the end of the pass), never right after the step (a host sync on a GPU)."""
    reads = Reads()
    item = torch.Tensor.item

    def counting_item(self):
        reads.n += 1
        return item(self)

    torch.manual_seed(0)
    x = torch.randn(STEPS * 2, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    precision = Precision.from_string("16-mixed")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    acc = ember.Accelerator(precision=precision, devices="cpu")
    net = nn.Linear(4, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, dl, sched = acc.prepare(net, opt, data, sched)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    at_end = []
    for i, (xb, yb) in enumerate(dl):
        if i == 0:
            reads.n = 0   # the loader's seed was drawn when the pass started
        with acc.accumulate(model):
            acc.backward((model(xb).float() - yb).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        at_end.append(reads.n)
    monkeypatch.setattr(torch.Tensor, "item", item)
    assert at_end == list(range(STEPS))            # after step k only the flags of steps 1..k-1 were read
    assert reads.n == STEPS                        # the last one at the end of the pass
    assert sched.scheduler.last_epoch == STEPS
    assert sched.get_last_lr() == [0.1 * 0.5 ** STEPS]
