"""The ``ember`` command (``fit|validate|test|predict``, ``launch``, ``config``, ``env``,
``report``). Guide: docs/cli.md."""
from ember.cli.main import SaveConfigCallback, build_parser, load_config, main  # noqa: F401
from ember.errors import UsageError  # noqa: F401
