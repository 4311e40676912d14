"""`ember launch`: real torchrun agents and real gloo process groups (CPU)."""
from __future__ import annotations

import json
import os
import socket
import textwrap

import pytest

from helpers import EXAMPLES, finish, launch_env, run_ember, start_ember

pytestmark = pytest.mark.multiproc

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.environ.get("FAIL_RANK") == str(rank):
        raise RuntimeError(f"boom on rank {rank}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == 0:
        keys = ["EMBER_PRECISION", "EMBER_STRATEGY", "LOCAL_RANK", "WORLD_SIZE",
                "EMBER_DEEPSPEED_ZERO_STAGE", "EMBER_FSDP_CPU_OFFLOAD"]
        with open(os.environ["OUT_FILE"], "w") as f:
            json.dump({"sum": t.item(), "world": world, "argv": sys.argv[1:],
                       "env": {k: os.environ.get(k) for k in keys}}, f)
    dist.barrier()
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


def test_two_processes_all_reduce_argv_and_env(tmp_path, worker):
    r = run_ember("launch", "--num-processes", 2, "--mixed_precision", "bf16", worker, "--flag", "x",
                  env=launch_env(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["sum"] == 3.0 and out["world"] == 2          # 1 + 2
    assert out["argv"] == ["--flag", "x"]
    assert out["env"]["EMBER_PRECISION"] == "bf16-mixed"
    assert out["env"]["LOCAL_RANK"] == "0" and out["env"]["WORLD_SIZE"] == "2"
    assert out["env"]["EMBER_STRATEGY"] is None              # strategy "no": left unset


def test_config_file_values_are_defaults_and_flags_override(tmp_path, worker):
    cfg = tmp_path / "launch.yaml"
    cfg.write_text("num_processes: 2\nstrategy: deepspeed\nmixed_precision: fp16\n"
                   "deepspeed_config:\n  zero_stage: 3\n")
    r = run_ember("launch", "--config_file", cfg, worker, env=launch_env(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 2 and out["sum"] == 3.0
    assert out["env"]["EMBER_PRECISION"] == "16-mixed"
    assert out["env"]["EMBER_STRATEGY"] == "deepspeed"
    assert out["env"]["EMBER_DEEPSPEED_ZERO_STAGE"] == "3"

    r = run_ember("launch", "--config_file", cfg, "--num-processes", 1, "--mixed_precision", "no",
                  "--strategy", "fsdp", worker, env=launch_env(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 1 and out["sum"] == 1.0
    assert out["env"]["EMBER_PRECISION"] == "32-true"
    assert out["env"]["EMBER_STRATEGY"] == "fsdp"
    assert out["env"]["EMBER_FSDP_CPU_OFFLOAD"] == "0"
    assert out["env"]["EMBER_DEEPSPEED_ZERO_STAGE"] is None


def test_config_file_with_unquoted_no(tmp_path, worker):
    cfg = tmp_path / "launch.yaml"
    cfg.write_text("strategy: no\nmixed_precision: no\n")      # unquoted: YAML 1.1 reads false
    r = run_ember("launch", "--config_file", cfg, worker, env=launch_env(tmp_path, EMBER_STRATEGY="ddp"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 1 and out["sum"] == 1.0
    assert out["env"]["EMBER_PRECISION"] == "32-true"
    assert out["env"]["EMBER_STRATEGY"] is None     # "no" given: the inherited value is removed


def test_default_config_file_is_used(tmp_path, worker):
    env = launch_env(tmp_path)
    r = run_ember("config", "--default", env=env)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "xdg" / "ember" / "default_config.yaml"
    path.write_text(path.read_text().replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    r = run_ember("launch", worker, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["env"]["EMBER_PRECISION"] == "bf16-mixed"


def test_failing_rank_stops_the_run_and_reports_once(tmp_path, worker):
    r = run_ember("launch", "--num-processes", 2, worker, env=launch_env(tmp_path, FAIL_RANK="1"), timeout=60)
    assert r.returncode != 0
    assert (r.stdout + r.stderr).count("boom on rank 1") == 1, r.stderr
    # a plain torch script records no error: rank 1 is named, or, when rank 0 lost its peer and
    # exited in the same poll of the agent (a loaded machine), both are, saying so
    assert "ember: error: launch: rank 1 " in r.stderr or "ember: error: launch: ranks 0, 1 exited" in r.stderr, \
        r.stderr
    assert "Traceback" in r.stderr      # the worker's own traceback, shown once
    assert not (tmp_path / "out.json").exists()


def test_two_machines_one_process_each(tmp_path, worker):
    port = free_port()
    env = launch_env(tmp_path)
    procs = [start_ember("launch", "--num-machines", 2, "--machine-rank", rank, "--main-process-ip", "127.0.0.1",
                         "--main-process-port", port, "--num-processes", 2, worker, "--node", rank, env=env)
             for rank in (0, 1)]
    results = [finish(p, 90) for p in procs]
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 2 and out["sum"] == 3.0
    assert out["argv"] == ["--node", "0"]        # global rank 0 lives on machine 0
    assert out["env"]["WORLD_SIZE"] == "2" and out["env"]["LOCAL_RANK"] == "0"
    assert out["env"]["EMBER_PRECISION"] is None      # not given: nothing exported


@pytest.mark.parametrize("args, message", [
    (["--num-machines", "2", "--num-processes", "2"], "--main-process-ip is required"),
    (["--num-machines", "2", "--num-processes", "3", "--main-process-ip", "127.0.0.1"],
     "num_processes: 3 is the total over all machines (as in Accelerate) and does not divide by "
     "num_machines (2)"),
    (["--num-machines", "2", "--nproc_per_node", "2", "--num-processes", "2", "--main-process-ip", "127.0.0.1"],
     "--nproc_per_node 2 on 2 machine(s) is 4 processes in total, but --num_processes says 2"),
    (["--num-machines", "2", "--machine-rank", "2", "--main-process-ip", "127.0.0.1"],
     "machine_rank: 2 must be below num_machines (2)"),
    (["--num-processes", "0"], "num_processes: expected an int >= 1, got 0"),
    (["--strategy", "horovod"], "argument --strategy: invalid choice"),
])
def test_bad_launch_arguments_are_one_line(tmp_path, worker, args, message):
    r = run_ember("launch", *args, worker, env=launch_env(tmp_path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error:") and message in lines[0], r.stderr


def test_bad_launch_config_file(tmp_path, worker):
    cfg = tmp_path / "launch.yaml"
    cfg.write_text("num_procesess: 2\n")
    r = run_ember("launch", "--config_file", cfg, worker, env=launch_env(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip() == ("ember: error: config_file: num_procesess: unknown key (did you mean "
                                "'num_processes'?); valid keys: compute_environment, num_machines, "
                                "machine_rank, main_process_ip, main_process_port, rdzv_backend, "
                                "num_processes, strategy, mixed_precision, fsdp_config, deepspeed_config")


def test_launch_ember_fit_on_two_processes(tmp_path):
    """`ember launch -m ember fit`: the exported precision/strategy reach the Trainer."""
    import yaml
    config = EXAMPLES / "cli" / "config.yaml"
    # the config's class_path names toy.ToyRegressor: its folder goes on PYTHONPATH (ember
    # never adds a config file's folder to sys.path itself)
    pythonpath = os.pathsep.join(p for p in (str(config.parent), os.environ.get("PYTHONPATH")) if p)
    r = run_ember("launch", "--num-processes", 2, "--strategy", "ddp", "--mixed_precision", "bf16",
                  "-m", "ember", "fit", "--config", config, "--trainer.max_steps", 2,
                  "--trainer.logger.save_dir", "logs", cwd=tmp_path, env=launch_env(tmp_path, PYTHONPATH=pythonpath),
                  timeout=120)
    assert r.returncode == 0, r.stderr
    runs = list((tmp_path / "logs").glob("*/version_*"))
    assert len(runs) == 1                      # rank 0 alone made the run directory
    saved = yaml.safe_load((runs[0] / "config.yaml").read_text())
    assert saved["trainer"]["precision"] == "bf16-mixed" and saved["trainer"]["strategy"] == "ddp"
    (meta,) = runs[0].glob("checkpoints/*/meta.json")
    meta = json.loads(meta.read_text())
    assert meta["world_size"] == 2 and meta["precision"] == "bf16-mixed" and meta["global_step"] == 2
