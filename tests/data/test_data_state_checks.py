"""A data state is checked against its data (issue: "Trust, round 4", items 5-7): a
position saved mid-epoch is refused when the data it belongs to changed, naming both
values and the fix, as for a single loader already: each loader of a CombinedLoader
(its batch size and dataset length), the Accelerator's prepared loader (the same,
recorded in its state) and a Hugging Face IterableDataset (its ``num_shards`` and a cheap
fingerprint), also inside torchdata's StatefulDataLoader."""
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import stateful_cases as sc  # noqa: E402

import ember  # noqa: E402
from ember.errors import CheckpointError  # noqa: E402


def _combined(n_b):
    return {"a": DataLoader(TensorDataset(*sc.tensors()), batch_size=sc.BATCH, shuffle=True),
            "b": DataLoader(TensorDataset(*sc.tensors(n_b)), batch_size=sc.BATCH, shuffle=True)}


def _fit(root, train, ckpt_path=None, save=False):
    module = sc.Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.trainer(str(root), save=save).fit(module, train, ckpt_path=ckpt_path)
    return module


def test_a_dict_of_loaders_resumed_after_one_dataset_grew_is_refused(tmp_path):
    """It trained another order with no error and no warning."""
    _fit(tmp_path / "full", _combined(40), save=True)
    ck = sc.checkpoint(str(tmp_path / "full"), 3)
    with pytest.raises(CheckpointError, match=r"saved mid-epoch \(epoch 0, 3 batches done\).*changed since "
                                              r"\(loader 'b': dataset len 40 -> 48\).*EMBER_ALLOW_DATA_CHANGE=1"):
        _fit(tmp_path / "r", _combined(48), ckpt_path=ck)
    grown = _combined(40)
    grown["a"] = DataLoader(TensorDataset(*sc.tensors()), batch_size=2 * sc.BATCH, shuffle=True)
    with pytest.raises(CheckpointError, match=r"loader 'a': batch size 4 -> 8"):
        _fit(tmp_path / "r", grown, ckpt_path=ck)
    assert len(_fit(tmp_path / "r", _combined(40), ckpt_path=ck).seen) == 2 * 16 - 3   # the same data resumes


def _acc(dataset_len, batch_size=sc.BATCH):
    acc = ember.Accelerator(cpu=True, seed=0)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    dl = DataLoader(TensorDataset(*sc.tensors(dataset_len)), batch_size=batch_size, shuffle=True)
    net, opt, dl = acc.prepare(net, opt, dl)
    return acc, net, dl


def test_accelerator_load_state_into_a_loader_of_another_length_is_refused(tmp_path, monkeypatch):
    """It skipped batches of the new data silently; docs/distributed.md said it checked."""
    acc, net, dl = _acc(64)
    for i, _ in enumerate(dl):
        if i == 2:   # saved inside the pass (a pass left by a break resumes at the next epoch's start)
            acc.save_state(str(tmp_path / "s"))
            state = dl.state_dict()
            break
    assert (state["batch_size"], state["dataset_len"]) == (sc.BATCH, 64)
    acc2, net2, dl2 = _acc(48)
    before = net2.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"dataloader 0\): the state was saved after 3 batches.*"
                                              r"dataset len 64 -> 48.*EMBER_ALLOW_DATA_CHANGE=1"):
        acc2.load_state(str(tmp_path / "s"))
    assert torch.equal(net2.weight, before)   # refused before anything was loaded
    with pytest.raises(CheckpointError, match=r"batch size 4 -> 8"):
        _acc(64, batch_size=8)[0].load_state(str(tmp_path / "s"))
    monkeypatch.setenv("EMBER_ALLOW_DATA_CHANGE", "1")
    with pytest.warns(UserWarning, match=r"dataset len 64 -> 48\), accepted because EMBER_ALLOW_DATA_CHANGE=1"):
        _acc(48)[0].load_state(str(tmp_path / "s"))
    monkeypatch.delenv("EMBER_ALLOW_DATA_CHANGE")
    acc3, _, dl3 = _acc(64)
    acc3.load_state(str(tmp_path / "s"))   # the same data resumes
    assert dl3.batches_done == 3


def _hf(n=sc.N, shards=4, stateful=False):
    ds = sc.hf_dataset(n).to_iterable_dataset(num_shards=shards)
    return (sc.stateful_dataloader if stateful else DataLoader)(ds, batch_size=sc.BATCH)


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_hugging_face_stream_with_other_shards_or_data_is_refused_naming_both(tmp_path, stateful):
    """Saved with 4 shards and resumed with 2, it trained samples 8-23 again; a 16-sample
    dataset given the 64-sample state trained one batch and ended the epoch."""
    pytest.importorskip("datasets")
    if stateful:
        pytest.importorskip("torchdata")
    _fit(tmp_path / "full", _hf(stateful=stateful), save=True)
    ck = sc.checkpoint(str(tmp_path / "full"), 3)
    with pytest.raises(CheckpointError, match=r"3 batches done.*changed since \(num_shards 4 -> 2, fingerprint .*\)"
                                              r".*belongs to other shards.*Resume with the dataset and num_shards"):
        _fit(tmp_path / "r", _hf(shards=2, stateful=stateful), ckpt_path=ck)
    with pytest.raises(CheckpointError, match=r"changed since \(fingerprint [0-9a-f]{16} -> [0-9a-f]{16}\)"):
        _fit(tmp_path / "r", _hf(n=16, stateful=stateful), ckpt_path=ck)
    assert len(_fit(tmp_path / "r", _hf(stateful=stateful), ckpt_path=ck).seen) == 2 * 16 - 3


