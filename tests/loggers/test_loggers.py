"""Loggers: TensorBoard event files, CSV files and offline W&B runs, read back for real."""

from __future__ import annotations

import csv
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ember.errors import MisconfigurationError
from ember.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger, build_logger
from ember.loggers.base import flatten_params, sanitize_params
from helpers import ROOT, wandb_artifacts, wandb_config, wandb_history, wandb_offline, wandb_records
from helpers import tensorboard_events as _accumulator  # noqa: E402
from helpers import tensorboard_hparams as _session_hparams  # noqa: E402
from helpers import tensorboard_scalars as _scalars  # noqa: E402


class Opaque:
    def __repr__(self):
        return "Opaque()"


HPARAMS = {"lr": 0.001, "model": {"layers": 2, "act": "relu"}, "betas": (0.9, 0.99),
           "obj": Opaque(), "flag": True, "none": None}
HPARAMS_YAML = {"lr": 0.001, "model": {"layers": 2, "act": "relu"}, "betas": [0.9, 0.99],
                "obj": "Opaque()", "flag": True, "none": None}


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


# ---------------------------------------------------------------------------
# shared helpers


def test_import_is_cheap():
    code = ("import sys, ember.loggers; "
            "print([m for m in ('tensorboard', 'torch.utils.tensorboard', 'wandb', 'yaml') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_flatten_and_sanitize_params():
    assert flatten_params(HPARAMS) == {"lr": 0.001, "model/layers": 2, "model/act": "relu",
                                       "betas": "[0.9, 0.99]", "obj": "Opaque()", "flag": True,
                                       "none": "None"}
    assert sanitize_params(HPARAMS) == HPARAMS_YAML
    import argparse

    assert flatten_params(argparse.Namespace(a=1, b={"c": Path("x")})) == {"a": 1, "b/c": "x"}
    with pytest.raises(MisconfigurationError, match="params"):
        flatten_params(3)


# ---------------------------------------------------------------------------
# TensorBoard



def test_tensorboard_scalars_hparams_and_files(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    assert logger.name == "ember_logs" and logger.version == 0
    assert logger.log_dir == os.path.join(str(tmp_path), "ember_logs", "version_0")
    assert not os.path.exists(logger.log_dir)  # created lazily, on the first write
    logger.log_metrics({"train/loss": 0.5, "lr": 0.25}, step=0)
    logger.log_metrics({"train/loss": 0.25}, step=10)
    logger.log_metrics({"train/loss": 0.125, "val/acc": 0.75}, step=20)
    logger.log_hyperparams(HPARAMS)
    logger.finalize("success")

    ea = _accumulator(logger.log_dir)
    assert _scalars(ea, "train/loss") == [(0, 0.5), (10, 0.25), (20, 0.125)]
    assert _scalars(ea, "lr") == [(0, 0.25)]
    assert _scalars(ea, "val/acc") == [(20, 0.75)]
    hp, metric_tags = _session_hparams(ea)
    assert hp == {"lr": pytest.approx(0.001), "model/layers": 2.0, "model/act": "relu",
                  "betas": "[0.9, 0.99]", "obj": "Opaque()", "flag": 1.0, "none": "None"}
    assert metric_tags == []  # default_hp_metric=False
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f) == HPARAMS_YAML

    # a second logger in the same place takes the next version
    second = TensorBoardLogger(tmp_path)
    assert second.version == 1
    second.log_metrics({"x": 1.0}, step=3)
    second.save()
    assert sorted(os.listdir(tmp_path / "ember_logs")) == ["version_0", "version_1"]
    assert _scalars(_accumulator(second.log_dir), "x") == [(3, 1.0)]
    second.finalize("failed")


def test_tensorboard_log_after_finalize_and_hp_metric(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="exp", version="run-a", default_hp_metric=True)
    assert logger.log_dir == os.path.join(str(tmp_path), "exp", "run-a")
    logger.log_hyperparams({"lr": 0.5})
    logger.log_metrics({"loss": 2.0}, step=1)
    logger.finalize("success")
    # e.g. trainer.test() after fit: the same log_dir, a new event file
    logger.log_metrics({"test/acc": 0.5}, step=1)
    logger.log_hyperparams({"batch_size": 4})  # merged with the earlier call
    logger.finalize("success")

    ea = _accumulator(logger.log_dir)
    assert _scalars(ea, "hp_metric") == [(0, -1.0), (0, -1.0)]
    assert _scalars(ea, "loss") == [(1, 2.0)]
    assert _scalars(ea, "test/acc") == [(1, 0.5)]
    # the first event file's session (TensorBoard lists a folder's event files by name, and a
    # name ends in the writer's number in this process: 9 sorts after 10, so read the first one alone)
    files = sorted(glob.glob(os.path.join(logger.log_dir, "events.out.tfevents.*")),
                   key=lambda f: int(f.rsplit(".", 1)[1]))
    assert len(files) == 2
    hp, metric_tags = _session_hparams(_accumulator(files[0]))
    assert hp == {"lr": 0.5}  # TensorBoard keeps the first hparams of a run...
    assert metric_tags == ["hp_metric"]
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:  # ...hparams.yaml has them all
        assert yaml.safe_load(f) == {"lr": 0.5, "batch_size": 4}


def test_versions_are_stable_and_explicit(tmp_path):
    (tmp_path / "ember_logs" / "version_3").mkdir(parents=True)
    (tmp_path / "ember_logs" / "version_x").mkdir()
    (tmp_path / "ember_logs" / "version_9").write_text("a file, not a run")
    a = TensorBoardLogger(tmp_path)
    assert a.version == 4
    (tmp_path / "ember_logs" / "version_7").mkdir()
    assert a.version == 4 and a.log_dir.endswith("version_4")  # computed once
    assert CSVLogger(tmp_path).version == 8
    assert CSVLogger(tmp_path, version=2).log_dir == os.path.join(str(tmp_path), "ember_logs", "version_2")
    flat = CSVLogger(tmp_path / "flat", name="")
    assert flat.version == 0 and flat.log_dir == os.path.join(str(tmp_path / "flat"), "version_0")
    with pytest.raises(MisconfigurationError, match="version"):
        CSVLogger(tmp_path, version=1.5)
    with pytest.raises(MisconfigurationError, match="status"):
        a.finalize("done")


# ---------------------------------------------------------------------------
# CSV


def test_csv_rows_union_of_columns_and_flush(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    path = os.path.join(logger.log_dir, "metrics.csv")
    logger.log_metrics({"a": 1.0}, step=0)
    assert not os.path.exists(path)  # buffered
    logger.log_metrics({"a": 0.5}, step=1)  # 2nd call: flushed
    assert read_csv(path) == [["step", "a"], ["0", "1.0"], ["1", "0.5"]]

    logger.log_metrics({"a": 0.25, "b": 3.0}, step=2)  # a new column
    assert read_csv(path) == [["step", "a"], ["0", "1.0"], ["1", "0.5"]]
    logger.save()  # rewritten with the union of the columns
    assert read_csv(path) == [["step", "a", "b"], ["0", "1.0", ""], ["1", "0.5", ""],
                              ["2", "0.25", "3.0"]]

    logger.log_metrics({"b": 4.0}, step=3)
    logger.log_metrics({"a": 0.1, "b": 5.0}, step=3)  # flush by count: appended
    assert read_csv(path)[-2:] == [["3", "", "4.0"], ["3", "0.1", "5.0"]]
    logger.log_metrics({"c": 7}, step=4)
    logger.finalize("success")
    assert read_csv(path) == [["step", "a", "b", "c"], ["0", "1.0", "", ""], ["1", "0.5", "", ""],
                              ["2", "0.25", "3.0", ""], ["3", "", "4.0", ""], ["3", "0.1", "5.0", ""],
                              ["4", "", "", "7"]]


def test_csv_hparams_resume_and_errors(tmp_path):
    logger = CSVLogger(tmp_path, name="exp", prefix="fit")
    logger.log_hyperparams(HPARAMS)
    logger.log_hyperparams({"lr": 0.5, "extra": {"k": [1, 2]}})
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f) == {**HPARAMS_YAML, "lr": 0.5, "extra": {"k": [1, 2]}}
    logger.log_metrics({"loss": 1.5}, step=0)
    logger.finalize("interrupted")

    # a resumed run writing into the same version keeps the earlier rows
    again = CSVLogger(tmp_path, name="exp", version=0)
    again.log_metrics({"loss": 0.5, "acc": 0.5}, step=1)
    again.finalize("success")
    assert read_csv(os.path.join(again.log_dir, "metrics.csv")) == [
        ["step", "fit-loss", "loss", "acc"], ["0", "1.5", "", ""], ["1", "", "0.5", "0.5"]]

    with pytest.raises(MisconfigurationError, match="step"):
        again.log_metrics({"step": 1.0}, step=2)
    with pytest.raises(MisconfigurationError, match="flush_logs_every_n_steps"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


# ---------------------------------------------------------------------------
# build_logger


def test_build_logger(tmp_path):
    tb = build_logger("tensorboard", save_dir=tmp_path)
    assert type(tb) is TensorBoardLogger and tb.save_dir == str(tmp_path) and tb.name == "ember_logs"
    c = build_logger(" CSV ", save_dir=tmp_path, name="proj", flush_logs_every_n_steps=5)
    assert type(c) is CSVLogger and c.name == "proj" and c._flush_every == 5
    wb = build_logger("wandb", save_dir=tmp_path, name="proj", offline=True)
    assert type(wb) is WandbLogger and wb.name == "proj" and wb.save_dir == str(tmp_path)
    assert wb.version is None and wb._experiment is None  # no run until first use
    assert build_logger(tb, save_dir="elsewhere") is tb
    assert isinstance(tb, Logger)
    for bad in ("comet", 42):
        with pytest.raises(MisconfigurationError) as e:
            build_logger(bad, save_dir=tmp_path)
        msg = str(e.value)
        assert "log_with" in msg and all(repr(c) in msg for c in ("tensorboard", "wandb", "csv"))


def test_wandb_missing_and_bad_arguments(monkeypatch, tmp_path):
    with pytest.raises(MisconfigurationError, match="log_model"):
        WandbLogger(save_dir=tmp_path, log_model="best")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        WandbLogger(save_dir=tmp_path)


# ---------------------------------------------------------------------------
# Weights & Biases, offline


def test_wandb_other_ranks_never_create_a_run(tmp_path, monkeypatch):
    """Every rank but 0 of a job: no wandb.init (a second run of the job), a no-op
    experiment for hooks that run on every rank, and rank 0's run id and folder once
    the Trainer agreed them at setup (run_key on rank 0, use_run_key here)."""
    import wandb
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(wandb, "init", lambda *a, **k: pytest.fail("wandb.init on rank 1"))
    lg = WandbLogger(project="p", save_dir=tmp_path / "save", offline=True, log_model=True)
    lg.experiment.log({"anything": 1})            # a hook's call on every rank: nothing on this one
    lg.experiment.config.update({"a": 1})
    lg.log_hyperparams({"lr": 0.1})
    lg.log_metrics({"loss": 1.0}, step=1)
    assert lg.log_dir == str(tmp_path / "save")   # before the agreement: no run folder to give
    lg.finalize("success")
    assert lg._experiment is None and not (tmp_path / "save" / "wandb").exists()
    assert type(lg).run_key is not Logger.run_key   # the Trainer agrees it under several processes
    lg.use_run_key(("abc123", str(tmp_path / "save" / "wandb" / "offline-run-x-abc123")))
    assert lg.version == "abc123" and lg.log_dir.endswith("offline-run-x-abc123")


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory):
    """Two offline runs: log_model="all" and log_model=True."""
    root = tmp_path_factory.mktemp("wandb")
    ckpt_dir = root / "ckpts" / "epoch=0-step=5"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "model.safetensors").write_bytes(b"\x01" * 64)
    (ckpt_dir / "meta.json").write_text('{"step": 5}')
    ckpt_file = root / "ckpts" / "weights-step=10.safetensors"
    ckpt_file.write_bytes(b"\x02" * 32)
    gone = root / "ckpts" / "deleted.safetensors"
    gone.write_bytes(b"\x03")

    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        wandb_offline(mp, root)

        all_ = WandbLogger(project="ember-test", name="all", save_dir=root / "save", version="emberall1",
                           log_model="all", offline=True)
        assert all_.version == "emberall1" and all_._experiment is None
        all_.log_hyperparams(HPARAMS)
        all_.log_metrics({"train/loss": 0.5, "lr": 0.25}, step=0)
        all_.log_metrics({"train/loss": 0.25}, step=5)
        all_.after_save_checkpoint(str(ckpt_dir), aliases=("best",), score=0.25)
        all_.log_metrics({"train/loss": 0.125, "val/acc": 0.75}, step=10)
        all_.after_save_checkpoint(str(ckpt_file), score=0.125)
        log_dir = all_.log_dir
        all_.finalize("success")
        # reading log_dir after the run finished returns its folder; it never starts a second run
        assert all_.log_dir == log_dir and all_._experiment is None
        runs["all"] = (all_, log_dir)

        last = WandbLogger(project="ember-test", save_dir=root / "save", log_model=True)
        last.log_metrics({"loss": 1.0}, step=1)
        last.after_save_checkpoint(str(ckpt_dir), aliases=("best",), score=0.5)
        last.after_save_checkpoint(str(gone), score=0.9)
        last.after_save_checkpoint(str(ckpt_file), score=0.75)
        run_id = last.version
        last.finalize("failed")  # no artifacts on failure...
        assert last._checkpoints  # ...and the pending ones are kept
        runs["last"] = (last, run_id)
        last.log_metrics({"loss": 0.5}, step=2)  # re-opens the same run id
        gone.unlink()
        last.after_save_checkpoint(str(gone), score=0.9)  # the newest, but deleted by now
        last.finalize("success")
        import wandb

        # finish() can return before W&B's service has written the last records
        # of the transaction log; shutting the service down (as at process exit) flushes them
        wandb.teardown()
    runs["root"] = root
    runs["ckpt_dir"], runs["ckpt_file"] = ckpt_dir, ckpt_file
    return runs


