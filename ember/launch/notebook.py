"""``notebook_launcher`` (Accelerate's): run a training function on several processes
from a notebook cell or any interactive session (forked processes, CPU/gloo or GPU/NCCL)."""
from __future__ import annotations

import os
from typing import Callable

__all__ = ["notebook_launcher"]


def _worker(index: int, function: Callable, args: tuple, env: dict) -> None:
    from ember.distributed.processes import forget_shared_strategy
    forget_shared_strategy()   # a state set up in the notebook process before the fork is not this process's
    os.environ.update(env)
    os.environ.update(RANK=str(int(env["NODE_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + index),
                      LOCAL_RANK=str(index), GROUP_RANK=env["NODE_RANK"])
    function(*args)


def notebook_launcher(function: Callable, args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, **kwargs) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (default:
    one per GPU, else one process running it in place). Each process sees ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` as under
    ``ember launch``, and ``EMBER_PRECISION`` from ``mixed_precision``. An error in any
    process is raised here. Other keyword arguments of Accelerate's launcher raise."""
    import torch
    import torch.multiprocessing as mp
    from ember.errors import MisconfigurationError
    if kwargs:
        raise MisconfigurationError(f"notebook_launcher: {', '.join(sorted(kwargs))} not supported by ember")
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise MisconfigurationError(f"notebook_launcher(mixed_precision={mixed_precision!r}): use 'no', 'fp16' "
                                    "or 'bf16'")
    if num_processes is None:
        num_processes = max(1, torch.cuda.device_count())
    precision = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}[mixed_precision]
    if num_processes == 1 and num_nodes == 1:
        os.environ.setdefault("EMBER_PRECISION", precision)
        function(*args)
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise MisconfigurationError("notebook_launcher: CUDA was initialised in this process before the launch; "
                                    "restart the notebook and keep CUDA calls inside the training function")
    env = {"WORLD_SIZE": str(num_processes * num_nodes), "LOCAL_WORLD_SIZE": str(num_processes),
           "MASTER_ADDR": master_addr, "MASTER_PORT": str(use_port), "NODE_RANK": str(node_rank),
           "EMBER_PRECISION": precision, "ACCELERATE_MIXED_PRECISION": mixed_precision}
    mp.start_processes(_worker, args=(function, tuple(args), env), nprocs=num_processes, join=True,
                       start_method="fork")
