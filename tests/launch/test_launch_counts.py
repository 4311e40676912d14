"""``ember launch``'s process counts on several machines: ``--num_processes`` (and
``num_processes`` in a config file, ember's or Accelerate's) is the total over all
machines, as in Accelerate; torchrun gets the count per machine."""
from __future__ import annotations

import pytest

from ember.cli import build_parser
from ember.launch import UsageError, resolve_launch_config, torchrun_argv

MACHINE = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1"]


def argv(*args, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    ns = build_parser().parse_args(["launch", *map(str, args), "train.py"])
    cfg = resolve_launch_config(ns)
    return cfg, torchrun_argv(cfg, ns)


@pytest.mark.parametrize("args, total, per_node", [
    (MACHINE + ["--num_processes", "4"], 4, 2),               # Accelerate's meaning: 4 in all
    (MACHINE + ["--nproc_per_node", "4"], 8, 4),              # torchrun's meaning: 4 each
    (MACHINE + ["--nproc_per_node", "2", "--num_processes", "4"], 4, 2),   # both, agreeing
    (MACHINE, 2, 1),                                          # nothing said: one per machine
    (MACHINE + ["--gpu_ids", "0,1"], 4, 2),                   # one per listed GPU on each machine
    (["--num_processes", "3"], 3, 3),                         # one machine: unchanged
])
def test_num_processes_is_the_total_over_all_machines(tmp_path, monkeypatch, args, total, per_node):
    cfg, run = argv(*args, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert cfg["num_processes"] == total
    assert f"--nproc-per-node={per_node}" in run and f"--nnodes={cfg['num_machines']}" in run


def test_config_files_count_the_total_too(tmp_path, monkeypatch):
    ours = tmp_path / "ours.yaml"
    ours.write_text("num_machines: 2\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\nnum_processes: 6\n")
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 3\n"
                          "machine_rank: 2\nmain_process_ip: 10.0.0.1\nnum_processes: 6\nuse_cpu: true\n")
    for path, per_node in ((ours, 3), (accelerate, 2)):
        cfg, run = argv("--config_file", path, tmp_path=tmp_path, monkeypatch=monkeypatch)
        assert cfg["num_processes"] == 6 and f"--nproc-per-node={per_node}" in run
    with pytest.raises(UsageError, match=r"num_processes: 5 is the total over all machines .* num_machines \(3\)"):
        argv("--config_file", accelerate, "--num_processes", 5, tmp_path=tmp_path, monkeypatch=monkeypatch)
    with pytest.raises(UsageError, match=r"--num_processes 4 \(2 per machine on 2 machines\) but only 1 GPU"):
        argv(*MACHINE, "--gpu_ids", "0", "--num_processes", 4, tmp_path=tmp_path, monkeypatch=monkeypatch)


def test_an_elastic_group_of_min_to_max_machines(tmp_path, monkeypatch):
    """``--num_machines MIN:MAX`` (``--nnodes``, as torchrun) goes to torchrun as
    ``--nnodes=MIN:MAX`` under the c10d rendezvous; the count per machine is taken from the
    most machines. The static rendezvous cannot run it; MIN above MAX or not a number is a
    usage error naming the flag."""
    c10d = ["--main_process_ip", "10.0.0.1", "--rdzv_backend", "c10d", "--nproc_per_node", "2"]
    cfg, run = argv("--nnodes", "1:2", *c10d, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert "--nnodes=1:2" in run and "--nproc-per-node=2" in run and "--rdzv-backend=c10d" in run
    assert (cfg["num_machines"], cfg["min_machines"], cfg["num_processes"]) == (2, 1, 4)
    _, run = argv("--num_machines", "2:2", *c10d, tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert "--nnodes=2" in run                               # MIN = MAX: a fixed group
    with pytest.raises(UsageError, match=r"--num_machines 1:2: a group of MIN to MAX machines needs --rdzv_backend "
                                         r"c10d"):
        argv("--num_machines", "1:2", "--machine_rank", "0", "--main_process_ip", "10.0.0.1", tmp_path=tmp_path,
             monkeypatch=monkeypatch)
    for bad in ("3:2", "0:2", "a:2"):
        with pytest.raises(SystemExit):
            argv("--num_machines", bad, *c10d, tmp_path=tmp_path, monkeypatch=monkeypatch)
