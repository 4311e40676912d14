"""The ``accelerate.utils`` helpers behind :mod:`ember.utils`. They run on the process's
shared strategy (:func:`ember.distributed.processes.shared_strategy`: the Accelerator's
once one exists).
"""
from __future__ import annotations

import functools
import gc
import inspect
import os
from typing import Any, Callable

import torch

from ember.accelerator.config import (DataLoaderConfiguration, DistributedDataParallelKwargs,  # noqa: F401
                                      DistributedType, GradientAccumulationPlugin, GradScalerKwargs,
                                      InitProcessGroupKwargs, ProfileKwargs, ProjectConfiguration, TorchDynamoPlugin)
from ember.compat.lightning import convert_lightning_checkpoint  # noqa: F401  (Lightning checkpoints)
from ember.distributed.processes import shared_strategy as _strategy
from ember.strategies.base import move_to_device

__all__ = ["set_seed", "ProjectConfiguration", "gather", "gather_object", "broadcast", "broadcast_object_list",
           "pad_across_processes", "reduce", "send_to_device", "find_executable_batch_size",
           "release_memory", "should_reduce_batch_size", "tqdm", "DistributedType", "GradientAccumulationPlugin",
           "DataLoaderConfiguration", "write_basic_config", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "InitProcessGroupKwargs", "ProfileKwargs", "TorchDynamoPlugin", "is_main_process", "skip_first_batches"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> int:
    """Seed ``random``, numpy and torch (all devices) with ``seed``; ``device_specific``:
    ``seed + process index``; ``deterministic``: ``torch.use_deterministic_algorithms(True)``."""
    from ember.data.worker_seed import seed_everything
    if device_specific:
        s = _strategy()
        seed += s.global_rank if s is not None else int(os.environ.get("RANK", 0))
    if deterministic:
        torch.use_deterministic_algorithms(True)
    return seed_everything(seed)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """Accelerate's ``skip_first_batches``: the next pass over ``dataloader`` starts after
    ``num_batches`` batches. A loader prepared by an Accelerator skips indices (no data is
    read) and is returned itself (:meth:`ember.Accelerator.skip_first_batches`); any other
    iterable is wrapped and reads the skipped batches."""
    from ember.distributed.processes import _Islice
    from ember.data.loader import DataLoaderShard
    if isinstance(dataloader, DataLoaderShard):
        dataloader.skip(num_batches)
        return dataloader
    return _Islice(dataloader, num_batches)


def is_main_process() -> bool:
    s = _strategy()
    return s.is_global_zero if s is not None else int(os.environ.get("RANK", 0)) == 0


def gather(tensor):
    """Concatenate ``tensor`` (or nested tensors) from every process along dim 0."""
    from ember.distributed import collectives as d
    return d.gather(tensor, strategy=_strategy())


def gather_object(obj: Any) -> list:
    """Every process's ``obj``; lists are concatenated (as Accelerate)."""
    from ember.distributed import collectives as d
    got = d.all_gather_object(obj, strategy=_strategy())
    return [x for part in got for x in part] if isinstance(obj, list) else got


def broadcast(tensor, from_process: int = 0):
    """Process ``from_process``'s tensor (same shape everywhere) or object."""
    from ember.distributed import collectives as d
    return d.broadcast(tensor, from_process, strategy=_strategy())


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Fill ``object_list`` in place with process ``from_process``'s items; returns it."""
    from ember.distributed import collectives as d
    got = d.broadcast(list(object_list), from_process, strategy=_strategy())
    object_list[:] = got
    return object_list


def pad_across_processes(tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    """Pad along ``dim`` to the largest size over processes."""
    from ember.distributed import collectives as d
    return d.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first, strategy=_strategy())


def reduce(tensor, reduction: str = "mean", scale: float = 1.0):
    """Reduce over processes: ``"sum"``, ``"mean"`` (default, as ``accelerate.utils.reduce``), ``"none"``."""
    from ember.distributed import collectives as d
    out = tensor if reduction == "none" else d.reduce(tensor, reduction, strategy=_strategy())
    return out if scale == 1.0 else d._map(out, lambda t: t * scale)


def send_to_device(tensor, device, non_blocking: bool = False, skip_keys=None):
    """Move tensors inside lists, tuples, dicts (and other mappings) and ``.to()``-able objects to
    ``device`` (not inside dataclasses)."""
    if skip_keys:
        if isinstance(skip_keys, str):
            skip_keys = [skip_keys]
        if isinstance(tensor, dict):
            return type(tensor)({k: v if k in skip_keys else send_to_device(v, device, non_blocking)
                                 for k, v in tensor.items()})
    return move_to_device(tensor, torch.device(device), non_blocking=non_blocking)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True for an out-of-memory error (CUDA, MPS, CPU allocator, cuDNN)."""
    if isinstance(exception, getattr(torch, "OutOfMemoryError", ())):
        return True
    if isinstance(exception, (RuntimeError, MemoryError)) and len(exception.args) >= 1:
        msg = str(exception.args[0]) if not isinstance(exception, MemoryError) else "out of memory"
        return any(s in msg for s in ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                                      "DefaultCPUAllocator: can't allocate memory", "out of memory",
                                      "MPS backend out of memory"))
    return False


def release_memory(*objects):
    """Drop references, collect garbage, empty the device cache; returns ``[None] * len(objects)``."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [None] * len(objects)


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[int], int] | None = None):
    """Decorator (Accelerate's): call ``function(batch_size, *args, **kwargs)`` with
    ``starting_batch_size``; on an out-of-memory error (``torch.OutOfMemoryError``, CUDA /
    CPU allocator messages) free memory and retry with ``int(batch_size * 0.9)``, as
    Accelerate does (128, 115, 103, 92, ...; 40, 36, 32, 28, 25, 22, ...), or with what
    ``reduce_batch_size_fn`` returns (called with the failed batch size, or with no argument as
    in Accelerate); at 0 raise ``RuntimeError("No executable batch size found, reached
    zero.")``. The decorated function is called without the batch size::

        @find_executable_batch_size(starting_batch_size=64)
        def train(batch_size, model):
            ...
        train(model)

    Each call of ``train`` starts again at ``starting_batch_size`` (Accelerate's decorator
    starts a second call where the first one ended).

    Under several processes the ranks retry together: a rank that ran out of memory
    waits for the others to run out at the same batch size (in the rendezvous store, no
    collective), and raises, naming itself, when they do not within the process-group
    timeout (60 s at most): then its exit ends the others.
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    reduce_fn = _reducer(reduce_batch_size_fn)

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        batch_size = starting_batch_size
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        params = list(inspect.signature(function).parameters.keys())
        if len(params) < len(args) + 1:
            arg_str = ", ".join(f"{arg}={value}" for arg, value in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                            f"Remove this as the decorator already does so: `{function.__name__}({arg_str})`")
        _CALLS["n"] += 1
        call = _CALLS["n"]
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not should_reduce_batch_size(e):
                    raise
                _agree_on_oom(call, batch_size, e)   # several processes: retry only together
                del e
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = reduce_fn(batch_size)
    return decorator


def _reducer(fn: Callable | None) -> Callable[[int], int]:
    """``batch_size -> next batch size``: Accelerate's ``int(b * 0.9)`` by default; a user's
    function may take the failed batch size or, as Accelerate's, no argument."""
    if fn is None:
        return lambda b: int(b * 0.9)
    try:
        takes_none = not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                             for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):   # a builtin without a signature: give it the batch size
        takes_none = False
    return (lambda b: int(fn())) if takes_none else (lambda b: int(fn(b)))


