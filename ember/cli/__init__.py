"""The ``ember`` command: ``ember fit|validate|test|predict`` (:mod:`~ember.cli.main`,
config files and their types in :mod:`~ember.cli.types`), ``launch``, ``config``,
``env`` (:mod:`ember.launch`) and ``report`` (:mod:`ember.loggers.report`). Guide:
docs/cli.md."""
from ember.cli.main import SaveConfigCallback, build_parser, load_config, main  # noqa: F401
from ember.errors import UsageError  # noqa: F401
