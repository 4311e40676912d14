"""The renaming layers: what a Lightning or Accelerate user imports under ember's
names. :mod:`~ember.compat.accelerate` (Accelerate's configuration classes,
``PartialState``, how its Accelerator keywords map), :mod:`~ember.compat.accelerate_checkpoint`
(reading Accelerate's ``save_state`` folders), :mod:`~ember.compat.lightning`
(Lightning checkpoints, ``accelerator=``), :mod:`~ember.compat.paths` (the module paths
that moved, still importable). The public entry points are ``ember.utils``
(``accelerate.utils``), ``ember.utilities`` (``lightning.pytorch.utilities``),
``ember.logging`` and ``ember.local_sgd``."""
