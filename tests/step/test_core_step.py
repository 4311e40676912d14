"""One core step: each rule of the optimizer step (``ember/step.py``) is tested once, for
both APIs: the Trainer, the Accelerator and a raw loop that spells the rule out give
bit-identical weights (``torch.equal``) and learning rates.

- accumulation: windows of ``n`` micro-batches from the start of each epoch; a short
  last window divides its losses by its own size (7 batches, n=3: 3 + 3 + 1), also when
  the data has no length (an IterableDataset: both read ahead to know the last window);
- clipping: the accumulated, unscaled gradient of each optimizer, once per step;
- 16-mixed: a step with inf gradients is skipped, the loss scale halves, and a
  step-interval scheduler does not step for it (read without a host sync).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import ember
from ember import Accelerator
from ember.precision import Precision

from conftest import regression_data

CASES = {   # rule -> (accumulation, clip norm, 16-mixed, epochs, data without a length)
    "accumulation": (3, None, False, 2, False),
    "clipping": (2, 0.05, False, 1, False),
    "16-mixed": (1, None, True, 1, False),
    "accumulation, stream": (3, None, False, 2, True),
    "16-mixed, accumulation, clipping, stream": (3, 0.05, True, 2, True),
}
INF_BATCH = 2   # under 16-mixed this batch's loss is inf: its step is skipped


class Stream(IterableDataset):
    """The same samples as a map-style dataset, with no length."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        return (self.ds[i] for i in range(len(self.ds)))


def loader(stream=False):
    ds = regression_data(56)
    return DataLoader(Stream(ds) if stream else ds, batch_size=8)   # 7 batches


def start_net():
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def loss_of(net, batch, i, mixed):
    x, y = batch
    loss = F.mse_loss(net(x).float(), y)
    return loss * float("inf") if mixed and i == INF_BATCH else loss


def optim(params):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)


def mixed16():
    p = Precision.from_string("16-mixed")
    p.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return p


def raw_loop(acc_n, clip, mixed, epochs, stream):
    net = start_net()
    opt, sched = optim(net.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if mixed else None
    batches = list(loader())
    last = len(batches) - len(batches) % acc_n          # where the short last window starts
    for _ in range(epochs):
        for i, batch in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16, enabled=mixed):
                loss = loss_of(net, batch, i, mixed)
            loss = loss / (acc_n if i < last else len(batches) - last)
            (scaler.scale(loss) if mixed else loss).backward()
            if (i + 1) % acc_n and i + 1 != len(batches):
                continue
            if mixed:
                scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            skipped = False
            if mixed:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped = scaler.get_scale() < before
            else:
                opt.step()
            if not skipped:
                sched.step()
            opt.zero_grad()
    return net, sched


def trainer_run(tmp_path, acc_n, clip, mixed, epochs, stream):
    class Module(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = start_net()

        def training_step(self, batch, batch_idx):
            return loss_of(self.net, batch, batch_idx, mixed)

        def configure_optimizers(self):
            opt, self.sched = optim(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

    module = Module()
    trainer = ember.Trainer(max_epochs=epochs, accumulate_grad_batches=acc_n, gradient_clip_val=clip,
                            precision=mixed16() if mixed else "32-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, devices="cpu", num_sanity_val_steps=0)
    trainer.fit(module, loader(stream))
    return module.net, module.sched


def accelerator_run(acc_n, clip, mixed, epochs, stream):
    acc = Accelerator(gradient_accumulation_steps=acc_n, precision=mixed16() if mixed else "32-true",
                      devices="cpu")
    net = start_net()
    opt, sched = optim(net.parameters())
    model, opt, dl, sched = acc.prepare(net, opt, loader(stream), sched)
    for _ in range(epochs):
        for i, batch in enumerate(dl):
            with acc.accumulate(model):
                acc.backward(loss_of(model, batch, i, mixed))
                if clip is not None:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                sched.step()
                opt.zero_grad()
    return acc.unwrap_model(model), sched


@pytest.mark.parametrize("rule", list(CASES))
def test_trainer_accelerator_and_raw_loop_take_the_same_steps(rule, tmp_path):
    args = CASES[rule]
    raw, raw_sched = raw_loop(*args)
    via_trainer, t_sched = trainer_run(tmp_path, *args)
    via_acc, a_sched = accelerator_run(*args)
    moved = (raw.weight - start_net().weight).abs().max()
    assert moved > 1e-3                                   # it trained
    for name, other in (("Trainer", via_trainer), ("Accelerator", via_acc)):
        for p, q in zip(raw.parameters(), other.parameters()):
            assert torch.equal(p, q), f"{rule}: {name} differs from the raw loop by {(p - q).abs().max()}"
    steps = raw_sched.last_epoch
    assert t_sched.last_epoch == steps and a_sched.scheduler.last_epoch == steps
    assert t_sched.get_last_lr() == raw_sched.get_last_lr() == a_sched.get_last_lr()
    expected = {"accumulation": 2 * 3, "clipping": 4, "16-mixed": 7 - 1, "accumulation, stream": 2 * 3,
                "16-mixed, accumulation, clipping, stream": 2 * 3 - 2}[rule]
    assert steps == expected
