"""ResumableSampler, prepare_dataloader and index-based skipping."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler, TensorDataset

from ember import data as edata
from ember.data import ResumableSampler, prepare_dataloader
from conftest import LinearModule, regression_data


def ids(n):
    return TensorDataset(torch.arange(n))


def batches(dl):
    return [b[0].tolist() for b in dl]


# ----------------------------------------------------------------------------- ResumableSampler
def test_same_permutation_for_seed_and_epoch_across_instances():
    a, b = ResumableSampler(50, shuffle=True, seed=3), ResumableSampler(50, shuffle=True, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    assert sorted(a) == list(range(50))
    torch.manual_seed(123)                       # the global RNG plays no part
    assert list(a) == list(b)
    b.set_epoch(3)
    assert list(a) != list(b)
    assert list(ResumableSampler(50, shuffle=True, seed=4)) != list(ResumableSampler(50, shuffle=True, seed=3))
    assert list(ResumableSampler(7)) == list(range(7))


def test_set_start_skips_exactly_once():
    s = ResumableSampler(20, shuffle=True, seed=1)
    s.set_epoch(5)
    full = list(s)
    s.set_start(7)
    assert list(s) == full[7:]
    assert list(s) == full                      # the offset applies to the next iteration only
    s.set_start(20)
    assert list(s) == []


@pytest.mark.parametrize("n,world", [(10, 3), (11, 3), (12, 3), (5, 4), (2, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_rank_striding_covers_the_dataset_with_recorded_padding(n, world, shuffle):
    shards = [ResumableSampler(n, shuffle=shuffle, seed=9, num_replicas=world, rank=r) for r in range(world)]
    for s in shards:
        s.set_epoch(1)
    lists = [list(s) for s in shards]
    total = shards[0].total_size
    assert total == -(-n // world) * world
    assert all(len(lst) == total // world == len(s) for lst, s in zip(lists, shards))
    assert all(s.padding == total - n for s in shards)
    assert set().union(*map(set, lists)) == set(range(n))
    # rank r takes positions r, r+world, ... of one global (padded) order
    order = shards[0].global_indices()
    assert [order[i] for i in range(total)] == [lists[i % world][i // world] for i in range(total)]
    assert order[n:] == order[:total - n]        # the padding repeats the first indices


def test_drop_last_under_several_replicas_drops_the_tail():
    shards = [ResumableSampler(11, num_replicas=3, rank=r, drop_last=True) for r in range(3)]
    assert [len(list(s)) for s in shards] == [3, 3, 3]
    assert all(s.padding == 0 and s.total_size == 9 for s in shards)


def test_state_dict_round_trip():
    a = ResumableSampler(30, shuffle=True, seed=11)
    a.set_epoch(4)
    b = ResumableSampler(30, shuffle=True, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {"seed": 11, "epoch": 4} and list(a) == list(b)


# ----------------------------------------------------------------------------- prepare_dataloader
def _collate(samples):
    return torch.stack([s[0] for s in samples]) * 10


@pytest.mark.parametrize("drop_last", [False, True])
def test_prepare_dataloader_keeps_loader_arguments(drop_last):
    dl = DataLoader(ids(23), batch_size=5, shuffle=True, drop_last=drop_last, collate_fn=_collate)
    p = prepare_dataloader(dl, seed=2)
    assert isinstance(p.sampler, ResumableSampler) and p.sampler.shuffle
    assert (p.batch_size, p.drop_last, p.collate_fn) == (5, drop_last, _collate)
    out = [b.tolist() for b in p]
    assert len(out) == (4 if drop_last else 5) == len(p)
    assert all(v % 10 == 0 for b in out for v in b)            # collate_fn applied
    flat = sorted(v // 10 for b in out for v in b)
    if drop_last:
        assert len(flat) == 20 and len(set(flat)) == 20
    else:
        assert flat == list(range(23))
    assert edata.is_shuffled(p) and not edata.is_shuffled(prepare_dataloader(DataLoader(ids(4)), seed=0))
    assert prepare_dataloader(p, seed=2) is p                    # already prepared


def test_prepare_dataloader_shuffle_argument_and_epochs():
    dl = DataLoader(ids(16), batch_size=4, shuffle=True)
    ordered = prepare_dataloader(dl, seed=0, shuffle=False)
    assert batches(ordered) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    p = prepare_dataloader(dl, seed=0)
    edata.set_epoch(p, 0)
    e0 = batches(p)
    edata.set_epoch(p, 1)
    e1 = batches(p)
    edata.set_epoch(p, 0)
    assert batches(p) == e0 != e1


def test_skip_batches_on_a_prepared_loader():
    p = prepare_dataloader(DataLoader(ids(22), batch_size=4, shuffle=True), seed=5)
    edata.set_epoch(p, 3)
    full = batches(p)
    assert edata.skip_batches(p, 2)
    assert batches(p) == full[2:]
    assert batches(p) == full


class EvenOddBatches(Sampler):
    """A custom batch sampler: the even indices in pairs, then the odd ones."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        idx = list(range(0, self.n, 2)) + list(range(1, self.n, 2))
        return iter([idx[i:i + 2] for i in range(0, self.n, 2)])

    def __len__(self):
        return (self.n + 1) // 2


