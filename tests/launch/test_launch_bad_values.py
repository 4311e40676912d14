"""`ember launch` refuses every value it cannot run with, as one `ember: error:` line naming
the argument, before any process starts; a rank's environment that is not an integer is
named too; and two agents on one host both given machine_rank 0 do not hang: the second
fails at once, the first within --rdzv_timeout (real agents on loopback)."""
from __future__ import annotations

import socket
import time

import pytest

from helpers import EXAMPLES, finish, launch_env, one_line_error, start_ember


@pytest.fixture
def cli(cli, tmp_path):
    """conftest.py's ``cli`` (no launcher or SLURM variable), a ``script.py`` to launch, and
    every call ends within 10 s (nothing waits for processes that never start)."""
    (tmp_path / "script.py").write_text("print('ran')\n")

    def run(*args):
        start = time.monotonic()
        r = cli(*args)
        took = time.monotonic() - start
        assert took < 10, took
        return r
    return run


BAD = {
    "port 0": (["--num_processes", "2", "--main_process_port", "0"],
               "main_process_port: 0 is not a TCP port (1 to 65535); 0 would ask the system for any free port"),
    "port 99999": (["--num_processes", "2", "--main_process_port", "99999"],
                   "main_process_port: 99999 is not a TCP port (1 to 65535)"),
    "port 70000 on two machines": (["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "10.0.0.1",
                                    "--main_process_port", "70000"], "main_process_port: 70000 is not a TCP port"),
    "ip with spaces": (["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "10.0.0.1 evil"],
                       "main_process_ip: '10.0.0.1 evil' is not an IP address or a host name"),
    "max_restarts -1": (["--max_restarts", "-1"], "--max_restarts: expected an int >= 0, got -1"),
    "monitor_interval 0": (["--monitor_interval", "0"], "--monitor_interval: expected a number of seconds > 0, got 0"),
    "monitor_interval -1": (["--monitor_interval", "-1"], "--monitor_interval: expected a number of seconds > 0"),
    "rdzv_timeout nan": (["--rdzv_timeout", "nan"], "--rdzv_timeout: expected a number of seconds > 0, got nan"),
    "gradient_accumulation_steps 0": (["--gradient_accumulation_steps", "0"],
                                      "--gradient_accumulation_steps: expected an int >= 1, got 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_launch_values_are_one_line_naming_the_argument(cli, case):
    args, message = BAD[case]
    line = one_line_error(cli("launch", *args, "script.py"))
    assert message in line, line


def test_deepspeed_yaml_with_a_non_integer_accumulation_is_one_line(tmp_path, cli):
    (tmp_path / "ds.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                                      "num_processes: 1\ndeepspeed_config:\n  zero_stage: 2\n"
                                      "  gradient_accumulation_steps: abc\n")
    line = one_line_error(cli("launch", "--config_file", "ds.yaml", "script.py"))
    assert "config_file: deepspeed_config.gradient_accumulation_steps: expected an int >= 1, got 'abc'" in line


def test_an_ip_port_and_host_names_that_are_fine_still_pass():
    from ember.launch.command import _check_host, _check_port
    for host in ("10.0.0.1", "::1", "[fe80::1]", "node-0", "gpu01.cluster.local", "localhost"):
        assert _check_host("main_process_ip", host) == host
    assert _check_port("main_process_port", 1) == 1 and _check_port("main_process_port", 65535) == 65535


@pytest.mark.parametrize("env, message", [
    ({"RANK": "abc", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "environment variable RANK='abc' is not an "
                                                                      "integer >= 0"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "x"},
     "environment variable SLURM_NTASKS_PER_NODE='x' is not a SLURM task count"),
])
def test_a_rank_environment_that_is_not_a_number_is_one_line(cli, monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = one_line_error(cli("fit", "--config", EXAMPLES / "cli" / "config.yaml", "--trainer.max_steps", "1"))
    assert message in line, line


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_agents_both_machine_rank_0_fail_fast_and_never_hang(tmp_path):
    (tmp_path / "w.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    port, env = _free_port(), launch_env(tmp_path)
    args = ["launch", "--num_machines", 2, "--machine_rank", 0, "--main_process_ip", "127.0.0.1",
            "--main_process_port", port, "--num_processes", 2, "--rdzv_timeout", 4, tmp_path / "w.py"]
    first = start_ember(*args, env=env)
    try:
        deadline = time.monotonic() + 60
        while not _port_taken(port):          # machine 0's store listens (binding, not connecting to it)
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        t0 = time.monotonic()
        second = finish(start_ember(*args, env=env), 60)
        assert time.monotonic() - t0 < 30
        line = one_line_error(second)
        assert f"--main_process_port {port} is already in use on this machine" in line, line
        assert "each machine needs its own --machine_rank" in line
    finally:
        r = finish(first, 60)                 # waits --rdzv_timeout for machine 1, then stops
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ember: error: launch: the 2 machines did not all join the rendezvous at "
                           f"127.0.0.1:{port} within --rdzv_timeout 4 s"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
