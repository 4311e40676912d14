"""MLFlowLogger and Accelerator(log_with="mlflow"): real MLflow stores (SQLite and a file
store in tmp), read back with MLflow's own client: params, metrics with their steps, the
run's status, the checkpoint artifacts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelCheckpoint
from ember.loggers import MLFlowLogger
from helpers import ROOT, CaptureLogger, LinearModule, regression_data

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One local store (SQLite + artifacts) for the file: creating its tables takes seconds."""
    return str(tmp_path_factory.mktemp("mlruns"))


@pytest.fixture
def experiment(request):
    return request.node.name.replace("[", "-").replace("]", "")


def client_for(logger: MLFlowLogger) -> MlflowClient:
    return MlflowClient(logger.tracking_uri)


def history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


def loaders(n=32):
    return DataLoader(regression_data(n), batch_size=8), DataLoader(regression_data(16, seed=1), batch_size=8)


def trainer(logger, tmp_path, **kw):
    kw.setdefault("max_epochs", 3)
    return ember.Trainer(logger=logger, log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, **kw)


class Hparams(LinearModule):
    def __init__(self, lr: float = 0.1, optim: dict | None = None, note: str = "short", betas=(0.9, 0.99)):
        super().__init__(lr=lr)
        self.save_hyperparameters()


class Failing(LinearModule):
    def __init__(self, at_epoch: int, exc: type = RuntimeError):
        super().__init__()
        self.at_epoch, self.exc = at_epoch, exc

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.at_epoch:
            raise self.exc("boom")
        return super().training_step(batch, batch_idx)


# -- the Trainer ---------------------------------------------------------------------------------
def test_fit_params_metrics_one_request_per_log_point_and_best_checkpoint(store, experiment, tmp_path):
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    lg = MLFlowLogger(experiment_name=experiment, save_dir=store, log_model=True, tags={"team": "a"},
                      run_name="first")
    capture = CaptureLogger()
    client = lg.experiment
    requests = []
    real = client.log_batch

    def counting(run_id, metrics=(), params=(), **kw):
        requests.append((list(metrics), list(params)))
        return real(run_id, metrics=metrics, params=params, **kw)
    client.log_batch = counting
    module = Hparams(optim={"name": "sgd", "sched": {"warmup": 2}}, note="x" * (MAX_PARAM_VAL_LENGTH + 5))
    t = trainer([lg, capture], tmp_path, callbacks=[ModelCheckpoint(monitor="val/loss", save_top_k=2)])
    with pytest.warns(RuntimeWarning, match=f"values of note are longer than MLflow's limit of {MAX_PARAM_VAL_LENGTH}"):
        t.fit(module, *loaders())

    run = client_for(lg).get_run(lg.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "first" and run.data.tags["team"] == "a"
    # params: flattened as Lightning's MLFlowLogger does, the long one cut to MLflow's limit
    lightning = {k: str(v) for k, v in _flatten_dict(_convert_params(dict(module.hparams))).items()}
    assert set(run.data.params) == set(lightning) == {"lr", "optim/name", "optim/sched/warmup", "note", "betas"}
    assert run.data.params == {**lightning, "note": "x" * MAX_PARAM_VAL_LENGTH}
    # metrics: what the Trainer sent, with its global steps; one request per log point
    metric_requests = [m for m, p in requests if m]
    assert len(metric_requests) == len(capture.calls) > 6
    for (step, sent), batch in zip(capture.calls, metric_requests):
        assert {m.key: (m.step, m.value) for m in batch} == {k: (step, pytest.approx(v)) for k, v in sent.items()}
    sent_train = [(s, pytest.approx(m["train/loss"])) for s, m in capture.calls if "train/loss" in m]
    assert history(client, lg.run_id, "train/loss") == sent_train
    assert [s for s, _ in sent_train] == [2, 4, 6, 8, 10, 12]
    assert [s for s, _ in history(client, lg.run_id, "val/loss")] == [4, 8, 12]
    # log_model=True: the best checkpoint only, uploaded at the end, loadable as saved
    cb = t.checkpoint_callback
    assert len(cb.best_k_models) == 2
    best = os.path.basename(cb.best_model_path)
    arts = sorted(a.path for a in client.list_artifacts(lg.run_id, "checkpoints"))
    assert arts == [f"checkpoints/{best}", f"checkpoints/{best}.json"]
    local = client.download_artifacts(lg.run_id, f"checkpoints/{best}", str(tmp_path / "dl"))
    assert sorted(os.listdir(local)) == sorted(os.listdir(cb.best_model_path))
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as a, open(os.path.join(cb.best_model_path, name), "rb") as b:
            assert a.read() == b.read()
    meta = json.load(open(client.download_artifacts(lg.run_id, f"checkpoints/{best}.json", str(tmp_path / "m"))))
    assert "best" in meta["aliases"] and meta["score"] == pytest.approx(float(cb.best_model_score))
    # the run's folder: its artifacts and the Trainer's checkpoints
    assert t.log_dir == lg.log_dir == os.path.join(store, lg.run_id)
    assert os.path.dirname(cb.best_model_path) == os.path.join(t.log_dir, "checkpoints")


def test_log_model_all_uploads_each_checkpoint_and_a_raising_fit_ends_failed(store, experiment, tmp_path):
    lg = MLFlowLogger(experiment_name=experiment, save_dir=store, log_model="all")
    t = trainer(lg, tmp_path, max_epochs=4, callbacks=[ModelCheckpoint(save_top_k=-1)])
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(Failing(at_epoch=2), *loaders())
    client = client_for(lg)
    assert client.get_run(lg.run_id).info.status == "FAILED"
    arts = sorted(a.path for a in client.list_artifacts(lg.run_id, "checkpoints"))
    assert arts == ["checkpoints/epoch=0-step=4", "checkpoints/epoch=0-step=4.json",
                    "checkpoints/epoch=1-step=8", "checkpoints/epoch=1-step=8.json"]
    assert history(client, lg.run_id, "train/loss")[-1][0] == 8


def test_ctrl_c_ends_the_run_killed(store, experiment, tmp_path):
    lg = MLFlowLogger(experiment_name=experiment, save_dir=store, log_model=True)
    t = trainer(lg, tmp_path)
    with pytest.raises(SystemExit) as exit_info:   # ember ends a non-interactive process with 130
        t.fit(Failing(at_epoch=1, exc=KeyboardInterrupt), *loaders())
    assert exit_info.value.code == 130
    client = client_for(lg)
    assert client.get_run(lg.run_id).info.status == "KILLED"
    assert client.list_artifacts(lg.run_id, "checkpoints") == []   # log_model=True: on success only


def test_run_id_continues_the_run_after_a_resume(store, experiment, tmp_path):
    first = MLFlowLogger(experiment_name=experiment, save_dir=store)
    t = trainer(first, tmp_path, max_epochs=2, callbacks=[ModelCheckpoint(save_last=True)])
    t.fit(Hparams(optim={"name": "sgd"}), *loaders())
    run_id = first.run_id

    again = MLFlowLogger(experiment_name="ignored-with-run-id", save_dir=store, run_id=run_id)
    assert again.log_dir == first.log_dir   # the same folder: ckpt_path="last" finds the run's checkpoint
    t2 = trainer(again, tmp_path, max_epochs=4, callbacks=[ModelCheckpoint(save_last=True)])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same params again: nothing to warn about
        t2.fit(Hparams(optim={"name": "sgd"}), *loaders(), ckpt_path="last")
    assert t2.ckpt_path.startswith(os.path.join(first.log_dir, "checkpoints"))
    client = client_for(again)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in history(client, run_id, "train/loss")] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert client.search_experiments(filter_string="name = 'ignored-with-run-id'") == []
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # a changed value cannot change an MLflow param: said, never silent
    with pytest.warns(RuntimeWarning, match="optim/name already have other values"):
        again.log_hyperparams({"optim": {"name": "adam"}})
    assert client.get_run(run_id).data.params["optim/name"] == "sgd"


