"""``ember launch --multi_gpu --num_processes 2 script.py --cpu``, the launch line of
Accelerate's examples, on a machine without GPUs: as with ``accelerate launch``, the
script asked for the CPU, so its processes run there (gloo). Without the script's
``--cpu`` neither can run, and the error names both ways out."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from ember.cli import build_parser
from ember.launch import UsageError, resolve_launch_config, worker_env
from ember.launch.accelerate_flags import accelerate_env
from helpers import launch_env as _env
from helpers import run_ember as ember

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without GPUs")


def resolve(argv, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))   # no default config file
    cfg = resolve_launch_config(build_parser().parse_args(["launch", *argv]))
    return cfg, {**worker_env(cfg), **accelerate_env(cfg)}


def test_script_cpu_flag_runs_the_processes_on_the_cpu(tmp_path, monkeypatch, capsys):
    cfg, env = resolve(["--multi_gpu", "--num_processes", "2", "nlp_example.py", "--mixed_precision", "no", "--cpu"],
                       tmp_path, monkeypatch)
    assert cfg["num_processes"] == 2 and cfg["strategy"] == "ddp"
    assert env["ACCELERATE_USE_CPU"] == "true" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert "running its 2 processes on the CPU" in capsys.readouterr().err


def test_without_cpu_the_error_names_both_ways_out(tmp_path, monkeypatch):
    with pytest.raises(UsageError) as err:
        resolve(["--multi_gpu", "--num_processes", "2", "nlp_example.py", "--lr", "1"], tmp_path, monkeypatch)
    msg = str(err.value)
    assert "no GPU is visible" in msg
    assert "ember launch --cpu --num_processes 2 nlp_example.py --lr 1" in msg
    assert "ember launch --multi_gpu --num_processes 2 nlp_example.py --lr 1 --cpu" in msg
    with pytest.raises(UsageError, match="give the number of CPU processes"):
        resolve(["--multi_gpu", "nlp_example.py", "--cpu"], tmp_path, monkeypatch)


WORKER = textwrap.dedent("""
    import argparse, json, os
    from ember import Accelerator
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    acc = Accelerator(cpu=args.cpu)
    world = acc.reduce(__import__("torch").ones(()), "sum").item()
    if acc.is_main_process:
        with open(os.environ["OUT_FILE"], "w") as f:
            json.dump({"world": acc.num_processes, "summed": world, "type": acc.distributed_type.value,
                       "device": str(acc.device)}, f)
""")


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_accelerate_launch_line_runs(tmp_path):
    (tmp_path / "w.py").write_text(WORKER)
    r = ember("launch", "--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1, tmp_path / "w.py",
              "--cpu", env=_env(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out == {"world": 2, "summed": 2.0, "type": "MULTI_CPU", "device": "cpu"}
