"""TensorBoardLogger keeps scalars and hands them to the SummaryWriter in bursts (its
writer thread wakes once per hand-off, not once per scalar); every scalar keeps the
step and the wall time it was logged at."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("tensorboard")

from ember.loggers import TensorBoardLogger  # noqa: E402


def _scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return [(e.step, e.value, e.wall_time) for e in ea.Scalars(tag)] if tag in ea.Tags()["scalars"] else []


def test_scalars_are_handed_over_in_bursts_with_their_own_wall_time(tmp_path):
    lg = TensorBoardLogger(tmp_path, name="run", handoff_secs=3600)
    before = time.time()
    lg.log_metrics({"loss": 0.5}, step=1)
    lg.log_metrics({"loss": 0.25, "acc": 0.75}, step=2)
    after = time.time()
    assert lg._experiment is None   # nothing handed over yet: no writer, no writer thread
    time.sleep(0.05)
    lg.save()
    got = _scalars(lg.log_dir, "loss")
    assert [(s, v) for s, v, _ in got] == [(1, 0.5), (2, 0.25)]
    assert all(before - 1e-3 <= w <= after + 1e-3 for _, _, w in got)   # logged at, not handed at
    assert [(s, v) for s, v, _ in _scalars(lg.log_dir, "acc")] == [(2, 0.75)]
    lg.log_metrics({"loss": 0.125}, step=3)
    lg.finalize("success")
    assert [s for s, _, _ in _scalars(lg.log_dir, "loss")] == [1, 2, 3]


def test_handoff_secs_zero_hands_over_at_once(tmp_path):
    lg = TensorBoardLogger(tmp_path, name="run", handoff_secs=0)
    lg.log_metrics({"loss": 1.0}, step=0)
    assert lg._pending == [] and lg._experiment is not None
    lg.finalize("success")
    assert [(s, v) for s, v, _ in _scalars(lg.log_dir, "loss")] == [(0, 1.0)]
