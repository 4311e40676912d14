# The static view of ``ember/__init__.py`` for IDEs and type checkers (jedi, pyright, mypy).
# At run time these names are imported on first use (``ember.__getattr__``), which keeps
# ``import ember`` cheap; tests/compat/test_static_names.py checks this list against
# ``ember._LAZY`` and that jedi resolves every name.
from ember.accelerator import Accelerator as Accelerator
from ember.compat.accelerate import AcceleratorState as AcceleratorState
from ember.compat.accelerate import DistributedType as DistributedType
from ember.compat.accelerate import PartialState as PartialState
from ember.compat.fabric import Fabric as Fabric
from ember.data.combined import CombinedLoader as CombinedLoader
from ember.launch.notebook import notebook_launcher as notebook_launcher
from ember.module import DataModule as DataModule
from ember.module import TrainModule as TrainModule
from ember.trainer import Trainer as Trainer
from ember.utilities import seed_everything as seed_everything
from ember.utils import find_executable_batch_size as find_executable_batch_size

__version__: str
__all__: list[str]
