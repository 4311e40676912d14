"""The line printed when a checkpoint is restored names the checkpoint's own epoch and
step (from its meta.json), not the trainer's counters at the time of the restore."""
from __future__ import annotations

import io
import json
import os

from rich.console import Console
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelCheckpoint, RichProgressBar
from tests.conftest import LinearModule, regression_data


def _console() -> Console:
    return Console(record=True, width=200, force_terminal=False, color_system=None, file=io.StringIO())


def test_restore_line_names_the_checkpoints_epoch_and_step(tmp_path):
    dl = DataLoader(regression_data(64), batch_size=8)   # 8 steps per epoch
    con = _console()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="epoch_{epoch:03d}", save_top_k=-1,
                           monitor="val/loss")
    t = ember.Trainer(max_epochs=4, logger=False, enable_model_summary=False, devices="cpu",
                      default_root_dir=tmp_path, callbacks=[RichProgressBar(console=con), ckpt])
    t.fit(LinearModule(), dl, dl)
    assert (t.current_epoch, t.global_step) == (4, 32)
    first = sorted(p for p in os.listdir(tmp_path / "ckpt") if p.startswith("epoch_"))[0]
    path = tmp_path / "ckpt" / first
    meta = json.loads((path / "meta.json").read_text())
    assert meta["global_step"] == 8
    t.test(LinearModule(), dl, ckpt_path=str(path), verbose=False)
    text = con.export_text()
    assert f"ember: restored {path} (epoch {meta['epoch']}, step 8)" in text, text[-800:]
    assert "(epoch 4, step 32)" not in text


def test_restore_line_of_a_weights_file_names_it_alone(tmp_path):
    from ember.trainer.summary import _saved_at
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert _saved_at(weights) == ""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"epoch": 2, "global_step": 190}))
    assert _saved_at(folder) == " (epoch 2, step 190)"


def test_restore_line_prints_without_a_progress_bar_and_once_with_one(tmp_path, capsys):
    """Batch jobs (enable_progress_bar=False) still say what was restored, on stderr; with a
    bar the line comes once, through it."""
    dl = DataLoader(regression_data(32), batch_size=8)
    t = ember.Trainer(max_epochs=1, logger=False, enable_model_summary=False, devices="cpu",
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_checkpointing=False)
    t.fit(LinearModule(), dl)
    path = tmp_path / "c"
    t.save_checkpoint(path)
    capsys.readouterr()
    ember.Trainer(max_epochs=2, logger=False, enable_model_summary=False, devices="cpu", default_root_dir=tmp_path,
                  enable_progress_bar=False, enable_checkpointing=False).fit(LinearModule(), dl, ckpt_path=str(path))
    err = capsys.readouterr().err
    assert err.count(f"ember: restored {path} (epoch 1, step 4)") == 1, err[-800:]
    con = _console()
    ember.Trainer(max_epochs=2, logger=False, enable_model_summary=False, devices="cpu", default_root_dir=tmp_path,
                  enable_checkpointing=False, callbacks=[RichProgressBar(console=con)]).fit(
        LinearModule(), dl, ckpt_path=str(path))
    both = con.export_text() + capsys.readouterr().err
    assert both.count("ember: restored ") == 1, both[-800:]
