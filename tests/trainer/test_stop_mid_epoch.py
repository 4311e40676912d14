"""A stop mid-epoch is recorded as mid-epoch, for every stop cause: the fit ends at an
optimizer step inside the epoch without the epoch-end work (epoch-interval schedulers
do not step, the epoch is not counted), the checkpoint saved at the stop records the
same epoch and the next batch, and resuming from it ends bit-identical (``torch.equal``
on every parameter, optimizer, scheduler and scaler state) to a run never stopped.

The run is tests/scripts/resume_common.py's (16-mixed, accumulation windows of 3, 3
and 1 batches, dropout, python/numpy draws) with an epoch-interval StepLR and a
validation every 3 batches; every stop below lands at the optimizer step after batch 2.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
from ember.checkpoint import io as cio  # noqa: E402
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint, Timer  # noqa: E402
from resume_common import SEED, ResumeNet, differences, loaders, make_trainer, snapshot  # noqa: E402

EPOCHS = 3
VAL_EVERY = 3   # validation after batches 2 and 5 of every epoch (optimizer-step boundaries)


class EpochLRNet(ResumeNet):
    """ResumeNet with an epoch-interval scheduler (halves the lr at each finished epoch)."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                        "interval": "epoch"}]


def run(root, callbacks=(), ckpt_path=None, **kw):
    ember.seed_everything(SEED)
    module = EpochLRNet()
    trainer = make_trainer(root, callbacks, ModelCheckpoint(save_last=True), max_epochs=EPOCHS,
                           val_check_interval=VAL_EVERY, **kw)
    train, val = loaders()
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return module, trainer


class At(Callback):
    """Call ``fn(trainer)`` at the end of batch ``batch_idx`` of ``epoch``."""

    def __init__(self, epoch, batch_idx, fn):
        self.at, self.fn = (epoch, batch_idx), fn

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == self.at:
            self.fn(trainer)


def _set_should_stop(trainer):
    trainer.should_stop = True


# cause -> (callbacks, Trainer kwargs, epoch of the stop); every stop is after batch 2 (step 3*epoch+1)
CAUSES = {
    # in a batch hook of epoch 1, batch 1 (inside a window): honoured at the step after batch 2
    "should_stop": (lambda: [At(1, 1, _set_should_stop)], {}, 1),
    # the budget is used up by the first step (checked after every batch)
    "timer": (lambda: [Timer(duration=1e-9, verbose=False)], {}, 0),
    # the deadline passes during batch 0 (it sleeps); checked at the next optimizer step
    "max_time": (lambda: [At(0, 0, lambda t: time.sleep(1.2))], {"max_time": 1.0}, 0),
    # checked after the mid-epoch validation that follows batch 2 of epoch 0
    "early_stopping": (lambda: [EarlyStopping(monitor="val/loss", divergence_threshold=-1.0,
                                              check_on_train_epoch_end=False)], {}, 0),
    # SIGUSR1 during epoch 1, batch 1: `last` is saved at the step after batch 2
    "preempted": (lambda: [At(1, 1, lambda t: os.kill(os.getpid(), signal.SIGUSR1))], {}, 1),
    # the step budget ends at the step after batch 2 of epoch 1 (3 steps per epoch)
    "max_steps": (lambda: [], {"max_steps": 4}, 1),
}

_REF: dict = {}


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_stop_mid_epoch_is_recorded_mid_epoch_and_resumes_bit_exact(cause, tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EMBER_PREEMPTION_EXIT", "0")
    if "ref" not in _REF:
        m, t = run(tmp_path_factory.mktemp("ref"))
        assert t.stop_reason == "max_epochs" and t.current_epoch == EPOCHS
        _REF["ref"] = snapshot(m, t)
    callbacks, kw, epoch = CAUSES[cause]
    _, stopped = run(tmp_path, callbacks(), **kw)
    # stopped at the optimizer step after batch 2 of `epoch`, recorded as such
    assert stopped.stop_reason == cause
    assert (stopped.current_epoch, stopped.batches_done, stopped.global_step) == (epoch, 3, 3 * epoch + 1)
    sched = stopped.lr_scheduler_configs[0]["scheduler"]
    assert sched.last_epoch == epoch   # the unfinished epoch did not step the epoch-interval scheduler
    last = os.path.join(tmp_path, "checkpoints", "last")
    loop = cio.read_checkpoint(last)[1]["loop"]
    assert (loop["epoch"], loop["batches_done"], loop["global_step"]) == (epoch, 3, 3 * epoch + 1)
    assert loop["stop_reason"] == cause and not loop["epoch_finished"]
    # resumed without the stop cause: continues at batch 3 of the same epoch, bit-exact
    module, resumed = run(tmp_path, ckpt_path="last")
    assert resumed.stop_reason == "max_epochs"
    assert differences(_REF["ref"], snapshot(module, resumed)) == []


def test_max_steps_mid_epoch_then_a_larger_max_steps_equals_one_run(tmp_path, tmp_path_factory):
    """max_steps=5 (epoch 1, batch 3 of 7), resumed with max_steps=7, is bit-identical to one
    max_steps=7 run: the first run neither finished epoch 1 nor stepped its StepLR."""
    m, t = run(tmp_path_factory.mktemp("straight"), max_steps=7)
    assert (t.stop_reason, t.global_step, t.current_epoch) == ("max_steps", 7, 2)
    straight = snapshot(m, t)
    _, stopped = run(tmp_path, max_steps=5)
    assert (stopped.stop_reason, stopped.current_epoch, stopped.batches_done) == ("max_steps", 1, 6)
    assert stopped.lr_scheduler_configs[0]["scheduler"].last_epoch == 1
    loop = cio.read_checkpoint(os.path.join(tmp_path, "checkpoints", "last"))[1]["loop"]
    assert (loop["epoch"], loop["batches_done"], loop["global_step"]) == (1, 6, 5)
    module, resumed = run(tmp_path, ckpt_path="last", max_steps=7)
    assert (resumed.stop_reason, resumed.global_step) == ("max_steps", 7)
    assert differences(straight, snapshot(module, resumed)) == []
