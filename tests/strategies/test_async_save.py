"""Background checkpoint writes for one device and DDP (``async_save=True``, the switch
FSDPStrategy has): the state is copied to CPU memory on the training thread, written
and committed by a writer thread with the synchronous path's rules."""
from __future__ import annotations

import os
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

from helpers import SCRIPTS, rank_results, run_ranks

sys.path.insert(0, str(SCRIPTS))

from resume_common import EPOCHS, STEPS_PER_EPOCH, differences, fit, snapshot  # noqa: E402

import ember  # noqa: E402
from ember.checkpoint import io as cio  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.errors import CheckpointError  # noqa: E402
from ember.strategies import DDPStrategy  # noqa: E402
from ember.strategies.base import SingleDeviceStrategy  # noqa: E402


def _async():
    return SingleDeviceStrategy("cpu", async_save=True)


def _every_step():
    return ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, filename="{step}")


def _ckpts(root) -> dict:
    d = os.path.join(root, "checkpoints")
    return {os.path.basename(p): p for p in cio.list_checkpoints(d)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run twice, checkpointing every step: synchronously and in the background."""
    sync_root, async_root = tmp_path_factory.mktemp("sync"), tmp_path_factory.mktemp("async")
    m_sync, t_sync = fit(sync_root, checkpoint=_every_step())
    m_async, t_async = fit(async_root, checkpoint=_every_step(), strategy=_async())
    return {"sync": (sync_root, snapshot(m_sync, t_sync)), "async": (async_root, snapshot(m_async, t_async))}


def _same_training_state(path_a, path_b, name):
    """Asserts that two checkpoints hold the same weights, optimizer, loop, precision,
    global step and epoch; returns their states and metas (state a, state b, meta a, meta b)."""
    wa, sa, ma = cio.read_checkpoint(path_a)
    wb, sb, mb = cio.read_checkpoint(path_b)
    assert differences(wa, wb, name) == []
    for key in ("optimizers", "loop", "precision", "global_step", "epoch"):
        assert differences(sa.get(key), sb.get(key), f"{name}/{key}") == []
    return sa, sb, ma, mb


def test_async_and_sync_checkpoints_hold_identical_tensors(runs):
    (sync_root, ref), (async_root, got) = runs["sync"], runs["async"]
    assert differences(ref, got) == []          # training did not change
    a, b = _ckpts(sync_root), _ckpts(async_root)
    assert sorted(a) == sorted(b) and len(a) == EPOCHS * STEPS_PER_EPOCH   # all committed by the end of fit
    for name in a:
        sa, sb, ma, mb = _same_training_state(a[name], b[name], name)
        assert sorted(ma["files"]) == sorted(mb["files"]) == ["model.safetensors", "trainer_state.pt"]
        assert not os.path.exists(cio.tmp_path(b[name]))


def test_resume_from_an_async_checkpoint_is_exact(runs, tmp_path):
    (_, ref), (async_root, _) = runs["sync"], runs["async"]
    ckpt = _ckpts(async_root)["step=4"]           # saved in the background mid-run
    assert cio.read_checkpoint(ckpt)[1]["loop"]["global_step"] == 4
    module, trainer = fit(tmp_path, ckpt_path=ckpt, checkpoint=_every_step(), strategy=_async())
    assert differences(ref, snapshot(module, trainer)) == []


class Big(ember.TrainModule):
    """~16 MB of weights: a write that takes a while."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2048, 2048)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _big_trainer(root, **kw):
    return ember.Trainer(strategy=_async(), max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root), **kw)


def _data():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2048)), batch_size=2)


def test_parameter_changed_after_save_returns_keeps_the_saved_value(tmp_path):
    module = Big()
    t = _big_trainer(tmp_path)
    t.fit(module, _data())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    path = str(tmp_path / "ckpt")
    t.save_checkpoint(path)
    with torch.no_grad():          # at once, while the writer may still be serialising
        for p in module.parameters():
            p.add_(1.0)
    t.strategy.wait_for_checkpoint()
    weights = cio.read_checkpoint(path)[0]
    assert differences(before, weights) == []
    assert not torch.equal(weights["lin.weight"], module.lin.weight.detach())


class BadStateAt(Callback):
    """Puts an object torch.load(weights_only=True) cannot read into the saved state at ``step``."""

    def __init__(self, step):
        self.step = step

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if trainer.global_step == self.step:
            checkpoint["bad"] = object()


