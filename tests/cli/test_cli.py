"""The `ember` command line, run as real subprocesses (`python -m ember ...`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import EXAMPLES, one_line_error

EXAMPLE = EXAMPLES / "cli"
CONFIG = EXAMPLE / "config.yaml"


def ember(*args, cwd, input=None, timeout=120, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update(XDG_CONFIG_HOME=str(Path(cwd) / "xdg"), WANDB_MODE="offline", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), env.get("PYTHONPATH")) if p)   # toy.py
    return subprocess.run([sys.executable, "-m", "ember", *map(str, args)], cwd=cwd, env=env,
                          input=input, capture_output=True, text=True, timeout=timeout)


def print_config(cli, *args) -> dict:
    r = cli("fit", "--config", CONFIG, *args, "--print_config")
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


# --------------------------------------------------------------------------- resolution
def test_print_config_fills_defaults_from_signatures(tmp_path):
    r = ember("fit", "--config", CONFIG, "--print_config", cwd=tmp_path)   # a real process
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert set(cfg) == {"seed_everything", "trainer", "model", "data", "ckpt_path"}
    assert cfg["model"] == {"class_path": "toy.ToyRegressor",
                            "init_args": {"hidden": 8, "lr": 0.01, "in_features": 4}}
    assert cfg["data"]["init_args"] == {"batch_size": 16, "num_samples": 128, "in_features": 4, "seed": 0}
    assert cfg["trainer"]["max_epochs"] == 2 and cfg["trainer"]["max_steps"] == -1   # default filled in
    assert cfg["trainer"]["accumulate_grad_batches"] == 1
    assert cfg["trainer"]["logger"]["class_path"].endswith("CSVLogger")
    assert cfg["trainer"]["logger"]["init_args"]["save_dir"] == "runs/toy"
    assert cfg["seed_everything"] == 7 and cfg["ckpt_path"] is None


def test_dotted_overrides_are_parsed_as_yaml(cli):
    cfg = print_config(cli, "--trainer.max_steps", "5", "--model.lr", "1e-3", "--model.init_args.hidden", "3",
                       "--data.batch_size=32", "--seed_everything", "11", "--ckpt_path", "last",
                       "--trainer.limit_val_batches", "0.5", "--trainer.max_time", "null",
                       "--trainer.logger.save_dir", "elsewhere", "--trainer.val_check_interval", "4",
                       "--trainer.gradient_clip_val", "1")
    assert cfg["trainer"]["max_steps"] == 5
    assert cfg["model"]["init_args"] == {"hidden": 3, "lr": 0.001, "in_features": 4}
    assert isinstance(cfg["model"]["init_args"]["lr"], float)
    assert cfg["data"]["init_args"]["batch_size"] == 32
    assert cfg["seed_everything"] == 11 and cfg["ckpt_path"] == "last"
    assert cfg["trainer"]["limit_val_batches"] == 0.5 and cfg["trainer"]["max_time"] is None
    assert cfg["trainer"]["logger"]["init_args"]["save_dir"] == "elsewhere"
    assert cfg["trainer"]["val_check_interval"] == 4                      # float | int: stays an int
    assert isinstance(cfg["trainer"]["val_check_interval"], int)
    assert isinstance(cfg["trainer"]["gradient_clip_val"], float)         # float | None: 1 -> 1.0


def test_several_configs_merge_and_later_wins(tmp_path, cli):
    extra = tmp_path / "extra.yaml"
    extra.write_text("model:\n  init_args:\n    hidden: 2\ntrainer:\n  callbacks:\n"
                     "    - class_path: ember.callbacks.Callback\n")
    cfg = print_config(cli, "--config", extra, "--model.hidden", "5")
    assert cfg["model"]["init_args"] == {"hidden": 5, "lr": 0.01, "in_features": 4}
    assert cfg["trainer"]["max_epochs"] == 2
    assert cfg["trainer"]["callbacks"] == [{"class_path": "ember.callbacks.base.Callback", "init_args": {}}]


def test_overrides_reach_into_lists_of_objects(cli):
    ckpt = CONFIG.parent / "checkpointing.yaml"
    cfg = print_config(cli, "-c", ckpt, "--trainer.callbacks.0.init_args.monitor", "train/loss",
                       "--trainer.callbacks.0.mode", "max")
    (callback,) = cfg["trainer"]["callbacks"]
    assert callback["class_path"].endswith(".ModelCheckpoint")     # short name resolved
    assert callback["init_args"]["monitor"] == "train/loss" and callback["init_args"]["mode"] == "max"
    assert callback["init_args"]["save_last"] is True


def test_model_class_given_on_the_command_line(cli):
    cfg = print_config(cli, "--model", "toy.ToyRegressor", "--model.hidden", "1")
    assert cfg["model"]["init_args"]["hidden"] == 1


def test_printed_config_is_a_fixed_point(tmp_path, cli):
    first = cli("fit", "--config", CONFIG, "--model.lr", "2e-2", "--print_config")
    (tmp_path / "printed.yaml").write_text(first.stdout)
    second = cli("fit", "--config", "printed.yaml", "--print_config")
    assert second.returncode == 0 and second.stdout == first.stdout


def test_script_with_fixed_classes(tmp_path, cli, capsys):
    """`main(model_class=..., datamodule_class=...)`: no class_path needed; flat init args."""
    from ember.cli import main
    from toy import ToyData, ToyRegressor
    (tmp_path / "flat.yaml").write_text("model:\n  hidden: 4\ndata:\n  batch_size: 8\n")
    assert main(["fit", "-c", "flat.yaml", "--model.lr", "0.5", "--print_config"],
                model_class=ToyRegressor, datamodule_class=ToyData) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"] == {"class_path": "toy.ToyRegressor",
                            "init_args": {"hidden": 4, "lr": 0.5, "in_features": 4}}
    assert cfg["data"]["init_args"]["batch_size"] == 8
    assert main(["fit", "--print_config"], model_class=ToyRegressor) == 2
    assert capsys.readouterr().err.strip() == ("ember: error: model.init_args: missing required "
                                               "argument 'hidden' of ToyRegressor")


BAD_CASES = {
    "unknown trainer key": (["--trainer.max_epoch", "3"],
                            "trainer.max_epoch: unknown key (did you mean 'max_epochs'?); valid: max_epochs, "),
    "unknown model arg": (["--model.hiden", "3"],
                          "model.init_args.hiden: unknown key (did you mean 'hidden'?); "
                          "valid: hidden, lr, in_features"),
    "unknown data arg": (["--data.batchsize", "3"],
                         "data.init_args.batchsize: unknown key (did you mean 'batch_size'?); "
                         "valid: batch_size, num_samples, in_features, seed"),
    "unknown section": (["--trainr.max_epochs", "3"],
                        "--trainr: unknown section (did you mean 'trainer'?); valid: seed_everything, "),
    "unknown callback arg": (["--trainer.callbacks", "[{class_path: ember.callbacks.Callback, "
                              "init_args: {every: 2}}]"],
                             "trainer.callbacks[0].init_args.every: unknown key; valid: (none)"),
    "wrong float": (["--model.lr", "abc"], "model.init_args.lr: expected float, got 'abc'"),
    "wrong int": (["--trainer.max_epochs", "two"], "trainer.max_epochs: expected int | None, got 'two'"),
    "wrong int (float given)": (["--data.batch_size", "1.5"], "data.init_args.batch_size: expected int, got 1.5"),
    "wrong seed": (["--seed_everything", "abc"], "seed_everything: expected int or bool, got 'abc'"),
    "missing module": (["--model.class_path", "nopkg.Model"],
                       "model.class_path: cannot import 'nopkg.Model': No module named 'nopkg'"),
    "missing class": (["--model", "toy.Nope"],
                      "model.class_path: cannot import 'toy.Nope': module 'toy' has no attribute 'Nope'"),
    "not a TrainModule": (["--model", "toy.ToyData"],
                          "model.class_path: 'toy.ToyData' is not a subclass of TrainModule"),
    "short name not found": (["--trainer.callbacks", "[{class_path: NoSuchCallback}]"],
                             "trainer.callbacks[0].class_path: class 'NoSuchCallback' not found in "),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_override_is_one_clear_line(cli, case):
    args, expected = BAD_CASES[case]
    line = one_line_error(cli("fit", "--config", CONFIG, *args))
    assert line.startswith(f"ember: error: {expected}"), line


BAD_FILES = {
    "unknown top-level key": ("trainr:\n  max_epochs: 1\n",
                              "trainr: unknown top-level key (did you mean 'trainer'?); "
                              "valid: seed_everything, trainer, model, data, ckpt_path"),
    "unknown model section key": ("model:\n  class_path: toy.ToyRegressor\n  init_arg: {hidden: 2}\n",
                                  "model.init_arg: unknown key (did you mean 'init_args'?); "
                                  "valid: class_path, init_args"),
    "missing required argument": ("model:\n  class_path: toy.ToyRegressor\n",
                                  "model.init_args: missing required argument 'hidden' of ToyRegressor"),
    "missing model": ("trainer:\n  max_epochs: 1\n", "model: missing; give model: {class_path: "),
    "missing class_path": ("model:\n  init_args: {hidden: 2}\n", "model.class_path: missing; "),
    "malformed yaml": ("model:\n  class_path: toy.ToyRegressor\n   init_args: [1\n", "is not valid YAML at line"),
    "not a mapping": ("- 1\n- 2\n", "must hold a mapping with keys seed_everything, trainer"),
    "wrong type in file": ("model:\n  class_path: toy.ToyRegressor\n  init_args: {hidden: [1, 2]}\n",
                           "model.init_args.hidden: expected int, got [1, 2]"),
    "trainer not a mapping": ("trainer: 3\nmodel: toy.ToyRegressor\n",
                              "trainer: expected a mapping of Trainer arguments, got 3"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_config_file_is_one_clear_line(tmp_path, cli, case):
    text, expected = BAD_FILES[case]
    (tmp_path / "bad.yaml").write_text(text)
    line = one_line_error(cli("fit", "--config", "bad.yaml"))
    assert expected in line, line


@pytest.mark.parametrize("case", ["malformed yaml", "missing required argument", "wrong type in file"])
def test_bad_config_in_a_real_process_has_no_traceback(tmp_path, case):
    text, expected = BAD_FILES[case]
    (tmp_path / "toy.py").write_text((EXAMPLE / "toy.py").read_text())   # importable next to the file
    (tmp_path / "bad.yaml").write_text(text)
    line = one_line_error(ember("fit", "--config", "bad.yaml", cwd=tmp_path))
    assert expected in line, line


def test_missing_config_file_and_missing_value(cli):
    line = one_line_error(cli("fit", "--config", "nope.yaml"))
    assert "--config: cannot read 'nope.yaml': No such file or directory" in line
    line = one_line_error(cli("fit", "--config", CONFIG, "--trainer.max_epochs"))
    assert "--trainer.max_epochs: expected a value" in line


def test_unknown_flag_is_one_line(tmp_path):
    line = one_line_error(ember("fit", "--config", CONFIG, "--max_epochs", "3", cwd=tmp_path))
    assert line == "ember: error: unrecognized arguments: --max_epochs 3 (see `ember fit --help`)"


def test_help_lists_trainer_keys(tmp_path):
    r = ember("fit", "--help", cwd=tmp_path)
    assert r.returncode == 0
    assert "--trainer.KEY VALUE" in r.stdout and "accumulate_grad_batches" in r.stdout
    for command in ("launch", "config", "env", "validate"):
        r = ember(command, "--help", cwd=tmp_path)
        assert r.returncode == 0 and "usage: ember " + command in r.stdout


def test_trainer_rejecting_a_value_is_one_clear_line(cli):
    line = one_line_error(cli("fit", "--config", CONFIG, "--trainer.precision", "17"))
    assert line.startswith("ember: error: trainer: precision=17 is not valid; choose one of: '64-true', '32-true'")
    line = one_line_error(cli("validate", "--config", CONFIG, "--trainer.accumulate_grad_batches", "0"))
    assert "accumulate_grad_batches=0 is not valid" in line


# --------------------------------------------------------------------------- running
def _meta(ckpt: Path) -> dict:
    import json
    return json.loads((ckpt / "meta.json").read_text())


def test_fit_saves_config_resumes_and_tests(tmp_path):
    env = {"PYTHONPATH": str(EXAMPLE)}   # so the saved config.yaml can name toy.ToyRegressor
    r = ember("fit", "--config", CONFIG, "--trainer.max_steps", "3", "--trainer.logger.save_dir", "logs",
              "--model.hidden", "5", "--seed_everything", "true", cwd=tmp_path, **env)
    assert r.returncode == 0, r.stderr
    run_dir = tmp_path / "logs" / "ember_logs" / "version_0"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 3 and saved["trainer"]["max_epochs"] == 2
    assert saved["model"]["init_args"] == {"hidden": 5, "lr": 0.01, "in_features": 4}
    assert isinstance(saved["seed_everything"], int) and saved["seed_everything"] is not True
    (ckpt,) = [p for p in (run_dir / "checkpoints").iterdir() if (p / "meta.json").exists()]
    meta = _meta(ckpt)
    assert meta["global_step"] == 3                         # the trainer ran max_steps=3
    assert meta["hparams"] == {"hidden": 5, "lr": 0.01, "in_features": 4}

    # the saved config runs again as is; resume from the checkpoint and train to step 6
    r = ember("fit", "--config", run_dir / "config.yaml", "--trainer.max_steps", "6",
              "--ckpt_path", ckpt, cwd=tmp_path, **env)
    assert r.returncode == 0, r.stderr
    run2 = tmp_path / "logs" / "ember_logs" / "version_1"
    assert yaml.safe_load((run2 / "config.yaml").read_text())["ckpt_path"] == str(ckpt)
    steps = sorted(_meta(p)["global_step"] for p in (run2 / "checkpoints").iterdir()
                   if (p / "meta.json").exists())
    assert steps[-1] == 6

    r = ember("test", "--config", run_dir / "config.yaml", "--ckpt_path", ckpt, cwd=tmp_path, **env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "test metrics" and lines[1].split()[0] == "test/loss"
    assert float(lines[1].split()[1]) > 0


# --------------------------------------------------------------------------- config / env
def test_config_wizard_with_scripted_stdin(tmp_path):
    answers = "multi_machine\n2\n1\n10.0.0.1\n29501\n4\nfsdp\nn\ny\nbf16\n"
    r = ember("config", cwd=tmp_path, input=answers)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((tmp_path / "xdg" / "ember" / "default_config.yaml").read_text())
    assert written == {"compute_environment": "multi_machine", "num_machines": 2, "machine_rank": 1,
                       "main_process_ip": "10.0.0.1", "main_process_port": 29501,
                       "rdzv_backend": "static", "num_processes": 4, "strategy": "fsdp",
                       "mixed_precision": "bf16",
                       "fsdp_config": {"reshard_after_forward": False, "cpu_offload": True}}


def test_config_wizard_reasks_invalid_answers_and_writes_given_path(tmp_path):
    answers = "cloud\nlocal_machine\n0\n3\nhorovod\ndeepspeed\n3\ncpu\ncpu\nfp16\n"
    r = ember("config", "--config_file", "ds.yaml", cwd=tmp_path, input=answers)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Please select one of the available options") == 2
    written = yaml.safe_load((tmp_path / "ds.yaml").read_text())
    assert written["num_processes"] == 3 and written["strategy"] == "deepspeed"
    assert written["mixed_precision"] == "fp16" and written["num_machines"] == 1
    assert written["deepspeed_config"] == {"zero_stage": 3, "offload_optimizer_device": "cpu",
                                           "offload_param_device": "cpu"}
    assert not (tmp_path / "xdg").exists()


def test_config_wizard_input_ends_early(tmp_path):
    line = one_line_error(ember("config", cwd=tmp_path, input="local_machine\n"))
    assert "config: input ended before every question was answered" in line


def test_config_default_and_env(tmp_path):
    r = ember("config", "--default", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "xdg" / "ember" / "default_config.yaml"
    written = yaml.safe_load(path.read_text())
    import torch
    n = torch.cuda.device_count()
    assert written["num_processes"] == max(n, 1) and written["num_machines"] == 1
    assert written["strategy"] == ("ddp" if n > 1 else "no") and written["mixed_precision"] == "no"

    r = ember("env", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "- `ember` version: " in r.stdout
    assert f"- PyTorch version: {torch.__version__}" in r.stdout
    assert "- CUDA available: " in r.stdout and "- MPS available: " in r.stdout
    assert "- deepspeed version: " in r.stdout and "- transformers version: " in r.stdout
    assert "Default launch config" in r.stdout and "  num_machines: 1" in r.stdout