def test_accelerator_refuses_a_hugging_face_stream_of_other_shards(tmp_path):
    pytest.importorskip("datasets")
    acc = ember.Accelerator(cpu=True, seed=0)
    dl = acc.prepare(_hf())
    for i, _ in enumerate(dl):
        if i == 2:   # saved inside the pass
            acc.save_state(str(tmp_path / "s"))
            break
    acc2 = ember.Accelerator(cpu=True, seed=0)
    acc2.prepare(_hf(shards=2))
    with pytest.raises(CheckpointError, match=r"num_shards 4 -> 2"):
        acc2.load_state(str(tmp_path / "s"))


def test_the_shard_warning_says_changing_num_shards_invalidates_checkpoints():
    pytest.importorskip("datasets")
    from ember.data.stateful import hf_shard, hf_identity
    ds = sc.hf_dataset().to_iterable_dataset(num_shards=4)
    with pytest.warns(UserWarning, match=r"4 shard\(s\), not a multiple of 3 ranks.*Changing num_shards invalidates "
                                         r"the checkpoints saved mid-epoch"):
        part = hf_shard(ds, 3, 0, 0)
    assert hf_identity(part) == hf_identity(ds) and hf_identity(ds)["num_shards"] == 4
    assert hf_identity(hf_shard(ds, 2, 1, 0, warn=False)) == hf_identity(ds)   # each rank's part: the whole stream's


def _read_parts(ds, old: int, new: int, consumed: int):
    """``old`` processes each read ``consumed`` samples of their parts of ``ds``; their
    position is carried to ``new`` processes (hf_reshard), which read on from the loaded
    states. Returns (what the old ones read, what each new one reads, the counts hf_reshard gave)."""
    from ember.data.stateful import hf_reshard, hf_shard
    before, saved = [], None
    for r in range(old):
        part = hf_shard(ds, old, r, 0, warn=False)
        it = iter(part)
        before += [int(next(it)["idx"]) for _ in range(consumed)]
        saved = part.state_dict()
    after, counts = [], None
    for r in range(new):
        part = hf_shard(ds, new, r, 0, warn=False)
        state, counts = hf_reshard(part, old, consumed, saved, r, new)
        part.load_state_dict(state)
        after.append([int(x["idx"]) for x in part])
    return before, after, counts


@pytest.mark.parametrize("old, new, consumed, left", [(2, 4, 12, [8, 8, 12, 12]), (2, 4, 16, [8, 8, 8, 8]),
                                                      (1, 2, 20, [20, 24]), (1, 4, 33, [7, 8, 8, 8]),
                                                      (4, 2, 8, [16, 16]), (2, 1, 8, [48]), (2, 4, 0, [16] * 4)])
@pytest.mark.parametrize("steps", ["plain", "map"])
def test_a_hugging_face_streams_shard_positions_are_carried_to_another_number_of_processes(old, new, consumed, left,
                                                                                          steps):
    """64 samples in 8 shards of 8: the states hf_reshard builds for the new processes read
    every sample the old ones had not, each once, on the process that now reads its shard
    (process r of n: shards r, r + n, ...), in shard order; counts match. Through an
    unbatched map too (its state and the Arrow reader's are rebuilt)."""
    pytest.importorskip("datasets")
    ds = sc.hf_dataset().to_iterable_dataset(num_shards=8)
    if steps == "map":
        ds = ds.map(lambda e: {"one": 1})
    before, after, counts = _read_parts(ds, old, new, consumed)
    assert counts == left and [len(a) for a in after] == left
    assert sorted(before + [x for a in after for x in a]) == list(range(64))   # each sample once
    for r, got in enumerate(after):   # in shard order, each shard from where it was left
        assert got == sorted(got) and all(x // 8 % new == r for x in got), (r, got)


def test_a_position_that_cannot_be_carried_says_why():
    """Two shards left partly read now on one process (one state_dict() holds one place),
    steps that may change the samples per shard (a filter, a batched map), and shards that
    do not divide over both numbers of processes."""
    pytest.importorskip("datasets")
    base = sc.hf_dataset().to_iterable_dataset(num_shards=8)
    with pytest.raises(ValueError, match=r"process 0 of 2 now reads shards that 4 processes left at places one "
                                         r"state_dict\(\) cannot hold \(shard 0: 4 of 8, shard 2: 4 of 8, shard 4: 0 "
                                         r"of 8, shard 6: 0 of 8 read\)"):
        _read_parts(base, 4, 2, 4)
    with pytest.raises(ValueError, match="FilteredExamplesIterable may change the number of examples per shard"):
        _read_parts(base.filter(lambda e: True), 2, 4, 4)
    with pytest.raises(ValueError, match=r"MappedExamplesIterable \(batched\)"):
        _read_parts(base.map(lambda b: b, batched=True), 2, 4, 4)
    with pytest.raises(ValueError, match="not a multiple of both"):
        _read_parts(sc.hf_dataset().to_iterable_dataset(num_shards=6), 2, 4, 4)
