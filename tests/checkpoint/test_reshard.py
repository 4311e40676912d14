"""Resume on another number of processes with the same global batch, each sample once
(issue: "Change the number of processes and keep going exactly", items 1-4).

A checkpoint records the global batch (per-process batch x processes x
accumulate_grad_batches) and the position in the epoch's global order (the order every
number of processes shares). Resumed on another number of processes, ember chooses the
accumulate_grad_batches that keeps the global batch and continues that order: the weights
after 18 more steps (SGD with momentum, a per-step scheduler) are those of the
uninterrupted run up to float summation order, for 2->1 (shuffled and length-grouped),
1->2 (from a checkpoint saved inside an accumulation window: the window is replayed) and
2->4 processes. 16 recorded vs 3 processes x 8 is refused on every rank before training;
an explicit accumulate_grad_batches wins, with a warning, and the epoch still trains every
sample once. A Hugging Face IterableDataset of 8 shards saved on 2 processes resumes on 4
(and one of 4 shards on 1 resumes on 2): each shard continues where it was, on the process
that now reads it; left different numbers of samples, the processes end the epoch together
after the smallest number of batches, with a warning naming what is left out. The same stream in
torchdata's StatefulDataLoader without workers resumes alike. A loader that records
another per-process state (a stateful dataset, a StatefulDataLoader over one) is
refused on another number of processes mid-epoch, naming the loader and both numbers. The
process groups are real (gloo; tests/scripts/reshard_ddp.py, three starts: 2, 4 and 3
processes)."""
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import SCRIPTS, child_env

sys.path.insert(0, str(SCRIPTS))
import reshard_ddp as rd  # noqa: E402

from ember.checkpoint import io as cio  # noqa: E402


