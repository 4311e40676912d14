"""Resuming is exact: a run interrupted anywhere and resumed from its checkpoint ends
bit-identical (every parameter, optimizer state, scheduler, GradScaler, step, epoch,
epoch metrics) to the same run without the interruption.

The run (tests/scripts/resume_common.py): shuffled data with an uneven last batch,
dropout, AdamW, a per-step LambdaLR/OneCycleLR, "16-mixed" with a GradScaler,
accumulate_grad_batches=3, ModelCheckpoint(every_n_train_steps=...), and a loss that
draws from Python's and NumPy's generators. 7 batches per epoch in accumulation windows
of 3, 3 and 1; optimizer steps after batches 2, 5 and 6 of every epoch.
"""
from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

from resume_common import (EPOCHS, STEPS_PER_EPOCH, Interrupt, differences, fit,  # noqa: E402
                           snapshot)

from ember.checkpoint import io as cio  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.errors import CheckpointError  # noqa: E402


class EpochMetrics(Callback):
    """Records the epoch mean of train/loss at every epoch end."""

    def __init__(self):
        self.values = {}

    def on_train_epoch_end(self, trainer, module):
        self.values[trainer.current_epoch] = float(trainer.callback_metrics["train/loss_epoch"])


class SaveAt(Callback):
    """trainer.save_checkpoint(path) at the end of batch ``batch_idx`` of ``epoch``."""

    def __init__(self, epoch, batch_idx, path):
        self.at, self.path = (epoch, batch_idx), str(path)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == self.at:
            trainer.save_checkpoint(self.path)


_REFERENCE: dict = {}


def reference(tmp_path_factory, scheduler="lambda"):
    """The uninterrupted run (computed once per scheduler)."""
    if scheduler not in _REFERENCE:
        rec = EpochMetrics()
        module, trainer = fit(tmp_path_factory.mktemp(f"ref-{scheduler}"), scheduler=scheduler, callbacks=[rec])
        assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH and trainer.current_epoch == EPOCHS
        _REFERENCE[scheduler] = (snapshot(module, trainer), rec.values)
    return _REFERENCE[scheduler]


# (checkpointing, where the run is interrupted, checkpoint to resume from)
CASES = {
    # ModelCheckpoint at epoch ends: resume from the end of epoch 0
    "epoch_boundary": (lambda d: ModelCheckpoint(save_last=True), (1, 4), "last", 1, 0),
    # every step: the newest is step 7, after batch 2 of epoch 2
    "mid_epoch": (lambda d: ModelCheckpoint(every_n_train_steps=1, save_last=True), (2, 3), "last", 2, 3),
    # every 3 steps: step 3 is the last batch of epoch 0, saved before the epoch-end work
    "last_batch_of_epoch": (lambda d: ModelCheckpoint(every_n_train_steps=3, save_last=True), (1, 1), "last", 0, 7),
    # interrupted inside an accumulation window (batch 4 of 3..5): resume from its start
    "mid_window_interrupt": (lambda d: None, (1, 4), "last", 1, 3),
}


