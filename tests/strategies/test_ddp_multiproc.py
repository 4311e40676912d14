"""DDP with two real processes (gloo, CPU), started the three ways ember supports:
a plain ``python script.py`` (ember's launcher), ``torchrun``, and SLURM-style
variables. The scripts live in tests/scripts/ and write JSON per rank."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.strategies.environments import find_free_port
from helpers import SCRIPTS, child_env, import_script

pytestmark = pytest.mark.multiproc

TIMEOUT = 120  # a hang guard: a healthy run takes a few seconds per process start


def run_plain(script, *args, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)], cwd=cwd,
                          env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)


def run_torchrun(script, *args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(find_free_port()),
           str(SCRIPTS / script), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)


def run_slurm(script, *args, cwd):
    """Two local tasks with the variables srun sets (one node, job 4242)."""
    port = find_free_port()
    procs = []
    for rank in range(2):
        env = child_env(SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                        SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_TASKS_PER_NODE="2",
                        SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / script), *map(str, args)], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def load(out, scenario):
    return [json.loads((Path(out) / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


def _max_diff(a, b):
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ddp_train_module():
    return import_script("ddp_train")


@pytest.fixture(scope="module")
def regression_reference(ddp_train_module, tmp_path_factory):
    """Single process, batch 16: the weights DDP with 2 x 8 must reproduce."""
    root = tmp_path_factory.mktemp("ref")
    return {acc: ddp_train_module.fit_regressor(1, 16, acc, str(root))[1] for acc in (1, 2)}


def test_collectives_plain_launch(tmp_path):
    """ember's own launcher: ranks, env vars, every collective, gather_for_metrics, DDP grads."""
    ok(run_plain("ddp_collectives.py", tmp_path, cwd=tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r, d in enumerate((r0, r1)):
        assert (d["rank"], d["world"], d["env"], d["local_rank"]) == (r, 2, "local", r)
        ev = d["env_vars"]
        assert (ev["RANK"], ev["LOCAL_RANK"], ev["WORLD_SIZE"], ev["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "2", "2")
        assert ev["MASTER_ADDR"] == "127.0.0.1" and ev["MASTER_PORT"] == r0["env_vars"]["MASTER_PORT"]
        assert d["reduce"] == {"sum": [3.0, 30.0], "mean": [1.5, 15.0], "max": [2.0, 20.0], "min": [1.0, 10.0]}
        assert d["reduce_int_mean"] == 1.5
        assert "'sum', 'mean', 'max', 'min'" in d["bad_op"]
        assert d["all_gather"] == [[1.0, 10.0], [2.0, 20.0]]
        assert d["all_gather_cat"] == [0.0, 1.0, 0.0, 1.0, 2.0]
        assert d["all_gather_object"] == [{"r": 0}, {"r": 1}]
        assert d["broadcast_obj"] == {"from": 1} and d["broadcast_t"] == [1.0, 1.0]
        assert d["gather"] == [0, 0, 1]
        # 7 samples over 2 ranks: one duplicate, dropped; dataset order restored
        assert d["num_padded"] == 1
        assert d["gfm"] == d["gfm_default_pg"] == [0, 10, 20, 30, 40, 50, 60]
        assert d["gfm_names"] == [f"s{i}" for i in range(0, 70, 10)]
        assert d["is_ddp"] == "DistributedDataParallel"
        assert d["grad"] == [[1.5, 1.5, 1.5]]           # mean of x = 1 and x = 2
        assert d["grad_nosync"] == [[r + 1.0] * 3]       # no all-reduce under no_backward_sync
    assert r0["pad"] == [[1.0, 1.0], [-1.0, -1.0]] and r1["pad"] == [[1.0, 1.0], [1.0, 1.0]]
    assert r0["pad_first"] == [[0.0, 1.0], [0.0, 1.0]]


def test_ddp_matches_single_process_plain_launch(tmp_path, regression_reference):
    """Trainer(devices=2, strategy="ddp") from `python script.py`: 2 x batch 8 gives the
    weights of one process with batch 16, with and without accumulate_grad_batches=2
    (two fit calls in one script share the process group)."""
    ok(run_plain("ddp_train.py", "equiv", tmp_path, cwd=tmp_path))
    r0, r1 = load(tmp_path, "equiv")
    assert (r0["env"], r0["world"], r1["rank"]) == ("local", 2, 1)
    for acc in (1, 2):
        assert _max_diff(r0[f"acc{acc}"], r1[f"acc{acc}"]) == 0.0
        assert _max_diff(r0[f"acc{acc}"], regression_reference[acc]) < 1e-5


def test_ddp_slurm_environment(tmp_path, regression_reference):
    """Two tasks with SLURM_* variables: ranks from SLURM_PROCID, same result as single process."""
    results = run_slurm("ddp_train.py", "equiv", tmp_path, cwd=tmp_path)
    for code, out, err in results:
        assert code == 0, err[-6000:]
    r0, r1 = load(tmp_path, "equiv")
    assert (r0["env"], r1["env"], r0["rank"], r1["rank"], r0["world"]) == ("slurm", "slurm", 0, 1, 2)
    assert _max_diff(r0["acc2"], regression_reference[2]) < 1e-5


def test_ddp_ember_launch(tmp_path, regression_reference):
    """`python -m ember launch --num-processes 2 script.py`: torchrun's agent underneath."""
    proc = subprocess.run([sys.executable, "-m", "ember", "launch", "--num-processes", "2",
                           str(SCRIPTS / "ddp_train.py"), "equiv", str(tmp_path)],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    ok(proc)
    r0, r1 = load(tmp_path, "equiv")
    assert (r0["env"], r0["world"], r1["rank"]) == ("torchelastic", 2, 1)
    assert _max_diff(r0["acc1"], regression_reference[1]) < 1e-5


def test_metrics_exact_under_torchrun(tmp_path, ddp_train_module):
    """1001 evaluation samples over 2 ranks (one padded duplicate, uneven last batch):
    GatherMetrics and gather_for_metrics see exactly the 1001 samples, in order, and the
    accuracy equals the single-process value; predict returns the dataset in order."""
    ok(run_torchrun("ddp_train.py", "metrics", tmp_path, cwd=tmp_path))
    _, single = ddp_train_module.run_metrics(1, str(tmp_path))
    assert single["validate"]["n"] == 1001.0
    r0, r1 = load(tmp_path, "metrics")
    n = ddp_train_module.N_EVAL
    for d in (r0, r1):
        assert d["env"] == "torchelastic" and d["world_size"] == 2
        for stage in ("validate", "validate_gather", "test", "by_hand"):
            assert d[stage]["n"] == n, stage
            assert d[stage]["ids_in_order"] == 1.0, stage
            assert d[stage]["acc"] == single[stage]["acc"], stage    # exact, not approximately
        assert d["fit_val"]["acc"] == single["fit_val"]["acc"] and d["fit_val"]["n"] == n
        assert d["validate"]["rank"] == 0.5 and d["fit_val"]["rank"] == 0.5   # sync_dist mean of 0 and 1
        assert d["predict_ids"] == list(range(n)) == d["callback_predict_ids"]
        assert d["predict_names"] == [f"sample-{k}" for k in range(n)]   # lists of strings gather too
        # a partial pass (limit_val_batches=3): 3 x 16 samples per rank, nothing dropped as padding
        assert d["partial"]["ids"] == list(range(2 * 3 * 16)) and d["partial_gather_metrics_n"] == 96
        assert d["predict_preds"] == single["predict_preds"]
        assert "ranks logged different metric names" in d["different_keys_error"]
        assert "only_on_rank0" in d["different_keys_error"] and "only_on_rank1" in d["different_keys_error"]
    assert single["validate"]["rank"] == 0.0
    assert single["partial"]["ids"] == list(range(3 * 16))


def _check_failure(proc, tmp_path):
    err = proc.stderr
    assert proc.returncode != 0
    assert err.count("RuntimeError: boom on rank 1 at step 3") == 1, err[-6000:]   # the traceback, once
    assert "[rank1]: Traceback (most recent call last)" in err
    assert "[rank0]: Traceback" not in err                                          # no second traceback
    assert not list(tmp_path.glob("fail_rank*.json"))                               # nobody finished


def test_rank_failure_plain_launch(tmp_path):
    """A rank that raises ends the whole job (not a 30-minute collective timeout)."""
    proc = run_plain("ddp_train.py", "fail", tmp_path, cwd=tmp_path)
    _check_failure(proc, tmp_path)
    assert proc.returncode == 1
    assert "ember: rank 1 exited with code 1; stopping the other ranks" in proc.stderr


def test_rank_failure_torchrun(tmp_path):
    proc = run_torchrun("ddp_train.py", "fail", tmp_path, cwd=tmp_path)
    _check_failure(proc, tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ending at C exit() uses glibc's on_exit")
def test_clean_exit_skips_native_teardown_and_keeps_the_exit_status(tmp_path):
    """After a DDP run each rank ends at C exit() with Python's exit status, before
    native (C++) teardown runs: gloo threads that outlive destroy_process_group()
    abort a few percent of processes there. An exit-time handler that aborts
    (registered as C++ static destructors are) stands in for them. Python's own
    finalisation (buffered output) still happens."""
    proc = run_plain("exit_status.py", "native-abort", tmp_path, cwd=tmp_path)
    ok(proc)
    assert "rank 0 finished" in proc.stdout and "rank 1 finished" in proc.stdout, proc.stdout
    proc = run_plain("exit_status.py", "exit3", tmp_path, cwd=tmp_path)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "rank 0 finished" in proc.stdout and "rank 1 finished" in proc.stdout, proc.stdout
