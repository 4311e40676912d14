"""The order of a prepared shuffled loader outside the Trainer (Accelerator, Fabric), next to
Accelerate: each pass draws a new order, also after a pass left before its end; the order
follows the seed in force when iteration starts (``set_seed`` after ``Accelerator()``); and
a resume continues it exactly, across a left pass too."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ember import Accelerator
from ember.utils import set_seed
from helpers import passes_left_early


def _loader(n=20):
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=True)


def _orders(acc, passes=3, stop=2):
    """A script that seeds after building its Accelerator and leaves each pass early."""
    set_seed(42)
    dl = acc.prepare(_loader())
    return passes_left_early(dl, passes, stop)


def test_orders_equal_accelerates_seeded_after_the_accelerator_new_each_pass():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(1234)           # the process's seed before the Accelerator differs from run to run
    ours = _orders(Accelerator(cpu=True))
    torch.manual_seed(99)
    again = _orders(Accelerator(cpu=True))
    theirs = _orders(accelerate.Accelerator(cpu=True))
    assert ours == again == theirs    # the order (and the stream after it) follow set_seed, as Accelerate's
    assert len({tuple(p[0]) for p in ours[0]}) == 3   # a new order each pass


def test_an_explicit_seed_keeps_the_seed_and_epoch_order_new_each_pass():
    dl = Accelerator(cpu=True, seed=5).prepare(_loader())
    firsts = []
    for _ in range(3):
        for (b,) in dl:
            firsts.append(b.tolist())
            break
    assert len({tuple(f) for f in firsts}) == 3 and dl.epoch == 2
    dl2 = Accelerator(cpu=True, seed=5).prepare(_loader())
    dl2.set_epoch(2)
    assert next(iter(dl2))[0].tolist() == firsts[2]


def _run(tmp_path, save_at, resume_from=None):
    """Pass 0 left after 2 batches, pass 1 complete, pass 2 left after 3; save_state at
    ``save_at`` = (pass, batch) (batch None: between passes, after the pass ended or was left)."""
    acc = Accelerator(cpu=True, project_dir=str(tmp_path))
    set_seed(0)
    dl = acc.prepare(_loader())
    if resume_from is not None:
        acc.load_state(resume_from)
    seen = []
    plan = [(0, 2), (1, None), (2, 3)]
    start = 0 if resume_from is None else save_at[0] + (1 if save_at[1] is None else 0)
    for p, stop in plan[start:]:
        for (b,) in dl:
            seen.append((p, b.tolist()))
            i = dl.batches_done - 1   # the batch's index in its pass (a resumed pass starts later)
            if resume_from is None and save_at == (p, i):
                acc.save_state(str(tmp_path / "ckpt"))
            if stop is not None and i + 1 == stop:
                break
        if resume_from is None and save_at == (p, None):
            acc.save_state(str(tmp_path / "ckpt"))
    return seen, torch.rand(1).item()


@pytest.mark.parametrize("save_at", [(0, None), (1, 2), (2, 1)])
def test_resume_continues_exactly_across_left_passes(tmp_path, save_at):
    full, tail = _run(tmp_path / "a", save_at)
    resumed, tail2 = _run(tmp_path / "b", save_at, resume_from=str(tmp_path / "a" / "ckpt"))
    p, i = save_at
    if i is None:
        expected = [s for s in full if s[0] > p]
    else:
        cut = next(k for k, s in enumerate(full) if s[0] == p) + i + 1
        expected = full[cut:]
    assert resumed == expected and tail2 == tail


def test_an_iterator_kept_alive_then_dropped_does_not_speak_for_the_next_pass():
    acc = Accelerator(cpu=True, seed=1)
    dl = acc.prepare(_loader())
    it = iter(dl)
    next(it)                              # a pass started and held, not finished
    second = iter(dl)
    first_of_second = next(second)[0].tolist()
    assert dl.epoch == 1                  # a new pass: the next epoch
    del it                                # the old iterator closes now, mid-way through the second pass
    assert dl.state_dict()["batches_done"] == 1 and dl.state_dict()["epoch"] == 1
    rest = [b.tolist() for (b,) in second]
    assert len(rest) == 4 and first_of_second not in rest and dl.epoch == 2
