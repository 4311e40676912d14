"""What a person sees during and after a fit: the rich progress bar at 80 and 120
columns, trainer.progress_bar_metrics, the end-of-fit summary, the restore line
and the validate()/test() results table."""
from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import ember
from ember.callbacks import EarlyStopping, ModelCheckpoint, RichProgressBar
from conftest import LinearModule

_TIME = r"\d+:\d\d:\d\d"


class Shown(LinearModule):
    """Logs a per-step prog_bar loss, a step+epoch value and an epoch value whose
    per-batch values (0, 1, ..., 7) differ from their epoch mean (3.5)."""

    long_names = False

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/idx", float(batch_idx), prog_bar=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(batch), prog_bar=True)
        self.log("val/idx", float(batch_idx), prog_bar=True)
        if self.long_names:
            for i in range(4):
                self.log(f"val/a_rather_long_metric_name_{i}", self.loss(batch) + i, prog_bar=True)


def _console(width: int, terminal: bool = True) -> Console:
    return Console(record=True, width=width, force_terminal=terminal, color_system=None, file=io.StringIO())


def _fit(tmp_path, console, module=None, data=None, ckpt_path=None, **kw):
    from conftest import regression_data
    from torch.utils.data import DataLoader
    dl = data or DataLoader(regression_data(64), batch_size=8)
    args = dict(max_epochs=3, logger=False, enable_checkpointing=False, enable_model_summary=False,
                devices="cpu", default_root_dir=tmp_path, callbacks=[RichProgressBar(console=console)])
    args.update(kw)
    t = ember.Trainer(**args)
    module = module or Shown()
    t.fit(module, dl, dl, ckpt_path=ckpt_path)
    return t, console.export_text()


def _final_frame(text: str, marker: str) -> list[str]:
    """The last frame the live display drew (frames are recorded back to back)."""
    frame = text[text.rindex(marker):]
    frame = frame.split("Fit stopped")[0]
    return [ln for ln in frame.splitlines() if ln.strip()]


@pytest.mark.parametrize("width", [80, 120])
def test_bar_layout_keeps_counts_times_and_wraps_metrics(tmp_path, width):
    module = Shown()
    module.long_names = True
    t, text = _fit(tmp_path, _console(width), module)
    lines = _final_frame(text, "Epoch 2/2")
    head = lines[0]
    # first line: description, bar, done/total, elapsed < ETA, rate: never cut
    assert re.search(rf"^Epoch 2/2 +━+ +8/8 +{_TIME} < {_TIME} +[\d.]+ it/s$", head), head
    assert all(len(ln) <= width for ln in lines) and "…" not in "".join(lines)
    # the metrics follow on their own line(s), wrapped, every one of them complete
    shown = "".join(lines[1:])
    assert shown.startswith("step 24 ")
    pbm = t.progress_bar_metrics
    for name, value in pbm.items():
        assert f"{name}={value:.4g}" in shown, (name, shown)
    if width == 80:
        assert len(lines) > 2   # 6 metrics do not fit one 80-column line
    # no frame ever showed an epoch that did not run
    assert "Epoch 3" not in text


def test_progress_bar_metrics_are_the_logged_values(tmp_path):
    seen = []

    class Watch(ember.callbacks.Callback):
        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
            seen.append(trainer.progress_bar_metrics.get("val/idx"))

    t, _ = _fit(tmp_path, _console(120, terminal=False),
                callbacks=[RichProgressBar(console=_console(120, False)), Watch()], num_sanity_val_steps=0)
    pbm, cm = t.progress_bar_metrics, t.callback_metrics
    # epoch metrics: exactly the emitted value (the mean 3.5, not the last batch's 7)
    for name in ("val/loss", "val/idx", "train/idx_epoch"):
        assert pbm[name] == pytest.approx(float(cm[name]), abs=0), name
    assert pbm["val/idx"] == 3.5 and pbm["train/idx_epoch"] == 3.5
    # step metrics: the latest step value
    assert pbm["train/idx_step"] == 7.0 and "train/loss" in pbm
    # during a validation pass the bar keeps the previous epoch's logged value: no per-batch flicker
    assert seen[:8] == [None] * 8 and seen[8:] == [3.5] * 16


def test_eta_follows_max_steps_and_validation_has_its_own_bar(tmp_path):
    # a validation after batch 4; max_steps stops mid-epoch after batch 5 (no epoch-end validation)
    t, text = _fit(tmp_path, _console(100), max_steps=5, max_epochs=3, val_check_interval=4)
    lines = _final_frame(text, "Epoch 0/2")
    assert re.search(rf" 5/5 +{_TIME} < {_TIME}", lines[0]), lines[0]
    assert "/8" not in lines[0] and "Epoch 1" not in text
    assert "Validation" in text


def test_fit_summary_checkpoint_and_resume_lines(tmp_path):
    con = _console(200, terminal=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/loss", save_last=True)
    t, text = _fit(tmp_path, con, max_epochs=2, enable_checkpointing=True,
                   callbacks=[RichProgressBar(console=con), ckpt])
    summary = text[text.index("Fit stopped"):].splitlines()
    assert summary[0] == "Fit stopped: reached max_epochs=2"
    assert re.fullmatch(r"  epochs: 2, steps: 16, wall time: [\d.]+ s", summary[1])
    assert summary[2] == f"  best checkpoint: {ckpt.best_model_path} (val/loss={float(ckpt.best_model_score):.4g})"
    final = summary[-1]
    assert final.startswith("  final metrics: ") and f"val/loss={float(t.callback_metrics['val/loss']):.4g}" in final

    con2 = _console(200, terminal=False)
    t2, text2 = _fit(tmp_path, con2, max_epochs=3, enable_checkpointing=True, ckpt_path="last",
                     callbacks=[RichProgressBar(console=con2), ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    assert f"ember: restored {tmp_path / 'ckpt' / 'last'} (epoch 1, step 16)" in text2   # as saved (epoch 1's end)
    assert "Fit stopped: reached max_epochs=3" in text2 and "epochs: 3, steps: 24" in text2


def test_summary_names_max_steps_and_early_stopping(tmp_path):
    con = _console(200, terminal=False)
    _, text = _fit(tmp_path, con, max_steps=5)
    assert re.search(r"Fit stopped: reached max_steps=5\n  epochs: (1|0 complete \+ 5/8 batches of epoch 0), "
                     r"steps: 5,", text)
    con = _console(200, terminal=False)
    es = EarlyStopping(monitor="val/loss", mode="max", patience=1)   # a falling loss never "improves"
    _, text = _fit(tmp_path, con, max_epochs=10,
                   callbacks=[RichProgressBar(console=con), es])
    assert f"Fit stopped: early stopping on val/loss={es.stopped_value:.4g} (patience=1): {es.stopping_reason}" in text
    assert "epochs: 2, steps: 16" in text


def test_validate_and_test_print_a_results_table(tmp_path, capsys):
    from conftest import regression_data
    from torch.utils.data import DataLoader
    dl = DataLoader(regression_data(64), batch_size=8)
    con = _console(100)
    t = ember.Trainer(logger=False, enable_checkpointing=False, enable_model_summary=False, devices="cpu",
                      default_root_dir=tmp_path, callbacks=[RichProgressBar(console=con)])
    (res,) = t.validate(Shown(), dl)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "validate metrics"
    assert out[1].split() == ["val/loss", f"{res['val/loss']:.6g}"] and out[2].split() == ["val/idx", "3.5"]
    assert "Validation" in con.export_text()   # a transient bar while it ran
    t.test(Shown(), dl, verbose=False)
    assert capsys.readouterr().out == ""
