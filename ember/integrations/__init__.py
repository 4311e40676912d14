"""Integrations with other libraries. Each lives in its own submodule and is
imported only when asked for (``import ember`` imports none of them):

- :mod:`ember.integrations.transformers`: fine-tune Hugging Face Transformers models.
- :mod:`ember.integrations.ray`: run a Trainer or an Accelerator under Ray Train's
  ``TorchTrainer``: report ember's committed checkpoints to Ray, resume from a Ray checkpoint.
- :mod:`ember.integrations.optuna`: ``PruningCallback``, Optuna's trial pruning inside ``fit``.
"""
