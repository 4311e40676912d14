"""Checkpoints on disk: :mod:`~ember.checkpoint.format` (names and version),
:mod:`~ember.checkpoint.io` (atomic writes, safetensors, the safe ``torch.load``,
reading a checkpoint folder), :mod:`~ember.checkpoint.trust` (the checks that make
loading safe: paths inside the folder, ``meta.json`` limits, digests; what a save may
replace), :mod:`~ember.checkpoint.lock` (one writer per folder),
:mod:`~ember.checkpoint.agree` (the ranks agree on a resume's outcome),
:mod:`~ember.checkpoint.rng` (RNG states). The format: docs/checkpoint_format.md."""
