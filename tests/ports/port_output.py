"""What every port writes for the comparison, on ember as on Lightning and Lightning Fabric:
rank 0 of the run (a Trainer or a Fabric) writes the results, tensors as plain numbers, to
the JSON file the test names in ``PORT_OUT``. Plain torch only; the ports' ``common.py``
puts this folder on ``sys.path`` and re-exports ``write``."""
from __future__ import annotations

import json
import os
from typing import Any

import torch


def num(value: Any) -> Any:
    """Tensors and containers of them as plain floats/lists for JSON."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {k: num(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [num(v) for v in value]
    return value


def write(run: Any, **results: Any) -> None:
    """Rank 0 of ``run`` (a Trainer or a Fabric) writes ``results`` (plus the world size) to
    ``PORT_OUT``."""
    out = os.environ.get("PORT_OUT")
    if out and run.global_rank == 0:
        results["world"] = run.world_size
        with open(out, "w") as f:
            json.dump(num(results), f, indent=1, sort_keys=True)
