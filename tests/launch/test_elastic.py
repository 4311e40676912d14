"""Elastic restarts under ``ember launch --max_restarts N`` (torchrun's elastic agent):
a worker killed with SIGKILL mid-run makes the group restart, and the restarted
Trainer resumes from the newest complete checkpoint by itself; the final weights
equal an uninterrupted run's bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

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


def test_a_first_attempt_that_may_be_a_membership_change_says_it_does_not_resume(tmp_path, monkeypatch):
    """Without the agents' shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) a group that
    torchrun restarted because a machine joined counts as a first attempt (torchrun counts
    no restart for it): it started afresh without a word, next to this run's checkpoints.
    Now a warning names the checkpoint left alone and the fix; with the shared store (where
    every new group counts) or without a checkpoint, nothing is said."""
    from torch.utils.data import DataLoader, TensorDataset
    from conftest import LinearModule
    for var in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EMBER_ELASTIC_RESUME", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)

    def fit():
        t = ember.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, devices="cpu", max_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(LinearModule(), loader)
        return [str(w.message) for w in caught if "EMBER_ELASTIC_RESUME" in str(w.message)]

    assert fit() == []                     # no checkpoint yet: nothing to leave alone
    (msg,) = fit()                         # the first fit's checkpoint is there now
    assert "counts as a first attempt" in msg and "fit(ckpt_path='last')" in msg and str(tmp_path) in msg, msg
    t = ember.Trainer(default_root_dir=tmp_path, logger=False, devices="cpu")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert _state.elastic_not_resumed(t) is None   # under the shared store a new group counts: no warning
