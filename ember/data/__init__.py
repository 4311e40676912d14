"""Data: sharding samplers, resumable loading, worker seeds and device prefetch (the
modules: docs/architecture.md)."""
from ember.data.sampling import (LengthGroupedSampler, LookAhead, ResumableSampler, ShardedIterable,  # noqa: F401
                                 agree_generator, batch_padding, dataset_length, draws_global_rng,
                                 generator_checkpoint_state, has_length, index_sampler, is_shuffled, num_padded, own_generator,
                                 prepare_dataloader, restore_generator, sampler_of, samples_per_rank, set_epoch,
                                 skip_batches)
