"""Strategies: *where* the work runs. ``build_strategy`` turns the Trainer's or the
Accelerator's ``strategy``/``devices``/``num_nodes`` arguments into a Strategy."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ember.errors import MisconfigurationError, invalid_choice
from ember.strategies.base import SingleDeviceStrategy, Strategy, auto_device

STRATEGIES = ("auto", "single", "ddp", "fsdp", "deepspeed", "model_parallel")
_DEVICE_TYPES = ("auto", "cpu", "cuda", "mps")

__all__ = ["Strategy", "SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy",
           "ModelParallelStrategy",
           "build_strategy", "parse_devices", "resolve_accelerator"]


def __getattr__(name):
    mod = {"DDPStrategy": "ddp", "FSDPStrategy": "fsdp", "DeepSpeedStrategy": "deepspeed",
           "ModelParallelStrategy": "model_parallel"}.get(name)
    if mod is None:
        raise AttributeError(f"module 'ember.strategies' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"ember.strategies.{mod}"), name)


def _launched_world_size() -> int:
    """World size when a launcher (torchrun, SLURM, ember launch) started us."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                pass
    return 1


def _check_available(devices, dtype: str, index: int | None = None) -> None:
    """``devices="cuda"`` / ``"cuda:N"`` / ``"mps"``: fail at construction on a machine without them."""
    if dtype == "cuda":
        if not torch.cuda.is_available():
            raise MisconfigurationError(f"devices={devices!r} but CUDA is not available on this machine "
                                        f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                                        "use devices='cpu' or 'auto'")
        n = torch.cuda.device_count()
        if index is not None and index >= n:
            raise MisconfigurationError(f"devices={devices!r}: CUDA device {index} does not exist "
                                        f"({n} device(s): cuda:0..cuda:{n - 1})")
    elif dtype == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise MisconfigurationError(f"devices={devices!r} but MPS (Apple GPU) is not available on this machine; "
                                        "use devices='cpu' or 'auto'")


def parse_devices(devices) -> tuple[str, int, list[int] | None]:
    """-> (device type, number of processes on this node, explicit indices or None)."""
    if isinstance(devices, bool) or devices is None:
        raise invalid_choice("devices", devices, ["auto", "cpu", "cuda", "cuda:N", "mps", "a positive int", "a list of ints"])
    if isinstance(devices, str):
        d = devices.strip().lower()
        if d.isdigit() or (d.startswith("-") and d[1:].isdigit()):
            return parse_devices(int(d))
        if d == "auto":
            return auto_device().type, 1, None
        if d.startswith("cuda:") and d[5:].isdigit():
            _check_available(devices, "cuda", int(d[5:]))
            return "cuda", 1, [int(d[5:])]
        if d in _DEVICE_TYPES:
            _check_available(devices, d)
            return d, 1, None
        raise invalid_choice("devices", devices, ["auto", "cpu", "cuda", "cuda:N", "mps", "a positive int", "a list of ints"])
    if isinstance(devices, int):
        if devices <= 0:
            raise MisconfigurationError(f"devices={devices} is not valid; use a positive number of devices, "
                                        "'auto', 'cpu', 'cuda', 'cuda:N', 'mps' or a list of device indices")
        dtype = auto_device().type
        if dtype == "cuda" and devices > torch.cuda.device_count():
            raise MisconfigurationError(f"devices={devices} but only {torch.cuda.device_count()} CUDA device(s) "
                                        "are available")
        if dtype == "mps" and devices > 1:
            raise MisconfigurationError("devices > 1 is not supported on MPS; use devices=1")
        return dtype, devices, None
    if isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(i, int) and i >= 0 for i in devices):
            raise MisconfigurationError(f"devices={devices!r}: a list must hold non-negative device indices")
        if not torch.cuda.is_available():
            raise MisconfigurationError(f"devices={devices!r} names CUDA devices, but CUDA is not available; "
                                        "use an int number of CPU processes instead")
        n = torch.cuda.device_count()
        bad = [i for i in devices if i >= n]
        if bad:
            raise MisconfigurationError(f"devices={devices!r}: indices {bad} do not exist ({n} CUDA device(s))")
        return "cuda", len(devices), list(devices)
    raise invalid_choice("devices", devices, ["auto", "cpu", "cuda", "mps", "an int", "a list of ints"])


