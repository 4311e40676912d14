"""``ember report`` on a run folder from anyone: an ``hparams.yaml`` or ``run.json`` that is a
"billion laughs" file, nests too deep or holds no mapping is left out with a note, and the
report is still drawn, at once."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
import warnings

import pytest

pytest.importorskip("matplotlib")


def laughs() -> str:
    out = 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, 9):
        out += f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n"
    return out


def _run_folder(root, hparams: str, run_json: str) -> str:
    d = os.path.join(root, "logs", "version_0")
    os.makedirs(d)
    with open(os.path.join(d, "metrics.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "epoch", "train/loss"])
        for step in range(4):
            w.writerow([step, 0, 1.0 / (step + 1)])
    with open(os.path.join(d, "hparams.yaml"), "w") as f:
        f.write(hparams)
    with open(os.path.join(d, "run.json"), "w") as f:
        f.write(run_json)
    return d


CASES = {
    "billion laughs": (laughs(), "[1, 2]", "its aliases expand to more than 200000 values", "holds a list"),
    "deep": ("x: " + "[" * 30000 + "]" * 30000 + "\n", "[" * 30000 + "]" * 30000,
             "nests deeper than 64 levels", "nests deeper than 64 levels"),
    "lists": ("- 1\n- 2\n", '[{"status": "success"}]', "holds a list", "holds a list"),
}


def _check_page(out, d) -> None:
    page = out.read_text(encoding="utf-8")
    assert 'data-chart="loss"' in page                     # the report is drawn
    assert "hparams.yaml is left out: " in page and "run.json is left out: " in page   # and says what it left out


def test_a_billion_laughs_run_folder_is_reported_at_once_by_the_command(tmp_path):
    hparams, run_json, hp_why, rj_why = CASES["billion laughs"]
    d = _run_folder(tmp_path, hparams, run_json)
    out = tmp_path / "r.html"
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ember", "report", d, "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert f"run report: {os.path.join(d, 'hparams.yaml')} is left out: " in r.stderr and hp_why in r.stderr
    assert f"run report: {os.path.join(d, 'run.json')} is left out: " in r.stderr and rj_why in r.stderr
    _check_page(out, d)


@pytest.mark.parametrize("case", ["deep", "lists"])
def test_bad_run_files_are_left_out_with_a_note_and_the_report_is_drawn(tmp_path, capsys, case):
    from ember.cli import main
    hparams, run_json, hp_why, rj_why = CASES[case]
    d = _run_folder(tmp_path, hparams, run_json)
    out = tmp_path / "r.html"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert main(["report", d, "-o", str(out)]) == 0
    notes = [str(x.message) for x in w if "is left out" in str(x.message)]
    assert len(notes) == 2, notes
    assert notes[0].startswith(f"run report: {os.path.join(d, 'hparams.yaml')} is left out: ") and hp_why in notes[0]
    assert notes[1].startswith(f"run report: {os.path.join(d, 'run.json')} is left out: ") and rj_why in notes[1]
    _check_page(out, d)


def test_good_files_are_still_read(tmp_path):
    from ember.loggers.report import load_run
    d = _run_folder(tmp_path, "lr: 0.1\nnet: &n {hidden: 4}\nteacher: *n\n",
                    '{"status": "success", "epoch_end_steps": [3]}')
    run = load_run(d)
    assert run.hparams == {"lr": 0.1, "net": {"hidden": 4}, "teacher": {"hidden": 4}}
    assert run.info["status"] == "success" and run.epoch_ends() == [3] and run.notes == []
