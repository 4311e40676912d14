"""Debug mode (run with 2 processes and EMBER_DEBUG=1): mismatched collectives raise
a clear error on every rank instead of hanging. Rank r writes ``OUT/rank<r>.json``.
With ``--uncaught`` the first mismatch is not caught (the run must fail promptly).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from ember import Accelerator
from ember.errors import DistributedOperationError


def main():
    out, uncaught = sys.argv[1], "--uncaught" in sys.argv
    acc = Accelerator()
    rank = acc.process_index
    res = {"debug": acc.debug}
    if uncaught:
        acc.gather(torch.zeros(3, 4 + rank))
    errors = {}
    cases = {
        "gather_shape": lambda: acc.gather(torch.zeros(3, 4 + rank)),
        "gather_dtype": lambda: acc.gather(torch.zeros(3, dtype=torch.float32 if rank == 0 else torch.int64)),
        "different_ops": lambda: acc.gather(torch.zeros(2)) if rank == 0 else acc.reduce(torch.zeros(2)),
        "reduce_shape": lambda: acc.reduce(torch.zeros(2 + rank)),
        "broadcast_shape": lambda: acc.broadcast(torch.zeros(1 + rank)),
        "pad_other_dim": lambda: acc.pad_across_processes(torch.zeros(2 + rank, 3 + rank), dim=1),
        "barrier_vs_gather": lambda: acc.wait_for_everyone() if rank == 0 else acc.gather(torch.zeros(1)),
    }
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = None
        except DistributedOperationError as err:
            errors[name] = str(err)
    res["errors"] = errors
    # compatible calls still work in debug mode (dim 0 may differ for gather / pad dim)
    res["gather_ragged"] = acc.gather(torch.full((rank + 1, 2), float(rank))).shape[0]
    res["pad_ok"] = list(acc.pad_across_processes(torch.zeros(2, 1 + rank), dim=1).shape)
    res["gfm"] = acc.gather_for_metrics({"p": torch.tensor([rank]), "ids": [f"x{rank}"]})["ids"]
    acc.wait_for_everyone()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
