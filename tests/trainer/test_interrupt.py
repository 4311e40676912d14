"""One Ctrl-C always stops a fit: during ``fit`` ember owns SIGINT (ember/trainer/stopping.py),
records the press and raises KeyboardInterrupt at the next batch boundary, whatever the
main thread was doing when the signal came (an optimizer step, a checkpoint's fsync)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import ember
from ember.callbacks import Callback

from helpers import SCRIPTS, LinearModule, regression_data


def test_one_sigint_stops_every_fit_under_load_at_many_timings(tmp_path):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]   # a busy machine
    try:
        proc = subprocess.run([sys.executable, str(SCRIPTS / "sigint_timings.py"), str(tmp_path), "12", "0.4"],
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        for h in hogs:
            h.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(runs) == 12
    for r in runs:
        assert r["outcome"] == "interrupted" and r["reason"] == "interrupted", r
        assert r["stop_s"] is not None and r["stop_s"] < 5.0, r   # at the next batch boundary, not later
        assert r["step"] < 512, r                                  # it did not train on


def test_sigint_is_acted_on_at_the_next_batch_boundary_and_the_handler_is_restored(tmp_path):
    seen = []

    class Press(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(batch_idx)
            if batch_idx == 2:
                os.kill(os.getpid(), signal.SIGINT)   # delivered now: the handler only records it

    before = signal.getsignal(signal.SIGINT)
    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[Press()], default_root_dir=tmp_path)
    sys.ps1 = ">>> "   # interactive: the KeyboardInterrupt propagates (a script exits with 130)
    try:
        with pytest.raises(KeyboardInterrupt):
            t.fit(LinearModule(), torch.utils.data.DataLoader(regression_data(64), batch_size=8))
    finally:
        del sys.ps1
    assert seen == [0, 1, 2]                 # raised at the boundary after batch 2, no batch later
    assert t.stop_reason == "interrupted" and t.interrupted
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_sigint_stops_at_once(tmp_path):
    """Two presses: the second raises inside the handler, without waiting for a boundary."""
    stopped = []

    class Slow(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                stopped.append("not reached")   # the second press raised inside this hook
                time.sleep(5)

    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[Slow()], default_root_dir=tmp_path)
    sys.ps1 = ">>> "
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            t.fit(LinearModule(), torch.utils.data.DataLoader(regression_data(64), batch_size=8))
    finally:
        del sys.ps1
    assert time.monotonic() - start < 4 and stopped == []
