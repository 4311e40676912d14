"""Every kind of train data resumes mid-epoch exactly under two gloo processes with two
DataLoader workers each: a plain stream (replayed), a stateful stream (each worker's
state, per rank), Hugging Face datasets (an IterableDataset split by shards over ranks and
workers, one with a shuffle buffer, a map-style one), StatefulDataLoaders, several loaders
in each CombinedLoader mode (each sharded), and the Accelerator's save_state/load_state.
One launch runs every case (tests/scripts/stateful_ddp.py)."""
import sys
from pathlib import Path

import pytest
import torch

from ember.strategies.environments import find_free_port
from helpers import clean_env, run_job

pytestmark = pytest.mark.multiproc

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TIMEOUT = 400   # every case, two processes, DataLoader workers; the script's process group times out in 45 s


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("stateful_ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "stateful_ddp.py"), str(out)]
    proc = run_job(cmd, out_dir=out, cwd=out, env=clean_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("case", ["stream", "stateful", "stateful_sampler", "hf_iter", "hf_shuffle", "hf_map",
                                  "sdl_map", "sdl_stateful", "combined_max_size_cycle", "combined_min_size",
                                  "combined_max_size", "combined_sequential", "acc_stateful", "acc_stream"])
def test_resumed_run_equals_the_uninterrupted_one_on_every_rank(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["seen"] == r["full_seen"][r["step"]:], (case, rank)
        assert _equal(r["w"], r["full_w"]), (case, rank)
        if "rand" in r:
            assert torch.equal(r["rand"], r["full_rand"]), (case, rank)   # the RNG stream too
        replayed = case in ("stream", "hf_shuffle", "combined_min_size", "acc_stream")   # streams without a state
        assert bool(r["replays"]) == (replayed and rank == 0), (case, rank, r["replays"])
    a, b = (res[case]["full_w"] for res in results)
    assert _equal(a, b)   # DDP: the ranks agree


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("case", ["stream", "stateful", "hf_iter", "hf_shuffle", "hf_map"])
def test_each_sample_once_per_epoch_over_the_ranks(results, case):
    for epoch in range(2):
        ids = []
        for res in results:
            seen = res[case]["full_seen"]
            per_epoch = len(seen) // 2
            ids += [i for s in seen[per_epoch * epoch:per_epoch * (epoch + 1)] for i in s]
        assert sorted(ids) == list(range(64)), (case, epoch)
