"""Silent traps turned into clear errors or one-time warnings, each naming the
argument or hook and the fix; the graceful Ctrl-C stop (a real SIGINT); the
statically importable, typed and documented public API."""
from __future__ import annotations

import csv
import glob
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from ember.errors import MisconfigurationError
from ember.loggers import CSVLogger, TensorBoardLogger
from conftest import LinearModule, regression_data
from helpers import ROOT, SCRIPTS, child_env


def _env():
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_second_fit_on_a_finished_trainer_says_which_limit(make_trainer, data):
    t = make_trainer(max_epochs=2)
    t.fit(LinearModule(), data())
    with pytest.warns(UserWarning, match=r"trains nothing: this run already reached max_epochs=2 "
                                         r"\(current_epoch=2\).*trainer\.max_epochs = N, then fit again.*"
                                         r"Trainer\(max_epochs=N, \.\.\.\)\.fit\(module, \.\.\., ckpt_path='last'\)"):
        t.fit(LinearModule(), data())
    t = make_trainer(max_steps=3)
    t.fit(LinearModule(), data())
    with pytest.warns(UserWarning, match=r"already reached max_steps=3 \(global_step=3\)"):
        t.fit(LinearModule(), data())
    assert t.global_step == 3


def test_dataset_where_a_dataloader_is_expected(make_trainer):
    ds = regression_data(16)
    with pytest.raises(MisconfigurationError, match=r"train_dataloaders= got a TensorDataset \(a Dataset\), not a "
                                                    r"DataLoader.*Pass train_dataloaders=DataLoader\(dataset, "
                                                    r"batch_size=\.\.\.\)"):
        make_trainer(max_epochs=1).fit(LinearModule(), ds)
    with pytest.raises(MisconfigurationError, match=r"val_dataloaders= got a TensorDataset"):
        make_trainer(max_epochs=1).fit(LinearModule(), DataLoader(ds, batch_size=4), ds)
    with pytest.raises(MisconfigurationError, match=r"dataloaders= got a TensorDataset"):
        make_trainer().validate(LinearModule(), ds)

    class FromHook(LinearModule):
        def train_dataloader(self):
            return ds
    with pytest.raises(MisconfigurationError, match=r"FromHook\.train_dataloader\(\) returned a TensorDataset.*"
                                                    r"Return DataLoader\(dataset, batch_size=\.\.\.\)"):
        make_trainer(max_epochs=1).fit(FromHook())


@pytest.mark.parametrize("devices", ["cuda", "cuda:3", "mps"])
def test_unavailable_device_strings_fail_at_construction(tmp_path, devices):
    if devices.startswith("cuda") and torch.cuda.device_count() > int(devices[5:] or 0):
        pytest.skip("this machine has the device")
    mps = getattr(torch.backends, "mps", None)
    if devices == "mps" and mps is not None and mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(MisconfigurationError, match=rf"devices={devices!r} .*(not available|does not exist)"):
        ember.Trainer(devices=devices, default_root_dir=tmp_path)


def test_logger_strings(tmp_path, data):
    with pytest.raises(MisconfigurationError, match=r"logger='tensorbord' is not valid.*'tensorboard', 'csv', 'wandb'"):
        ember.Trainer(logger="tensorbord", default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationError, match=r"logger=\['csv', 3\] is not valid \(3\)"):
        ember.Trainer(logger=["csv", 3], default_root_dir=tmp_path)
    t = ember.Trainer(logger=["tensorboard", "csv"], max_epochs=1, enable_checkpointing=False, devices="cpu",
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      log_every_n_steps=1)
    t.fit(LinearModule(), data())
    assert [type(lg) for lg in t.loggers] == [TensorBoardLogger, CSVLogger]


