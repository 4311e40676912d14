"""One Ctrl-C always stops a fit: during ``fit`` ember owns SIGINT (ember/trainer/stopping.py),
records the press and raises KeyboardInterrupt at the next batch boundary, whatever the
main thread was doing when the signal came (logging into TensorBoard's queue, an optimizer
step, a checkpoint's fsync)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ember
from ember.callbacks import Callback

from helpers import SCRIPTS, LinearModule, regression_data


@pytest.fixture(autouse=True)
def default_sigint():
    """Python's default Ctrl-C handling in this process, whatever the test run was started
    with (a pytest started with '&' from a non-interactive shell inherits SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_one_sigint_inside_tensorboards_queue_put_stops_the_fit_at_once(tmp_path):
    """The cause of the lost Ctrl-C: a KeyboardInterrupt raised inside
    ``threading.Condition.notify`` of TensorBoard's event queue broke the writer thread's
    wake-up, and the exception path's ``SummaryWriter.close()`` then waited up to the
    writer's 120 s flush interval (tests/scripts/ctrl_c_tensorboard.py sends the SIGINT at
    exactly that line). With the press only recorded by ember's handler, the fit stops at
    the next batch boundary: status 130 within seconds."""
    env = dict(os.environ, EMBER_CHECKPOINT_FSYNC="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "ctrl_c_tensorboard.py"), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "SIGINT"
        start = time.monotonic()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR2)   # the child prints every thread's stack
            time.sleep(1.0)
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"the fit did not stop within 30 s of one SIGINT:\n{err[err.find('Thread 0x'):]}")
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "ember: interrupted (Ctrl-C)" in err and "fit returned" not in out, err[-3000:]
    assert time.monotonic() - start < 30


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
