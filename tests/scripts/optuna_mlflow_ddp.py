"""Optuna pruning and the MLflow logger under 2 CPU processes (gloo, a 10 s process-group
timeout), run by tests/integrations/test_optuna.py.

    python optuna_mlflow_ddp.py ROOT

1. MLflow: a 2-epoch fit with ``MLFlowLogger`` on both ranks: rank 0 creates the one run of
   the job; rank 1 never talks to the tracking store and takes rank 0's run folder.
2. Optuna, the documented pattern: rank 0 runs ``study.optimize`` on an in-memory study; rank 1
   runs the objective with ``trial=None`` once per trial; the trial's hyperparameter (here the
   score the module logs) goes from rank 0 to the others with ``broadcast_object_list``. Trial 0
   completes; trial 1 logs a score over the ThresholdPruner's limit and is pruned at epoch 1;
   in trial 2 rank 0's ``trial.should_prune()`` raises (a storage gone): rank 0 raises that
   error (``study.optimize(catch=...)`` records the trial as FAILED and goes on), rank 1 a
   DistributedOperationError naming it, at the same validation (not the 10 s timeout).
3. MLflow again: rank 0 cannot open the run it is told to continue (``run_id`` of no run):
   rank 0 raises MLflow's error at setup, rank 1 a DistributedOperationError naming it.
Every rank records what it saw in ROOT/result_<rank>.json.
"""
import json
import os
import sys
import time

import optuna
import torch.distributed as dist
from torch.utils.data import DataLoader

import ember
from ember.errors import DistributedOperationError
from ember.integrations.optuna import PruningCallback
from ember.loggers import MLFlowLogger
from ember.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, sum_data  # noqa: E402


class Scored(Regressor):
    def __init__(self, score: float = 1.0):
        super().__init__()
        self.score = score

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/score", self.score, sync_dist=True)


def trainer(root, **kw):
    return ember.Trainer(devices=2, strategy=DDPStrategy(timeout=10), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root, **kw)


def loaders():   # 32 samples, 2 ranks, 4 a batch: 4 steps an epoch
    return DataLoader(sum_data(32), batch_size=4), DataLoader(sum_data(16), batch_size=4)


def main(root):
    out = {}
    # -- 1. MLflow: one run per job
    lg = MLFlowLogger(experiment_name="ddp", save_dir=os.path.join(root, "mlruns"))
    if "RANK" not in os.environ:
        # rank 0, before ember's launcher starts rank 1: create the store and the run now (its
        # tables take seconds on a busy machine; rank 1 would wait for them in the setup's
        # broadcast, whose timeout is 10 s here); the other ranks still take the run at setup
        _ = lg.run_id
    t = trainer(root, max_epochs=2, logger=lg, log_every_n_steps=2)
    t.fit(Scored(), *loaders())
    rank = t.global_rank
    out["mlflow"] = {"log_dir": t.log_dir, "client": lg._experiment is not None}
    if rank == 0:
        from mlflow.tracking import MlflowClient
        client = MlflowClient(lg.tracking_uri)
        runs = client.search_runs([lg.experiment_id])
        out["mlflow"].update(runs=len(runs), status=runs[0].info.status,
                             train_steps=[m.step for m in client.get_metric_history(lg.run_id, "train/loss")])

    # -- 2. Optuna: the study on rank 0, the objective on every rank
    out["trials"] = []

    def objective(trial):   # trial is None on the ranks other than 0
        params = [{"score": [1.0, 10.0, 1.0][trial.number]} if trial is not None else None]
        if trial is not None and trial.number == 2:
            def storage_gone():
                raise RuntimeError("the study's storage is unreachable")
            trial.should_prune = storage_gone
        dist.broadcast_object_list(params, src=0)   # every rank trains the same hyperparameters
        t = trainer(root, max_epochs=3, logger=False, enable_checkpointing=False,
                    callbacks=[PruningCallback(trial, monitor="val/score")])
        record = {"raised": None}
        out["trials"].append(record)
        start = time.monotonic()
        try:
            t.fit(Scored(**params[0]), *loaders())
        except Exception as err:
            record["raised"] = type(err).__name__ if isinstance(err, optuna.TrialPruned) else f"{type(err).__name__}: {err}"
            raise
        finally:
            record.update(stop_reason=t.stop_reason, epoch=t.current_epoch, step=t.global_step,
                          seconds=time.monotonic() - start)
        return float(t.callback_metrics["val/score"])

    if rank == 0:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=5.0, n_warmup_steps=1))
        study.optimize(objective, n_trials=3, catch=(RuntimeError,))
        out["states"] = [tr.state.name for tr in study.trials]
        out["intermediate"] = [{str(k): v for k, v in tr.intermediate_values.items()} for tr in study.trials]
    else:
        for _ in range(3):
            try:
                objective(None)
            except (optuna.TrialPruned, DistributedOperationError):
                pass

    # -- 3. MLflow: rank 0 cannot open the run it should continue
    lg = MLFlowLogger(experiment_name="ddp", save_dir=os.path.join(root, "mlruns"), run_id="0" * 32)
    t = trainer(root, max_epochs=1, logger=lg)
    start = time.monotonic()
    try:
        t.fit(Scored(), *loaders())
        out["mlflow_down"] = None
    except Exception as err:
        out["mlflow_down"] = {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start,
                              "step": t.global_step}
    with open(os.path.join(root, f"result_{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