@pytest.mark.parametrize("scheduler", ["lambda", "onecycle"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_in_process_is_bit_exact(case, scheduler, tmp_path, tmp_path_factory):
    ref, ref_epochs = reference(tmp_path_factory, scheduler)
    make_ckpt, at, ckpt, epoch, batches_done = CASES[case]
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(tmp_path, scheduler=scheduler, callbacks=[Interrupt(*at)], checkpoint=make_ckpt(tmp_path))
    last = cio.read_checkpoint(os.path.join(tmp_path, "checkpoints", "last"))[1]["loop"]
    assert (last["epoch"], last["batches_done"]) == (epoch, batches_done)
    # a fresh module and Trainer in the same process
    rec = EpochMetrics()
    module, trainer = fit(tmp_path, ckpt_path=ckpt, scheduler=scheduler, callbacks=[rec],
                          checkpoint=make_ckpt(tmp_path))
    assert differences(ref, snapshot(module, trainer)) == []
    # epoch means of the resumed epoch include the batches before the interruption
    assert rec.values == {e: v for e, v in ref_epochs.items() if e >= epoch}


def test_resume_from_checkpoint_inside_accumulation_window(tmp_path, tmp_path_factory):
    """A checkpoint saved after batch 4 (gradients of batches 3 and 4 pending) carries
    those gradients; the resumed run adds batch 5 and steps exactly as the original."""
    ref, ref_epochs = reference(tmp_path_factory)
    inside = tmp_path / "inside"
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(tmp_path, callbacks=[SaveAt(1, 4, inside), Interrupt(1, 5)])
    state = cio.read_checkpoint(inside)[1]
    assert state["loop"]["batches_done"] == 5 and state["loop"]["global_step"] == 4
    assert set(state["grads"][0]) == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
    rec = EpochMetrics()
    module, trainer = fit(tmp_path, ckpt_path=inside, callbacks=[rec])
    assert differences(ref, snapshot(module, trainer)) == []
    assert rec.values == {1: ref_epochs[1], 2: ref_epochs[2]}


def test_resume_is_not_exact_without_saved_gradients(tmp_path, tmp_path_factory, monkeypatch):
    """Guard for the test above: dropping the pending gradients changes the result."""
    from ember.trainer import checkpoint as st
    ref, _ = reference(tmp_path_factory)
    inside = tmp_path / "inside"
    with pytest.raises(RuntimeError):
        fit(tmp_path, callbacks=[SaveAt(1, 4, inside), Interrupt(1, 5)])
    monkeypatch.setattr(st, "_restore_grads", lambda t, grads, path: None)
    module, trainer = fit(tmp_path, ckpt_path=inside)
    assert differences(ref, snapshot(module, trainer))


def test_resume_skips_indices_without_reading_data(tmp_path, tmp_path_factory):
    """Mid-epoch resume fetches only the remaining samples of the epoch."""
    from torch.utils.data import Dataset

    import resume_common as rc

    class Counting(Dataset):
        def __init__(self, base):
            self.base, self.reads = base, []

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            self.reads.append(i)
            return self.base[i]

    with pytest.raises(RuntimeError):
        fit(tmp_path, callbacks=[Interrupt(1, 4)])
    counting = Counting(rc.dataset())
    orig = rc.loaders
    rc.loaders = lambda: (torch.utils.data.DataLoader(counting, batch_size=rc.BATCH, shuffle=True), orig()[1])
    try:
        fit(tmp_path, ckpt_path="last", max_epochs=2)
    finally:
        rc.loaders = orig
    # resumed after batch 2 of epoch 1: 4 batches (3 of 8, 1 of 2) = 26 samples, then nothing
    assert len(counting.reads) == 26 and len(set(counting.reads)) == 26


def _run_script(*args, timeout=240):
    env = dict(os.environ, EMBER_CHECKPOINT_FSYNC="0")
    return subprocess.run([sys.executable, str(SCRIPTS / "resume_train.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_resume_after_sigkill_in_fresh_process(tmp_path, tmp_path_factory):
    ref, _ = reference(tmp_path_factory)
    # killed inside an accumulation window of epoch 1 (the newest checkpoint is step 4)
    p = _run_script(tmp_path, "--kill-at", 1, 4)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert "done" not in p.stdout
    out = tmp_path / "snap.pt"
    p = _run_script(tmp_path, "--resume", "--out", out)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"start 4 {os.path.join(tmp_path, 'checkpoints', 'last')}" in p.stdout
    assert differences(ref, torch.load(out, weights_only=True)) == []


class _Zygote:
    """Drives tests/scripts/resume_zygote.py (forks one child per run)."""

    RUN_EPOCHS = 20   # of each run

    def __init__(self, env):
        self.p = subprocess.Popen([sys.executable, str(SCRIPTS / "resume_zygote.py")], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", 180)

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def expect(self, prefix, timeout=120):
        end = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            if line is None:
                raise AssertionError(f"the zygote ended while waiting for {prefix!r}")
            if line.startswith(prefix):
                return line

    def run(self, root, resume, out="-", epochs=RUN_EPOCHS, every=1) -> int:
        self.send(f"run {root} {int(resume)} {out} {epochs} {every}")
        return int(self.expect("pid").split()[1])

    def wait(self, pid) -> int:
        self.send(f"wait {pid}")
        return int(self.expect(f"exit {pid} ").split()[2])

    def poll(self, pid) -> int | None:
        """The child's exit code, or None while it runs."""
        self.send(f"poll {pid}")
        answer: list = []
        while answer[:1] not in (["exit"], ["alive"]) or answer[1:2] != [str(pid)]:
            answer = self.expect("", 60).split()     # (the children's own lines are skipped)
        return int(answer[2]) if answer[0] == "exit" else None

    def close(self):
        try:
            self.send("quit")
            self.p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()


def _newest_step(ckpt_dir) -> int:
    steps = [int(m.group(1)) for c in cio.list_checkpoints(ckpt_dir)
             for m in [re.search(r"step=(\d+)", os.path.basename(c))] if m]
    return max(steps, default=0)


def _wait_for_progress(z: _Zygote, pid: int, ckpt_dir, past_step: int, total_steps: int,
                       timeout: float = 60.0) -> None:
    """Until the running fit ``pid`` has written a checkpoint beyond ``past_step`` (or has none
    left to write). Fails at once, naming its exit code, if the fit ends before that (its
    traceback is on stderr)."""
    end, polled = time.monotonic() + timeout, time.monotonic()
    while past_step < total_steps and _newest_step(ckpt_dir) <= past_step:
        assert time.monotonic() < end, f"no checkpoint past step {past_step} within {timeout}s"
        if time.monotonic() - polled > 0.5:
            polled = time.monotonic()
            code = z.poll(pid)
            if code is not None and _newest_step(ckpt_dir) <= past_step:
                raise AssertionError(f"the fit resumed at step {past_step} ended (exit code {code}) before "
                                     "writing a newer checkpoint; its traceback is on stderr")
        time.sleep(0.001)


def test_stress_random_sigkills_then_resume_is_bit_exact(tmp_path):
    """Ten SIGKILLs at random moments of a fit that checkpoints every step (so many land
    inside a save); every run resumes from the newest complete checkpoint ('last', or the
    top-k one saved just before a kill that came before `last` was swapped to it), never
    from a half-written '*.ember-tmp', and the final parameters equal the uninterrupted run's.
    Each kill comes at a random moment within about four steps after the run's first new
    checkpoint, so every run makes progress however fast the machine is (a whole fit
    takes ~0.2 s here)."""
    env = dict(os.environ, EMBER_CHECKPOINT_FSYNC="0")
    z = _Zygote(env)
    try:
        ref_out = tmp_path / "ref.pt"
        pid = z.run(tmp_path / "ref", False, ref_out)
        z.expect("start")
        t0 = time.monotonic()
        z.expect("done")
        duration = time.monotonic() - t0
        assert z.wait(pid) == 0
        root = tmp_path / "run"
        rng = random.Random(0)
        kills, resumed_from = 0, []
        for _ in range(10):
            pid = z.run(root, bool(cio.list_checkpoints(root / "checkpoints")))
            start = z.expect("start").split()
            resumed_from.append((int(start[1]), start[2]))
            _wait_for_progress(z, pid, root / "checkpoints", int(start[1]), _Zygote.RUN_EPOCHS * STEPS_PER_EPOCH)
            time.sleep(rng.uniform(0.0, duration / 15))
            os.kill(pid, signal.SIGKILL)
            code = z.wait(pid)
            assert code in (-signal.SIGKILL, 0)
            kills += code == -signal.SIGKILL
            found = cio.list_checkpoints(root / "checkpoints")
            assert not [c for c in found if c.endswith((".tmp", ".ember-tmp"))]
        out = tmp_path / "final.pt"
        pid = z.run(root, True, out)
        start = z.expect("start").split()
        resumed_from.append((int(start[1]), start[2]))
        z.expect("done")
        assert z.wait(pid) == 0
    finally:
        z.close()
    assert kills >= 5, f"only {kills} kills landed before training ended"
    assert resumed_from[0] == (0, "None")
    steps = [s for s, _ in resumed_from]
    assert steps == sorted(steps) and steps[-1] > 0
    # ckpt_path="last" is the newest complete checkpoint: the `last` link, or the top-k
    # checkpoint just written when the kill came before `last` was swapped to it
    ckpt_dir = os.path.join(root, "checkpoints")
    for s, p in resumed_from[1:]:
        if p != "None":
            name = os.path.basename(p)
            assert os.path.dirname(p) == ckpt_dir and not name.endswith((".tmp", ".ember-tmp")), resumed_from
            assert name == "last" or name.endswith(f"-step={s}"), resumed_from
    assert differences(torch.load(ref_out, weights_only=True), torch.load(out, weights_only=True)) == []
    # top-k (2 latest) bookkeeping survived the kills: no orphans left behind
    names = sorted(os.path.basename(c) for c in cio.list_checkpoints(root / "checkpoints"))
    assert names == ["epoch=19-step=59", "epoch=19-step=60", "last"]


# -- training errors ---------------------------------------------------------------------------------
class NanAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step >= self.step:
            with torch.no_grad():
                module.net[0].weight.fill_(float("nan"))


def test_non_finite_loss_raises_naming_the_step(tmp_path):
    from ember.errors import NonFiniteLossError
    with pytest.raises(NonFiniteLossError, match=r"nan at global step 5 .*log_every_n_steps=1"):
        fit(tmp_path, precision="32-true", log_every_n_steps=1, accumulate_grad_batches=1,
            callbacks=[NanAt(4)], checkpoint=ModelCheckpoint())


def test_non_finite_loss_checked_every_step_under_detect_anomaly(tmp_path):
    from ember.errors import NonFiniteLossError
    assert not torch.is_anomaly_enabled()
    with pytest.raises(NonFiniteLossError, match=r"nan at global step 4 .*optimizer step was not taken"):
        fit(tmp_path, precision="32-true", log_every_n_steps=50, accumulate_grad_batches=1,
            callbacks=[NanAt(3)], checkpoint=ModelCheckpoint(), detect_anomaly=True)
    assert not torch.is_anomaly_enabled()   # switched on for the run only


def test_non_finite_loss_under_16_mixed_is_skipped_by_the_scaler(tmp_path):
    class NanOnce(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.saved = module.net[0].weight.detach().clone() if (trainer.current_epoch, batch_idx) == (0, 3) else None
            if self.saved is not None:
                module.net[0].weight.data[0, 0] = float("inf")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.saved is not None:
                module.net[0].weight.data.copy_(self.saved)
    module, trainer = fit(tmp_path, log_every_n_steps=1, callbacks=[NanOnce()], max_epochs=1)
    assert trainer.global_step == STEPS_PER_EPOCH
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_iterable_dataset_resumes_mid_epoch_by_replaying_with_a_warning(tmp_path):
    """It raised 'cannot resume mid-epoch'; now the stream is read again up to the saved
    batch (exactness: tests/data/test_stream_resume.py)."""
    from torch.utils.data import DataLoader, IterableDataset

    import resume_common as rc

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(rc.dataset())

    with pytest.raises(RuntimeError):
        fit(tmp_path, callbacks=[Interrupt(1, 4)])
    orig = rc.loaders
    rc.loaders = lambda: (DataLoader(Stream(), batch_size=rc.BATCH), orig()[1])
    try:
        with pytest.warns(UserWarning, match=r"replayed to batch \d+: \d+ batch\(es\) read again and discarded in "
                                             r"[\d.]+ s.*exact only when the stream yields the same items"):
            fit(tmp_path, ckpt_path="last")
    finally:
        rc.loaders = orig


def test_fit_refuses_weights_only_checkpoint(tmp_path):
    _, trainer = fit(tmp_path / "a", max_epochs=1)
    trainer.save_checkpoint(tmp_path / "w", weights_only=True)
    with pytest.raises(CheckpointError, match="weights only"):
        fit(tmp_path / "b", ckpt_path=tmp_path / "w")
    assert not (tmp_path / "b").exists()


@pytest.mark.multiproc
def test_ddp_resume_inside_window_and_after_one_rank_is_preempted(tmp_path):
    """2 gloo processes (tests/scripts/resume_ddp.py): per-rank pending gradients and RNG
    states are saved and restored; SIGTERM on rank 1 alone stops both ranks at the same
    log point; both resumes end bit-identical to the uninterrupted DDP run."""
    import json
    env = dict(os.environ, EMBER_CHECKPOINT_FSYNC="0")
    p = subprocess.run([sys.executable, str(SCRIPTS / "resume_ddp.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=500, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "received SIGTERM at step 4" in p.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"a": [], "b": [], "grads_ranks": 2, "grads_differ": True, "rng_ranks": 2,
                      "stopped": [4, True], "last_step_after_resume": 6}
