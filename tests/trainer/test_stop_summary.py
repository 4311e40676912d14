"""Why a fit stopped, as a person reads it: the end-of-fit summary's first lines and
``run.json``'s ``stop_reason`` both come from ``trainer.stop_reason``, for every way a
fit ends (limits, early stopping, should_stop, preemption, an exception, Ctrl-C)."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import time

import pytest
from rich.console import Console
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback, EarlyStopping, RichProgressBar
from ember.loggers import CSVLogger
from conftest import LinearModule, regression_data


def _run(tmp_path, module=None, raises=None, **kw):
    """Fit 8 batches per epoch; return (trainer, summary lines, run.json)."""
    con = Console(record=True, width=300, force_terminal=False, color_system=None, file=io.StringIO())
    args = dict(max_epochs=3, enable_checkpointing=False, enable_model_summary=False, devices="cpu",
                default_root_dir=tmp_path, logger=CSVLogger(tmp_path, name="run", version=0),
                num_sanity_val_steps=0, log_every_n_steps=4)
    args.update(kw)
    args["callbacks"] = [RichProgressBar(console=con)] + list(args.get("callbacks", []))
    t = ember.Trainer(**args)
    dl = DataLoader(regression_data(64), batch_size=8)
    if raises is None:
        t.fit(module or LinearModule(), dl, dl)
    else:
        with pytest.raises(raises):
            t.fit(module or LinearModule(), dl, dl)
    text = con.export_text()
    summary = text[text.index("Fit stopped"):].splitlines()
    with open(os.path.join(tmp_path, "run", "version_0", "run.json")) as f:
        record = json.load(f)
    assert record["stop_reason"] == t.stop_reason   # one source of truth
    return t, summary, record


def _counts(line: str, epochs: str, steps: int) -> None:
    """The summary's second line, exactly, up to the wall time (the one number that varies)."""
    wall = r"(\d+\.\d s|\d+:\d\d(:\d\d)?)"
    assert re.fullmatch(rf"  epochs: {re.escape(epochs)}, steps: {steps}, wall time: {wall}", line), line


def test_limits(tmp_path):
    t, s, _ = _run(tmp_path / "e", max_epochs=2)
    assert t.stop_reason == "max_epochs" and s[0] == "Fit stopped: reached max_epochs=2"
    _counts(s[1], "2", 16)
    t, s, _ = _run(tmp_path / "s", max_steps=5)
    assert t.stop_reason == "max_steps" and s[0] == "Fit stopped: reached max_steps=5"
    _counts(s[1], "0 complete + 5/8 batches of epoch 0", 5)   # what ran: 5 of epoch 0's 8 batches

    class Slow(LinearModule):
        def training_step(self, batch, batch_idx):
            time.sleep(0.02)
            return super().training_step(batch, batch_idx)

    t, s, _ = _run(tmp_path / "t", Slow(), max_epochs=100, max_time=0.3)
    assert t.stop_reason == "max_time" and s[0] == "Fit stopped: reached max_time (0.3 s)"
    assert 0 < t.global_step < 100 * 8
    _counts(s[1], f"{t.current_epoch} complete + {t.batches_done}/8 batches of epoch {t.current_epoch}"
            if 0 < t.batches_done < 8 else str(t.current_epoch), t.global_step)


class ValLosses(Callback):
    def __init__(self):
        self.values = []

    def on_validation_end(self, trainer, module):
        self.values.append(float(trainer.callback_metrics["val/loss"]))


def test_early_stopping_names_metric_value_and_patience(tmp_path):
    es = EarlyStopping(monitor="val/loss", mode="max", patience=2)   # a falling loss never "improves"
    seen = ValLosses()
    t, s, record = _run(tmp_path, max_epochs=10, callbacks=[es, seen])
    assert len(seen.values) == 3 and seen.values[0] > seen.values[1] > seen.values[2], seen.values
    best, value = seen.values[0], seen.values[2]   # the first epoch's is the best; the stop is at the third
    assert value == float(t.callback_metrics["val/loss"])
    assert t.stop_reason == "early_stopping" and record["stop_reason"] == "early_stopping"
    assert s[0] == (f"Fit stopped: early stopping on val/loss={value:.4g} (patience=2): Monitored metric val/loss "
                    f"did not improve in the last 2 records. Best score: {best:.3f}. Signaling Trainer to stop.")
    _counts(s[1], "3", 24)


def test_should_stop_mid_epoch(tmp_path):
    class StopAt(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.current_epoch == 1 and batch_idx == 2:
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

    t, s, _ = _run(tmp_path, StopAt())
    assert t.stop_reason == "should_stop"
    assert s[0] == "Fit stopped: trainer.should_stop was set"
    _counts(s[1], "1 complete + 3/8 batches of epoch 1", 11)


def test_preemption_signal(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_PREEMPTION_EXIT", "0")   # fit returns instead of exiting the test process

    class Term(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(batch, batch_idx)

    t, s, record = _run(tmp_path, Term())
    assert t.stop_reason == "preempted" and record["stop_reason"] == "preempted"
    assert s[0] == "Fit stopped: preemption signal SIGTERM (the last checkpoint was saved)"
    _counts(s[1], "0 complete + 4/8 batches of epoch 0", 4)   # the step that got the signal ran to its end


def test_exception_and_ctrl_c(tmp_path):
    class Boom(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 10:
                raise ValueError("bad batch")
            return super().training_step(batch, batch_idx)

    t, s, record = _run(tmp_path / "x", Boom(), raises=ValueError)
    assert t.stop_reason == "exception" and record["status"] == "failed"
    assert s[0] == "Fit stopped: an exception: ValueError: bad batch"
    _counts(s[1], "1", 10)

    class CtrlC(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 4:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    t, s, record = _run(tmp_path / "c", CtrlC(), raises=SystemExit)   # exit status 130 outside a REPL
    assert t.stop_reason == "interrupted" and record["status"] == "interrupted"
    assert s[0] == "Fit stopped: interrupted (Ctrl-C)"
    _counts(s[1], "0", 4)   # the broken epoch restarts on the next fit
