"""Lightning's Trainer arguments (issue 15): min_epochs, min_steps, overfit_batches,
limit_test/predict_batches, reload_dataloaders_every_n_epochs, use_distributed_sampler,
benchmark, barebones, enable_autolog_hparams, sync_batchnorm; each checked for what it
does and for its error message."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.errors import MisconfigurationError
from conftest import LinearModule


class StopAtOnce(Callback):
    """Asks to stop at the first optimizer step and at every epoch end."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.should_stop = True


def test_min_epochs_and_min_steps_hold_a_stop_request(make_trainer, data):
    t = make_trainer(max_epochs=10, num_sanity_val_steps=0, callbacks=[StopAtOnce()])
    t.fit(LinearModule(), data(n=32))
    assert (t.global_step, t.current_epoch) == (1, 0)   # without a minimum: stops at once
    t = make_trainer(max_epochs=10, min_epochs=3, num_sanity_val_steps=0, callbacks=[StopAtOnce()])
    t.fit(LinearModule(), data(n=32))
    assert (t.global_step, t.current_epoch, t.stop_reason) == (12, 3, "should_stop")
    t = make_trainer(max_epochs=10, min_steps=6, num_sanity_val_steps=0, callbacks=[StopAtOnce()])
    t.fit(LinearModule(), data(n=32))
    assert t.global_step == 6 and t.stop_reason == "should_stop"
    with pytest.raises(MisconfigurationError, match="min_epochs"):
        make_trainer(min_epochs=-1)


def test_overfit_batches_trains_and_validates_on_the_same_first_batches(make_trainer, data):
    seen = {"train": [], "val": []}

    class Record(LinearModule):
        def training_step(self, batch, batch_idx):
            seen["train"].append(batch[0][0, 0].item())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            seen["val"].append(batch[0][0, 0].item())

    loader = data(n=64, batch_size=8, shuffle=True)
    first = [b[0][0, 0].item() for b in DataLoader(loader.dataset, batch_size=8)][:2]
    make_trainer(max_epochs=2, overfit_batches=2, num_sanity_val_steps=0).fit(Record(), loader, data(n=64, seed=9))
    assert seen["train"] == first * 2 and seen["val"] == first * 2
    t = make_trainer(max_epochs=1, overfit_batches=0.25, num_sanity_val_steps=0)
    t.fit(LinearModule(), loader, data(n=64, seed=9))
    assert t.num_training_batches == 2 and t.global_step == 2

    class NoVal(LinearModule):
        validation_step = None   # a module without validation: overfitting trains only

    t = make_trainer(max_epochs=1, overfit_batches=2, num_sanity_val_steps=0)
    t.fit(NoVal(), loader)
    assert t.global_step == 2 and t.val_dataloaders == []
    with pytest.raises(MisconfigurationError, match="overfit_batches"):
        make_trainer(overfit_batches=1.5)


def test_limit_test_and_predict_batches(make_trainer, data):
    steps = []

    class Count(LinearModule):
        def test_step(self, batch, batch_idx):
            steps.append(batch_idx)

    t = make_trainer(limit_test_batches=3, limit_predict_batches=0.5)
    t.test(Count(), data(n=64), verbose=False)
    assert steps == [0, 1, 2]
    assert len(t.predict(Count(), data(n=64))) == 4
    with pytest.raises(MisconfigurationError, match="limit_predict_batches"):
        make_trainer(limit_predict_batches=-2)


def test_reload_dataloaders_every_n_epochs(make_trainer):
    class Reload(LinearModule):
        calls = 0

        def train_dataloader(self):
            Reload.calls += 1   # each epoch's data differs: 8 more samples
            return DataLoader(TensorDataset(torch.randn(8 * Reload.calls, 4), torch.randn(8 * Reload.calls, 1)),
                              batch_size=8)

    t = make_trainer(max_epochs=4, reload_dataloaders_every_n_epochs=2, num_sanity_val_steps=0)
    t.fit(Reload())
    assert Reload.calls == 2 and t.global_step == 1 + 1 + 2 + 2
    with pytest.raises(MisconfigurationError, match="reload_dataloaders_every_n_epochs"):
        make_trainer(reload_dataloaders_every_n_epochs=None)


def test_use_distributed_sampler_false_keeps_the_users_loader(make_trainer, data):
    loader = data(n=16)
    t = make_trainer(max_epochs=1, use_distributed_sampler=False, num_sanity_val_steps=0)
    t.fit(LinearModule(), loader)
    assert t.train_dataloader is loader
    t = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    t.fit(LinearModule(), loader)
    assert t.train_dataloader is not loader   # rebuilt around ember's resumable sampler


def test_benchmark_sets_cudnn_and_warns_with_deterministic(make_trainer):
    before = torch.backends.cudnn.benchmark
    try:
        make_trainer(benchmark=True)
        assert torch.backends.cudnn.benchmark is True
        make_trainer(benchmark=False)
        assert torch.backends.cudnn.benchmark is False
        with pytest.warns(UserWarning, match="benchmark=True with deterministic=True"):   # as Lightning
            make_trainer(benchmark=True, deterministic=True)
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before
    with pytest.raises(MisconfigurationError, match="benchmark"):
        make_trainer(benchmark="yes")


def test_barebones_turns_everything_off_and_refuses_logging(tmp_path, data):
    t = ember.Trainer(barebones=True, max_epochs=1, default_root_dir=tmp_path, devices="cpu", num_sanity_val_steps=0)
    assert t.loggers == [] and [type(c).__name__ for c in t.callbacks] == []

    class Quiet(LinearModule):
        def training_step(self, batch, batch_idx):
            return self.loss(batch)

    t.fit(Quiet(), data(n=16))
    assert t.global_step == 2 and not list(tmp_path.iterdir())   # nothing written
    t = ember.Trainer(barebones=True, max_epochs=1, default_root_dir=tmp_path, devices="cpu")
    with pytest.raises(MisconfigurationError, match=r"self.log\('train/loss', ...\) under Trainer\(barebones=True\)"):
        t.fit(LinearModule(), data(n=16))
    for kw in ({"logger": "csv"}, {"enable_checkpointing": True}, {"callbacks": [ModelCheckpoint()]}):
        with pytest.raises(MisconfigurationError, match="barebones=True turns off"):
            ember.Trainer(barebones=True, **kw)


def test_enable_autolog_hparams(tmp_path, data):
    from ember.loggers import CSVLogger

    class H(LinearModule):
        def __init__(self, lr=0.1):
            super().__init__(lr=lr)
            self.save_hyperparameters()

    for flag in (True, False):
        lg = CSVLogger(save_dir=tmp_path / str(flag))
        ember.Trainer(max_epochs=1, logger=lg, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, devices="cpu", enable_autolog_hparams=flag).fit(H(), data(n=8))
        files = {p.name for p in (tmp_path / str(flag)).rglob("*")}
        assert ("hparams.yaml" in files) is flag


def test_sync_batchnorm_single_process_is_a_no_op_and_validated(make_trainer, data):
    class BN(LinearModule):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.net(self.bn(x))

    m = BN()
    make_trainer(max_epochs=1, sync_batchnorm=True, num_sanity_val_steps=0).fit(m, data(n=16))
    assert type(m.bn) is torch.nn.BatchNorm1d   # one process: nothing to synchronise
    with pytest.raises(MisconfigurationError, match="sync_batchnorm"):
        make_trainer(sync_batchnorm=1)
