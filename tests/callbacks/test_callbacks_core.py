"""Callback machinery: the per-hook table, inactive_hooks, the event order of a
full fit (as documented in ember/trainer/loops.py), the progress bar without a
terminal, and the model summary."""
from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

from ember.callbacks import Callback, ModelSummary, RichProgressBar
from ember.callbacks.base import HOOKS, Event
from ember.trainer.events import Dispatcher
from conftest import LinearModule


class EpochEndOnly(Callback):
    def __init__(self):
        self.calls = 0

    def on_train_epoch_end(self, trainer, module):
        self.calls += 1


def test_dispatcher_calls_only_overriding_callbacks_then_the_module():
    a, b = EpochEndOnly(), Callback()
    module = LinearModule()
    calls = []
    module.on_train_epoch_end = lambda: calls.append("module")   # an override on the instance is not one
    d = Dispatcher("trainer", module, [a, b])
    assert set(HOOKS) == {e.value for e in Event}
    assert d[Event.ON_TRAIN_EPOCH_END] is not None
    assert all(d[e] is None for e in Event if e is not Event.ON_TRAIN_EPOCH_END)
    d(Event.ON_TRAIN_EPOCH_END)
    assert a.calls == 1 and calls == []

    class Overriding(LinearModule):
        def on_train_epoch_end(self):
            calls.append("module")
    d = Dispatcher("trainer", Overriding(), [a])
    d("on_train_epoch_end")
    assert a.calls == 2 and calls == ["module"]   # the callbacks first, then the module


def test_epoch_end_callback_is_not_called_per_batch(make_trainer, data):
    cb = EpochEndOnly()
    trainer = make_trainer(max_epochs=3, callbacks=[cb])
    trainer.fit(LinearModule(), data(n=32))
    assert cb.calls == 3
    assert trainer.events["on_train_batch_end"] is None and trainer.events["on_train_batch_start"] is None


def test_inactive_hooks_are_honoured(make_trainer, data):
    class Both(Callback):
        def __init__(self, inactive=()):
            self.inactive_hooks = frozenset(inactive)
            self.batch_ends = self.epoch_ends = 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.batch_ends += 1

        def on_train_epoch_end(self, trainer, module):
            self.epoch_ends += 1

    on, off = Both(), Both(inactive={"on_train_batch_end"})
    trainer = make_trainer(max_epochs=2, callbacks=[on, off])
    trainer.fit(LinearModule(), data(n=32))
    assert (on.batch_ends, on.epoch_ends) == (8, 2)
    assert (off.batch_ends, off.epoch_ends) == (0, 2)
    assert trainer.events.handlers("on_train_batch_end") == [on.on_train_batch_end]


class Recorder(Callback):
    """Overrides every hook and records its name."""

    def __init__(self, log):
        self.log = log


def _make_recording_hook(name):
    def hook(self, trainer, module, *args):
        self.log.append(name)
    return hook


for _name in HOOKS:
    setattr(Recorder, _name, _make_recording_hook(_name))

MODULE_HOOKS = ("on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
                "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_epoch_start",
                "on_validation_epoch_end", "on_before_optimizer_step")


class RecordingModule(LinearModule):
    def __init__(self, log):
        super().__init__()
        self.log_ = log


def _make_module_hook(name):
    def hook(self, *args):
        self.log_.append("module." + name)
    return hook


for _name in MODULE_HOOKS:
    setattr(RecordingModule, _name, _make_module_hook(_name))


def test_hook_order_of_a_full_fit(make_trainer, data):
    log = []
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=1, callbacks=[Recorder(log)])
    trainer.fit(RecordingModule(log), data(n=16, batch_size=8), data(n=8, batch_size=8))
    train_batch = ["on_train_batch_start", "module.on_train_batch_start",
                   "on_before_backward", "on_after_backward",
                   "on_before_optimizer_step", "module.on_before_optimizer_step",
                   "on_before_zero_grad",
                   "on_train_batch_end", "module.on_train_batch_end"]
    expected = [
        "setup",
        "on_fit_start", "module.on_fit_start",
        # sanity check: epoch and batch hooks, no on_validation_start/end
        "on_sanity_check_start",
        "on_validation_epoch_start", "module.on_validation_epoch_start",
        "on_validation_batch_start", "on_validation_batch_end",
        "on_validation_epoch_end", "module.on_validation_epoch_end",
        "on_sanity_check_end",
        "on_train_start", "module.on_train_start",
        "on_train_epoch_start", "module.on_train_epoch_start",
        *train_batch, *train_batch,
        # epoch-end validation, before on_train_epoch_end
        "on_validation_start",
        "on_validation_epoch_start", "module.on_validation_epoch_start",
        "on_validation_batch_start", "on_validation_batch_end",
        "on_validation_epoch_end", "module.on_validation_epoch_end",
        "on_validation_end",
        "on_train_epoch_end", "module.on_train_epoch_end",
        "on_train_end", "module.on_train_end",
        "on_fit_end", "module.on_fit_end",
        "teardown",
    ]
    assert log == expected


