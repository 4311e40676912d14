"""Lightning's Trainer helpers: trainer.state and the stage booleans, the batch counts, the
dataloaders, devices, ckpt_path, early_stopping_callback(s), received_sigterm, print. The
state seen from every hook is compared with Lightning 2.6 running the same module."""
from __future__ import annotations

import io
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback, EarlyStopping, RichProgressBar
from conftest import LinearModule, regression_data

FIELDS = ("fn", "stage", "status", "training", "sanity_checking", "validating", "testing", "predicting",
          "evaluating")
HOOKS = ("on_fit_start", "on_sanity_check_start", "on_train_epoch_start", "on_validation_start",
         "on_validation_epoch_end", "on_train_end", "on_fit_end", "on_test_start", "on_predict_start",
         "teardown")


def _snapshot(t) -> dict:
    s = t.state
    out = {"fn": None if s.fn is None else str(s.fn.value), "stage": None if s.stage is None else str(s.stage.value),
           "status": str(s.status.value)}
    out.update({f: getattr(t, f) for f in FIELDS[3:]})
    out.update(num_val=list(t.num_val_batches), num_sanity=list(t.num_sanity_val_batches),
               num_train=t.num_training_batches, devices=t.num_devices, ids=list(t.device_ids), nodes=t.num_nodes)
    if s.fn is not None and s.fn.value == "test":
        out["num_test"] = list(t.num_test_batches)
    if s.fn is not None and s.fn.value == "predict":
        out["num_predict"] = list(t.num_predict_batches)
    return out


def _recorder(base):
    class Rec(base):
        def __init__(self):
            self.seen = []

    for h in HOOKS:
        def hook(self, trainer, *args, _h=h, **kwargs):
            self.seen.append((_h, _snapshot(trainer)))
        setattr(Rec, h, hook)
    return Rec()


def _loaders():
    val = [DataLoader(regression_data(24), batch_size=8), DataLoader(regression_data(40), batch_size=8)]
    return DataLoader(regression_data(64), batch_size=8), val


def _run(trainer, module):
    train, val = _loaders()
    trainer.fit(module, train, val)
    after_fit = _snapshot(trainer)
    trainer.validate(module, val, verbose=False)
    trainer.test(module, DataLoader(regression_data(24), batch_size=8), verbose=False)
    trainer.predict(module, DataLoader(regression_data(16), batch_size=8))
    return after_fit, _snapshot(trainer)