def test_failing_write_raises_at_the_next_save(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\['bad'\]"):
        fit(tmp_path, callbacks=[BadStateAt(2)], checkpoint=_every_step(), strategy=_async())
    names = sorted(_ckpts(tmp_path))
    assert names == ["step=1"]         # the failed step-2 save was not committed; step 3 never started
    assert not os.path.exists(cio.tmp_path(os.path.join(tmp_path, "checkpoints", "step=2")))


def test_failing_last_write_raises_at_the_end_of_fit(tmp_path):
    last = EPOCHS * STEPS_PER_EPOCH
    with pytest.raises(CheckpointError, match=r"state\['bad'\]"):
        fit(tmp_path, callbacks=[BadStateAt(last)], checkpoint=_every_step(), strategy=_async())
    assert len(_ckpts(tmp_path)) == last - 1


class HoldsSnapshot(Callback):
    """Keeps a weak reference to a tensor of the CPU copy the last save was written from."""
    ref = None

    def on_train_end(self, trainer, module):
        import weakref
        weights = trainer.strategy._snapshot[0]      # (weights, trainer state) of the last save
        HoldsSnapshot.ref = weakref.ref(next(iter(weights.values())))


def test_the_cpu_copy_is_released_after_fit(tmp_path):
    # the copy is reused between saves, but a model-sized buffer must not outlive the fit
    import gc
    module, trainer = fit(tmp_path, callbacks=[HoldsSnapshot()], checkpoint=_every_step(), strategy=_async())
    gc.collect()     # the trainer and its strategy are still alive here
    assert HoldsSnapshot.ref is not None and HoldsSnapshot.ref() is None


class SaveThenFail(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.save_checkpoint(os.path.join(trainer.default_root_dir, "pending"))
        raise RuntimeError("training failed")


def test_exception_in_training_drops_the_pending_save(tmp_path):
    t = _big_trainer(tmp_path, callbacks=[SaveThenFail()])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="training failed"):
            t.fit(Big(), _data())
    assert any("asynchronous save" in str(x.message) and "not committed" in str(x.message) for x in w)
    # the writer has ended (and cleaned up) by the time fit raises
    assert not any(th.name.startswith("ember-save:") for th in threading.enumerate())
    assert not os.path.exists(tmp_path / "pending") and not os.path.exists(tmp_path / "pending.ember-tmp")


class Gate:
    """A trainer-state entry whose serialisation waits until ``opened`` is set: it holds
    the background writer in the middle of a write, for as long as the test wants."""

    def __init__(self):
        self.opened = threading.Event()

    def __deepcopy__(self, memo):      # the CPU snapshot keeps it as it is (nothing waits on this thread)
        return self

    def __reduce__(self):              # torch.save on the writer thread
        assert self.opened.wait(20), "the test never opened the gate"
        return (Gate, ())


class HoldSave(Callback):
    """Puts ``gate`` into the checkpoint saved at ``step``; at the first ``on_train_batch_end``
    of each global step (before ModelCheckpoint's save of that step) records the committed
    checkpoints, and opens the gate at ``step + 1``."""

    def __init__(self, step):
        self.step, self.gate, self.seen = step, Gate(), []

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if trainer.global_step == self.step:
            checkpoint["gate"] = self.gate

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not self.seen or self.seen[-1][0] != trainer.global_step:
            self.seen.append((trainer.global_step, sorted(_ckpts(trainer.default_root_dir))))
        if trainer.global_step == self.step + 1:
            self.gate.opened.set()


def _strategy(kind: str, async_save: bool):
    if kind == "ddp":        # one process
        return DDPStrategy(devices=1, accelerator="cpu", timeout=60, async_save=async_save)
    return SingleDeviceStrategy("cpu", async_save=async_save)


@pytest.mark.parametrize("kind", ["single", "ddp"])
def test_async_save_returns_before_the_write_and_commits_the_synchronous_checkpoint(tmp_path, kind):
    with torch.serialization.safe_globals([Gate]):
        hold = HoldSave(step=1)
        _, t = fit(tmp_path / "async", callbacks=[hold], checkpoint=_every_step(), strategy=_strategy(kind, True))
        # the step-1 save returned while its write waited: not committed at step 2 (before the
        # step-2 save, which finishes it first); committed by step 3; every save committed at fit end
        seen = dict(hold.seen)
        assert seen[1] == [] and seen[2] == [] and "step=1" in seen[3], hold.seen
        assert len(_ckpts(tmp_path / "async")) == EPOCHS * STEPS_PER_EPOCH
        # a save after fit: the directory appears only at wait_for_checkpoint()
        hold.step, hold.gate = t.global_step, Gate()
        path = tmp_path / "after_fit"
        t.save_checkpoint(path)
        alive = [th.name for th in threading.enumerate() if th.name.startswith("ember-save:")]
        assert alive == [f"ember-save:{path}"] and not path.exists()
        hold.gate.opened.set()
        t.strategy.wait_for_checkpoint()
        assert path.is_dir() and not os.path.exists(cio.tmp_path(path))
        # the same run saving synchronously wrote the same tensors
        _, s = fit(tmp_path / "sync", checkpoint=_every_step(), strategy=_strategy(kind, False))
        s.save_checkpoint(tmp_path / "sync_after_fit")
        a, b = _ckpts(tmp_path / "sync"), _ckpts(tmp_path / "async")
        a["after_fit"], b["after_fit"] = str(tmp_path / "sync_after_fit"), str(path)
        assert sorted(a) == sorted(b)
        for name in a:
            sa, sb, _, _ = _same_training_state(a[name], b[name], name)
            assert isinstance(sb.get("gate"), Gate) == (name in ("step=1", "after_fit")) and "gate" not in sa


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_ddp_rank0_writes_in_the_background_and_errors_reach_every_rank(tmp_path):
    run_ranks("async_save_ddp.py", tmp_path, timeout=280, EMBER_CHECKPOINT_FSYNC="0", PYTHONWARNINGS="ignore")
    r0, r1 = rank_results(tmp_path)
    # seen before the step's own save: from the first save on, rank 0 holds a background write
    first = r0["async"]["pending"].index(True)
    assert first == 3 and all(r0["async"]["pending"][first:])
    assert not any(r1["async"]["pending"]) and not any(r0["sync"]["pending"])
    assert r0["async"]["params"] == r0["sync"]["params"] == r1["async"]["params"]
    a, b = (_ckpts(tmp_path / mode) for mode in ("sync", "async"))
    assert sorted(a) == sorted(b) and len(a) == 6     # 2 ranks: 2 optimizer steps per epoch
    for name in a:
        wa, sa, _ = cio.read_checkpoint(a[name])
        wb, sb, _ = cio.read_checkpoint(b[name])
        assert differences(wa, wb, name) == [] and differences(sa["optimizers"], sb["optimizers"]) == []
    assert r0["fail"].startswith("CheckpointError") and "state['bad']" in r0["fail"]
    assert r1["fail"].startswith("CheckpointError") and "failed on rank 0" in r1["fail"]
    # save_top_k=1 + save_last with rank 0's step-2 write held until step 3: the step-1
    # checkpoint stays, and 'last' names it, until step 2 is committed (at the step-3 save)
    for r in (r0, r1):     # from step 3 on there is always a complete checkpoint, and 'last' names one
        for step, complete, last in r["topk"]["seen"]:
            assert step < 3 or (complete and last in complete), r["topk"]
    assert r0["topk"]["final"] == [4] and r0["topk"]["last"] == 4     # rank 0 deletes, after fit's last commit
    seen = {step: (complete, last) for step, complete, last in r0["topk"]["seen"]}
    assert seen[3] == ([1], 1), r0["topk"]      # rank 0's step-2 write held: step 1 stays, 'last' names it
    assert seen[4][0] in ([2], [2, 3]) and seen[4][1] == 2, r0["topk"]


def test_snapshot_keeps_dict_types_and_shared_tensors():
    """State the synchronous save accepts snapshots too: a defaultdict keeps its factory,
    an OrderedDict its type, and one tensor held twice (tied weights) stays one copy."""
    import collections

    from ember.strategies.async_save import cpu_snapshot
    t = torch.ones(3)
    snap = cpu_snapshot({"s": collections.defaultdict(list, a=t, b=t), "o": collections.OrderedDict(x=1)})
    assert type(snap["s"]) is collections.defaultdict and snap["s"].default_factory is list
    assert snap["s"]["a"] is snap["s"]["b"] and snap["s"]["a"] is not t and torch.equal(snap["s"]["a"], t)
    assert type(snap["o"]) is collections.OrderedDict and snap["o"] == {"x": 1}