def _launch(root: Path, world: int, modes: str, timeout: float = 240) -> str:
    env = child_env(EMBER_CHECKPOINT_FSYNC="0")
    p = subprocess.run([sys.executable, str(SCRIPTS / "reshard_ddp.py"), str(world), str(root), modes], cwd=root,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stderr


def _folder_digest(path: Path) -> dict:
    return {str(f.relative_to(path)): (f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(path.rglob("*")) if f.is_file()}


# a dataset with state_dict(); torchdata's StatefulDataLoader over it; a Hugging Face IterableDataset (4 shards)
STATEFUL = ("stateful", "sdl_stateful", "hf_iter")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    out = {}
    rd.run("ref1_map", str(root), 1)
    for case in STATEFUL:
        rd.run(f"state1_{case}", str(root), 1)
    out["stderr2"] = _launch(root, 2, ",".join(["ref2_map", "ref2_grouped", "ref2_stream", "from1", "hf2", "hfsdl2"] +
                                              [f"state2_{case}" for case in STATEFUL]))
    out["stderr4"] = _launch(root, 4, "grow4,hf4_even,hf4_uneven,hf4_again,hfsdl4")
    ck = Path(rd.step6(str(root / "ref2_map")))
    before = _folder_digest(ck)
    out["stderr3"] = _launch(root, 3, "explicit,refused")   # explicit first: the refusal's group is up
    out["ck_unchanged"] = _folder_digest(ck) == before
    out["root"] = root
    return out


def _rec(root: Path, mode: str, rank: int = 0) -> dict:
    return json.loads((root / mode / f"rank{rank}.json").read_text())


def _weights(root: Path, mode: str) -> dict:
    return torch.load(root / mode / "weights.pt")


def _close(a: dict, b: dict, tol: float = 1e-5) -> float:
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= tol, diff
    return diff


def _global_steps(root: Path, mode: str, world: int, acc: int) -> list:
    """The samples of each optimizer step (the sets, over the ranks and the window)."""
    per_rank = [_rec(root, mode, r)["seen"] for r in range(world)]
    steps = []
    for i in range(0, len(per_rank[0]), acc):
        steps.append(sorted(x for seen in per_rank for b in seen[i:i + acc] for x in b))
    return steps


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_the_global_order_and_batch_are_the_same_on_one_process_accumulating_and_on_two(runs):
    root = runs["root"]
    one, two = _global_steps(root, "ref1_map", 1, 2), _global_steps(root, "ref2_map", 2, 1)
    assert len(one) == len(two) == rd.STEPS and one == two   # every optimizer step: the same 16 samples
    _close(_weights(root, "ref1_map"), _weights(root, "ref2_map"))
    for mode in ("ref1_map", "ref2_map"):
        data = cio.load_torch(str(Path(rd.step6(str(root / mode))) / cio.STATE_NAME))["data"]
        assert (data["global_batch"], data["samples_done"]) == (16, 96), data
    mid = cio.load_torch(str(root / "ref1_map" / "mid" / cio.STATE_NAME))["data"]
    assert (mid["world_size"], mid["global_batch"], mid["samples_done"]) == (1, 16, 13 * 8)


def _epoch0_once(root: Path, before: list, mode: str, world: int, batches: int) -> None:
    """The batches of epoch 0 the resumed run trained, with the ones trained before the save:
    each of the 192 samples once."""
    after = [x for r in range(world) for b in _rec(root, mode, r)["seen"][:batches] for x in b]
    assert sorted(before + after) == list(range(rd.N))


def _first_steps(root: Path, mode: str, world: int, batches: int) -> list:
    return [x for r in range(world) for b in _rec(root, mode, r)["seen"][:batches] for x in b]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["map", "grouped", "stream"])
def test_two_processes_resumed_on_one_keep_the_global_batch_and_order(runs, kind, capsys):
    """Shuffled by ember's sampler, grouped by length, and a stream without state (replayed
    to the samples trained: 6 steps of 16 are 12 batches of 8 on one process)."""
    root = runs["root"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rd.run(f"to1_{kind}", str(root), 1, enable_progress_bar=True)
    out = capsys.readouterr()
    replays = [str(w.message) for w in caught if "replayed to batch" in str(w.message)]
    if kind == "stream":   # the 96 items trained, read again as 12 batches of 8
        assert len(replays) == 1 and "replayed to batch 12: 12 batch(es) read again" in replays[0], replays
    else:
        assert replays == []
    assert ("Saved by 2 process(es), resumed by 1: accumulate_grad_batches=2 keeps the global batch of 16 samples "
            "per optimizer step (8 per process x 1 x 2).") in out.out + out.err
    rec = _rec(root, f"to1_{kind}")
    assert rec["accumulate_grad_batches"] == 2 and rec["global_step"] == rd.STEPS and rec["error"] is None
    assert len(rec["seen"]) == 2 * (rd.STEPS - 6)
    _epoch0_once(root, _first_steps(root, f"ref2_{kind}", 2, 6), f"to1_{kind}", 1, 12)
    assert _global_steps(root, f"to1_{kind}", 1, 2) == _global_steps(root, f"ref2_{kind}", 2, 1)[6:]
    _close(_weights(root, f"to1_{kind}"), _weights(root, f"ref2_{kind}"))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_one_process_saved_inside_a_window_resumed_on_two_replays_the_window(runs):
    """Saved after 13 micro-batches (6 steps and half of the 7th): the resumed run starts at
    the window's start (its partial gradients belong to the old process's shard)."""
    root = runs["root"]
    recs = [_rec(root, "from1", r) for r in (0, 1)]
    assert all(r["error"] is None and r["accumulate_grad_batches"] == 1 and r["global_step"] == rd.STEPS
               for r in recs)
    assert _global_steps(root, "from1", 2, 1) == _global_steps(root, "ref1_map", 1, 2)[6:]
    _close(_weights(root, "from1"), _weights(root, "ref1_map"))
    assert "saved inside a gradient accumulation window" not in runs["stderr2"]   # replayed, not dropped


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_two_processes_resumed_on_four_with_half_the_batch(runs):
    root = runs["root"]
    recs = [_rec(root, "grow4", r) for r in range(4)]
    assert all(r["error"] is None and r["accumulate_grad_batches"] == 1 and r["global_step"] == rd.STEPS
               for r in recs)
    assert all(len(b) == 4 for r in recs for b in r["seen"])
    _epoch0_once(root, _first_steps(root, "ref2_map", 2, 6), "grow4", 4, 6)
    assert _global_steps(root, "grow4", 4, 1) == _global_steps(root, "ref2_map", 2, 1)[6:]
    _close(_weights(root, "grow4"), _weights(root, "ref2_map"))
    assert "not bit-exactly" not in runs["stderr4"]   # the old world-size warning is replaced by the restore line


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_global_batch_no_accumulation_gives_is_refused_on_every_rank_before_training(runs):
    root = runs["root"]
    recs = [_rec(root, "refused", r) for r in range(3)]
    errors = {r["error"] for r in recs}
    assert len(errors) == 1, errors
    err = errors.pop()
    assert err.startswith("CheckpointError: ")
    for needle in ("global batch of 16 samples per optimizer step (8 per process x 2 process(es) x "
                   "accumulate_grad_batches=1)", "8 per process x 3 processes = 24 per micro-batch",
                   "no whole accumulate_grad_batches gives 16", "Resume with 1 or 2 process(es) at batch size 8",
                   "Trainer(accumulate_grad_batches=N)"):
        assert needle in err, err
    assert all(r["seen"] == [] and r["seconds"] < 12 for r in recs), [(r["seen"], r["seconds"]) for r in recs]
    assert runs["ck_unchanged"]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_an_explicit_accumulation_wins_with_a_warning_and_trains_each_sample_once(runs):
    root = runs["root"]
    recs = [_rec(root, "explicit", r) for r in range(3)]
    assert all(r["error"] is None and r["accumulate_grad_batches"] == 1 for r in recs)
    assert recs[0]["global_step"] == 6 + 4   # 96 samples left of epoch 0 in steps of 24
    _epoch0_once(root, _first_steps(root, "ref2_map", 2, 6), "explicit", 3, 4)
    warn = runs["stderr3"]
    assert warn.count("with accumulate_grad_batches=1 as given: the global batch is now 24 samples per optimizer "
                      "step (8 per process x 3 x 1), where the checkpoint was trained with 16; the learning-rate "
                      "schedule was written for 16") == 1   # once, on rank 0


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case, loader", [("stateful", "DataLoader over StatefulStream"),
                                          ("sdl_stateful", "StatefulDataLoader over StatefulStream")])