def test_file_store_metric_names_and_values(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    lg = MLFlowLogger(experiment_name="files", tracking_uri=f"file:{tmp_path / 'mlruns'}", prefix="p")
    assert lg.save_dir == str(tmp_path / "mlruns")
    lg.log_hyperparams({"a": {"b": 1}, "c": None})
    with pytest.warns(RuntimeWarning) as caught:
        lg.log_metrics({"acc@1": 0.5, "note": "text", "loss": torch.tensor(0.25)}, step=7)
        lg.log_metrics({"acc@1": 0.75}, step=8)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2   # once per name
    assert any("'p-acc@1' is logged as 'p-acc1'" in m for m in messages)
    assert any("'p-note' = 'text' is not a number" in m for m in messages)
    lg.finalize("success")
    client = client_for(lg)
    run = client.get_run(lg.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"a/b": "1", "c": "None"}
    assert history(client, lg.run_id, "p-acc1") == [(7, 0.5), (8, 0.75)]
    assert history(client, lg.run_id, "p-loss") == [(7, 0.25)]
    assert os.path.isdir(os.path.join(tmp_path, "mlruns", lg.experiment_id, lg.run_id))   # a real file store
    assert lg.log_dir == os.path.join(tmp_path, "mlruns", lg.experiment_id, lg.run_id)


def test_nothing_is_created_before_a_call_and_bad_arguments(tmp_path):
    lg = MLFlowLogger(save_dir=tmp_path / "never")
    lg.finalize("success")   # no run was started: nothing to end
    assert not (tmp_path / "never").exists()
    with pytest.raises(ember.errors.MisconfigurationError, match="log_model"):
        MLFlowLogger(log_model="best")


def test_the_users_random_streams_are_left_as_they_were(store, experiment):
    import random
    random.seed(3)
    torch.manual_seed(3)
    before = random.getstate(), torch.get_rng_state()
    lg = MLFlowLogger(experiment_name=experiment, save_dir=store)   # no run_name: MLflow draws one
    lg.log_hyperparams({"lr": 0.1})
    lg.log_metrics({"loss": 1.0}, step=1)
    lg.finalize("success")
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert client_for(lg).get_run(lg.run_id).info.run_name   # MLflow's random name, all the same


def test_a_log_point_copies_no_random_state_once_mlflow_is_imported(store, experiment, monkeypatch):
    """The RNG states are kept around MLflow's first import only: a log point costs no copy."""
    from ember.checkpoint import rng
    lg = MLFlowLogger(experiment_name=experiment, save_dir=store, run_name="r")
    lg.log_metrics({"loss": 1.0}, step=1)   # the run and the first import
    copies = []
    enter = rng.keep_rng_states.__enter__
    monkeypatch.setattr(rng.keep_rng_states, "__enter__", lambda self: copies.append(1) or enter(self))
    for step in range(2, 5):
        lg.log_metrics({"loss": float(step)}, step=step)
    lg.finalize("success")
    assert copies == []
    assert history(client_for(lg), lg.run_id, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]


def test_other_ranks_never_create_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")   # what every rank but 0 of a job has
    lg = MLFlowLogger(save_dir=tmp_path / "store")
    lg.experiment.log_param("anything", "x")   # a hook's call on every rank: nothing on this one
    lg.log_hyperparams({"lr": 0.1})
    lg.log_metrics({"loss": 1.0}, step=1)
    lg.finalize("success")
    assert not (tmp_path / "store").exists()
    lg.use_run_key(("1", "abc", str(tmp_path / "run")))   # rank 0's run, agreed at setup
    assert (lg.name, lg.version, lg.log_dir) == ("1", "abc", str(tmp_path / "run"))


def test_missing_mlflow_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)   # as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=r'pip install "ember\[mlflow\]"'):
        MLFlowLogger()
    with pytest.raises(ModuleNotFoundError, match=r'log_with="mlflow" needs .*pip install "ember\[mlflow\]"'):
        ember.Accelerator(cpu=True, log_with="mlflow")


