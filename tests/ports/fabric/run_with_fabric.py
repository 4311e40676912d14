"""Run a Fabric port unchanged on Lightning Fabric: the ``ember`` modules it imports are
mapped to ``lightning.fabric``'s, then the script runs as ``__main__``.

    python tests/ports/fabric/run_with_fabric.py tests/ports/fabric/image_classifier.py [ARGS]

The script is also passed on in ``PORT_SCRIPT`` and ``sys.argv[0]`` stays this file, so
the processes Fabric's launcher starts (it re-runs ``sys.argv``) run the port through this
mapping too.
"""
import os
import sys
import types

import lightning.fabric as lf
import lightning.fabric.loggers
import lightning.fabric.strategies
import lightning.fabric.utilities
import lightning.fabric.utilities.types
import lightning.fabric.wrappers

ember = types.ModuleType("ember")
ember.Fabric, ember.seed_everything = lf.Fabric, lf.seed_everything
ember.strategies, ember.fabric = lf.strategies, lf   # (import lightning as L; L.fabric)
sys.modules.update({"ember": ember, "ember.strategies": lf.strategies, "ember.fabric": lf,
                    "ember.fabric.loggers": lf.loggers, "ember.fabric.utilities": lf.utilities,
                    "ember.fabric.utilities.types": lf.utilities.types, "ember.fabric.wrappers": lf.wrappers})
script = os.environ.get("PORT_SCRIPT")
if script is None:
    script = os.environ["PORT_SCRIPT"] = os.path.abspath(sys.argv.pop(1))
sys.argv[0] = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(script))
with open(script) as f:
    code = compile(f.read(), script, "exec")
exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})
