"""Preemption: SIGTERM / SIGUSR1 finish the current optimizer step, save 'last', end
the fit and (by default) the process with exit code 0; a later fit(ckpt_path="last")
continues bit-exactly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

from resume_common import EPOCHS, STEPS_PER_EPOCH, differences, fit, snapshot  # noqa: E402

from ember.checkpoint import io as cio  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402

_REF: dict = {}


def reference(tmp_path_factory):
    if "snap" not in _REF:
        _REF["snap"] = snapshot(*fit(tmp_path_factory.mktemp("ref")))
    return _REF["snap"]


class SendSignal(Callback):
    def __init__(self, sig, epoch, batch_idx):
        self.sig, self.at = sig, (epoch, batch_idx)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == self.at:
            os.kill(os.getpid(), self.sig)


def _meta(path):
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")
def test_sigterm_saves_last_and_exits_zero_then_resume_is_exact(tmp_path, tmp_path_factory):
    ref = reference(tmp_path_factory)
    env = dict(os.environ, EMBER_CHECKPOINT_FSYNC="0")
    # slow down from batch 4 of epoch 1 on, so the signal lands mid-run
    p = subprocess.Popen([sys.executable, str(SCRIPTS / "resume_train.py"), str(tmp_path),
                          "--ready-at", "1", "4", "--slow", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in p.stdout:
            if line.strip() == "ready":
                p.send_signal(signal.SIGTERM)
                break
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    assert "received SIGTERM at step" in err and "Exiting with code 0" in err
    assert "done" not in out   # the script's code after fit() never ran: the process exited
    last = tmp_path / "checkpoints" / "last"
    meta = _meta(last)
    # the signal came inside the window of batches 3..5: the step after batch 5 finished first
    assert STEPS_PER_EPOCH + 2 <= meta["global_step"] < EPOCHS * STEPS_PER_EPOCH
    state = cio.read_checkpoint(last)[1]
    assert state["grads"] is None and state["loop"]["batches_done"] in (0, 3, 6, 7)   # after a step
    module, trainer = fit(tmp_path, ckpt_path="last")
    assert differences(ref, snapshot(module, trainer)) == []


def test_sigusr1_in_process_exits_zero_after_saving(tmp_path, tmp_path_factory, capsys):
    ref = reference(tmp_path_factory)
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as exc:
        fit(tmp_path, callbacks=[SendSignal(signal.SIGUSR1, 1, 4)])
    assert exc.value.code == 0
    assert signal.getsignal(signal.SIGUSR1) is before   # handlers are put back
    assert "received SIGUSR1 at step 5" in capsys.readouterr().err
    last = tmp_path / "checkpoints" / "last"
    assert os.path.isdir(last) and not os.path.islink(last)
    state = cio.read_checkpoint(last)[1]
    loop = state["loop"]
    assert (loop["epoch"], loop["global_step"], loop["batches_done"]) == (1, 5, 6)
    module, trainer = fit(tmp_path, ckpt_path="last")
    assert differences(ref, snapshot(module, trainer)) == []
    # after the resume, 'last' is the checkpoint callback's link to the newest again
    assert os.path.islink(last) and os.readlink(last) == f"epoch={EPOCHS - 1}-step={EPOCHS * STEPS_PER_EPOCH - 1}"


def test_preemption_can_return_instead_of_exiting(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_PREEMPTION_EXIT", "0")
    module, trainer = fit(tmp_path, callbacks=[SendSignal(signal.SIGTERM, 0, 1)])
    assert trainer.interrupted and trainer.global_step == 1
    assert cio.read_checkpoint(tmp_path / "checkpoints" / "last")[1]["loop"]["global_step"] == 1


def test_preemption_without_checkpoint_callback_saves_under_log_dir(tmp_path, monkeypatch):
    import resume_common as rc
    monkeypatch.setenv("EMBER_PREEMPTION_EXIT", "0")
    import ember
    ember.seed_everything(0)
    trainer = ember.Trainer(max_epochs=2, enable_checkpointing=False, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path,
                            callbacks=[SendSignal(signal.SIGTERM, 0, 0)])
    trainer.fit(rc.ResumeNet(), rc.loaders()[0])
    assert trainer.global_step == 1
    assert cio.is_checkpoint(tmp_path / "checkpoints" / "last")


def test_signal_handlers_exist_only_during_fit(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    class Peek(Callback):
        def on_train_start(self, trainer, module):
            seen["during"] = signal.getsignal(signal.SIGTERM)

    fit(tmp_path, max_epochs=1, callbacks=[Peek()])
    assert seen["during"] is not before and callable(seen["during"])
    assert signal.getsignal(signal.SIGTERM) is before
