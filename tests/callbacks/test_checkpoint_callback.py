"""ModelCheckpoint (top-k, templates, last, weights only, triggers, state across resume),
ckpt_path resolution for fit/validate/test/predict, load_from_checkpoint, module
checkpoint hooks, and the checkpoint error cases."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.checkpoint import io as cio
from conftest import reseal
from ember.callbacks import Callback, ModelCheckpoint
from ember.errors import CheckpointError, MisconfigurationError

SCORES = (5.0, 3.0, 4.0, 1.0, 2.0, 6.0)   # val/score by epoch
BATCHES = 4                                # per epoch: global step = 4 * (epoch + 1) at epoch end


def data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Scripted(ember.TrainModule):
    """Logs val/score = SCORES[epoch]; remembers what its checkpoint hooks saw."""

    def __init__(self, lr: float = 0.05, hidden: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.loaded_extra = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/score", torch.tensor(SCORES[self.current_epoch]))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["extra"] = {"epoch_seen": self.current_epoch, "t": torch.arange(3)}

    def on_load_checkpoint(self, checkpoint):
        self.loaded_extra = checkpoint["extra"]


class StopAt(Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError(f"stopped at epoch {self.epoch}")


class CountBatches(Callback):
    def __init__(self):
        self.n = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.n += 1


def trainer(root, callbacks=(), **kw):
    args = dict(max_epochs=len(SCORES), default_root_dir=root, logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kw)
    return ember.Trainer(callbacks=list(callbacks), **args)


def fit(root, callbacks=(), ckpt_path=None, module=None, **kw):
    ember.seed_everything(0)
    module = module or Scripted()
    t = trainer(root, callbacks, **kw)
    t.fit(module, DataLoader(data(), batch_size=8, shuffle=True), DataLoader(data(8), batch_size=8),
          ckpt_path=ckpt_path)
    return module, t


def names(d):
    return sorted(os.listdir(d))


def tree(root):
    """{relative path: (size, mtime_ns)} of every file under root."""
    out = {}
    for dp, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dp, f)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


# -- top-k --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,kept,best", [("min", (3, 4), 3), ("max", (0, 5), 5)])
def test_top_k_by_monitor(tmp_path, mode, kept, best):
    cb = ModelCheckpoint(monitor="val/score", mode=mode, save_top_k=2)
    fit(tmp_path, [cb])
    expect = [f"epoch={e}-step={BATCHES * (e + 1)}" for e in sorted(kept)]
    assert names(tmp_path / "checkpoints") == expect
    assert cb.best_model_path == str(tmp_path / "checkpoints" / f"epoch={best}-step={BATCHES * (best + 1)}")
    assert float(cb.best_model_score) == SCORES[best]
    assert sorted(cb.best_k_models.values()) == sorted(SCORES[e] for e in kept)
    worst = max(kept, key=lambda e: SCORES[e]) if mode == "min" else min(kept, key=lambda e: SCORES[e])
    assert cb.kth_best_model_path.endswith(f"epoch={worst}-step={BATCHES * (worst + 1)}")


def test_top_k_bookkeeping_survives_resume(tmp_path):
    ref = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True)
    fit(tmp_path / "ref", [ref])
    first = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True)
    with pytest.raises(RuntimeError, match="stopped at epoch 4"):
        fit(tmp_path / "run", [StopAt(4), first])
    # after epoch 3: top-2 are epochs 3 (1.0) and 1 (3.0)
    assert names(tmp_path / "run" / "checkpoints") == ["epoch=1-step=8", "epoch=3-step=16", "last"]
    second = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True)
    fit(tmp_path / "run", [second], ckpt_path="last")
    assert names(tmp_path / "run" / "checkpoints") == names(tmp_path / "ref" / "checkpoints")
    rel = {os.path.basename(p): s for p, s in second.best_k_models.items()}
    assert rel == {os.path.basename(p): s for p, s in ref.best_k_models.items()} == {
        "epoch=3-step=16": 1.0, "epoch=4-step=20": 2.0}
    assert os.path.basename(second.best_model_path) == "epoch=3-step=16" and float(second.best_model_score) == 1.0
    # epoch 5 (6.0) did not make the top 2: 'last' holds its own copy of the newest state
    last = tmp_path / "run" / "checkpoints" / "last"
    assert not os.path.islink(last) and cio.read_checkpoint(last)[1]["loop"]["global_step"] == 24


def test_without_monitor_keeps_the_k_latest_and_last_links_newest(tmp_path):
    cb = ModelCheckpoint(save_top_k=2, save_last=True)
    fit(tmp_path, [cb], max_epochs=4)
    d = tmp_path / "checkpoints"
    assert names(d) == ["epoch=2-step=12", "epoch=3-step=16", "last"]
    assert os.path.islink(d / "last") and os.readlink(d / "last") == "epoch=3-step=16"
    assert cb.best_model_path == str(d / "epoch=3-step=16") and cb.best_model_score is None
    assert cb.last_model_path == str(d / "last")


def test_save_top_k_zero_with_save_last_writes_only_last(tmp_path):
    fit(tmp_path, [ModelCheckpoint(save_top_k=0, save_last=True)], max_epochs=2)
    d = tmp_path / "checkpoints"
    assert names(d) == ["last"] and os.path.isdir(d / "last") and not os.path.islink(d / "last")
    assert cio.read_checkpoint(d / "last")[1]["loop"]["global_step"] == 8


def test_save_top_k_all_and_every_n_epochs(tmp_path):
    fit(tmp_path, [ModelCheckpoint(save_top_k=-1, every_n_epochs=2)])
    assert names(tmp_path / "checkpoints") == ["epoch=1-step=8", "epoch=3-step=16", "epoch=5-step=24"]


def test_every_n_train_steps_and_train_time_interval(tmp_path):
    fit(tmp_path / "a", [ModelCheckpoint(save_top_k=-1, every_n_train_steps=3)], max_epochs=2)
    assert names(tmp_path / "a" / "checkpoints") == ["epoch=0-step=3", "epoch=1-step=6"]
    # a (tiny) time interval is due after every optimizer step
    fit(tmp_path / "b", [ModelCheckpoint(save_top_k=-1, train_time_interval=1e-9)], max_epochs=1)
    assert names(tmp_path / "b" / "checkpoints") == [f"epoch=0-step={s}" for s in range(1, BATCHES + 1)]


def test_filename_templates(tmp_path):
    cb = ModelCheckpoint(filename="{epoch}-{step}-{val/score:.3f}", monitor="val/score", save_top_k=1)
    fit(tmp_path / "a", [cb], max_epochs=2)
    assert names(tmp_path / "a" / "checkpoints") == ["epoch=1-step=8-val_score=3.000"]
    cb = ModelCheckpoint(filename="run-{epoch:02d}-{val/score:.1f}", auto_insert_metric_name=False,
                         dirpath=tmp_path / "b", save_top_k=-1)
    fit(tmp_path / "a2", [cb], max_epochs=2)
    assert names(tmp_path / "b") == ["run-00-5.0", "run-01-3.0"]
    assert cb.format_checkpoint_name({"val/score": torch.tensor(0.12345)}, 3, 40) == "run-03-0.1"
    with pytest.raises(MisconfigurationError, match="'val/score' is not a logged metric"):
        cb.format_checkpoint_name({}, 0, 1)


def test_name_collisions_get_a_version_suffix(tmp_path):
    cb = ModelCheckpoint(filename="{epoch}", every_n_train_steps=1, save_top_k=-1)
    fit(tmp_path, [cb], max_epochs=1)
    assert names(tmp_path / "checkpoints") == ["epoch=0", "epoch=0-v1", "epoch=0-v2", "epoch=0-v3"]
    steps = [json.loads((tmp_path / "checkpoints" / n / "meta.json").read_text())["global_step"]
             for n in names(tmp_path / "checkpoints")]
    assert steps == [1, 2, 3, 4]


def test_save_weights_only_writes_safetensors(tmp_path):
    cb = ModelCheckpoint(save_weights_only=True, save_last=True, monitor="val/score", save_top_k=1)
    module, _ = fit(tmp_path, [cb], max_epochs=2)
    d = tmp_path / "checkpoints"
    assert names(d) == ["epoch=1-step=8.safetensors", "last.safetensors"]
    assert os.readlink(d / "last.safetensors") == "epoch=1-step=8.safetensors"
    weights = cio.load_safetensors(d / "epoch=1-step=8.safetensors")
    assert set(weights) == set(module.state_dict())
    loaded = Scripted.load_from_checkpoint(d / "last.safetensors")
    for k, v in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    with pytest.raises(CheckpointError, match="weights only"):
        fit(tmp_path / "again", ckpt_path=d / "last.safetensors")
    # but validate/test/predict take it
    t = trainer(tmp_path / "v")
    assert t.validate(Scripted(), DataLoader(data(8), batch_size=8), ckpt_path=d / "last.safetensors")


# -- metric errors ----------------------------------------------------------------------------------
def test_monitor_never_logged_lists_the_logged_names(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"could not find \['val/acc'\]: 'val/acc' was never logged.*available now: \['train/loss', 'val/score'\]"):
        fit(tmp_path, [ModelCheckpoint(monitor="val/acc")], max_epochs=1)


def test_validation_metric_before_first_validation_is_skipped_with_a_warning(tmp_path):
    cb = ModelCheckpoint(monitor="val/score", every_n_train_steps=2, save_top_k=-1)
    with pytest.warns(UserWarning, match="no validation has run yet"):
        fit(tmp_path, [cb], max_epochs=2)
    # steps 2 and 4 come before the first validation (at the end of epoch 0): skipped
    assert names(tmp_path / "checkpoints") == ["epoch=1-step=6", "epoch=1-step=8"]


def test_save_last_is_written_although_the_monitored_metric_is_not_there_yet(tmp_path):
    # max_steps stops mid-epoch before the first validation: no top-k checkpoint can be
    # ranked, but save_last=True still leaves a `last` to resume from (as Lightning does)
    cb = ModelCheckpoint(monitor="val/score", save_last=True)
    with pytest.warns(UserWarning, match=r"no validation has run yet\); 'last' is written"):
        _, t = fit(tmp_path, [cb], max_steps=2)
    assert t.stop_reason == "max_steps"
    assert names(tmp_path / "checkpoints") == ["last"]
    assert cb.best_model_path == "" and cb.last_model_path == str(tmp_path / "checkpoints" / "last")
    resumed, t2 = fit(tmp_path / "resumed", ckpt_path=cb.last_model_path, max_steps=3)
    assert t2.global_step == 3 and t2.current_epoch == 0     # continued in the middle of epoch 0
    ref, _ = fit(tmp_path / "ref", max_steps=3)
    for k, v in ref.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


# -- ckpt_path for every entry point --------------------------------------------------------------------
def test_validate_test_predict_with_best_and_last(tmp_path):
    cb = ModelCheckpoint(monitor="val/score", save_top_k=1, save_last=True)
    module, t = fit(tmp_path, [cb])
    best = cio.load_safetensors(os.path.join(cb.best_model_path, cio.WEIGHTS_NAME))
    t.test(module, DataLoader(data(8), batch_size=8), ckpt_path="best")
    for k, v in module.state_dict().items():
        assert torch.equal(v, best[k])
    # a fresh Trainer finds 'best' through the newest checkpoint's ModelCheckpoint state
    fresh = Scripted()
    t2 = trainer(tmp_path, [ModelCheckpoint(monitor="val/score", save_top_k=1, save_last=True)])
    preds = t2.predict(fresh, DataLoader(data(8), batch_size=8), ckpt_path="best")
    x = data(8).tensors[0]
    ref = Scripted()
    ref.load_state_dict(best)
    assert torch.equal(torch.cat(preds), ref.net(x).detach())
    last = cio.load_safetensors(os.path.join(tmp_path, "checkpoints", "last", cio.WEIGHTS_NAME))
    t3 = trainer(tmp_path)
    out = t3.validate(Scripted(), DataLoader(data(8), batch_size=8), ckpt_path="last")
    assert out and all(torch.equal(v, last[k]) for k, v in t3.module.state_dict().items())


def test_fit_resume_calls_module_hooks_and_restores_datamodule_state(tmp_path):
    class DM(ember.DataModule):
        def __init__(self):
            super().__init__()
            self.counter = 0

        def train_dataloader(self):
            self.counter += 1
            return DataLoader(data(), batch_size=8, shuffle=True)

        def state_dict(self):
            return {"counter": self.counter}

        def load_state_dict(self, state):
            self.counter = state["counter"] + 100

    dm = DM()
    ember.seed_everything(0)
    trainer(tmp_path, [ModelCheckpoint(save_last=True)], max_epochs=2).fit(Scripted(), datamodule=dm)
    state = cio.read_checkpoint(tmp_path / "checkpoints" / "last")[1]
    assert state["extra"]["epoch_seen"] == 1 and torch.equal(state["extra"]["t"], torch.arange(3))
    assert state["datamodule"] == {"counter": 1}
    module, dm2 = Scripted(), DM()
    trainer(tmp_path, [ModelCheckpoint(save_last=True)], max_epochs=3).fit(module, datamodule=dm2, ckpt_path="last")
    assert module.loaded_extra["epoch_seen"] == 1 and dm2.counter == 101


def test_load_from_checkpoint_with_overrides_and_meta(tmp_path):
    module, t = fit(tmp_path, [ModelCheckpoint(save_last=True)], module=Scripted(lr=0.01, hidden=6), max_epochs=1)
    last = tmp_path / "checkpoints" / "last"
    meta = json.loads((last / "meta.json").read_text())
    assert meta["hparams"] == {"lr": 0.01, "hidden": 6}
    assert meta["world_size"] == 1 and meta["precision"] == "32-true" and meta["strategy"] == "single"
    assert meta["ember_version"] == ember.__version__ and meta["torch_version"] == torch.__version__
    loaded = Scripted.load_from_checkpoint(last, lr=0.5)
    assert loaded.hparams.lr == 0.5 and loaded.hparams.hidden == 6
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), module.parameters()))


def test_checkpointing_is_on_by_default_and_last_resumes(tmp_path):
    ember.seed_everything(0)
    t = ember.Trainer(max_epochs=2, default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(t.checkpoint_callback, ModelCheckpoint)
    t.fit(Scripted(), DataLoader(data(), batch_size=8))
    ckdir = os.path.join(t.log_dir, "checkpoints")
    assert names(ckdir) == ["epoch=1-step=8"]
    t2 = ember.Trainer(max_epochs=3, default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    t2.fit(Scripted(), DataLoader(data(), batch_size=8), ckpt_path="last")
    assert t2.global_step == 12 and t2.ckpt_path == os.path.join(ckdir, "epoch=1-step=8")


# -- errors: before any training, nothing deleted ----------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    fit(tmp_path, [ModelCheckpoint(save_last=True, save_top_k=-1)], max_epochs=2)
    return tmp_path


def _fails_cleanly(root, ckpt_path, match, module=None):
    before = tree(root)
    counter = CountBatches()
    with pytest.raises(CheckpointError, match=match):
        fit(root, [counter, ModelCheckpoint(save_last=True, save_top_k=-1)], ckpt_path=ckpt_path,
            module=module, max_epochs=4)
    after = tree(root)
    assert counter.n == 0
    assert {k: v for k, v in after.items() if k in before} == before   # nothing removed or changed


def test_missing_checkpoint(saved):
    _fails_cleanly(saved, saved / "checkpoints" / "epoch=9-step=40", r"not found.*epoch=0-step=4, epoch=1-step=8")
    empty = saved / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint found"):
        fit(empty, ckpt_path="last")


def test_truncated_checkpoint(saved):
    target = saved / "checkpoints" / "epoch=0-step=4" / cio.WEIGHTS_NAME
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) // 2)
    _fails_cleanly(saved, saved / "checkpoints" / "epoch=0-step=4", "truncated")
    state = saved / "checkpoints" / "epoch=1-step=8" / cio.STATE_NAME
    with open(state, "r+b") as f:
        f.truncate(10)
    _fails_cleanly(saved, saved / "checkpoints" / "epoch=1-step=8", "truncated")


def test_incompatible_model_lists_mismatches(saved):
    _fails_cleanly(saved, "last", r"shape mismatches.*net\.0\.weight: checkpoint \(8, 4\) vs model \(5, 4\)",
                   module=Scripted(hidden=5))

    class Bigger(Scripted):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)

    _fails_cleanly(saved, "last", r"missing keys \(2\): extra\.weight, extra\.bias", module=Bigger())


def test_pickled_object_in_trainer_state_is_refused_without_running_it(saved):
    marker = saved / "pwned"
    ckpt = saved / "checkpoints" / "epoch=1-step=8"
    state_file = ckpt / cio.STATE_NAME

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"version": 1, "loop": {"epoch": 1}, "payload": Evil()}, state_file)
    reseal(ckpt)   # a consistent, but malicious, checkpoint
    _fails_cleanly(saved, ckpt, "refusing to load")
    assert not marker.exists()


def test_bad_arguments():
    with pytest.raises(MisconfigurationError, match="mode"):
        ModelCheckpoint(mode="best")
    with pytest.raises(MisconfigurationError, match="save_top_k"):
        ModelCheckpoint(save_top_k=-2)
    with pytest.raises(MisconfigurationError, match="only one of"):
        ModelCheckpoint(every_n_train_steps=2, every_n_epochs=1)
    with pytest.raises(MisconfigurationError, match="train_time_interval"):
        ModelCheckpoint(train_time_interval=-1)
    with pytest.raises(MisconfigurationError, match="ckpt_path"):
        trainer(".").fit(Scripted(), DataLoader(data(), batch_size=8), ckpt_path=3)
