"""Debug mode (``Accelerator(debug=True)`` / ``EMBER_DEBUG=1``): before each collective,
every process sends the others the operation and its tensors' dtypes and shapes, and
all raise the same error when they do not fit (instead of hanging)."""
from __future__ import annotations

from typing import Any

import torch

from ember.errors import DistributedOperationError


# -- debug mode --------------------------------------------------------------------------------------
def _describe(data: Any, out: list) -> list:
    if isinstance(data, torch.Tensor):
        out.append((str(data.dtype).replace("torch.", ""), tuple(data.shape)))
    elif isinstance(data, dict):
        for v in data.values():
            _describe(v, out)
    elif isinstance(data, (list, tuple)):
        if data and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in data):
            out.append(("objects", None))
        else:
            for v in data:
                _describe(v, out)
    elif data is not None:
        out.append(("objects", None))
    return out


def _fmt(op: str, leaves: list) -> str:
    parts = [f"{d}[{', '.join(str(s) for s in shape)}]" if shape is not None else d for d, shape in leaves]
    return f"{op}({', '.join(parts)})"


def _compatible(a: list, b: list, free_dim: int | None) -> bool:
    if len(a) != len(b):
        return False
    for (da, sa), (db, sb) in zip(a, b):
        if da != db or (sa is None) != (sb is None):
            return False
        if sa is None:
            continue
        if len(sa) != len(sb):
            return False
        free = None if free_dim is None or not sa else free_dim % len(sa)
        if any(x != y for i, (x, y) in enumerate(zip(sa, sb)) if i != free):
            return False
    return True


def check_collective(strategy: Any, op: str, data: Any, free_dim: int | None = None) -> None:
    """Debug mode: every process sends the others the name of the collective it is
    about to run and its tensors' dtypes and shapes; raise
    :class:`DistributedOperationError` on every process if they do not fit."""
    mine = (op, _describe(data, []))
    every = strategy.all_gather_object(mine)
    ok = all(o == every[0][0] for o, _ in every) and all(_compatible(every[0][1], l, free_dim) for _, l in every)
    if ok:
        return
    if len({o for o, _ in every}) > 1:
        what, rule = "different operations", "Every process must call the same collectives in the same order."
    else:
        what = f"`{op}` with tensors that do not fit"
        rule = ("Every process must pass tensors of the same dtype and number of dimensions and the same "
                "shape" + (f" except in dimension {free_dim}." if free_dim is not None else "."))
    lines = [f"ember debug mode: the processes called {what}; running it would hang or fail:"]
    lines += [f"  rank {r}: {_fmt(o, l)}" for r, (o, l) in enumerate(every)]
    lines.append(rule)
    raise DistributedOperationError("\n".join(lines))