def test_hook_order_of_validate_test_predict(make_trainer, data):
    log = []
    trainer = make_trainer(callbacks=[Recorder(log)])
    module = LinearModule()
    trainer.validate(module, data(n=8))
    trainer.test(module, data(n=8))
    trainer.predict(module, data(n=8))
    assert log == [
        "setup", "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
        "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end", "teardown",
        "setup", "on_test_start", "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end",
        "on_test_epoch_end", "on_test_end", "teardown",
        "setup", "on_predict_start", "on_predict_epoch_start", "on_predict_batch_start",
        "on_predict_batch_end", "on_predict_epoch_end", "on_predict_end", "teardown",
    ]


def test_on_exception_then_teardown(make_trainer, data):
    log = []

    class Boom(LinearModule):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom at step")

    with pytest.raises(RuntimeError, match="boom at step"):
        make_trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[Recorder(log)]).fit(Boom(), data(n=8))
    assert log[-3:] == ["on_train_batch_start", "on_exception", "teardown"]


def test_callback_sees_batch_arguments(make_trainer, data):
    seen = []

    class Args(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            assert isinstance(outputs, dict) and set(outputs) == {"loss"}   # a returned tensor, as Lightning
            seen.append((batch_idx, batch[0].shape[0], float(outputs["loss"].detach())))

    trainer = make_trainer(max_epochs=1, callbacks=[Args()])
    trainer.fit(LinearModule(), data(n=20, batch_size=8))
    assert [s[:2] for s in seen] == [(0, 8), (1, 8), (2, 4)]
    assert all(s[2] > 0 for s in seen)


def test_state_key_defaults_to_qualname():
    assert EpochEndOnly().state_key.endswith("EpochEndOnly")


# ----------------------------------------------------------------------------- progress bar
def test_progress_bar_prints_plain_lines_without_a_terminal(make_trainer, data, capsys):
    class ProgModule(LinearModule):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("train/loss", loss, prog_bar=True)
            return loss

    bar = RichProgressBar(plain_interval=0.05)
    trainer = make_trainer(max_epochs=2, enable_progress_bar=True, callbacks=[bar])
    assert [c for c in trainer.callbacks if isinstance(c, RichProgressBar)] == [bar]
    trainer.fit(ProgModule(), data(n=40, batch_size=8))
    err = capsys.readouterr().err
    assert "\x1b[" not in err                       # no terminal control codes
    lines = [ln for ln in err.splitlines() if ln.startswith("Epoch ")]
    assert any(ln.startswith("Epoch 0/1: 5/5 batches, step 5,") for ln in lines)
    assert any(ln.startswith("Epoch 1/1: 5/5 batches, step 10,") for ln in lines)
    final = [ln for ln in lines if ln.startswith("Epoch 1/1: 5/5")][-1]
    assert re.search(r" train/loss=[0-9]", final)
    assert bar._thread is None                      # the timer thread ended with the fit


def test_progress_bar_epoch_line_counts_the_batches_run(make_trainer, data, capsys):
    trainer = make_trainer(max_steps=3, enable_progress_bar=True, callbacks=[RichProgressBar(plain_interval=60)])
    trainer.fit(LinearModule(), data(n=64, batch_size=8))        # stops after 3 of 8 batches
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("Epoch ")]
    # the epoch's total is what max_steps lets it run (3 of the loader's 8), so the ETA is right
    assert lines and lines[-1].startswith("Epoch 0: 3/3 batches, step 3,")


def test_progress_bar_disabled(make_trainer):
    trainer = make_trainer(enable_progress_bar=False)
    assert not any(isinstance(c, RichProgressBar) for c in trainer.callbacks)


# ----------------------------------------------------------------------------- model summary
def test_model_summary_table(make_trainer, data):
    class Two(LinearModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            self.frozen = torch.nn.Linear(1000, 2)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.net(x)

    buf = io.StringIO()
    summary = ModelSummary(console=Console(file=buf, width=120))
    trainer = make_trainer(max_epochs=1, enable_model_summary=True, callbacks=[summary])
    trainer.fit(Two(), data(n=8))
    text = buf.getvalue()
    assert "Two" in text
    rows = {ln.split("│")[2].strip(): [c.strip() for c in ln.split("│")[1:-1]]
            for ln in text.splitlines() if ln.count("│") >= 6}
    assert rows["net"][2:5] == ["Sequential", "49", "49"]          # 4*8+8 + 8*1+1
    assert rows["frozen"][2:5] == ["Linear", "2.0 K", "0"]          # 1000*2+2 frozen
    assert "49 trainable params, 2.0 K non-trainable, 2.1 K total" in text
    assert "32-true, single on cpu" in text


def test_model_summary_added_by_default_and_disabled(make_trainer):
    assert any(isinstance(c, ModelSummary) for c in make_trainer(enable_model_summary=True).callbacks)
    assert not any(isinstance(c, ModelSummary) for c in make_trainer(enable_model_summary=False).callbacks)
