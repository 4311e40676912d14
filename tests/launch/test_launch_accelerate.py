"""``ember launch`` with Accelerate's flags, config YAML and ACCELERATE_* variables."""
from __future__ import annotations

import json
import textwrap

import pytest

from ember.cli import build_parser
from ember.launch import UsageError, resolve_launch_config, worker_env
from ember.launch.accelerate_flags import accelerate_env
from helpers import launch_env, run_ember

ACCELERATE_YAML = textwrap.dedent("""\
    compute_environment: LOCAL_MACHINE
    debug: false
    distributed_type: MULTI_CPU
    downcast_bf16: 'no'
    machine_rank: 0
    main_training_function: main
    mixed_precision: bf16
    num_machines: 1
    num_processes: 2
    rdzv_backend: static
    same_network: true
    tpu_env: []
    tpu_use_cluster: false
    tpu_use_sudo: false
    use_cpu: true
    dynamo_config:
      dynamo_backend: EAGER
""")


def resolve(*argv, tmp_path=None, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    args = build_parser().parse_args(["launch", *map(str, argv), "script.py"])
    cfg = resolve_launch_config(args)
    return cfg, {**worker_env(cfg), **accelerate_env(cfg)}


def test_accelerate_config_and_flags_map_onto_ember(tmp_path, monkeypatch):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_YAML)
    cfg, env = resolve("--config_file", path, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert cfg["num_processes"] == 2 and cfg["strategy"] == "ddp"
    assert env["EMBER_PRECISION"] == "bf16-mixed" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_USE_CPU"] == "true" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "eager"
    cfg, env = resolve("--use_deepspeed", "--num_cpu_threads_per_process", 3, "--mixed_precision", "fp16",
                       "--dynamo_backend", "inductor", "-m", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert cfg["strategy"] == "deepspeed" and env["EMBER_STRATEGY"] == "deepspeed"
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["OMP_NUM_THREADS"] == "3"
    assert env["EMBER_PRECISION"] == "16-mixed" and env["ACCELERATE_DYNAMO_BACKEND"] == "inductor"
    cfg, env = resolve("--gpu_ids", "0,1", tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert cfg["num_processes"] == 2 and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_offload_params: true\n"
                    "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n")
    cfg, env = resolve("--config_file", fsdp, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert env["EMBER_STRATEGY"] == "fsdp" and env["EMBER_FSDP_CPU_OFFLOAD"] == "1"
    assert env["EMBER_FSDP_RESHARD_AFTER_FORWARD"] == "0"


@pytest.mark.parametrize("argv, yaml_text, message", [
    (["--gpu_ids", "0,1", "--num_processes", 3], None, "never runs fewer processes"),
    (["--cpu", "--gpu_ids", "0"], None, "--cpu excludes"),
    (["--use_deepspeed", "--use_fsdp"], None, "exclude each other"),
    (["--use_fsdp", "--strategy", "ddp"], None, "contradicts"),
    ([], "distributed_type: XLA\n", "distributed_type='XLA' is not supported"),
    ([], "distributed_type: MULTI_GPU\nmixed_precision: fp8\n", "fp8"),
])
def test_accelerate_flags_refused_with_one_line(tmp_path, monkeypatch, argv, yaml_text, message):
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text)
        argv = ["--config_file", tmp_path / "c.yaml", *argv]
    with pytest.raises(UsageError, match=message):
        resolve(*argv, tmp_path=tmp_path, monkeypatch=monkeypatch)


WORKER = textwrap.dedent("""
    import json, os
    from ember import Accelerator
    acc = Accelerator()
    if acc.is_main_process:
        keys = ["ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "OMP_NUM_THREADS", "EMBER_PRECISION"]
        with open(os.environ["OUT_FILE"], "w") as f:
            json.dump({"world": acc.num_processes, "type": acc.distributed_type.value, "device": str(acc.device),
                       "precision": acc.mixed_precision, "gas": acc.gradient_accumulation_steps,
                       "env": {k: os.environ.get(k) for k in keys}}, f)
    acc.wait_for_everyone()
""")


@pytest.mark.timeout(150)
def test_launch_with_an_accelerate_config_runs_every_process(tmp_path):
    (tmp_path / "w.py").write_text(WORKER)
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_YAML.replace("dynamo_backend: EAGER", "dynamo_backend: 'NO'"))
    r = run_ember("launch", "--config_file", tmp_path / "accelerate.yaml", "--num_cpu_threads_per_process", 1,
                  "--gradient_accumulation_steps", 2, tmp_path / "w.py", env=launch_env(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world"] == 2 and out["type"] == "MULTI_CPU" and out["device"] == "cpu"
    assert out["precision"] == "bf16" and out["gas"] == 2
    assert out["env"] == {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
                          "EMBER_PRECISION": "bf16-mixed"}