def test_wandb_offline_metrics_and_config(wandb_runs):
    logger, log_dir = wandb_runs["all"]
    (run_dir,) = glob.glob(str(wandb_runs["root"] / "save" / "wandb" / "offline-run-*-emberall1"))
    assert log_dir == run_dir
    assert logger.name == "ember-test" and logger.version == "emberall1"
    records = wandb_records(run_dir)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project, run.display_name) == ("emberall1", "ember-test", "all")
    assert wandb_history(records) == [
        {"train/loss": 0.5, "lr": 0.25, "trainer/global_step": 0},
        {"train/loss": 0.25, "trainer/global_step": 5},
        {"train/loss": 0.125, "val/acc": 0.75, "trainer/global_step": 10},
    ]
    assert wandb_config(records) == flatten_params(HPARAMS)
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "trainer/global_step" for m in metrics)
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert [e.exit_code for e in exits] == [0]


def test_wandb_log_model_all_creates_artifacts(wandb_runs):
    (run_dir,) = glob.glob(str(wandb_runs["root"] / "save" / "wandb" / "offline-run-*-emberall1"))
    arts = wandb_artifacts(wandb_records(run_dir))
    assert [(a.name, a.type) for a in arts] == [("model-emberall1", "model")] * 2
    assert [sorted(a.aliases) for a in arts] == [["best", "latest"], ["latest"]]
    assert [json.loads(a.metadata) for a in arts] == [
        {"original_path": "epoch=0-step=5", "score": 0.25},
        {"original_path": "weights-step=10.safetensors", "score": 0.125}]
    # a checkpoint directory is added as a directory, a single file as that file;
    # the staged copies hold the checkpoint's bytes until `wandb sync` uploads them
    staged = [{c.path: Path(c.local_path).read_bytes() for c in a.manifest.contents} for a in arts]
    assert staged == [{"meta.json": b'{"step": 5}', "model.safetensors": b"\x01" * 64},
                      {"weights-step=10.safetensors": b"\x02" * 32}]


