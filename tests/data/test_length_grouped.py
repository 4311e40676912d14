"""LengthGroupedSampler: batches of similar lengths, seeded by the run seed, sharded
exactly over ranks and resumable mid-epoch, built on ResumableSampler."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

from ember.data import LengthGroupedSampler, prepare_dataloader, skip_batches


def _lengths(n, seed=0):
    rng = random.Random(seed)
    return [rng.randint(3, 120) for _ in range(n)]


def _loader(lengths, batch_size):
    return DataLoader(list(range(len(lengths))), batch_size=batch_size,
                      sampler=LengthGroupedSampler(lengths, batch_size))


def _padded_tokens(batches, lengths):
    return sum(max(lengths[i] for i in b) * len(b) for b in batches)


def test_groups_lengths_and_keeps_every_sample_once():
    lengths = _lengths(1000)
    dl = prepare_dataloader(_loader(lengths, 16), seed=7)
    batches = [b.tolist() for b in dl]
    assert sorted(i for b in batches for i in b) == list(range(1000))
    plain = [b.tolist() for b in prepare_dataloader(DataLoader(list(range(1000)), batch_size=16, shuffle=True), seed=7)]
    real = sum(lengths)
    # shuffled batches: about half of the computed tokens are padding; grouped: under 5%
    assert real / _padded_tokens(plain, lengths) < 0.7
    assert real / _padded_tokens(batches, lengths) > 0.95
    # the batch with the longest sample comes first; the order is not sorted overall
    assert max(lengths) in [lengths[i] for i in batches[0]]
    firsts = [lengths[b[0]] for b in batches[1:-1]]
    assert firsts != sorted(firsts, reverse=True)


def test_seeded_by_the_run_seed_and_the_epoch():
    lengths = _lengths(300)
    a = prepare_dataloader(_loader(lengths, 8), seed=1).sampler
    b = prepare_dataloader(_loader(lengths, 8), seed=1).sampler
    c = prepare_dataloader(_loader(lengths, 8), seed=2).sampler
    assert list(a) == list(b) != list(c)
    a.set_epoch(1)
    assert list(a) != list(b)
    # an explicit seed is the user's: the run seed does not replace it
    own = DataLoader(list(range(300)), batch_size=8, sampler=LengthGroupedSampler(lengths, 8, seed=5))
    assert list(prepare_dataloader(own, seed=1).sampler) == list(prepare_dataloader(own, seed=2).sampler)


@pytest.mark.parametrize("n,world", [(512, 2), (517, 2), (300, 3), (301, 4)])
def test_ddp_shards_give_every_sample_once_per_epoch(n, world):
    lengths = _lengths(n, seed=n)
    bs = 8
    for epoch in (0, 1):
        per_rank = []
        for rank in range(world):
            dl = prepare_dataloader(_loader(lengths, bs), seed=3, num_replicas=world, rank=rank)
            assert isinstance(dl.sampler, LengthGroupedSampler) and dl.sampler.num_replicas == world
            dl.sampler.set_epoch(epoch)
            per_rank.append([b.tolist() for b in dl])
        # every rank runs the same number of batches
        assert len({len(r) for r in per_rank}) == 1
        seen = [i for r in per_rank for b in r for i in b]
        pad = per_rank and prepare_dataloader(_loader(lengths, bs), seed=3, num_replicas=world, rank=0).sampler.padding
        assert len(seen) == n + pad and sorted(set(seen)) == list(range(n))
        if n % world == 0:
            assert sorted(seen) == list(range(n))   # exactly once
        # the ranks' j-th batches together are one global batch of similar lengths (sorted
        # mega-batches of 50 global batches): narrow spreads, where random batches span ~the range
        spreads = []
        for j in range(len(per_rank[0])):
            glob = [lengths[i] for r in per_rank for i in r[j]]
            spreads.append(max(glob) - min(glob))
        rng = random.Random(0)
        shuffled = rng.sample(lengths, len(lengths))
        glob_bs = bs * world
        random_spreads = [max(shuffled[i:i + glob_bs]) - min(shuffled[i:i + glob_bs])
                          for i in range(0, len(shuffled), glob_bs)]
        assert sum(spreads) / len(spreads) < 0.3 * sum(random_spreads) / len(random_spreads)


def test_resumes_mid_epoch_by_skipping_indices():
    lengths = _lengths(200)
    for world, rank in ((1, 0), (2, 1)):
        dl = prepare_dataloader(_loader(lengths, 8), seed=0, num_replicas=world, rank=rank)
        dl.sampler.set_epoch(2)
        full = [b.tolist() for b in dl]
        again = prepare_dataloader(_loader(lengths, 8), seed=0, num_replicas=world, rank=rank)
        again.sampler.set_epoch(2)
        assert skip_batches(again, 5)
        assert [b.tolist() for b in again] == full[5:]
        assert [b.tolist() for b in again] == full   # the skip applies once


def test_batch_size_must_match_the_loader():
    dl = DataLoader(list(range(10)), batch_size=4, sampler=LengthGroupedSampler([1] * 10, 2))
    with pytest.raises(ValueError, match="batch_size"):
        prepare_dataloader(dl, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        LengthGroupedSampler([1, 2], 0)
    assert list(LengthGroupedSampler([], 4)) == []
    assert sorted(LengthGroupedSampler([5, 1, 3], 4)) == [0, 1, 2]
    assert torch.equal(torch.tensor(list(LengthGroupedSampler([5, 1, 3], 2, seed=0))),
                       torch.tensor(list(LengthGroupedSampler([5, 1, 3], 2, seed=0))))