def test_log_every_n_steps_larger_than_an_epoch_warns_once(tmp_path, data):
    t = ember.Trainer(logger=CSVLogger(save_dir=tmp_path), max_epochs=2, log_every_n_steps=50, devices="cpu",
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        t.fit(LinearModule(), data())
        t.max_epochs = 3
        t.fit(LinearModule(), data())
    msgs = [str(w.message) for w in got if "log_every_n_steps" in str(w.message)]
    assert msgs == ["log_every_n_steps=50 is larger than the 8 optimizer step(s) of a training epoch (8 batches): "
                    "step metrics are logged only every 50 steps. Set Trainer(log_every_n_steps=...) to at most 8 "
                    "to see them within each epoch."]


@pytest.mark.timeout(120)
def test_epoch_metric_without_sync_dist_under_ddp_warns_once_by_name(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "unsynced_metric.py"), str(tmp_path)], env=_env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hits = [ln for ln in proc.stderr.splitlines() if "without sync_dist=True differ" in ln]
    assert len(hits) == 2, proc.stderr[-3000:]   # once for the training stage, once for validation, over 2 epochs
    (train,) = [h for h in hits if "'train/only_rank1' logged as epoch value(s)" in h]
    (val,) = [h for h in hits if "'val/rank' logged as epoch value(s)" in h]
    assert "self.log('val/rank', ..., sync_dist=True)" in val
    assert "val/same" not in val and "val/synced" not in val


@pytest.mark.timeout(120)
def test_ctrl_c_stops_gracefully_with_status_130(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "interrupt_fit.py"), str(tmp_path)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "fit returned" not in out
    last = os.path.join(tmp_path, "ckpt", "last")
    assert os.path.isdir(last)
    assert (f"ember: interrupted (Ctrl-C) at epoch 0, step " in err and "loggers were flushed; the last checkpoint is "
            f"{last} (resume with trainer.fit(..., ckpt_path='last'))." in err), err
    assert Path(tmp_path, "on_exception.txt").read_text() == "KeyboardInterrupt"
    (metrics,) = glob.glob(os.path.join(tmp_path, "**", "metrics.csv"), recursive=True)
    rows = list(csv.DictReader(open(metrics)))
    assert len(rows) >= 4 and all(r["train/loss"] for r in rows)   # the buffered rows were written


def test_public_api_is_static_typed_and_documented():
    import ast
    import inspect
    tree = ast.parse(Path(ember.__file__).with_suffix(".pyi").read_text())   # the stub IDEs read
    static = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              for a in node.names}
    assert {"Trainer", "TrainModule", "DataModule", "Accelerator"} <= static
    assert (Path(ember.__file__).parent / "py.typed").is_file()
    doc = inspect.getdoc(ember.Trainer)
    params = [p for p in inspect.signature(ember.Trainer.__init__).parameters if p != "self"]
    missing = [p for p in params if f"{p}:" not in doc]
    assert not missing, f"Trainer arguments without a docstring entry: {missing}"
    for name, fn in vars(ember.Trainer).items():
        if not name.startswith("_") and callable(fn):
            hints = inspect.signature(fn).parameters
            assert all(p.annotation is not inspect.Parameter.empty for n, p in hints.items()
                       if n not in ("self",) and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)), name
            assert inspect.getdoc(fn), name


def test_fit_help_lists_types_defaults_and_descriptions():
    proc = subprocess.run([sys.executable, "-m", "ember", "fit", "--help"], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    i = out.index("  max_epochs (int | None; default None)")
    assert out[i + 1].strip().startswith("stop after this many epochs")
    j = out.index("  log_every_n_steps (int; default 50)")
    assert "every N optimizer steps" in out[j + 1]
    assert "  accumulate_grad_batches (int; default 1)" in out


def test_empty_validation_loader_is_warned_naming_the_argument(make_trainer):
    empty = DataLoader(regression_data(4), batch_size=8, drop_last=True)   # 4 samples, batches of 8: none
    t = make_trainer(max_epochs=1)
    with pytest.warns(UserWarning, match=r"val_dataloaders= has no batches .*drop_last=True.*skipped"):
        t.fit(LinearModule(), DataLoader(regression_data(16), batch_size=8), val_dataloaders=empty)
    assert t.global_step == 2

    class M(LinearModule):
        def val_dataloader(self):
            return [DataLoader(regression_data(8), batch_size=8), empty]
    with pytest.warns(UserWarning, match=r"M\.val_dataloader\(\) \(#1\) has no batches"):
        make_trainer().validate(M())
    with warnings.catch_warnings():   # a loader with batches: no warning
        warnings.simplefilter("error")
        make_trainer().validate(LinearModule(), DataLoader(regression_data(8), batch_size=8))
