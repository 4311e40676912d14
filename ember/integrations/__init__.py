"""Integrations with other libraries (Transformers, peft, Ray Train, Optuna). Each lives in
its own submodule and is imported only when asked for (``import ember`` imports none of
them); the modules: docs/architecture.md.
"""
