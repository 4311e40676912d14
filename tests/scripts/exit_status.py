"""A 2-process DDP fit (ember's own launcher), then a chosen way of leaving:

    python exit_status.py MODE OUT_DIR

MODE ``native-abort``: an exit-time handler that calls ``abort()``, registered with
``__cxa_atexit`` as C++ static destructors are, stands in for native teardown that
aborts at process exit (as gloo's sometimes does after ``destroy_process_group()``);
ember must end the process before it runs.
MODE ``exit3``: ``sys.exit(3)``; the exit status must stay 3 on every rank.
Each rank prints (without flushing) a last line that must not be lost.
"""
import ctypes
import os
import sys

from torch.utils.data import DataLoader

from ember import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Regressor, noise_data  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
data = noise_data(32)
trainer = Trainer(max_steps=3, strategy="ddp", devices=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=out)
trainer.fit(Regressor(lr=0.1), DataLoader(data, batch_size=8))
if mode == "native-abort":
    libc = ctypes.CDLL(None)   # registered the way C++ static destructors are
    libc.__cxa_atexit(libc.abort, None, None)
print(f"rank {trainer.global_rank} finished", end="")   # left in Python's buffer
if mode == "exit3":
    sys.exit(3)
