"""Elastic restarts under ``ember launch --max_restarts N`` (torchrun's elastic agent):
a worker killed with SIGKILL mid-run makes the group restart, and the restarted
Trainer resumes from the newest complete checkpoint by itself; the final weights
equal an uninterrupted run's bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import ember
from ember.trainer import checkpoint as _state
from helpers import SCRIPTS, quiet_env

SCRIPT = str(SCRIPTS / "elastic_train.py")


def _launch(out, tag, *extra, restarts=0):
    env = quiet_env()
    args = [sys.executable, "-m", "ember", "launch", "--num_processes", "2", "--max_restarts", str(restarts),
            SCRIPT, out, tag, *extra]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.multiproc
def test_sigkilled_worker_restarts_and_resumes_bit_exactly(tmp_path):
    out = str(tmp_path)
    killed = _launch(out, "killed", "--kill-at", "5", restarts=1)
    assert killed.returncode == 0, killed.stderr[-4000:]
    with open(os.path.join(out, "killed.attempts")) as f:
        first_steps = [int(s) for s in f.read().split()]
    assert first_steps == [1, 5]        # the restart resumed the step-4 checkpoint
    plain = _launch(out, "plain")
    assert plain.returncode == 0, plain.stderr[-4000:]
    a, b = load_file(os.path.join(out, "killed.safetensors")), load_file(os.path.join(out, "plain.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_elastic_resume_only_after_a_restart_and_only_with_a_checkpoint(tmp_path, monkeypatch):
    t = ember.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, devices="cpu")
    for var in ("EMBER_ELASTIC_RESUME", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    assert _state.elastic_resume_path(t) is None
    monkeypatch.setenv("EMBER_ELASTIC_RESUME", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _state.elastic_resume_path(t) is None          # first attempt: start afresh
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _state.elastic_resume_path(t) is None          # restarted before any checkpoint
    from torch.utils.data import DataLoader, TensorDataset
    from conftest import LinearModule
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    ember.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  devices="cpu", max_steps=1).fit(LinearModule(), loader)     # writes this run's checkpoint
    assert _state.elastic_resume_path(t) == "last"
