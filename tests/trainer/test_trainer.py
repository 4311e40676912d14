"""The fit loop of the single-device Trainer: accumulation, stopping conditions,
batch limits, validation scheduling, sanity check, fast_dev_run, evaluation
entry points, DataModule hooks, reproducibility, compile, default outputs."""
from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import ember
import ember.errors
from ember.callbacks import Callback
from conftest import LinearModule, regression_data


def flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def torch_loop(module, dataset, batch_size, epochs, lr):
    """Reference: plain PyTorch SGD on mean-squared error."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in DataLoader(dataset, batch_size=batch_size, shuffle=False):
            F.mse_loss(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    return module


class Counter(Callback):
    """Counts batches and remembers when validation ran (epoch, global_step)."""

    def __init__(self):
        self.train_batches = 0
        self.val_batches = 0
        self.val_points = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train_batches += 1

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.val_batches += 1

    def on_validation_start(self, trainer, module):
        self.val_points.append((trainer.current_epoch, trainer.global_step))


# ----------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("n", [64, 72], ids=["even", "uneven-last-window"])
def test_accumulation_equals_one_big_batch(make_trainer, n):
    torch.manual_seed(0)
    ds = regression_data(n)
    module = LinearModule(lr=0.1)
    reference = torch_loop(copy.deepcopy(module.net), ds, batch_size=32, epochs=2, lr=0.1)
    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=4)
    trainer.fit(module, DataLoader(ds, batch_size=8, shuffle=False))
    # 64 samples: 2 windows of 4 per epoch; 72: 4 + 4 + a last window of 1 micro-batch
    assert trainer.global_step == 2 * (-(-n // 32))
    torch.testing.assert_close(flat_params(module.net), flat_params(reference), atol=1e-5, rtol=0)


def test_no_accumulation_matches_torch_loop(make_trainer):
    torch.manual_seed(1)
    ds = regression_data(40)
    module = LinearModule(lr=0.05)
    reference = torch_loop(copy.deepcopy(module.net), ds, batch_size=8, epochs=3, lr=0.05)
    trainer = make_trainer(max_epochs=3)
    trainer.fit(module, DataLoader(ds, batch_size=8))
    assert trainer.global_step == 15 and trainer.current_epoch == 3
    torch.testing.assert_close(flat_params(module.net), flat_params(reference), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("max_steps,acc,batches_seen", [(5, 1, 5), (3, 1, 3), (3, 2, 6), (11, 1, 11)])
def test_max_steps_stops_exactly(make_trainer, data, max_steps, acc, batches_seen):
    counter = Counter()
    trainer = make_trainer(max_steps=max_steps, accumulate_grad_batches=acc, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=64, batch_size=8))   # 8 batches per epoch
    assert trainer.global_step == max_steps
    assert counter.train_batches == batches_seen


def test_max_epochs(make_trainer, data):
    counter = Counter()
    trainer = make_trainer(max_epochs=3, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=40, batch_size=8))
    assert trainer.current_epoch == 3
    assert trainer.global_step == 15 and counter.train_batches == 15


def test_max_time_stops_and_sets_should_stop(make_trainer, data):
    trainer = make_trainer(max_time=1)     # no max_epochs / max_steps: only the clock stops it
    assert trainer.max_epochs is None and trainer.max_steps == -1
    trainer.fit(LinearModule(), data(n=32, batch_size=8))
    assert trainer.should_stop
    assert trainer.global_step > 0


@pytest.mark.parametrize("limit,expected", [(3, 3), (0.5, 4), (0.25, 2), (1.0, 8), (100, 8)])
def test_limit_train_batches(make_trainer, data, limit, expected):
    counter = Counter()
    trainer = make_trainer(max_epochs=2, limit_train_batches=limit, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=64, batch_size=8))
    assert trainer.num_training_batches == expected
    assert counter.train_batches == 2 * expected and trainer.global_step == 2 * expected


@pytest.mark.parametrize("limit,expected", [(2, 2), (0.5, 2), (None, 4), (0, 0)])
def test_limit_val_batches(make_trainer, data, limit, expected):
    counter = Counter()
    trainer = make_trainer(max_epochs=1, limit_val_batches=limit, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=16, batch_size=8), data(n=32, batch_size=8))
    assert counter.val_batches == expected
    assert ("val/loss" in trainer.callback_metrics) == (expected > 0)


def test_val_check_interval_fraction(make_trainer, data):
    counter = Counter()
    trainer = make_trainer(max_epochs=2, val_check_interval=0.5, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=64, batch_size=8), data(n=16, batch_size=8))
    # twice per epoch, the second time at the epoch's last batch (no extra epoch-end run)
    assert counter.val_points == [(0, 4), (0, 8), (1, 12), (1, 16)]
    assert counter.val_batches == 4 * 2


def test_val_check_interval_int(make_trainer, data):
    counter = Counter()
    trainer = make_trainer(max_epochs=1, val_check_interval=3, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=64, batch_size=8), data(n=16, batch_size=8))
    # every 3 training batches, and once more at the end of the epoch (8 is not a multiple of 3)
    assert counter.val_points == [(0, 3), (0, 6), (0, 8)]


def test_check_val_every_n_epoch(make_trainer, data):
    counter = Counter()
    trainer = make_trainer(max_epochs=5, check_val_every_n_epoch=2, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(LinearModule(), data(n=16, batch_size=8), data(n=16, batch_size=8))
    assert counter.val_points == [(1, 4), (3, 8)]


class SanityModule(LinearModule):
    def __init__(self):
        super().__init__()
        self.calls = []

    def validation_step(self, batch, batch_idx):
        self.calls.append((self.trainer.sanity_checking, batch_idx))
        self.log("val/loss", self.loss(batch))


class AfterSanity(Callback):
    def on_sanity_check_end(self, trainer, module):
        self.metrics_after_sanity = dict(trainer.callback_metrics)
        self.logged_after_sanity = dict(trainer.logged_metrics)


@pytest.mark.parametrize("n,expected", [(2, 2), (0, 0), (-1, 4)])
def test_num_sanity_val_steps(make_trainer, data, n, expected):
    module, cb = SanityModule(), AfterSanity()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=n, callbacks=[cb])
    trainer.fit(module, data(n=16, batch_size=8), data(n=32, batch_size=8))
    sanity = [c for c in module.calls if c[0]]
    assert sanity == [(True, i) for i in range(expected)]
    assert [c for c in module.calls if not c[0]] == [(False, i) for i in range(4)]
    if expected:
        assert cb.metrics_after_sanity == {} and cb.logged_after_sanity == {}
    assert not trainer.sanity_checking
    assert "val/loss" in trainer.callback_metrics      # the real validation did publish


@pytest.mark.parametrize("n", [True, 3])
def test_fast_dev_run(make_trainer, data, n):
    module, counter = SanityModule(), Counter()
    trainer = make_trainer(fast_dev_run=n, max_epochs=10, callbacks=[counter])
    trainer.fit(module, data(n=64, batch_size=8), data(n=64, batch_size=8))
    k = int(n)
    assert counter.train_batches == k and trainer.global_step == k
    assert module.calls == [(False, i) for i in range(k)]     # no sanity check, k validation batches
    assert trainer.current_epoch == 1


def test_fast_dev_run_keeps_checkpoint_and_early_stopping_callbacks_but_they_do_nothing(make_trainer, data, tmp_path):
    """As in Lightning: a smoke test with the production callbacks writes no checkpoint and
    never stops early (EarlyStopping would not even find its metric here)."""
    from ember.callbacks import EarlyStopping, ModelCheckpoint
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), monitor="val/loss")
    stop = EarlyStopping(monitor="never_logged", patience=0)
    trainer = make_trainer(fast_dev_run=2, enable_checkpointing=True, callbacks=[ckpt, stop])
    trainer.fit(SanityModule(), data(n=64, batch_size=8), data(n=64, batch_size=8))
    assert trainer.global_step == 2 and not trainer.should_stop
    assert trainer.checkpoint_callback is ckpt and not (tmp_path / "ckpts").exists()
    assert ckpt.best_model_path == ""


def test_fit_after_a_failed_fit_restarts_the_broken_epoch(make_trainer, data):
    class FailOnce(LinearModule):
        fail_at, seen = 3, []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.trainer.current_epoch, batch_idx))
            if batch_idx == self.fail_at:
                self.fail_at = None
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    module = FailOnce()
    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, data(n=64, batch_size=8))
    assert trainer.global_step == 1 and all(p.grad is None for p in module.parameters())
    module.seen.clear()
    trainer.fit(module, data(n=64, batch_size=8))
    assert module.seen == [(0, i) for i in range(8)] and trainer.global_step == 1 + 4


def test_training_step_none_skips_the_batch(make_trainer, data):
    class Skip(LinearModule):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    module = Skip()
    before = flat_params(module)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, data(n=32, batch_size=8))
    assert trainer.global_step == 2          # batches 0 and 2 stepped, 1 and 3 skipped
    assert not torch.equal(before, flat_params(module))


def test_skipped_micro_batch_still_steps_on_window_end(make_trainer, data):
    class SkipLast(LinearModule):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    trainer = make_trainer(max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(SkipLast(), data(n=64, batch_size=8))
    assert trainer.global_step == 4          # each window has one real micro-batch


# ----------------------------------------------------------------------------- evaluation
def test_validate_test_predict_return_values(make_trainer, data):
    module = LinearModule()
    trainer = make_trainer(max_epochs=1)
    loader = data(n=20, batch_size=8)
    x, y = loader.dataset.tensors
    with torch.no_grad():
        exact = F.mse_loss(module(x), y).item()
    val = trainer.validate(module, loader)
    assert isinstance(val, list) and len(val) == 1 and set(val[0]) == {"val/loss"}
    assert val[0]["val/loss"] == pytest.approx(exact, rel=1e-5)
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(exact, rel=1e-5)
    test = trainer.test(module, loader)
    assert test == [{"test/loss": pytest.approx(exact, rel=1e-5)}]
    preds = trainer.predict(module, loader)
    assert [p.shape for p in preds] == [(8, 1), (8, 1), (4, 1)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(preds), module(x))
    assert module.training        # evaluation puts the module back into train mode


def test_predict_with_several_dataloaders(make_trainer, data):
    class Tagged(LinearModule):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return (dataloader_idx, batch_idx, batch[0].shape[0])

    out = make_trainer().predict(Tagged(), [data(n=10, batch_size=8), data(n=8, batch_size=8)])
    assert out == [[(0, 0, 8), (0, 1, 2)], [(1, 0, 8)]]


def test_validate_after_fit_uses_fitted_module(make_trainer, data):
    trainer = make_trainer(max_epochs=1)
    module = LinearModule()
    trainer.fit(module, data())
    out = trainer.validate(dataloaders=data(n=16))
    assert out[0]["val/loss"] == pytest.approx(trainer.callback_metrics["val/loss"].item())


def test_multiple_val_dataloaders(make_trainer, data):
    class Multi(LinearModule):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val/loss", self.loss(batch))
            self.log("val/idx", float(dataloader_idx))

    module = Multi()
    loaders = [data(n=16, seed=1), data(n=24, seed=2)]
    trainer = make_trainer(max_epochs=1)
    out = trainer.validate(module, loaders)
    assert len(out) == 2
    with torch.no_grad():
        exact = [F.mse_loss(module(dl.dataset.tensors[0]), dl.dataset.tensors[1]).item() for dl in loaders]
    for i in range(2):
        assert set(out[i]) == {f"val/loss/dataloader_idx_{i}", f"val/idx/dataloader_idx_{i}"}
        assert out[i][f"val/loss/dataloader_idx_{i}"] == pytest.approx(exact[i], rel=1e-5)
        assert out[i][f"val/idx/dataloader_idx_{i}"] == float(i)
    # inside fit too: both loaders run every validation
    counter = Counter()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(module, data(n=16), val_dataloaders=loaders)
    assert counter.val_batches == 2 + 3
    assert {"val/loss/dataloader_idx_0", "val/loss/dataloader_idx_1"} <= set(trainer.callback_metrics)


def test_datamodule_hook_order(make_trainer):
    calls = []

    class DM(ember.DataModule):
        def prepare_data(self):
            calls.append("prepare_data")

        def setup(self, stage):
            calls.append(f"setup:{stage}")

        def train_dataloader(self):
            calls.append("train_dataloader")
            return DataLoader(regression_data(16), batch_size=8)

        def val_dataloader(self):
            calls.append("val_dataloader")
            return DataLoader(regression_data(16), batch_size=8)

        def test_dataloader(self):
            calls.append("test_dataloader")
            return DataLoader(regression_data(16), batch_size=8)

        def teardown(self, stage):
            calls.append(f"teardown:{stage}")

    dm = DM()
    trainer = make_trainer(max_epochs=2)
    trainer.fit(LinearModule(), datamodule=dm)
    assert calls == ["prepare_data", "setup:fit", "train_dataloader", "val_dataloader", "teardown:fit"]
    assert dm.trainer is trainer and trainer.global_step == 4
    calls.clear()
    out = trainer.test(datamodule=dm)
    assert calls == ["prepare_data", "setup:test", "test_dataloader", "teardown:test"]
    assert set(out[0]) == {"test/loss"}


def test_datamodule_in_place_of_the_dataloaders(make_trainer):
    class DM(ember.DataModule):
        def train_dataloader(self):
            return DataLoader(regression_data(24), batch_size=8)

        def test_dataloader(self):
            return DataLoader(regression_data(16), batch_size=8)

    trainer = make_trainer(max_epochs=1)
    module = LinearModule()
    trainer.fit(module, DM())                       # positional, as in Lightning
    assert trainer.global_step == 3 and isinstance(trainer.datamodule, DM)
    assert set(trainer.test(module, DM())[0]) == {"test/loss"}
    with pytest.raises(ember.errors.MisconfigurationError, match="pass it once"):
        trainer.fit(module, DM(), datamodule=DM())


def test_dataloaders_defined_on_the_module(make_trainer):
    class WithData(LinearModule):
        def train_dataloader(self):
            return DataLoader(regression_data(24), batch_size=8)

    trainer = make_trainer(max_epochs=1)
    trainer.fit(WithData())
    assert trainer.global_step == 3


# ----------------------------------------------------------------------------- reproducibility
class DropoutModule(LinearModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))


def _seeded_fit(make_trainer, seed):
    trainer = make_trainer(max_epochs=2, seed=seed, deterministic=True)
    module = DropoutModule()      # built after the Trainer seeded everything
    trainer.fit(module, DataLoader(regression_data(48), batch_size=8, shuffle=True))
    return flat_params(module)


def test_seed_and_deterministic_reproduce(make_trainer):
    a = _seeded_fit(make_trainer, 7)
    b = _seeded_fit(make_trainer, 7)
    c = _seeded_fit(make_trainer, 8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_shuffle_order_depends_on_seed_and_epoch(make_trainer):
    seen = []

    class Record(LinearModule):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0][:, 0].clone())
            return super().training_step(batch, batch_idx)

    ds = regression_data(32)
    for _ in range(2):
        make_trainer(max_epochs=2, seed=3).fit(Record(), DataLoader(ds, batch_size=32, shuffle=True))
    first_run, second_run = seen[:2], seen[2:]
    assert all(torch.equal(a, b) for a, b in zip(first_run, second_run))      # same seed: same order
    assert not torch.equal(first_run[0], first_run[1])                        # epochs differ
    assert torch.equal(first_run[0].sort().values, ds.tensors[0][:, 0].sort().values)


def _compile_usable() -> bool:
    try:
        f = torch.compile(lambda t: t * 2 + 1)
        return bool(torch.equal(f(torch.ones(2)), torch.full((2,), 3.0)))
    except Exception:
        return False


@pytest.mark.slow
def test_compile_trains(make_trainer, data):
    if not _compile_usable():
        pytest.skip("torch.compile is not usable on this machine")
    module = LinearModule()
    trainer = make_trainer(max_epochs=1, compile=True)
    before = module.loss(data(n=32, batch_size=32).dataset.tensors).item()
    trainer.fit(module, data(n=32, batch_size=8))
    assert module.net._compiled_call_impl is not None
    assert trainer.global_step == 4
    with torch.no_grad():
        assert module.loss(data(n=32).dataset.tensors).item() < before


# ----------------------------------------------------------------------------- default outputs
def test_default_logger_and_checkpoint_are_written(tmp_path, data):
    pytest.importorskip("ember.loggers")
    trainer = ember.Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False,
                            enable_model_summary=False)
    trainer.fit(LinearModule(), data(n=16), data(n=16))
    assert trainer.log_dir.startswith(str(tmp_path))
    assert glob.glob(os.path.join(trainer.log_dir, "events.out.tfevents.*"))
    ckpts = glob.glob(os.path.join(str(tmp_path), "**", "checkpoints", "*"), recursive=True)
    assert ckpts, "the default ModelCheckpoint saved nothing"
    assert trainer.checkpoint_callback is not None
