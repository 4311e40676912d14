"""PruningCallback with real Optuna studies (in memory): reports once per validation at
step=epoch, never in the sanity check; a pruned trial ends the fit cleanly and
``optuna.TrialPruned`` comes out of ``fit``, so the study records PRUNED. Under two
processes (gloo) rank 0 decides and both ranks stop at the same step."""
from __future__ import annotations

import json
import os
import sys

import pytest
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelCheckpoint
from ember.errors import MisconfigurationError
from ember.loggers import CSVLogger
from helpers import SCRIPTS, CaptureLogger, LinearModule, child_env, regression_data, run_job

optuna = pytest.importorskip("optuna")
from ember.integrations.optuna import PruningCallback  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


class Scored(LinearModule):
    """Logs ``val/score`` = ``score`` at every validation (and counts the validation steps)."""

    def __init__(self, score: float):
        super().__init__()
        self.score = score
        self.val_steps = 0

    def validation_step(self, batch, batch_idx):
        self.val_steps += 1
        self.log("val/score", self.score)


def loaders():
    return DataLoader(regression_data(32), batch_size=8), DataLoader(regression_data(16, seed=1), batch_size=8)


def test_study_records_pruned_and_the_fit_ends_cleanly(tmp_path):
    seen = []

    def objective(trial):
        capture = CaptureLogger()
        module = Scored(score=[1.0, 10.0][trial.number])   # the second trial is the bad one
        trainer = ember.Trainer(max_epochs=5, log_every_n_steps=4, logger=[CSVLogger(tmp_path, version=trial.number), capture],
                                enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[PruningCallback(trial, monitor="val/score"), ModelCheckpoint(save_last=True)])
        seen.append((trainer, capture, module))
        trainer.fit(module, *loaders())   # num_sanity_val_steps=2: a sanity check runs first
        return float(trainer.callback_metrics["val/score"])

    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=5.0, n_warmup_steps=1))
    study.optimize(objective, n_trials=2)

    good, bad = study.trials
    assert good.state == optuna.trial.TrialState.COMPLETE and good.value == 1.0
    assert good.intermediate_values == {e: 1.0 for e in range(5)}   # once per validation, step=epoch
    assert bad.state == optuna.trial.TrialState.PRUNED
    assert bad.intermediate_values == {0: 10.0, 1: 10.0}   # pruned at epoch 1 (after the warm-up step)
    (t_good, c_good, m_good), (t_bad, c_bad, m_bad) = seen
    assert m_good.val_steps == 2 + 5 * 2   # the sanity check ran, and reported nothing
    assert t_good.stop_reason == "max_epochs"
    # the pruned fit stopped at that epoch's end, cleanly: loggers finalised, checkpoint written
    assert t_bad.stop_reason == "pruned" and t_bad.current_epoch == 2 and t_bad.global_step == 8
    assert c_bad.status == "success" and t_bad.state.finished
    last = t_bad.checkpoint_callback.last_model_path
    assert os.path.basename(last) == "last" and os.path.isfile(os.path.join(last, "model.safetensors"))


def test_trial_pruned_comes_out_of_fit_and_a_mid_epoch_validation_stops_at_its_step(tmp_path):
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=5.0))
    trial = study.ask()
    trainer = ember.Trainer(max_epochs=3, val_check_interval=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[PruningCallback(trial, monitor="val/score")])
    with pytest.raises(optuna.TrialPruned, match="Trial was pruned at epoch 0"):
        trainer.fit(Scored(score=9.0), *loaders())
    # the first validation (after batch 2 of 4) prunes; the stop is taken at the optimizer-step boundary
    # it followed (one process: no agreement to wait for), mid-epoch
    assert trainer.stop_reason == "pruned" and trainer.current_epoch == 0 and trainer.global_step == 2
    assert trainer.batches_done == 2
    assert study.trials[0].intermediate_values == {0: 9.0}


def test_monitor_not_logged_names_the_logged_metrics():
    study = optuna.create_study()
    trainer = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[PruningCallback(study.ask(), monitor="val/acc")])
    with pytest.raises(MisconfigurationError, match=r"PruningCallback\(monitor='val/acc'\).*'val/score'"):
        trainer.fit(Scored(score=1.0), *loaders())


def test_validate_and_sanity_check_report_nothing():
    study = optuna.create_study()
    trial = study.ask()
    trainer = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[PruningCallback(trial, monitor="val/score")])
    module = Scored(score=2.0)
    trainer.validate(module, loaders()[1])
    assert trial.storage.get_trial(trial._trial_id).intermediate_values == {}
    trainer.fit(module, *loaders())
    assert trial.storage.get_trial(trial._trial_id).intermediate_values == {0: 2.0}


def test_missing_optuna_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "ember\[optuna\]"'):
        PruningCallback(None, monitor="val/loss")


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_two_processes_follow_rank_zeros_decision_and_log_one_mlflow_run(tmp_path):
    pytest.importorskip("mlflow")
    out = run_job([sys.executable, SCRIPTS / "optuna_mlflow_ddp.py", tmp_path], out_dir=tmp_path / "job",
                  env=child_env(), timeout=200, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-6000:]
    r0, r1 = (json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1))
    # Optuna: rank 0 held the study; both ranks stopped the pruned trial at the same step,
    # and both saw optuna.TrialPruned come out of fit
    assert r0["states"] == ["COMPLETE", "PRUNED", "FAIL"]
    assert r0["intermediate"][:2] == [{"0": 1.0, "1": 1.0, "2": 1.0}, {"0": 10.0, "1": 10.0}]
    for r in (r0, r1):
        for trial in r["trials"]:
            trial.pop("seconds") if trial["raised"] is None or "Pruned" in trial["raised"] else None
        assert r["trials"][0] == {"raised": None, "stop_reason": "max_epochs", "epoch": 3, "step": 12}
        assert r["trials"][1] == {"raised": "TrialPruned", "stop_reason": "pruned", "epoch": 2, "step": 8}
        # trial 2: rank 0's should_prune raised at the first validation; every rank ended there
        assert r["trials"][2]["step"] == 4 and r["trials"][2]["seconds"] < 8, r["trials"][2]
    assert r0["trials"][2]["raised"] == "RuntimeError: the study's storage is unreachable"
    assert r1["trials"][2]["raised"] == ("DistributedOperationError: PruningCallback: the trial's report failed on "
                                         "rank 0: RuntimeError: the study's storage is unreachable")
    # a run rank 0 cannot open ends every rank at setup, each with its error
    for r in (r0, r1):
        assert r["mlflow_down"]["step"] == 0 and r["mlflow_down"]["seconds"] < 8, r["mlflow_down"]
    assert r0["mlflow_down"]["error"].startswith("MlflowException") and "0" * 32 in r0["mlflow_down"]["error"]
    assert r1["mlflow_down"]["error"].startswith(
        "DistributedOperationError: a logger's run could not be created on rank 0: MlflowException")
    # MLflow: one run for the job, created by rank 0; every rank has its folder
    assert r0["mlflow"]["runs"] == 1 and r0["mlflow"]["status"] == "FINISHED"
    assert r0["mlflow"]["log_dir"] == r1["mlflow"]["log_dir"] and r1["mlflow"]["client"] is False
    assert r0["mlflow"]["train_steps"] == [2, 4, 6, 8]
