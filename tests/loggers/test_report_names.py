"""Metric names are shown literally in the run report (``$...$`` is not math text), and
a chart that cannot be drawn is left out with a warning: it never fails the run or
``ember report``."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("matplotlib")

import ember  # noqa: E402
from conftest import LinearModule, regression_data  # noqa: E402
from ember.loggers import CSVLogger  # noqa: E402

MATH = r"cost_$\nosuchcmd{x}$"


class LogsMathName(LinearModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log(MATH, loss.detach() * 2)
        return loss


def test_fit_with_report_and_a_math_text_metric_name_succeeds(tmp_path):
    t = ember.Trainer(max_steps=4, log_every_n_steps=1, default_root_dir=str(tmp_path), report=True,
                      logger=CSVLogger(str(tmp_path)), enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False)
    t.fit(LogsMathName(), torch.utils.data.DataLoader(regression_data(16), batch_size=4))
    page = open(t.report_path, encoding="utf-8").read()
    assert "cost_$\\nosuchcmd{x}$" in page          # the chart is there, named as logged
    charts = os.path.join(os.path.dirname(t.report_path), "report_charts")
    assert any(n.startswith("cost") and n.endswith(".png") for n in os.listdir(charts)), os.listdir(charts)


def _run_folder(root) -> str:
    d = os.path.join(root, "logs", "version_0")
    os.makedirs(d)
    with open(os.path.join(d, "metrics.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "epoch", MATH, "train/loss", "huge"])
        for step, huge in ((0, 1.7e308), (1, -1.7e308), (2, 1.7e308)):   # an axis matplotlib cannot lay out
            w.writerow([step, 0, 1.0 / (step + 1), 2.0 / (step + 1), huge])
    return d


def test_ember_report_shows_math_text_names_and_skips_a_chart_it_cannot_draw(tmp_path):
    d = _run_folder(tmp_path)
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "ember", "report", d, "-o", str(tmp_path / "r.html")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "the chart 'huge' (huge) could not be drawn and is left out" in r.stderr
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert 'data-series="cost_$\\nosuchcmd{x}$"' in page and 'data-series="train/loss"' in page
    assert 'data-chart="huge"' not in page


def test_write_report_warns_and_still_writes_the_page(tmp_path):
    from ember.loggers.report import write_report
    d = _run_folder(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = write_report([d], str(tmp_path / "r.html"))
    assert os.path.isfile(out)
    assert [str(x.message) for x in w if "could not be drawn" in str(x.message)] != []
