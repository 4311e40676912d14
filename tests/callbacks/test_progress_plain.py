"""Plain (non-terminal) progress lines name what runs: during a validation they say
"validation" with its own counts, not the training line frozen at ``eta 0s``; a
standalone validate()/test() prints lines of its own."""
from __future__ import annotations

import io
import re
import time

import pytest
import torch
from rich.console import Console
from torch.utils.data import DataLoader

import ember
from ember.callbacks import RichProgressBar
from tests.conftest import LinearModule, regression_data


class SlowValidation(LinearModule):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.03)
        super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        time.sleep(0.03)
        super().test_step(batch, batch_idx)


def _bar() -> RichProgressBar:
    console = Console(file=io.StringIO(), force_terminal=False, width=200)   # a log file, not a terminal
    return RichProgressBar(plain_interval=0.1, console=console)


def test_plain_lines_name_the_validation(tmp_path, capsys):
    train = DataLoader(regression_data(16), batch_size=8)          # 2 quick training batches
    val = DataLoader(regression_data(160), batch_size=8)           # 20 slow validation batches (~0.6 s)
    t = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                      num_sanity_val_steps=0, devices="cpu", default_root_dir=tmp_path, callbacks=[_bar()])
    t.fit(SlowValidation(), train, val)
    lines = capsys.readouterr().err.splitlines()
    during = [ln for ln in lines if "validation" in ln]
    assert during, lines
    assert all(re.match(r"Epoch 0/0, validation: \d+/20 batches, [\d.]+ it/s, elapsed \d+s, eta \d+s$", ln)
               for ln in during), during
    first, last = lines.index(during[0]), lines.index(during[-1])
    assert not [ln for ln in lines[first:last] if ln.startswith("Epoch 0/0: ")]   # no frozen training line
    assert lines[-1].startswith("Epoch 0/0: 2/2 batches")   # the epoch's end, after its validation


def test_standalone_test_prints_its_own_lines(tmp_path, capsys):
    data = DataLoader(regression_data(160), batch_size=8)
    t = ember.Trainer(logger=False, enable_checkpointing=False, enable_model_summary=False, devices="cpu",
                      default_root_dir=tmp_path, callbacks=[_bar()])
    t.test(SlowValidation(), data, verbose=False)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("Testing")]
    assert lines and all(re.match(r"Testing: \d+/20 batches", ln) for ln in lines), lines


class Stream(torch.utils.data.IterableDataset):
    """Samples with no length: the epoch's size is unknown until it ends."""

    def __init__(self, n):
        self.ds = regression_data(n)

    def __iter__(self):
        for i in range(len(self.ds)):
            time.sleep(0.01)
            yield self.ds[i]


def test_plain_lines_of_an_epoch_of_unknown_length_give_no_eta(tmp_path, capsys):
    t = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                      devices="cpu", default_root_dir=tmp_path, callbacks=[_bar()])
    t.fit(LinearModule(), DataLoader(Stream(64), batch_size=2))   # 32 batches, ~0.4 s
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("Epoch 0/0: ")]
    assert lines, lines
    assert all(re.match(r"Epoch 0/0: \d+/\? batches, step \d+, [\d.]+ it/s, elapsed \d+s( |$)", ln)
               for ln in lines), lines   # "?" batches and no "eta": it would be made up (it said "eta nans")


@pytest.mark.slow
def test_demo_prints_the_report_path_once(tmp_path, capsys):
    """``make demo`` (examples/digits.py) printed the run report's path twice: once from the
    RunRecord callback that wrote it, once from the example."""
    import importlib.util
    import os

    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "digits.py")
    spec = importlib.util.spec_from_file_location("digits_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main(["--epochs", "1", "--root", str(tmp_path)])
    out = capsys.readouterr()
    assert (out.out + out.err).count("report.html") == 1, out.out[-1000:]