def test_import_costs_nothing():
    code = ("import sys, ember, ember.loggers, ember.integrations.optuna; "
            "from ember.loggers import MLFlowLogger; "
            "print([m for m in ('mlflow', 'optuna', 'sqlalchemy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# -- the Accelerator -----------------------------------------------------------------------------
def test_accelerator_log_with_mlflow_takes_accelerates_semantics(store, tmp_path, monkeypatch):
    uri = "sqlite:///" + os.path.join(store, "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    acc = ember.Accelerator(cpu=True, log_with="mlflow", project_dir=tmp_path)
    acc.init_trackers("project", config={"lr": 0.1, "model": {"layers": 2}},
                      init_kwargs={"mlflow": {"run_name": "acc-run", "description": "notes"}})
    acc.log({"loss": torch.tensor(0.5), "acc": 0.25}, step=3)
    acc.log({"loss": 0.125})
    tracker = acc.get_tracker("mlflow")
    assert isinstance(tracker, MLFlowLogger) and acc.get_tracker("mlflow", unwrap=True) is tracker.experiment
    run_id = tracker.run_id
    acc.end_training()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "from-env"   # the variable wins, as in Accelerate
    assert run.info.status == "FINISHED" and run.info.run_name == "acc-run"
    assert run.data.params == {"lr": "0.1", "model/layers": "2"}
    assert run.data.tags["mlflow.note.content"] == "notes"
    assert history(client, run_id, "loss") == [(3, 0.5), (4, 0.125)]
    assert history(client, run_id, "acc") == [(3, 0.25)]
    assert not (tmp_path / "mlruns").exists()   # the tracking URI came from the environment


def test_accelerator_mlflow_store_in_project_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    acc = ember.Accelerator(cpu=True, log_with="mlflow", project_dir=tmp_path)
    acc.init_trackers("project", config={"lr": 0.1})
    acc.log({"loss": 1.0}, step=1)
    run_id = acc.get_tracker("mlflow").run_id
    acc.end_training()
    client = MlflowClient("sqlite:///" + str(tmp_path / "mlruns" / "mlflow.db"))
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "project"
    assert run.info.status == "FINISHED" and history(client, run_id, "loss") == [(1, 1.0)]


# -- the command line ----------------------------------------------------------------------------
def test_cli_fit_with_mlflow_logger(store, tmp_path, monkeypatch, capsys):
    from ember.cli import main
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(ROOT / "examples" / "cli"), *sys.path])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({
        "model": {"class_path": "toy.ToyRegressor", "init_args": {"hidden": 2}},
        "data": {"class_path": "toy.ToyData", "init_args": {"num_samples": 16}},
        "trainer": {"max_steps": 4, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False, "enable_checkpointing": False}}))
    code = main(["fit", "-c", str(cfg), "--trainer.logger=MLFlowLogger", "--trainer.logger.save_dir", store,
                 "--trainer.logger.experiment_name", "cli"])
    assert code == 0, capsys.readouterr().err
    client = MlflowClient("sqlite:///" + os.path.join(store, "mlflow.db"))
    exp = client.get_experiment_by_name("cli")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["hidden"] == "2"
    losses = [k for k in run.data.metrics if "loss" in k]
    assert losses and all([s for s, _ in history(client, run.info.run_id, k)] == [1, 2, 3, 4] for k in losses)
