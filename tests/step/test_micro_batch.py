"""The micro-batch rules of ``ember.step`` where they reach beyond the loop: one
``StepRules.micro_batch`` context (window, divisor, no_sync), the exception path's
zeroing through the rules, and the OneCycleLR end-of-schedule rule for the Trainer's
schedulers as for prepared ones."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from ember.precision import NULL_CONTEXT
from ember.step import StepRules
from ember.strategies.base import SingleDeviceStrategy
from tests.helpers import LinearModule, regression_data


def _trainer(tmp_path, **kw):
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tmp_path, num_sanity_val_steps=0, accelerator="cpu")
    args.update(kw)
    return ember.Trainer(**args)


class _TwoProcesses(SingleDeviceStrategy):
    """A strategy that reports two processes and records the no_sync contexts it hands out."""
    world_size = 2

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.log = []

    def no_backward_sync(self, module, enabled=True):
        @contextlib.contextmanager
        def ctx():
            self.log.append(("enter", module))
            try:
                yield
            finally:
                self.log.append(("exit", module))
        return ctx()


def test_micro_batch_sets_window_divisor_and_no_sync_of_every_model():
    strategy = _TwoProcesses()
    rules = StepRules(strategy, accumulation_steps=3)
    # micro-batch 0 of 5: no step, the window's size divides, both models skip the all-reduce
    with rules.micro_batch(0, 5, ("a", "b")):
        assert (rules.sync_gradients, rules.loss_divisor) == (False, 3)
        assert strategy.log == [("enter", "a"), ("enter", "b")]
    assert strategy.log[2:] == [("exit", "b"), ("exit", "a")]
    # the short last window (micro-batches 3, 4) divides by 2 and steps on its end: no no_sync
    strategy.log.clear()
    assert rules.micro_batch(3, 5, ("a", "b")) is not NULL_CONTEXT
    assert rules.micro_batch(4, 5, ("a", "b")) is NULL_CONTEXT
    assert (rules.sync_gradients, rules.loss_divisor) == (True, 2)
    # a divisor given (a window's item count) replaces the window's size
    n = torch.tensor(7.0)
    rules.micro_batch(1, 5, (), divisor=n)
    assert rules.loss_divisor is n
    # contexts are left on an exception too
    strategy.log.clear()
    with pytest.raises(RuntimeError):
        with rules.micro_batch(0, None, ("a", "b")):
            raise RuntimeError("boom")
    assert [e for e, _ in strategy.log] == ["enter", "enter", "exit", "exit"]


class _RaisesAtBatch(LinearModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("broken batch")
        return super().training_step(batch, batch_idx)


class _EngineOwnsStep(SingleDeviceStrategy):
    """As DeepSpeed: the engine steps and zeroes its own gradients."""
    owns_optimizer_step = True


@pytest.mark.parametrize("owns", [False, True], ids=["plain", "engine-owns-zeroing"])
def test_exception_path_zeroes_gradients_through_the_rules(tmp_path, owns):
    module = _RaisesAtBatch()
    strategy = _EngineOwnsStep(torch.device("cpu")) if owns else SingleDeviceStrategy(torch.device("cpu"))
    trainer = _trainer(tmp_path, strategy=strategy, max_epochs=1, accumulate_grad_batches=4)
    with pytest.raises(RuntimeError, match="broken batch"):
        trainer.fit(module, DataLoader(regression_data(32), batch_size=8))
    grads = [p.grad for p in module.parameters()]
    if owns:   # batch 0's gradients are the engine's to clear: ember leaves them
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
    else:      # the broken window's gradients are dropped: a later fit starts clean
        assert all(g is None for g in grads)
    assert (trainer.step_rules.sync_gradients, trainer.step_rules.loss_divisor) == (True, 1)


class _OneCycle(LinearModule):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_trainer_onecycle_past_its_end_is_held_with_one_warning(tmp_path):
    module = _OneCycle()
    trainer = _trainer(tmp_path, max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(regression_data(64), batch_size=8))   # OneCycleLR raises at step 4
    assert trainer.global_step == 6
    held = [w for w in caught if "total_steps=3" in str(w.message)]
    assert len(held) == 1
    sched = trainer.lr_scheduler_configs[0]["scheduler"]
    assert sched.last_epoch == 3
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.5, total_steps=3)
    for _ in range(3):
        ref_opt.step()
        ref.step()
    assert sched.get_last_lr() == ref.get_last_lr()


class _SumLoss(LinearModule):
    """A loss summed over samples; ``loss_count`` says how many: each step is the mean
    over every sample of its window, whatever the micro-batch sizes."""

    def __init__(self, count: bool):
        super().__init__()
        self.count, self.seen = count, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x) - y).pow(2).sum()

    def loss_count(self, batch):
        return batch[0].shape[0] if self.count else None

    def on_before_optimizer_step(self, optimizer):
        self.seen.append([p.grad.clone() for p in self.parameters()])


@pytest.mark.parametrize("sampler", [[[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]], [[0, 1, 2, 3, 4, 5, 6, 7], [8]]],
                         ids=["uneven", "short-last-window"])
def test_loss_count_divides_each_window_by_its_items(tmp_path, sampler):
    data = regression_data(10)
    torch.manual_seed(0)
    module = _SumLoss(count=True)
    init = [p.detach().clone() for p in module.parameters()]
    trainer = _trainer(tmp_path, max_steps=1, accumulate_grad_batches=3)
    trainer.fit(module, DataLoader(data, batch_sampler=sampler))
    # the big batch: the window's samples at once, mean loss
    window = [i for b in sampler[:3] for i in b]
    ref = LinearModule()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), init):
            p.copy_(q)
    x, y = data[window]
    (ref(x) - y).pow(2).mean().backward()
    for g, r in zip(module.seen[0], ref.parameters()):
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-7)
    # without a count, the sums are divided by the number of micro-batches only
    torch.manual_seed(0)
    plain = _SumLoss(count=False)
    _trainer(tmp_path, max_steps=1, accumulate_grad_batches=3).fit(plain, DataLoader(data, batch_sampler=sampler))
    assert not torch.allclose(plain.seen[0][0], module.seen[0][0])