def test_wandb_log_model_true_logs_best_and_last_at_finalize(wandb_runs):
    logger, run_id = wandb_runs["last"]
    # the re-opened run gets its own folder ("...-<id>-1" when within the same second)
    run_dirs = sorted(glob.glob(str(wandb_runs["root"] / "save" / "wandb" / f"offline-run-*-{run_id}*")))
    assert len(run_dirs) == 2
    records = [r for d in run_dirs for r in wandb_records(d)]
    assert [row["loss"] for row in wandb_history(records)] == [1.0, 0.5]
    assert sorted(e.exit_code for r in records if r.WhichOneof("record_type") == "exit"
                  for e in [r.exit]) == [0, 1]
    arts = wandb_artifacts(records)  # only at the successful finalize; deleted files skipped
    # (W&B gives each new version "latest"; the server moves it to the newest one)
    assert [(a.name, sorted(a.aliases)) for a in arts] == [(f"model-{run_id}", ["best", "latest"]),
                                                          (f"model-{run_id}", ["latest"])]
    assert [json.loads(a.metadata)["score"] for a in arts] == [0.5, 0.75]
    assert [sorted(c.path for c in a.manifest.contents) for a in arts] == [
        ["meta.json", "model.safetensors"], ["weights-step=10.safetensors"]]


