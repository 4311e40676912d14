"""Run a port unchanged on Accelerate: the ``ember`` modules it imports are mapped to
``accelerate``'s (same names), then the script runs as ``__main__``.

    python tests/ports/accelerate/run_with_accelerate.py tests/ports/accelerate/by_feature.py OUT.json
"""
import runpy
import sys

import accelerate
import accelerate.local_sgd
import accelerate.logging
import accelerate.utils

sys.modules.update({"ember": accelerate, "ember.utils": accelerate.utils, "ember.local_sgd": accelerate.local_sgd,
                    "ember.logging": accelerate.logging})
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
