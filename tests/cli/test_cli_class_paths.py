"""A config never runs code: a ``{class_path, init_args}`` mapping is built only where
the argument's type is a class the path subclasses (or ember's untyped-argument bases);
in an argument that holds data (``dict``, ``bool | dict``, ...) it is refused, naming the
argument, and ``instantiate`` builds only what ``resolve_class`` checked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(cli, tmp_path, monkeypatch):
    """conftest.py's ``cli``, the test's own modules (written to ``tmp_path``) importable too."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return cli


def _popen(marker: Path) -> str:
    return json.dumps({"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(marker)]}})


BASE = {"model": {"class_path": "toy.ToyRegressor", "init_args": {"hidden": 2}},
        "data": {"class_path": "toy.ToyData", "init_args": {"num_samples": 16}},
        "trainer": {"max_steps": 1, "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
                    "enable_checkpointing": False}}


@pytest.mark.parametrize("key", ["max_time", "compile"])
def test_trainer_dict_arguments_never_build_a_class_path(tmp_path, cli, key):
    marker = tmp_path / "X"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps(BASE))
    r = cli("fit", "-c", cfg, f"--trainer.{key}", _popen(marker))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"ember: error: trainer.{key}"), r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()


def test_trainer_max_time_still_takes_a_dict_of_data(tmp_path, cli):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps(BASE))
    r = cli("fit", "-c", cfg, "--trainer.max_time", "{hours: 1}", "--print_config")
    assert r.returncode == 0, r.stderr
    assert "max_time:\n    hours: 1" in r.stdout


MODEL = '''
from toy import ToyRegressor


class DataArgs(ToyRegressor):
    def __init__(self, hidden: int, options: dict | None = None, anything: object = None,
                 table: dict[str, int] | None = None):
        super().__init__(hidden)
        self.options, self.anything, self.table = options, anything, table

    def on_fit_start(self):
        import json
        with open("seen.json", "w") as f:
            json.dump({"options": self.options, "table": self.table}, f)
'''


@pytest.mark.parametrize("key, message", [
    ("options", "model.init_args.options: a mapping with class_path ('subprocess.Popen') is given for an "
                "argument of type dict | None, which holds data"),
    ("table", "model.init_args.table: a mapping with class_path ('subprocess.Popen') is given for an "
              "argument of type dict[str, int] | None, which holds data"),
    ("anything", "model.init_args.anything.class_path: 'subprocess.Popen' is given for an argument without a "
                 "type, where ember builds only subclasses of Module, Dataset, Callback"),
])
def test_model_arguments_typed_dict_or_object_never_build_a_class_path(tmp_path, cli, key, message):
    (tmp_path / "data_args_model.py").write_text(MODEL)
    marker = tmp_path / "X"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({**BASE, "model": {"class_path": "data_args_model.DataArgs",
                                                 "init_args": {"hidden": 2}}}))
    r = cli("fit", "-c", cfg, f"--model.{key}", _popen(marker))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert not marker.exists()


def test_a_data_mapping_reaches_the_model_as_data(tmp_path, cli):
    (tmp_path / "data_args_model.py").write_text(MODEL)
    cfg = tmp_path / "cfg.yaml"
    options = {"lr": 0.1, "nested": {"k": [1, 2]}}
    cfg.write_text(json.dumps({**BASE, "model": {"class_path": "data_args_model.DataArgs",
                                                 "init_args": {"hidden": 2, "options": options,
                                                               "table": {"a": 1}}}}))
    r = cli("fit", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "seen.json").read_text()) == {"options": options, "table": {"a": 1}}


def test_instantiate_builds_only_checked_entries(tmp_path):
    """A ``class_path`` key in plain data (anything ``resolve_class`` did not return) is
    never built, wherever it comes from."""
    import torch

    from ember.cli.types import instantiate, resolve_class
    marker = tmp_path / "X"
    raw = json.loads(_popen(marker))
    assert instantiate(raw) == raw and instantiate({"a": [raw]}) == {"a": [raw]}
    assert not marker.exists()
    spec = resolve_class("m", {"class_path": "torch.nn.Linear", "init_args": {"in_features": 2,
                                                                               "out_features": 1}},
                         base=torch.nn.Module)
    assert isinstance(instantiate({"m": spec})["m"], torch.nn.Linear)
