"""Checkpoints on disk. The modules: docs/architecture.md; the format: docs/checkpoint_format.md."""