ARGS = dict(max_epochs=2, limit_val_batches=4, limit_test_batches=2, num_sanity_val_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class _Multi(LinearModule):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val/loss", self.loss(batch))


def test_state_and_counts_from_every_hook(tmp_path):
    rec = _recorder(Callback)
    t = ember.Trainer(**ARGS, callbacks=[rec], default_root_dir=tmp_path, devices="cpu")
    assert (t.state.status, t.state.fn, t.state.stage) == ("initializing", None, None)
    after_fit, after_all = _run(t, _Multi())
    seen = dict(rec.seen)   # last snapshot per hook
    fit = [s for h, s in rec.seen if s["fn"] == "fit"]
    assert [h for h, s in rec.seen if s["stage"] == "sanity_check"] == ["on_sanity_check_start",
                                                                       "on_validation_epoch_end"]
    assert seen["on_sanity_check_start"]["num_sanity"] == [3, 3]   # min(3, limited val batches)
    assert fit[0]["num_val"] == [3, 4]   # 24 / 8 = 3 and limit_val_batches=4 of 5
    assert all(s["status"] == "running" and s["num_train"] == 8 for s in fit)
    assert {h: s["stage"] for h, s in rec.seen if s["fn"] == "fit"} == {
        "on_fit_start": "train", "on_sanity_check_start": "sanity_check", "on_train_epoch_start": "train",
        "on_validation_start": "validate", "on_validation_epoch_end": "validate", "on_train_end": "train",
        "on_fit_end": "train", "teardown": "train"}
    assert seen["on_test_start"]["num_test"] == [2] and seen["on_test_start"]["testing"]
    assert seen["on_predict_start"]["num_predict"] == [2] and seen["on_predict_start"]["predicting"]
    assert (after_fit["fn"], after_fit["stage"], after_fit["status"]) == ("fit", None, "finished")
    assert (after_all["fn"], after_all["stage"], after_all["status"]) == ("predict", None, "finished")
    assert seen["on_fit_start"]["devices"] == 1 and seen["on_fit_start"]["ids"] == [0] and t.num_nodes == 1
    assert t.state.stage is None and t.state.finished and t.state.stopped
    assert [len(dl) for dl in t.test_dataloaders] == [3] and [len(dl) for dl in t.predict_dataloaders] == [2]
    assert len(t.train_dataloader) == 8
    # the state's values are str enums: Lightning code compares them with strings or the enums
    from ember.trainer.state import RunningStage, TrainerFn
    assert t.state.fn == TrainerFn.PREDICTING == "predict" and RunningStage.SANITY_CHECKING.evaluating
    with pytest.raises(AttributeError):
        t.num_val_batches = [1]   # read-only, as Lightning's


def test_state_and_counts_equal_lightning(tmp_path):
    """The same module and data under Lightning 2.6: every hook sees the same state and counts."""
    pl = pytest.importorskip("lightning.pytorch")

    class LitMulti(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val/loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

        def test_step(self, batch, batch_idx):
            self.log("test/loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lrec = _recorder(pl.Callback)
    lt = pl.Trainer(**ARGS, callbacks=[lrec], default_root_dir=tmp_path / "l", accelerator="cpu", devices=1)
    l_fit, l_all = _run(lt, LitMulti())
    erec = _recorder(Callback)
    et = ember.Trainer(**ARGS, callbacks=[erec], default_root_dir=tmp_path / "e", devices="cpu")
    e_fit, e_all = _run(et, _Multi())
    # documented difference (docs/trainer.md): ember's sanity check runs no on_validation_start
    lseen = [(h, s) for h, s in lrec.seen if not (h == "on_validation_start" and s["stage"] == "sanity_check")]
    assert [h for h, _ in erec.seen] == [h for h, _ in lseen]
    state = ("fn", "stage", "status") + FIELDS[3:] + ("devices", "ids", "nodes")
    for (h, e), (_, lit) in zip(erec.seen, lseen):
        assert {k: e[k] for k in state} == {k: lit[k] for k in state}, h
        if lit["num_train"] != float("inf"):   # Lightning loads the data after on_fit_start and the sanity
            assert e == lit, h                   # check; ember before setup ends (the counts are known earlier)
    assert sum(lit["num_train"] != float("inf") for _, lit in lseen) >= 12
    assert (e_fit, e_all) == (l_fit, l_all)


def test_ckpt_path_is_the_restored_checkpoint(tmp_path, data):
    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, devices="cpu")
    assert t.ckpt_path is None
    m = LinearModule()
    t.fit(m, data())
    assert t.ckpt_path is None   # this fit restored nothing
    first = t.checkpoint_callback.best_model_path   # epoch=0-step=8
    t2 = ember.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                       default_root_dir=tmp_path, devices="cpu")
    m2 = LinearModule()
    t2.fit(m2, data(), ckpt_path="last")
    assert t2.ckpt_path == first and t2.current_epoch == 2
    t2.validate(dataloaders=data(), verbose=False)
    assert t2.ckpt_path is None   # the validate run restored nothing
    # Lightning's setter: the next runs restore from it until it is set back to None
    newest = t2.checkpoint_callback.best_model_path
    t3 = ember.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=tmp_path, devices="cpu")
    t3.ckpt_path = newest
    m3 = LinearModule()
    t3.validate(m3, data(), verbose=False)
    assert t3.ckpt_path == newest
    assert all(torch.equal(a, b) for a, b in zip(m3.state_dict().values(), m2.state_dict().values()))
    t3.ckpt_path = None
    m4 = LinearModule()
    before = {k: v.clone() for k, v in m4.state_dict().items()}
    t3.validate(m4, data(), verbose=False)
    assert t3.ckpt_path is None and all(torch.equal(before[k], v) for k, v in m4.state_dict().items())


def test_status_interrupted_after_an_exception(make_trainer, data):
    class Boom(LinearModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    t = make_trainer(max_epochs=1)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(Boom(), data())
    assert (t.state.fn, t.state.stage, t.state.status) == ("fit", None, "interrupted") and t.state.stopped


def test_received_sigterm(make_trainer, data):
    class Term(LinearModule):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(batch, batch_idx)

    t = make_trainer(max_epochs=1)
    assert t.received_sigterm is False
    with pytest.raises(SystemExit) as exc:
        t.fit(Term(), data())
    assert exc.value.code == 0 and t.received_sigterm is True
    assert t.stop_reason == "preempted" and t.state.status == "interrupted"


def test_early_stopping_callbacks(make_trainer):
    es1, es2 = EarlyStopping(monitor="val/loss"), EarlyStopping(monitor="train/loss")
    t = make_trainer(callbacks=[es1, es2])
    assert t.early_stopping_callback is es1 and t.early_stopping_callbacks == [es1, es2]
    assert make_trainer().early_stopping_callback is None


def test_print_rank_zero_through_a_live_bar(tmp_path, data, capsys):
    from rich.console import Console
    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)

    class Printing(LinearModule):
        def on_train_epoch_end(self):
            self.trainer.print("epoch", self.current_epoch, "done", sep="_")
            self.print("module", self.current_epoch)   # LightningModule.print: the same path

    t = ember.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                      callbacks=[RichProgressBar(console=console)], default_root_dir=tmp_path, devices="cpu")
    t.fit(Printing(), data())
    drawn = console.file.getvalue()
    assert "epoch_0_done" in drawn and "epoch_1_done" in drawn   # above the bar, through its console
    assert "module 0" in drawn and "module 1" in drawn
    out = capsys.readouterr().out
    assert "epoch_" not in out and "module" not in out
    t.print("after", "fit")   # no live bar now: the built-in print
    assert capsys.readouterr().out == "after fit\n"


