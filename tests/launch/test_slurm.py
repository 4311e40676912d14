"""A real SLURM cluster on this host (Debian's ``slurm-wlm``: munged, slurmctld and
slurmd, set up by the fixture in a temporary folder with its own ports), and a 2-task
DDP fit under ``srun``: plain, warned by SIGUSR1 (``--signal=USR1@...``) and requeued, and
stopped by SIGTERM then resumed (tests/scripts/slurm_train.py). Skipped where the SLURM
daemons are not installed (``apt-get install slurm-wlm``)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "slurm_train.py")
BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "scancel", "squeue", "sinfo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(path: str) -> str | None:
    return shutil.which(path) or next((p for p in (f"/usr/sbin/{path}", f"/sbin/{path}") if os.path.exists(p)), None)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node cluster (2 CPUs shared by up to 4 tasks each); yields the environment
    of its clients (``SLURM_CONF``)."""
    missing = [b for b in BINARIES if _daemon(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed here (missing {', '.join(missing)}; apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's slurmd runs as root (SlurmdUser=root)")
    root = tmp_path_factory.mktemp("slurm")
    for d in ("state", "spool", "log", "munge"):
        (root / d).mkdir()
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "key"
    key.write_bytes(os.urandom(128))
    os.chmod(key, 0o600)
    sock = root / "munge" / "sock"
    subprocess.run([_daemon("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--log-file={root / 'munge' / 'log'}", f"--pid-file={root / 'munge' / 'pid'}",
                    f"--seed-file={root / 'munge' / 'seed'}"], check=True, timeout=30)
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(textwrap.dedent(f"""\
        ClusterName=ember{uuid.uuid4().hex[:6]}
        SlurmctldHost={host}(127.0.0.1)
        SlurmctldPort={free_port()}
        SlurmdPort={free_port()}
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/munge
        AuthInfo=socket={sock},cred_expire=5
        CredType=cred/munge
        StateSaveLocation={root / 'state'}
        SlurmdSpoolDir={root / 'spool'}
        SlurmctldPidFile={root / 'slurmctld.pid'}
        SlurmdPidFile={root / 'slurmd.pid'}
        SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
        SlurmdLogFile={root / 'log' / 'slurmd.log'}
        PlugStackConfig={root / 'plugstack.conf'}
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        MpiDefault=none
        SwitchType=switch/none
        SchedulerType=sched/builtin
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        ReturnToService=2
        JobRequeue=1
        JobCompType=jobcomp/none
        AccountingStorageType=accounting_storage/none
        JobAcctGatherType=jobacct_gather/none
        InactiveLimit=0
        KillWait=5
        MinJobAge=300
        NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
        PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
        """))
    (root / "plugstack.conf").write_text("")
    env = dict(os.environ, SLURM_CONF=str(conf))
    for var in [k for k in env if k.startswith(("SLURM_", "EMBER_", "TORCHELASTIC", "MASTER_", "RANK", "LOCAL_RANK",
                                                 "WORLD_SIZE"))]:
        if var != "SLURM_CONF":
            del env[var]
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        subprocess.run([_daemon("slurmctld"), "-c", "-f", str(conf)], env=env, check=True, timeout=30)
        subprocess.run([_daemon("slurmd"), "-N", host, "-f", str(conf)], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                           text=True).stdout:
            if time.monotonic() > deadline:
                pytest.fail("the test cluster's node never became idle:\n" +
                            (root / "log" / "slurmctld.log").read_text()[-3000:])
            time.sleep(0.3)
        yield env, root
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((root / pid_file).read_text().split()[0]), signal.SIGTERM)


def srun_argv(out, tag, *args):
    return ["srun", "-n", "2", "-N", "1", f"--job-name={tag}", sys.executable, SCRIPT, str(out), tag, *args]


def wait_for(path, proc=None, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            pytest.fail(f"{path} never appeared")
        time.sleep(0.1)


def attempts(out, tag) -> list[list[int]]:
    with open(os.path.join(out, f"{tag}.attempts")) as f:
        return [[int(v) for v in line.split()] for line in f.read().splitlines()]


def weights(out, tag) -> dict:
    return load_file(os.path.join(out, f"{tag}.safetensors"))


def bit_equal(a, b) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(600)
def test_srun_fit_usr1_preemption_requeue_and_sigterm(slurm, tmp_path):
    env, root = slurm
    out = tmp_path
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(
        SCRIPT))), env.get("PYTHONPATH")])))

    # 1. training under srun: two tasks are two ranks (the uninterrupted reference)
    r = subprocess.run(srun_argv(out, "plain"), env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert attempts(out, "plain") == [[0, 1, 2]]

    # 2. a job submitted as `sbatch --signal=USR1@50 --requeue`: once training runs, every task
    # gets SIGUSR1 (as SLURM's warning before the time limit sends it, to every step); ember
    # saves `last`, rank 0 requeues the job, and the requeued job (SLURM_RESTART_COUNT=1)
    # resumes from `last`. The signal is sent with `scancel --signal=USR1`, not by cutting
    # the time limit: SLURM measures a new limit from the job's start, so on a loaded machine
    # (a start-up over a minute) a one-minute limit had already passed and SLURM ended the
    # job for its time (SIGTERM, no requeue) rather than warning it; and the requeued job
    # kept the short limit, so a slow resume could be warned (and requeued) a second time.
    job = out / "job.sh"
    job.write_text("#!/bin/bash\n" + " ".join(srun_argv(out, "usr1", "--wait-at", "3")) + "\n")
    jid = subprocess.run(["sbatch", "--parsable", "-n", "2", "-N", "1", "--time=10", "--signal=USR1@50", "--requeue",
                          "--open-mode=append", f"--output={out / 'usr1.log'}", str(job)],
                         env=env, capture_output=True, text=True, check=True, timeout=30).stdout.strip().split(";")[0]
    try:
        wait_for(out / "usr1.ready", timeout=180)
        subprocess.run(["scancel", "--signal=USR1", jid], env=env, check=True, timeout=30)
        wait_for(out / "usr1.safetensors", timeout=240)
    finally:
        subprocess.run(["scancel", jid], env=env, timeout=30)
    log = (out / "usr1.log").read_text()
    assert "received SIGUSR1 at step" in log and "DUE TO JOB REQUEUE" in log, log[-4000:]
    runs = attempts(out, "usr1")
    assert [run[0] for run in runs] == [0, 1] and runs[1][1] > 1 and runs[1][2] == 2, runs
    assert bit_equal(weights(out, "usr1"), weights(out, "plain"))

    # 3. SIGTERM to every task (what SLURM sends at a time limit or preemption): `last` is
    # saved and srun exits 0; the next srun resumes from it
    p = subprocess.Popen(srun_argv(out, "term", "--wait-at", "5"), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(out / "term.ready", p, timeout=180)
        subprocess.run(["scancel", "--signal=TERM", "--name=term"], env=env, check=True, timeout=30)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "received SIGTERM at step" in err, err[-4000:]
    assert not (out / "term.safetensors").exists()
    r = subprocess.run(srun_argv(out, "term"), env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    runs = attempts(out, "term")
    assert len(runs) == 2 and runs[1][1] > 1, runs
    assert bit_equal(weights(out, "term"), weights(out, "plain"))