def test_a_loader_state_saved_per_process_is_refused_on_another_number_naming_both(runs, case, loader):
    """Its per-process states cannot be split or merged: refused on every rank (before,
    a warning, and the resumed epoch replayed batches of other shards)."""
    recs = [_rec(runs["root"], f"state2_{case}", r) for r in (0, 1)]
    assert recs[0]["error"] == recs[1]["error"] and recs[0]["seen"] == recs[1]["seen"] == []
    err = recs[0]["error"]
    for needle in ("saved mid-epoch (epoch 0, 6 batches done) by 1 process(es) and is resumed by 2",
                   f"the train dataloader ({loader}) records its position per process",
                   "Resume on 1 process(es), or from a checkpoint saved at an epoch end"):
        assert needle in err, err


HF_LEFT_OUT = "example(s) of this epoch are left out"


def _hf_before(root: Path, steps: int) -> list:
    """The samples hf2 (2 processes x batch 4) trained in its first ``steps`` steps."""
    return [x for r in (0, 1) for b in _rec(root, "hf2", r)["seen"][:steps] for x in b]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_hugging_face_stream_of_8_shards_saved_on_2_processes_resumes_on_4(runs):
    """Process r of 2 read the shards r, r+2, r+4, r+6 of 8 samples each (batch 4); saved
    after 4 steps (shards 0-3 read), 4 processes with batch 2 (the same global batch of 8)
    each continue the shards they now read (r, r+4): the other 32 samples, each once, on
    the process that reads its shard, and the epoch ends after 4 more steps on every process."""
    root = runs["root"]
    ref = [_rec(root, "hf2", r) for r in (0, 1)]
    assert all(r["error"] is None and r["global_step"] == 8 for r in ref)
    assert sorted(_hf_before(root, 8)) == list(range(rd.HF_N))   # the uninterrupted epoch: each sample once
    recs = [_rec(root, "hf4_even", r) for r in range(4)]
    assert all(r["error"] is None and r["accumulate_grad_batches"] == 1 and r["global_step"] == 8 for r in recs)
    for r, rec in enumerate(recs):   # shard r + 4 of 8 samples: idx 8 * (r + 4) ...
        assert [x for b in rec["seen"] for x in b] == list(range(8 * (r + 4), 8 * (r + 5))), (r, rec["seen"])
    after = [x for rec in recs for b in rec["seen"] for x in b]
    assert sorted(_hf_before(root, 4) + after) == list(range(rd.HF_N))
    data = cio.load_torch(str(root / "hf2" / "ck" / "epoch=0-step=4" / cio.STATE_NAME))["data"]
    assert (data["world_size"], data["global_batch"], data["num_shards"]) == (2, 8, 8), data


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_stream_left_uneven_by_the_carried_shards_ends_the_epoch_together_with_a_warning(runs):
    """Saved after 3 steps (12 samples per process: shard 0 and half of shard 2 on process
    0), the 4 processes are left 8, 8, 12 and 12 samples: every process trains 4 batches of
    2 (the smallest: their steps must pair up, as for loaders of different lengths), no
    sample twice, and the warning names the 8 samples left out (the last 4 of shards 6 and 7)."""
    root = runs["root"]
    recs = [_rec(root, "hf4_uneven", r) for r in range(4)]
    assert all(r["error"] is None and r["global_step"] == 7 and len(r["seen"]) == 4 for r in recs)
    assert [x for b in recs[2]["seen"] for x in b] == [20, 21, 22, 23, 48, 49, 50, 51]   # shard 2 from 4, then 6
    after = [x for rec in recs for b in rec["seen"] for x in b]
    before = _hf_before(root, 3)
    assert len(set(before + after)) == len(before + after)   # no sample twice
    assert sorted(set(range(rd.HF_N)) - set(before + after)) == [52, 53, 54, 55, 60, 61, 62, 63]
    # saved inside that epoch and resumed on 4 processes: the agreed end is in the checkpoint
    again = [_rec(root, "hf4_again", r) for r in range(4)]
    assert all(r["error"] is None and r["global_step"] == 7 for r in again)
    assert [r["seen"] for r in again] == [r["seen"][2:] for r in recs]
    # a checkpoint of that epoch on yet another number of processes: its positions do not follow
    # from the samples trained (its processes did not read their shards from the start): refused
    twice = rd.run("hf1_twice", str(root), 1)
    assert twice["seen"] == [] and "was itself resumed on another number of processes" in twice["error"], twice
    assert "saved mid-epoch (epoch 0, 5 batches done) by 4 process(es) and is resumed by 1" in twice["error"]
    # the same stream in torchdata's StatefulDataLoader (no workers): its state is rebuilt around
    # the stream's, and the resumed run reads the same samples (not replayed)
    sdl = [_rec(root, "hfsdl4", r) for r in range(4)]
    assert [r["seen"] for r in sdl] == [r["seen"] for r in recs] and all(r["error"] is None for r in sdl)
    warn = runs["stderr4"]
    assert warn.count(HF_LEFT_OUT) == 2, warn[-3000:]   # once per run, on rank 0, for the uneven cases only
    assert "replayed" not in warn
    assert ("leaves the processes different numbers of examples of this epoch (rank 0: 8, rank 1: 8, rank 2: 12, "
            "rank 3: 12)") in warn
    assert f"every process trains 4 more batch(es) of it, the smallest, and 8 {HF_LEFT_OUT}" in warn


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_hugging_face_stream_of_4_shards_saved_on_one_process_resumes_on_two(runs):
    """4 shards of 16, saved after 3 steps of 2 x batch 4 on one process (24 samples: shard 0
    and half of shard 1); on 2 processes (batch 4, accumulate_grad_batches 1) process 0 reads
    shard 2, process 1 the rest of shard 1, then shard 3: 4 batches each, the smallest."""
    recs = [_rec(runs["root"], "state2_hf_iter", r) for r in (0, 1)]
    assert all(r["error"] is None and r["accumulate_grad_batches"] == 1 for r in recs), recs[0]["error"]
    first = [[x for b in r["seen"][:4] for x in b] for r in recs]
    assert first == [list(range(32, 48)), list(range(24, 32)) + list(range(48, 56))], first
    assert "rank 0: 16, rank 1: 24" in runs["stderr2"]


