"""``ember.utils``: what Accelerate users import from ``accelerate.utils``, under the
same names: ``from accelerate.utils import set_seed, ProjectConfiguration`` becomes
``from ember.utils import set_seed, ProjectConfiguration``. Differences are listed in
``docs/porting.md``.
"""
from ember.compat.accelerate_utils import *  # noqa: F401,F403  (its __all__)
from ember.compat.accelerate_utils import __all__  # noqa: F401
from ember.compat.lightning import convert_lightning_checkpoint  # noqa: F401  (Lightning checkpoints)
