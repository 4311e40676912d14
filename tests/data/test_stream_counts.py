"""A Hugging Face stream split over ranks: the batches each rank's pass yields, counted
from the shards' lengths (``ember.data.stateful.hf_rank_batches``, which lets ranks with
uneven shards agree on the smallest count), equal the batches a real pass yields."""
import warnings

import pytest
from torch.utils.data import DataLoader

datasets = pytest.importorskip("datasets")

from ember.data.stateful import hf_rank_batches, hf_shard  # noqa: E402


@pytest.mark.parametrize("workers", [0, 2])
def test_the_count_from_the_shards_is_what_a_pass_yields(workers):
    base = datasets.Dataset.from_dict({"x": list(range(31))}).with_format("torch")
    for shards in (2, 3, 4, 6):          # whole shards per rank (2, 4, 6) and every 2nd example (3)
        stream = base.to_iterable_dataset(num_shards=shards)
        for batch_size, drop_last in ((4, False), (5, True)):
            for rank in (0, 1):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")   # shards not a multiple of ranks x workers
                    part = hf_shard(stream, 2, rank, workers, warn=False)
                    real = sum(1 for _ in DataLoader(part, batch_size=batch_size, drop_last=drop_last,
                                                     num_workers=workers))
                counted = hf_rank_batches(part, batch_size, drop_last, workers)
                if shards % 2 and workers > 1:
                    assert counted is None   # every 2nd example, split again over workers: not counted
                else:
                    assert counted == real, (shards, batch_size, drop_last, rank)
    # a stream whose examples per shard are unknown without reading it (a filter): no count
    filtered = hf_shard(base.to_iterable_dataset(num_shards=2).filter(lambda e: True), 2, 0, workers, warn=False)
    assert hf_rank_batches(filtered, 4, False, workers) is None