# ---------------------------------------------------------------------------
# with the Trainer


def test_trainer_fit_writes_tensorboard_and_csv(tmp_path):
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from ember import Trainer, TrainModule

    class Tiny(TrainModule):
        def __init__(self, lr=0.1, arch=None):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 3, generator=g), torch.randint(0, 2, (32,), generator=g))
    tb, csv_logger = TensorBoardLogger(tmp_path), CSVLogger(tmp_path, name="csv")
    trainer = Trainer(max_epochs=2, logger=[tb, csv_logger], log_every_n_steps=2, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(Tiny(arch={"width": 4}), DataLoader(data, batch_size=8))

    rows = list(csv.DictReader(open(os.path.join(csv_logger.log_dir, "metrics.csv"), newline="")))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    losses = [float(r["train/loss"]) for r in rows]
    tb_losses = _scalars(_accumulator(tb.log_dir), "train/loss")
    assert [s for s, _ in tb_losses] == [2, 4, 6, 8]
    assert [v for _, v in tb_losses] == pytest.approx(losses, rel=1e-6)  # float32 in event files
    for lg in (tb, csv_logger):
        with open(os.path.join(lg.log_dir, "hparams.yaml")) as f:
            assert yaml.safe_load(f) == {"lr": 0.1, "arch": {"width": 4}}
