"""Data: sharding samplers, resumable loading, worker seeds and device prefetch.

:mod:`~ember.data.sampling` shards and resumes a DataLoader (the names below),
:mod:`~ember.data.loader` is the loader ``Accelerator.prepare`` returns,
:mod:`~ember.data.resume` resumes every kind of train loader mid-epoch (by index, from a
stateful loader's state, or by replaying a stream), :mod:`~ember.data.stateful` says which
object holds that state (torchdata's ``StatefulDataLoader``, Hugging Face datasets),
:mod:`~ember.data.combined` iterates several loaders together (``CombinedLoader``),
:mod:`~ember.data.worker_seed` seeds DataLoader workers, :mod:`~ember.data.prefetch`
copies the next batch to the GPU while a step runs."""
from ember.data.sampling import (LengthGroupedSampler, LookAhead, ResumableSampler, ShardedIterable,  # noqa: F401
                                 agree_generator, batch_padding, dataset_length, draws_global_rng,
                                 generator_checkpoint_state, has_length, index_sampler, is_shuffled, num_padded, own_generator,
                                 prepare_dataloader, restore_generator, sampler_of, samples_per_rank, set_epoch,
                                 skip_batches)