def test_custom_batch_sampler_is_kept_and_skippable():
    dl = DataLoader(ids(8), batch_sampler=EvenOddBatches(8))
    p = prepare_dataloader(dl, seed=0)
    assert batches(p) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert len(p) == 4
    assert edata.skip_batches(p, 3)
    assert batches(p) == [[5, 7]]
    assert batches(p) == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_custom_sampler_with_batch_size_is_kept_and_skippable():
    class Reverse(Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    p = prepare_dataloader(DataLoader(ids(7), batch_size=3, sampler=Reverse(7)), seed=0)
    assert batches(p) == [[6, 5, 4], [3, 2, 1], [0]]
    assert edata.skip_batches(p, 1)
    assert batches(p) == [[3, 2, 1], [0]]


def test_custom_sampler_sharded_over_replicas():
    dl = DataLoader(ids(7), batch_size=2, sampler=SequentialSampler(range(7)), shuffle=False)
    shards = [prepare_dataloader(DataLoader(ids(7), batch_size=2, sampler=list(range(6, -1, -1))), seed=0,
                                 num_replicas=2, rank=r) for r in range(2)]
    got = [batches(s) for s in shards]
    assert got == [[[6, 4], [2, 0]], [[5, 3], [1, 6]]]        # one index duplicated to even the shards
    assert edata.num_padded(shards[0]) == 1
    assert isinstance(prepare_dataloader(dl, seed=0).sampler, ResumableSampler)


def test_iterable_datasets_get_a_seeded_generator_and_plain_iterables_pass_through():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(6).split(2))

    dl = DataLoader(Stream(), batch_size=None)
    p = prepare_dataloader(dl, seed=0)
    # rebuilt with nothing to shard: its own generator draws the workers' base seed (per epoch),
    # so a pass (a resumed one too) draws nothing from the global RNG
    assert p is not dl and isinstance(p.generator, torch.Generator) and p.dataset is dl.dataset
    assert [b.tolist() for b in p] == [b.tolist() for b in dl]
    assert prepare_dataloader(p, seed=0) is p
    assert not edata.skip_batches(p, 1)
    plain = [torch.zeros(2)]
    assert prepare_dataloader(plain, seed=0) is plain
    assert edata.skip_batches(dl, 0)                 # nothing to skip is always possible


def test_sharded_prepared_loader_records_padding():
    shards = [prepare_dataloader(DataLoader(ids(10), batch_size=2), seed=0, num_replicas=4, rank=r)
              for r in range(4)]
    assert [edata.num_padded(s) for s in shards] == [2, 2, 2, 2]
    seen = sorted(v for s in shards for b in batches(s) for v in b)
    assert seen == sorted(list(range(10)) + [0, 1])
    assert edata.dataset_length(shards[0]) == 10


# ----------------------------------------------------------------------------- in the Trainer
def test_trainer_keeps_a_custom_batch_sampler(make_trainer):
    seen = []

    class Record(LinearModule):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0][:, 0].tolist())
            return super().training_step(batch, batch_idx)

    ds = regression_data(6)
    ds.tensors = (torch.arange(6, dtype=torch.float32).unsqueeze(1).repeat(1, 4), ds.tensors[1])
    make_trainer(max_epochs=1).fit(Record(), DataLoader(ds, batch_sampler=EvenOddBatches(6)))
    assert seen == [[0.0, 2.0], [4.0, 1.0], [3.0, 5.0]]


def test_trainer_val_loader_is_never_shuffled(make_trainer):
    seen = []

    class Record(LinearModule):
        def validation_step(self, batch, batch_idx):
            seen.append(batch[0][:, 0].clone())

    ds = regression_data(12)
    make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(
        Record(), DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=4, shuffle=True))
    assert torch.equal(torch.cat(seen), ds.tensors[0][:, 0])



@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_without_automatic_batching(shuffle):
    """batch_size=None: the dataset's items are the batches; still resumable and shardable."""
    dl = DataLoader(ids(6), batch_size=None, shuffle=shuffle)
    p = prepare_dataloader(dl, seed=1)
    assert isinstance(p.sampler, ResumableSampler) and p.sampler.shuffle == shuffle and p.batch_size is None
    full = [int(b[0]) for b in p]
    assert sorted(full) == list(range(6)) and (full != list(range(6))) == shuffle
    assert edata.skip_batches(p, 4)
    assert [int(b[0]) for b in p] == full[4:]
    shards = [prepare_dataloader(DataLoader(ids(5), batch_size=None), seed=0, num_replicas=2, rank=r) for r in range(2)]
    assert [[int(b[0]) for b in s] for s in shards] == [[0, 2, 4], [1, 3, 0]]
    assert edata.num_padded(shards[0]) == 1


def test_prepared_loader_with_custom_batch_sampler_can_be_copied():
    import copy
    import pickle
    p = prepare_dataloader(DataLoader(ids(8), batch_sampler=EvenOddBatches(8)), seed=0)
    assert batches(copy.deepcopy(p)) == batches(p)
    assert batches(pickle.loads(pickle.dumps(p))) == batches(p)
