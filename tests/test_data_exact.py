"""Exact data handling across ranks: gather_for_metrics per batch and per epoch,
IterableDataset sharding, DataLoader worker seeds. Single-process checks here;
the two-process (gloo) runs are in test_data_multiproc.py."""
import pytest
import torch
from torch.utils.data import DataLoader

import ember.distributed as ed
from ember import data as edata

COMBOS = [(1001, 10, 2), (7, 3, 2), (5, 4, 2), (8, 4, 2), (3, 5, 2), (1, 4, 2), (10, 3, 3), (11, 2, 4),
          (100, 7, 3), (13, 1, 4)]


def _rank_loaders(size, batch, world):
    return [edata.prepare_dataloader(DataLoader(list(range(size)), batch_size=batch), seed=0, num_replicas=world,
                                     rank=r, shuffle=False) for r in range(world)]


def _gather(per_rank, pad):
    """What gather_for_metrics returns for one call: ranks' rows interleaved, padding dropped."""
    sizes = [len(x) for x in per_rank]
    padded = torch.full((len(per_rank), max(sizes)), -1)
    for r, x in enumerate(per_rank):
        padded[r, :len(x)] = x
    out = ed._interleave(padded, sizes)
    return out[:len(out) - pad]


@pytest.mark.parametrize("size, batch, world", COMBOS)
def test_per_batch_and_epoch_end_gather_give_exactly_the_dataset(size, batch, world):
    """Per batch, only the last batch of a pass carries the sampler's duplicates; the
    epoch-end form drops them from the end of the concatenation."""
    loaders = _rank_loaders(size, batch, world)
    per_rank = [list(dl) for dl in loaders]
    n = len(loaders[0])
    assert all(len(b) == n for b in per_rank)
    got = []
    for k in range(n):
        pads = {edata.batch_padding(dl, k) for dl in loaders}
        assert len(pads) == 1                 # every rank drops the same number
        got.append(_gather([b[k] for b in per_rank], pads.pop()))
    assert torch.cat(got).tolist() == list(range(size))
    pads = {edata.batch_padding(dl, None) for dl in loaders}
    cat = [torch.cat(b) for b in per_rank]
    assert _gather(cat, pads.pop()).tolist() == list(range(size))
    assert {edata.samples_per_rank(dl) for dl in loaders} == {len(cat[0])}


@pytest.mark.parametrize("size, batch, world", [(1001, 10, 2), (7, 2, 2), (11, 2, 4)])
def test_a_partial_pass_drops_nothing(size, batch, world):
    loaders = _rank_loaders(size, batch, world)
    n = len(loaders[0]) - 1                   # limit_val_batches: one batch short
    for dl in loaders:
        assert edata.batch_padding(dl, None, n) == 0
        assert all(edata.batch_padding(dl, k, n) == 0 for k in range(n))


def test_deepspeed_version_check_names_the_minimum():
    """DeepSpeed before 0.19.4 ignores managed_gradient_accumulation (steps every acc_n**2
    micro-batches), 0.19.4 refuses it with offload: setup refuses them, naming 0.19.5."""
    from importlib import metadata

    from ember.errors import MisconfigurationError
    from ember.strategies.deepspeed import MIN_VERSION, check_version
    assert MIN_VERSION == (0, 19, 5)
    for old in ("0.14.0", "0.18.9", "0.19.4", "0.19.4+cu121"):
        with pytest.raises(MisconfigurationError, match=r"deepspeed>=0\.19\.5 \(found .*managed_gradient_accumulation"):
            check_version(old)
    for ok in ("0.19.5", "0.19.8", "0.20.0rc1", "1.0"):
        check_version(ok)
    try:
        installed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return
    check_version(installed)   # the version the project installs passes
