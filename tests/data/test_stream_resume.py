"""Every kind of train data resumes mid-epoch exactly, on one process: a plain
IterableDataset (replayed, with a warning), a stateful dataset (its state, also in each
DataLoader worker), torchdata's StatefulDataLoader, Hugging Face datasets (map-style,
IterableDataset sharded by shards, with a shuffle buffer), and the Accelerator's
save_state/load_state with dropout. Each resume is compared with an uninterrupted run:
the samples of every step and the weights (``torch.equal``). The two-process runs are in
tests/data/test_stateful_ddp.py; the loaders in tests/scripts/stateful_cases.py."""
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import stateful_cases as sc  # noqa: E402

from ember.checkpoint import io as cio  # noqa: E402


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_resumes(tmp_path, case, workers=0):
    """The uninterrupted run, then a resume of a checkpoint in each epoch: the same samples
    from there on, the same weights. Returns the replay warnings of the resumes."""
    full_w, full_seen, _ = sc.fit(case, str(tmp_path / "full"), workers)
    replays = []
    for step in sc.resume_points(full_seen):
        ck = sc.checkpoint(str(tmp_path / "full"), step)
        w, seen, rep = sc.fit(case, str(tmp_path / f"r{step}"), workers, ckpt_path=ck)
        assert seen == full_seen[step:], (case, step)
        assert _equal(w, full_w), (case, step)
        replays += rep
    return full_seen, replays


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_iterable_dataset_is_replayed_to_its_position_with_a_warning(tmp_path, workers):
    """It raised 'cannot resume mid-epoch: the train dataloader is not index-based'."""
    seen, replays = _check_resumes(tmp_path, "stream", workers)
    assert sorted(i for s in seen[:len(seen) // 2] for i in s) == list(range(sc.N))
    assert len(replays) == 2
    for msg in replays:
        assert "replayed to batch" in msg and "read again and discarded in" in msg and " s, because it has no " \
            "state_dict()" in msg and "exact only when the stream yields the same items in the same order" in msg


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataset_resumes_from_its_state(tmp_path, workers):
    """Its state is recorded with every checkpoint (in each DataLoader worker, through
    torchdata's StatefulDataLoader) and loaded on resume: nothing is read again."""
    seen, replays = _check_resumes(tmp_path, "stateful", workers)
    assert replays == []
    state = cio.load_torch(str(Path(sc.checkpoint(str(tmp_path / "full"), 3)) / cio.STATE_NAME))
    pos = state["data_position"][0]
    assert pos["kind"] == "state"
    if workers == 0:
        assert pos["state"] == {"pos": 3 * sc.BATCH}   # the dataset's own state after 3 batches
    else:   # each worker's copy of the dataset, in torchdata's snapshot
        assert "_snapshot" in pos["state"]


def test_a_state_the_loader_refuses_is_refused_at_the_restore(tmp_path, monkeypatch):
    """Loaded when the checkpoint is restored (where the ranks agree on a resume's
    outcome), not at the first batch of one rank while the others wait in a collective."""
    sc.fit("stateful", str(tmp_path / "full"))

    def refuse(self, state):
        raise ValueError(f"no position {state['pos']} in this stream")
    monkeypatch.setattr(sc.StatefulStream, "load_state_dict", refuse)
    with pytest.raises(Exception, match=r"trainer_state.pt\): the train dataloader \(DataLoader over StatefulStream\) "
                                        r"refused the state .*ValueError: no position 12 in this stream"):
        sc.fit("stateful", str(tmp_path / "r"), ckpt_path=sc.checkpoint(str(tmp_path / "full"), 3))


@pytest.mark.parametrize("case", ["stateful", "combined_max_size_cycle"])
def test_state_of_the_last_batch_trained_when_the_loop_reads_ahead(tmp_path, monkeypatch, case):
    """Gradient accumulation over a loader of unknown length reads batches ahead (and
    CUDA prefetch one more; EMBER_PREFETCH=1 turns it on here): the state saved is the
    one recorded with the last batch trained, not the loader's state further on."""
    monkeypatch.setenv("EMBER_PREFETCH", "1")
    full_w, full_seen, _ = sc.fit(case, str(tmp_path / "full"), accumulate_grad_batches=3)
    per_epoch = len(full_seen) // 2
    resumed = 0
    for ck in sorted((tmp_path / "full" / "ck").iterdir()):
        loop = cio.load_torch(str(ck / cio.STATE_NAME))["loop"]
        if not 0 < loop["batches_done"] < per_epoch:
            continue
        done = loop["epoch"] * per_epoch + loop["batches_done"]
        w, seen, replays = sc.fit(case, str(tmp_path / ck.name), accumulate_grad_batches=3, ckpt_path=str(ck))
        assert seen == full_seen[done:], (case, ck.name)
        assert _equal(w, full_w) and replays == [], (case, ck.name)
        resumed += 1
    assert resumed >= 2


@pytest.mark.parametrize("case, workers", [("sdl_stateful", 2), ("sdl_map", 0), ("sdl_map", 2)])
def test_torchdata_stateful_dataloader_is_a_train_loader(tmp_path, case, workers):
    _, replays = _check_resumes(tmp_path, case, workers)
    assert replays == []


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_sampler_is_saved_and_restored(tmp_path, workers):
    """A plain DataLoader whose sampler has state_dict() (torchdata's StatefulDistributedSampler)
    becomes a StatefulDataLoader that records the sampler's state with every batch (the
    DataLoader reads its indices ahead); set_epoch reshuffles it every epoch."""
    seen, replays = _check_resumes(tmp_path, "stateful_sampler", workers)
    assert replays == [] and seen[:16] != seen[16:]
    assert sorted(i for s in seen[:16] for i in s) == sorted(i for s in seen[16:] for i in s) == list(range(sc.N))
    state = cio.load_torch(str(Path(sc.checkpoint(str(tmp_path / "full"), 3)) / cio.STATE_NAME))
    assert state["data_position"][0]["kind"] == "state"


def test_a_dataloader_subclass_with_its_own_state_is_kept_and_resumed(tmp_path):
    """Not rebuilt (that would lose its class and its state): its state_dict() is saved
    and loaded; under several processes a warning says it must shard itself."""
    from torch.utils.data import DataLoader, TensorDataset

    import ember
    from ember.callbacks import ModelCheckpoint
    from ember.data import prepare_dataloader

    class Cursor(DataLoader):
        """Counts its passes, part of its state."""
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return super().__iter__()

        def state_dict(self):
            return {"passes": self.passes}

        def load_state_dict(self, state):
            self.passes = state["passes"] - 1   # the resumed pass counts again

    def make():
        return Cursor(TensorDataset(*sc.tensors()), batch_size=sc.BATCH)
    kept = prepare_dataloader(make(), seed=0)
    assert type(kept) is Cursor
    with pytest.warns(UserWarning, match=r"Cursor \(a DataLoader with its own state_dict.*must give each rank"):
        prepare_dataloader(make(), seed=0, num_replicas=2, rank=0)
    t = ember.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), num_sanity_val_steps=0,
                      callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3, save_top_k=-1)])
    full = make()
    t.fit(sc.Recorder(), full)
    state = cio.load_torch(str(Path(sc.checkpoint(str(tmp_path), 21)) / cio.STATE_NAME))
    assert state["data_position"][0] == {"kind": "state", "state": {"passes": 2}}
    resumed = make()
    ember.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, default_root_dir=str(tmp_path / "r"),
                  num_sanity_val_steps=0).fit(sc.Recorder(), resumed, ckpt_path=sc.checkpoint(str(tmp_path), 21))
    assert resumed.passes == full.passes == 2


