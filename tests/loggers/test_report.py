"""The run report: `ember report` and Trainer(report=True) on a short digits run."""
from __future__ import annotations

import csv
import glob
import html.parser
import json
import os
import sys

import pytest

from helpers import EXAMPLES

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

sys.path.insert(0, str(EXAMPLES))
from digits import DigitsCNN, DigitsData  # noqa: E402

import ember  # noqa: E402
from ember.cli import main as cli_main  # noqa: E402
from ember.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from ember.loggers.report import chart_key, load_run  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


class _Page(html.parser.HTMLParser):
    """Collects the figures (their series) and images of a report page."""

    def __init__(self):
        super().__init__()
        self.figures, self.images, self.stack = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure":
            self.figures.append((a["data-chart"], a["data-series"].split()))
        if tag == "img":
            self.images.append(a["src"])
        if tag not in ("img", "meta", "br"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-3:])
        self.stack.pop()


def _parse(path) -> _Page:
    p = _Page()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
    p.close()
    assert p.stack == [], p.stack   # every element closed
    return p


def _digits_run(root, logger, epochs=2, **kw):
    ember.seed_everything(0)
    trainer = ember.Trainer(max_epochs=epochs, default_root_dir=root, logger=logger, enable_progress_bar=False,
                            enable_model_summary=False, devices="cpu", log_every_n_steps=4,
                            limit_train_batches=12, **kw)
    trainer.fit(DigitsCNN(channels=8), datamodule=DigitsData())
    return trainer


def test_report_at_end_of_fit_has_a_chart_per_scalar(tmp_path, capsys):
    trainer = _digits_run(tmp_path, CSVLogger(tmp_path), report=True)
    out = trainer.report_path
    assert out == os.path.join(trainer.log_dir, "report.html") and os.path.isfile(out)
    assert f"run report: {out}" in capsys.readouterr().out
    with open(os.path.join(trainer.log_dir, "metrics.csv")) as f:
        logged = [c for c in next(csv.reader(f)) if c not in ("step", "epoch")]
    assert set(logged) == {"train/loss", "val/loss", "val/acc"}
    page = _parse(out)
    charted = [n for _, names in page.figures for n in names]
    assert sorted(charted) == sorted(logged)   # each scalar on exactly one chart
    charts = dict(page.figures)
    assert charts["loss"] == ["train/loss", "val/loss"]   # train and val paired
    assert all(src.startswith("data:image/png;base64,") for src in page.images)   # no network needed
    assert len(page.images) == len(page.figures) == 2
    pngs = sorted(glob.glob(os.path.join(trainer.log_dir, "report_charts", "*.png")))
    assert [os.path.basename(p) for p in pngs] == ["acc.png", "loss.png"]
    assert all(open(p, "rb").read(8) == PNG for p in pngs)
    info = json.load(open(os.path.join(trainer.log_dir, "run.json")))
    assert info["status"] == "success" and info["stop_reason"] == "max_epochs"
    assert info["epoch_end_steps"] == [12, 24] and info["global_step"] == 24
    text = open(out, encoding="utf-8").read()
    for fact in ("max_epochs", info["start_time"], info["end_time"], trainer.checkpoint_callback.best_model_path,
                 "channels", "0.003"):
        assert fact in text, fact


def test_ember_report_reads_tensorboard_and_overlays_runs(tmp_path, capsys):
    a = _digits_run(tmp_path / "a", TensorBoardLogger(tmp_path / "a"), epochs=1)
    b = _digits_run(tmp_path / "b", CSVLogger(tmp_path / "b"), epochs=1, max_steps=8)
    run = load_run(a.log_dir)
    assert run.source == "TensorBoard events"
    assert set(run.scalars) == {"train/loss", "val/loss", "val/acc", "epoch"}
    assert run.scalars["train/loss"][0] == [4, 8, 12]
    assert cli_main(["report", str(tmp_path / "a")]) == 0   # the newest run folder under it
    single = capsys.readouterr().out.strip()
    assert single == os.path.join(a.log_dir, "report.html")
    assert sorted(n for _, ns in _parse(single).figures for n in ns) == ["train/loss", "val/acc", "val/loss"]
    out = tmp_path / "cmp.html"
    assert cli_main(["report", a.log_dir, b.log_dir, "--out", str(out)]) == 0
    page = _parse(out)
    assert len(page.figures) == 2
    text = out.read_text()
    assert "max_steps" in text and "max_epochs" in text   # both runs' stop reasons
    assert len(glob.glob(str(tmp_path / "cmp_charts" / "*.png"))) == 2
    assert cli_main(["report", str(tmp_path / "nothing-here")]) == 2


def test_chart_key_pairs_split_names():
    assert chart_key("train/loss") == chart_key("val/loss") == chart_key("loss/val") == "loss"
    assert chart_key("train_acc_step") == chart_key("train_acc_epoch") == chart_key("val_acc") == "acc"
    assert chart_key("lr-SGD") == "lr-SGD" and chart_key("throughput/samples_per_sec") == "throughput/samples_per_sec"


def test_run_record_with_a_logger_without_folder(tmp_path):
    from ember.loggers import Logger

    class Memory(Logger):
        name, version, log_dir = "memory", 0, None

        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

        def log_hyperparams(self, params):
            pass

    logger = Memory()
    with pytest.warns(UserWarning, match="has no log folder"):
        trainer = _digits_run(tmp_path, logger, epochs=1, max_steps=4, report=True, enable_checkpointing=False)
    assert trainer.global_step == 4 and logger.rows and trainer.report_path is None
    assert not glob.glob(str(tmp_path / "**" / "run.json"), recursive=True)


def test_cli_run_report_shows_the_config(tmp_path, monkeypatch, capsys):
    cfg = str(EXAMPLES / "cli" / "config.yaml")
    monkeypatch.syspath_prepend(os.path.dirname(cfg))   # toy.py importable, as PYTHONPATH=examples/cli in the docs
    monkeypatch.chdir(tmp_path)
    assert cli_main(["fit", "-c", cfg, "--trainer.report", "true", "--trainer.profiler", "simple",
                     "--trainer.max_epochs", "1"]) == 0
    (page,) = glob.glob(str(tmp_path / "runs" / "toy" / "**" / "report.html"), recursive=True)
    text = open(page, encoding="utf-8").read()
    assert "<h2>Config</h2>" in text and "toy.ToyRegressor" in text   # the CLI's config.yaml
    assert "<h2>Profile</h2>" in text and "training_step" in text     # the simple profiler's table
    assert sorted(n for _, ns in _parse(page).figures for n in ns) == ["train/loss", "val/loss"]
