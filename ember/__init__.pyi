# The static view of ``ember/__init__.py`` for IDEs and type checkers (jedi, pyright, mypy).
# At run time these names are imported on first use (``ember.__getattr__``), which keeps
# ``import ember`` cheap; tests/compat/test_static_names.py checks this list against
# ``ember._LAZY`` and that jedi resolves every name.
import ember.fabric as fabric
from ember.accelerator import Accelerator as Accelerator
from ember.big_modeling.device_map import infer_auto_device_map as infer_auto_device_map
from ember.big_modeling.device_map import init_empty_weights as init_empty_weights
from ember.big_modeling.device_map import init_on_device as init_on_device
from ember.big_modeling.hooks import dispatch_model as dispatch_model
from ember.big_modeling.loading import load_checkpoint_and_dispatch as load_checkpoint_and_dispatch
from ember.big_modeling.loading import load_checkpoint_in_model as load_checkpoint_in_model
from ember.compat.accelerate import AcceleratorState as AcceleratorState
from ember.compat.accelerate import DataLoaderConfiguration as DataLoaderConfiguration
from ember.compat.accelerate import DistributedDataParallelKwargs as DistributedDataParallelKwargs
from ember.compat.accelerate import GradScalerKwargs as GradScalerKwargs
from ember.compat.accelerate import InitProcessGroupKwargs as InitProcessGroupKwargs
from ember.compat.accelerate import ProfileKwargs as ProfileKwargs
from ember.compat.accelerate import DistributedType as DistributedType
from ember.compat.accelerate import PartialState as PartialState
from ember.compat.fabric import Fabric as Fabric
from ember.data.combined import CombinedLoader as CombinedLoader
from ember.launch.notebook import notebook_launcher as notebook_launcher
from ember.module import DataModule as DataModule
from ember.module import TrainModule as TrainModule
from ember.trainer import Trainer as Trainer
from ember.data.worker_seed import seed_everything as seed_everything
from ember.utils import find_executable_batch_size as find_executable_batch_size
from ember.utils import skip_first_batches as skip_first_batches

__version__: str
__all__: list[str]