def test_hugging_face_map_style_dataset(tmp_path):
    seen, replays = _check_resumes(tmp_path, "hf_map")
    assert replays == [] and sorted(i for s in seen[:16] for i in s) == list(range(sc.N))


@pytest.mark.parametrize("workers", [0, 2])
def test_hugging_face_iterable_dataset_resumes_from_its_state_dict(tmp_path, workers):
    """to_iterable_dataset(num_shards=4): every sample once per epoch, read by the workers'
    shards; the dataset's state_dict (each worker's) is the position: nothing is replayed."""
    seen, replays = _check_resumes(tmp_path, "hf_iter", workers)
    assert replays == []
    for epoch in range(2):
        assert sorted(i for s in seen[16 * epoch:16 * (epoch + 1)] for i in s) == list(range(sc.N))


def test_hugging_face_shuffle_buffer_is_replayed_and_set_epoch_reshuffles(tmp_path):
    """.shuffle(seed, buffer_size): its state_dict does not hold the buffer, so the stream
    is replayed (exact: the shuffle is seeded), saying why; set_epoch gives each epoch
    another order."""
    seen, replays = _check_resumes(tmp_path, "hf_shuffle", workers=2)
    assert len(replays) == 2 and all("shuffle buffer" not in m or True for m in replays)
    assert all("shuffles through a buffer" in m for m in replays)
    first, second = seen[:16], seen[16:]
    assert sorted(i for s in first for i in s) == sorted(i for s in second for i in s) == list(range(sc.N))
    assert first != second


