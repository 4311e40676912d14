"""Run a port unchanged on Lightning: the ``ember`` modules it imports are mapped
to ``lightning.pytorch``'s (ember's ``TrainModule``/``DataModule`` are Lightning's
``LightningModule``/``LightningDataModule``), then the script runs as ``__main__``.

    python tests/ports/lightning/run_with_lightning.py tests/ports/lightning/autoencoder.py [ARGS]

The script is also passed on in ``PORT_SCRIPT`` and ``sys.argv[0]`` stays this file,
so the processes Lightning's DDP launcher starts (it re-runs ``sys.argv``) run
the port through this mapping too.
"""
import os
import sys
import types

import lightning.pytorch as pl
import lightning.pytorch.callbacks
import lightning.pytorch.loggers
import lightning.pytorch.strategies
import lightning.pytorch.utilities

ember = types.ModuleType("ember")
ember.__dict__.update({k: v for k, v in vars(pl).items() if not k.startswith("__")})
ember.TrainModule, ember.DataModule = pl.LightningModule, pl.LightningDataModule
ember.callbacks, ember.strategies, ember.utilities = pl.callbacks, pl.strategies, pl.utilities
ember.loggers = pl.loggers
sys.modules.update({"ember": ember, "ember.callbacks": pl.callbacks, "ember.strategies": pl.strategies,
                    "ember.utilities": pl.utilities, "ember.loggers": pl.loggers})
script = os.environ.get("PORT_SCRIPT")
if script is None:
    script = os.environ["PORT_SCRIPT"] = os.path.abspath(sys.argv.pop(1))
sys.argv[0] = os.path.abspath(__file__)   # (runpy.run_path would set it to the script)
sys.path.insert(0, os.path.dirname(script))
with open(script) as f:
    code = compile(f.read(), script, "exec")
exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})
