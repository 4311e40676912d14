"""Exact data handling with two real processes (gloo, CPU, torchrun): per-batch and
epoch-end gather_for_metrics, IterableDataset sharding with accumulation, worker
seeds. The scripts live in tests/scripts/data_ddp.py and write JSON per rank."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.strategies.environments import find_free_port
from helpers import SCRIPTS, child_env, import_script

pytestmark = pytest.mark.multiproc

TIMEOUT = 150   # the scripts set a 45 s process-group timeout; this guards the whole run


@pytest.fixture(scope="module")
def script():
    return import_script("data_ddp")


def torchrun(scenario, out):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "data_ddp.py"), scenario, str(out)]
    proc = subprocess.run(cmd, cwd=out, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((Path(out) / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(TIMEOUT + 30)
def test_gather_for_metrics_per_batch_and_per_epoch_is_exactly_the_dataset(tmp_path, script):
    """1001 samples, batch 10, 2 ranks gathered 951 per batch (the padding dropped from
    every batch); now every form returns the dataset's samples in order, with the values
    one process computes, for even and uneven (size, batch) combinations."""
    for d in torchrun("gather", tmp_path):
        assert d["world"] == 2
        for size, batch in script.GATHER_COMBOS:
            ref = script.values(size)
            for key in (f"{size}_{batch}", f"acc_{size}_{batch}"):
                forms = ("per_batch", "epoch_end") + (("callback",) if not key.startswith("acc") else ())
                for form in forms:
                    got = d[key][form]
                    assert got["ids"] == list(range(size)), (key, form, len(got["ids"]))
                    torch.testing.assert_close(torch.tensor(got["v"]), ref, rtol=0, atol=1e-6)
            # after the pass, one row per rank is not the pass's output (unless the pass was one row)
            assert d[f"acc_{size}_{batch}"]["other_after_pass"] == ([0, 1] if size > 2 else list(range(size)))
        assert d["partial"]["per_batch"] == d["partial"]["epoch_end"] == list(range(2 * 2 * 10))


@pytest.mark.timeout(TIMEOUT + 30)
def test_iterable_dataset_under_ddp_with_accumulation(tmp_path, script):
    """An IterableDataset reached every rank unsharded (both read the same stream), uneven
    lengths hung DDP at epoch end, and accumulation gave NaN weights. Now: each rank reads
    its share, the ranks end together (no collective per step), and 2 x batch 4 with
    accumulate_grad_batches=2 gives the weights of one process with batch 8. DataLoader
    workers draw different random numbers on the two ranks."""
    r0, r1 = torchrun("iterable", tmp_path)
    _, ref = script.fit_stream(1, str(tmp_path), 54, 8)
    a, b = r0["fit"], r1["fit"]
    assert a["weights"] == b["weights"] and a["steps"] == b["steps"] == ref["steps"] == 2 * 4
    for k, v in ref["weights"].items():
        got = torch.tensor(a["weights"][k])
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.tensor(v), rtol=0, atol=1e-6)
    per_epoch = len(a["seen"]) // 2
    assert not set(a["seen"][:per_epoch]) & set(b["seen"][:per_epoch])     # no item on both ranks
    assert sorted(a["seen"][:per_epoch] + b["seen"][:per_epoch]) == list(range(54))
    assert a["seen"][:per_epoch] == list(range(0, 54, 2))                  # in stream order
    for d in (r0, r1):
        assert d["eval_ids"] == list(range(55))   # evaluation keeps every item
        assert "gather once after the steps" in d["per_batch_error"].lower()
    d0, d1 = r0["draws"], r1["draws"]
    assert len(d0) == len(d1) == 8
    for col in range(3):   # torch, numpy, python random: no value shared between the ranks
        assert not {row[col] for row in d0} & {row[col] for row in d1}, col


@pytest.mark.timeout(TIMEOUT + 30)
def test_user_generator_seeded_per_rank_is_agreed_from_rank_0(tmp_path, script):
    """DataLoader(shuffle=True, generator=torch.Generator().manual_seed(100 + rank)): each
    rank drew its own order and kept its shard of it, so some samples were trained twice and
    others never in an epoch, silently. Now the ranks agree on the generator state at setup
    (rank 0's, with one warning on rank 0), under the Trainer and the Accelerator: the two
    shards are the dataset once each, in the order one process draws with rank 0's seed.
    Generators seeded alike: no warning, the same shards."""
    r0, r1 = torchrun("generator", tmp_path)
    n, ref = script.GEN_SIZE, script.gen_order(100)
    assert r0["world"] == 2
    for key in ("trainer_per_rank", "acc_per_rank", "trainer_alike", "acc_alike"):
        a, b = r0[key]["seen"], r1[key]["seen"]
        assert not set(a) & set(b), (key, a, b)                 # no sample on both ranks
        assert sorted(a + b) == list(range(n)), key             # every sample once
        assert (a, b) == (ref[0::2], ref[1::2]), key            # rank r: samples r, r+2, ... of the order
        assert r1[key]["warnings"] == [], key                   # warned on rank 0 only
    for key in ("trainer_per_rank", "acc_per_rank"):
        (msg,) = r0[key]["warnings"]
        assert "RandomSampler" in msg and "rank(s) 1" in msg and "seed" in msg, msg
    for key in ("trainer_alike", "acc_alike"):
        assert r0[key]["warnings"] == [], key
    # a resume gives every rank the checkpoint's (rank 0's) generator state: the resumed
    # epoch is the uninterrupted run's epoch 1 on both ranks
    half = n // 2
    for d in (r0, r1):
        full = d["resume"]["full"]
        assert d["resume"]["first"] == full[:half]
        assert d["resume"]["resumed"] == full[half:], d["rank"]
    assert sorted(r0["resume"]["full"][half:] + r1["resume"]["full"][half:]) == list(range(n))


@pytest.mark.timeout(TIMEOUT + 30)
def test_user_generator_with_workers_resumes_mid_epoch_exactly_on_two_ranks(tmp_path):
    """DataLoader(shuffle=True, generator=g, num_workers=2, persistent_workers=True) under
    DDP (g draws the workers' base seed, only at the first pass of a persistent loader):
    resumed in the middle of epoch 1 (after step 7: 2 of its 5 steps) and after its last
    batch (step 10), each rank trains the rest of the uninterrupted 3-epoch run in its order,
    to the same weights; the ranks' shards are the data set once per epoch. Before, the
    resumed run's new iterator drew a base seed from g that the uninterrupted run's reused
    one did not draw, and the resumed epochs came in another order."""
    r0, r1 = torchrun("generator_workers", tmp_path)
    for d in (r0, r1):
        full = d["full"]
        assert len(full["seen"]) == 3 * 10   # 5 steps of 2 ids per rank and epoch
        for name, step in (("mid", 7), ("last_batch", 10)):
            assert d[name]["seen"] == full["seen"][2 * step:], (d["rank"], name)
            assert d[name]["weights"] == full["weights"], (d["rank"], name)
    for e in range(3):
        ids = r0["full"]["seen"][10 * e: 10 * e + 10] + r1["full"]["seen"][10 * e: 10 * e + 10]
        assert sorted(ids) == list(range(20)), e