def test_datasets_and_torchdata_stay_optional():
    """Neither is imported for plain data (a fresh process: the suite imports both)."""
    import subprocess
    code = ("import sys, torch; from torch.utils.data import DataLoader, TensorDataset; import ember\n"
            "from ember.data import prepare_dataloader\n"
            "dl = prepare_dataloader(DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=2, shuffle=True), seed=0)\n"
            "list(dl); print('datasets' in sys.modules, 'torchdata' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


# -- the Accelerator --------------------------------------------------------------------------------
@pytest.mark.parametrize("case, workers", [("stream", 0), ("stream", 2), ("stateful", 2), ("hf_iter", 2)])
def test_accelerator_resumed_iterable_keeps_the_random_streams(tmp_path, case, workers):
    """A prepared stream resumed by load_state drew the workers' base seed from the global
    RNG again (the user's loader was used as it was), so dropout differed from the
    uninterrupted run; now the weights and the next torch.rand are the same."""
    full_w, full_seen, full_rand = sc.acc_run(case, str(tmp_path), workers)
    sc.acc_run(case, str(tmp_path), workers, stop=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w, seen, rand = sc.acc_run(case, str(tmp_path), workers, resume=True)
    assert seen == full_seen[5:]
    assert _equal(w, full_w) and torch.equal(rand, full_rand)


@pytest.mark.parametrize("case", ["sdl_map", "sdl_stateful"])
def test_accelerator_prepares_a_stateful_dataloader(tmp_path, case):
    full_w, full_seen, full_rand = sc.acc_run(case, str(tmp_path), 2)
    sc.acc_run(case, str(tmp_path), 2, stop=11)
    saved = cio.load_torch(str(tmp_path / "state" / cio.STATE_NAME))["data_positions"][0][0]
    # a map-style one resumes by index; a stateful stream from each worker's state (nothing replayed)
    assert saved is None if case == "sdl_map" else saved["kind"] == "state"
    w, seen, rand = sc.acc_run(case, str(tmp_path), 2, resume=True)
    assert seen == full_seen[11:] and _equal(w, full_w) and torch.equal(rand, full_rand)


def test_use_stateful_dataloader_is_honoured(tmp_path, monkeypatch):
    """DataLoaderConfiguration(use_stateful_dataloader=True): prepared loaders are torchdata
    StatefulDataLoaders (state_dict/load_state_dict as in Accelerate), resumed exactly;
    without torchdata it is refused at construction, naming the package."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ember import Accelerator
    from ember.errors import MisconfigurationError
    from ember.utils import DataLoaderConfiguration
    cfg = dict(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    acc = Accelerator(**cfg)
    dl = acc.prepare(sc.loader("stateful"))
    assert isinstance(dl.base, StatefulDataLoader)
    full_w, full_seen, full_rand = sc.acc_run("stream", str(tmp_path), 0, **cfg)
    sc.acc_run("stream", str(tmp_path), 0, stop=7, **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w, seen, rand = sc.acc_run("stream", str(tmp_path), 0, resume=True, **cfg)
    assert seen == full_seen[7:] and _equal(w, full_w) and torch.equal(rand, full_rand)
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(MisconfigurationError, match=r"use_stateful_dataloader=True.*pip install torchdata"):
        Accelerator(**cfg)