_CALLS = {"n": 0}
_OOM_WAIT_S = 60.0


def _agree_on_oom(call: int, batch_size: int, error: BaseException) -> None:
    """Wait until every rank ran out of memory at this batch size, else raise (see
    :func:`find_executable_batch_size`): a rank that retried alone would run its
    collectives against the others' (a hang, or ranks training with different batch
    sizes). The rendezvous store, not a collective: the others may be blocked in one."""
    import time
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed import distributed_c10d as c10d
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        store = c10d._get_default_store()
    except Exception:   # noqa: BLE001 - no store: the others cannot be asked
        store = None
    limit = _OOM_WAIT_S
    s = _strategy()
    timeout = getattr(s, "timeout", None)
    if timeout is not None:
        limit = min(limit, timeout.total_seconds())
    got = 1
    if store is not None:
        key = f"ember/find_executable_batch_size/{call}/{batch_size}"
        try:
            got = int(store.add(key, 1))
            deadline = time.monotonic() + limit
            while got < world and time.monotonic() < deadline:
                time.sleep(0.05)
                got = int(store.add(key, 0))
        except Exception:   # noqa: BLE001 - the store is gone (a rank ended): no retry together
            pass
    if got >= world:
        return
    raise RuntimeError(
        f"find_executable_batch_size: rank {rank} ran out of memory at batch size {batch_size}, but only {got} "
        f"of {world} ranks did within {limit:g} s: the ranks cannot retry with a smaller batch size apart (their "
        "collectives would no longer match). Lower starting_batch_size, or even out the memory use of the ranks"
    ) from error


def tqdm(*args, main_process_only: bool = True, **kwargs):
    """``tqdm.auto.tqdm`` that draws on the main process only (``disable`` elsewhere)."""
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from tqdm.auto import tqdm as _tqdm
    if main_process_only and not is_main_process():
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> "str | bool":
    """Write the default ``ember launch`` configuration (the file ``ember config``
    writes) for this machine: one process per GPU (one on the CPU), ``mixed_precision``.
    Returns the path, or False when a file is already there (as Accelerate)."""
    from ember.launch.command import default_config_path, default_launch_config, write_config
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(f"mixed_precision={mixed_precision!r}: use 'no', 'fp16' or 'bf16'")
    path = os.fspath(save_location) if save_location is not None else os.fspath(default_config_path())
    if os.path.exists(path):
        return False
    cfg = default_launch_config()
    cfg["mixed_precision"] = mixed_precision
    return os.fspath(write_config(cfg, path))
