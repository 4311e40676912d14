"""``fabric.save`` under 2 processes (gloo, a 20 s process-group timeout), each failure
caught by the script as a user's would be: a state holding an object that cannot be
saved, a target that is a user's folder, and a state whose check fails on rank 1 alone
with another error than CheckpointError (a list holding itself). Every rank must raise the same error and go
on (no rank left in the save's closing collective); then a good save and a load work.
Each rank writes ``OUT/rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/fabric_save_ddp.py OUT
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

from ember import Fabric
from ember.errors import CheckpointError
from ember.strategies import DDPStrategy

OUT = sys.argv[1]
fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(timeout=20), devices=2)
model = fabric.setup(nn.Linear(2, 1))
result = {}
user = os.path.join(OUT, "results")
if fabric.is_global_zero:
    os.makedirs(user, exist_ok=True)
    with open(os.path.join(user, "results.csv"), "w") as f:
        f.write("epoch,acc\n")
fabric.barrier()
loop = []
loop.append(loop)   # a list holding itself, on rank 1 only: its check fails there alone (RecursionError)
for case, path, state in (("unsavable", os.path.join(OUT, "ck"), {"model": model, "bad": object()}),
                          ("user_folder", user, {"model": model, "step": 1}),
                          ("rank1_only", os.path.join(OUT, "ck"),
                           {"model": model, "seen": loop if fabric.global_rank == 1 else []})):
    start = time.monotonic()
    try:
        fabric.save(path, state)
        result[case] = None
    except CheckpointError as err:
        result[case] = str(err)
    except RecursionError as err:
        result[case] = f"own RecursionError: {err}"
    result[case + "_s"] = time.monotonic() - start
fabric.save(os.path.join(OUT, "ck"), {"model": model, "step": 2})
result["loaded_step"] = fabric.load(os.path.join(OUT, "ck"))["step"]
with open(os.path.join(OUT, "results", "results.csv")) as f:
    result["user_file"] = f.read()
with open(os.path.join(OUT, f"rank{fabric.global_rank}.json"), "w") as f:
    json.dump(result, f)