def test_a_length_grouped_run_resumed_again_on_the_same_number_keeps_its_groups(tmp_path):
    """A run resumed from 2 processes on 1 groups by the checkpoint's global batch (16, not
    1 x 8); a checkpoint of that run resumed on 1 process again keeps grouping by 16, so the
    resumed epoch trains the batches the uninterrupted run trains (each sample once)."""
    class Grouped16(rd.Callback):   # the sampler as a 2 -> 1 resume leaves it (resume_data.reshard)
        def on_train_start(self, trainer, module):
            trainer.train_dataloader.sampler.group_size = 16

    ref, again = str(tmp_path / "ref"), str(tmp_path / "again")
    full = rd.Net()
    rd.trainer(ref, 1, save=True, callbacks=[Grouped16()], accumulate_grad_batches=2, max_steps=12) \
        .fit(full, rd.loader("grouped"))
    ckpt = cio.load_torch(str(Path(rd.step6(ref)) / cio.STATE_NAME))["data"]
    assert ckpt["group_size"] == 16
    resumed = rd.Net()
    t = rd.trainer(again, 1, accumulate_grad_batches=2, max_steps=12)
    t.fit(resumed, rd.loader("grouped"), ckpt_path=rd.step6(ref))
    assert t.train_dataloader.sampler.group == 16
    assert len(full.seen) == 24 and resumed.seen == full.seen[12:]
    assert sorted(x for b in full.seen[:12] + resumed.seen for x in b) == list(range(rd.N))
