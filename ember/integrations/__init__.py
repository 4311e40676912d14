"""Integrations with other libraries. Each lives in its own submodule and is
imported only when asked for (``import ember`` imports none of them):

- :mod:`ember.integrations.transformers`: fine-tune Hugging Face Transformers models.
"""