_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def resolve_accelerator(accelerator: str | None, devices: Any) -> Any:
    """Map Lightning's ``Trainer(accelerator=..., devices=...)`` onto ember's ``devices``.

    ``"auto"``/None: ``devices`` unchanged. ``"cpu"``: CPU processes (``"auto"`` is one).
    ``"gpu"``/``"cuda"``: CUDA devices (``"auto"`` or -1: every visible GPU, as
    Lightning). ``"mps"``: Apple's GPU. A missing device type is a MisconfigurationError.
    """
    if accelerator is None:
        return devices
    if not isinstance(accelerator, str) or accelerator.lower() not in _ACCELERATORS:
        raise MisconfigurationError(f"accelerator={accelerator!r} is not supported; use one of {list(_ACCELERATORS)}")
    acc = accelerator.lower()
    if acc == "auto":
        return devices
    if acc in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise MisconfigurationError(f"accelerator={accelerator!r} but no CUDA device is available on this "
                                        "machine; use accelerator='cpu' (or 'auto')")
        n = torch.cuda.device_count()
        if devices in ("auto", -1, "-1"):
            return n if n > 1 else "cuda"
        if devices in (1, "1"):
            return "cuda"
        return devices
    if acc == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise MisconfigurationError(f"accelerator='mps' but MPS is not available on this machine; use "
                                        "accelerator='cpu' (or 'auto')")
        if devices not in ("auto", 1, "1", "mps"):
            raise MisconfigurationError(f"accelerator='mps' runs on one device; devices={devices!r} is not valid")
        return "mps"
    # cpu
    if devices in ("auto", 1, "1", "cpu"):
        return "cpu"
    if isinstance(devices, int) and devices > 1:
        if auto_device().type != "cpu":
            raise MisconfigurationError(f"accelerator='cpu' with devices={devices}: on a machine with a GPU ember "
                                        "runs several processes on the GPUs; use devices='cpu' for one CPU process")
        return devices
    raise MisconfigurationError(f"accelerator='cpu' with devices={devices!r}: use a number of processes or 'auto'")


def build_strategy(strategy="auto", devices="auto", num_nodes: int = 1) -> Strategy:
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise MisconfigurationError(f"num_nodes={num_nodes!r} is not valid; use a positive int")
    dtype, n, indices = parse_devices(devices)
    if isinstance(strategy, Strategy):
        apply = getattr(strategy, "apply_trainer_devices", None)
        if apply is not None:
            apply(indices if indices else (n if n > 1 or devices not in ("auto", "cpu", "cuda", "mps") else "auto"),
                  num_nodes)
        elif n > 1 or num_nodes > 1:
            raise MisconfigurationError(f"strategy={type(strategy).__name__} runs one process, but devices={devices!r}"
                                        f", num_nodes={num_nodes}; use strategy='ddp' (or a DDPStrategy) for several")
        return strategy
    if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
        raise invalid_choice("strategy", strategy, STRATEGIES + ("a Strategy instance",))
    name = strategy.lower()
    if name == "auto":
        name = os.environ.get("EMBER_STRATEGY", "auto").lower()
        if name in ("no", "auto", "single", ""):
            name = "ddp" if (n > 1 or num_nodes > 1 or _launched_world_size() > 1) else "single"
    if name == "ddp" and n == 1 and num_nodes == 1 and _launched_world_size() == 1:
        warnings.warn("strategy='ddp' with devices=1 on one node: running on a single device instead",
                      stacklevel=3)
        name = "single"
    if name == "single":
        if n > 1:
            raise MisconfigurationError(f"strategy='single' runs one process but devices={devices!r}; "
                                        "use strategy='ddp' for several")
        if indices:
            device = torch.device("cuda", indices[0])
        elif dtype == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        else:
            device = torch.device(dtype)
        return SingleDeviceStrategy(device)
    cls = __getattr__({"ddp": "DDPStrategy", "fsdp": "FSDPStrategy", "deepspeed": "DeepSpeedStrategy",
                       "model_parallel": "ModelParallelStrategy"}[name])
    kwargs = {"devices": indices if indices else (n if n > 1 or dtype == "cuda" else None), "num_nodes": num_nodes}
    if dtype == "cpu":
        kwargs["accelerator"] = "cpu"
    try:
        return cls(**kwargs)
    except TypeError:
        kwargs.pop("accelerator", None)
        return cls(**kwargs)
