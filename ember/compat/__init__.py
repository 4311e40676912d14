"""The renaming layers: what a Lightning or Accelerate user imports, under ember's names,
over ember's own modules (nothing below this package imports it).
:mod:`~ember.compat.accelerate` (Accelerate's configuration and state names, from
:mod:`ember.accelerator.config` and :mod:`ember.accelerator.state`),
:mod:`~ember.compat.accelerate_utils` and :mod:`~ember.compat.accelerate_logging`
(``accelerate.utils`` and ``accelerate.logging``), :mod:`~ember.compat.lightning`
(Lightning checkpoints), :mod:`~ember.compat.fabric` (Fabric on the Accelerator),
:mod:`~ember.compat.paths` (the module paths that moved, still importable). The public
entry points are ``ember.utils`` (``accelerate.utils``), ``ember.utilities``
(``lightning.pytorch.utilities``), ``ember.logging``, ``ember.fabric`` and ``ember.local_sgd``."""