def test_sanity_check_runs_num_sanity_val_batches(make_trainer, data):
    """As Lightning: min(num_sanity_val_steps, limit_val_batches) batches per val loader."""
    seen = []

    class Count(LinearModule):
        def validation_step(self, batch, batch_idx):
            if self.trainer.sanity_checking:
                seen.append(batch_idx)

    t = make_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=2, num_sanity_val_steps=3)
    t.fit(Count(), data(), data())
    assert seen == [0, 1] and t.num_sanity_val_batches == [2]
    seen.clear()
    t = make_trainer(max_epochs=1, limit_train_batches=1, num_sanity_val_steps=-1)
    t.fit(Count(), data(), data(n=24))
    assert seen == [0, 1, 2] and t.num_sanity_val_batches == [3]


# ----------------------------------------------------------------------------- datamodule hparams
class _HDM(ember.DataModule):
    def __init__(self, batch_size: int = 8, name: str = "reg", transform=None):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return DataLoader(regression_data(32), batch_size=self.hparams.batch_size)


class _HModule(LinearModule):
    def __init__(self, lr: float = 0.1, dim: int = 4):
        super().__init__(dim=dim, lr=lr)
        self.save_hyperparameters()


def test_datamodule_hparams_in_meta_json_and_logger(tmp_path):
    import json

    import yaml
    from ember.loggers import CSVLogger
    t = ember.Trainer(max_epochs=1, logger=CSVLogger(tmp_path, name="run"), enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, devices="cpu")
    t.fit(_HModule(lr=0.05), datamodule=_HDM(batch_size=4, transform=object()))
    with open(os.path.join(t.checkpoint_callback.best_model_path, "meta.json")) as f:
        meta = json.load(f)
    # JSON-safe values only: the transform object is left out (no str() of it)
    assert meta["datamodule_hparams"] == {"batch_size": 4, "name": "reg"}
    assert meta["datamodule_class"].endswith("_HDM") and meta["hparams"] == {"lr": 0.05, "dim": 4}
    with open(os.path.join(t.logger.log_dir, "hparams.yaml")) as f:
        logged = yaml.safe_load(f)
    assert {k: logged[k] for k in ("lr", "dim", "batch_size", "name")} == {"lr": 0.05, "dim": 4, "batch_size": 4,
                                                                          "name": "reg"}
    # no datamodule hparams: no key
    t2 = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                       default_root_dir=tmp_path / "b", devices="cpu")
    t2.fit(_HModule(), DataLoader(regression_data(16), batch_size=8))
    with open(os.path.join(t2.checkpoint_callback.best_model_path, "meta.json")) as f:
        assert "datamodule_hparams" not in json.load(f)


def test_datamodule_hparams_logged_as_lightning(tmp_path):
    """Lightning's CSVLogger gets the same merged hparams from the same module and datamodule."""
    import yaml
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger as LitCSV
    from ember.loggers import CSVLogger

    class LitDM(pl.LightningDataModule):
        def __init__(self, batch_size: int = 8, name: str = "reg"):
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self):
            return DataLoader(regression_data(32), batch_size=self.hparams.batch_size)

    class LitM(pl.LightningModule):
        def __init__(self, lr: float = 0.1, dim: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(dim, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    quiet = dict(max_epochs=1, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    lt = pl.Trainer(logger=LitCSV(tmp_path / "l"), accelerator="cpu", devices=1, **quiet)
    lt.fit(LitM(lr=0.05), datamodule=LitDM(batch_size=4))
    et = ember.Trainer(logger=CSVLogger(tmp_path / "e"), devices="cpu", **quiet)
    et.fit(_HModule(lr=0.05), datamodule=_HDM(batch_size=4))
    read = [yaml.safe_load(open(os.path.join(t.logger.log_dir, "hparams.yaml"))) for t in (lt, et)]
    assert read[1] == {**read[0], "transform": None}   # ember's _HDM also has transform=None


def test_datamodule_and_module_hparams_that_clash(make_trainer, tmp_path):
    from ember.errors import MisconfigurationError
    from ember.loggers import CSVLogger

    class Clash(_HModule):
        def __init__(self, batch_size: int = 16):
            super().__init__()
            self.save_hyperparameters()

    t = make_trainer(max_epochs=1, logger=CSVLogger(tmp_path))
    with pytest.raises(MisconfigurationError, match=r"\['batch_size'\].*Clash and _HDM"):
        t.fit(Clash(), datamodule=_HDM(batch_size=4))
    make_trainer(max_epochs=1, logger=CSVLogger(tmp_path)).fit(Clash(batch_size=4), datamodule=_HDM(batch_size=4))
