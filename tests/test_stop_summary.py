"""Why a fit stopped, as a person reads it: the end-of-fit summary's first lines and
``run.json``'s ``stop_reason`` both come from ``trainer.stop_reason``, for every way a
fit ends (limits, early stopping, should_stop, preemption, an exception, Ctrl-C)."""
from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest
from rich.console import Console
from torch.utils.data import DataLoader

import ember
from ember.callbacks import EarlyStopping, RichProgressBar
from ember.loggers import CSVLogger
from tests.conftest import LinearModule, regression_data


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


def test_limits(tmp_path):
    t, s, _ = _run(tmp_path / "e", max_epochs=2)
    assert s[0] == "Fit stopped: reached max_epochs=2" and s[1].startswith("  epochs: 2, steps: 16, ")
    t, s, _ = _run(tmp_path / "s", max_steps=5)
    assert t.stop_reason == "max_steps" and s[0] == "Fit stopped: reached max_steps=5"
    # whether or not the epoch counter moved at the stop, the count is what ran
    assert s[1].startswith(("  epochs: 1, steps: 5, ", "  epochs: 0 complete + 5/8 batches of epoch 0, steps: 5, ")), s[1]

    class Slow(LinearModule):
        def training_step(self, batch, batch_idx):
            time.sleep(0.02)
            return super().training_step(batch, batch_idx)

    t, s, _ = _run(tmp_path / "t", Slow(), max_epochs=100, max_time=0.3)
    assert t.stop_reason == "max_time" and s[0] == "Fit stopped: reached max_time (0.3 s)"
    assert t.global_step < 100 * 8


def test_early_stopping_names_metric_value_and_patience(tmp_path):
    es = EarlyStopping(monitor="val/loss", mode="max", patience=2)   # a falling loss never "improves"
    t, s, record = _run(tmp_path, max_epochs=10, callbacks=[es])
    value = float(t.callback_metrics["val/loss"])
    assert t.stop_reason == "early_stopping" and record["stop_reason"] == "early_stopping"
    assert s[0] == f"Fit stopped: early stopping on val/loss={value:.4g} (patience=2): {es.stopping_reason}"
    assert s[1].startswith("  epochs: 3, steps: 24, ")


def test_should_stop_mid_epoch(tmp_path):
    class StopAt(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.current_epoch == 1 and batch_idx == 2:
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

    t, s, _ = _run(tmp_path, StopAt())
    assert t.stop_reason == "should_stop"
    assert s[0] == "Fit stopped: trainer.should_stop was set"
    assert s[1].startswith("  epochs: 1 complete + 3/8 batches of epoch 1, steps: 11, "), s[1]


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


def test_exception_and_ctrl_c(tmp_path):
    class Boom(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 10:
                raise ValueError("bad batch")
            return super().training_step(batch, batch_idx)

    t, s, record = _run(tmp_path / "x", Boom(), raises=ValueError)
    assert t.stop_reason == "exception" and record["status"] == "failed"
    assert s[0] == "Fit stopped: an exception: ValueError: bad batch"
    assert s[1].startswith("  epochs: 1, steps: 10, ")

    class CtrlC(LinearModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 4:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    t, s, record = _run(tmp_path / "c", CtrlC(), raises=SystemExit)   # exit status 130 outside a REPL
    assert t.stop_reason == "interrupted" and record["status"] == "interrupted"
    assert s[0] == "Fit stopped: interrupted (Ctrl-C)"
    assert s[1].startswith("  epochs: 0, steps: 4, ")   # the broken epoch restarts on the next fit
