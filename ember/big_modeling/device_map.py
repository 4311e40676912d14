"""Empty-weight init, module sizes, memory budgets and the automatic device map.

Names and arguments follow Hugging Face Accelerate (``accelerate.init_empty_weights``,
``accelerate.utils.compute_module_sizes``, ``get_max_memory``, ``get_balanced_memory``,
``infer_auto_device_map``, ``find_tied_parameters``, ``check_device_map``).
"""
from __future__ import annotations

import contextlib
import os
import re
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch import nn

from ember.errors import DeviceMapError, MisconfigurationError  # noqa: F401  (DeviceMapError: public here too)

__all__ = ["init_empty_weights", "init_on_device", "compute_module_sizes", "get_max_memory",
           "get_balanced_memory", "infer_auto_device_map", "find_tied_parameters", "check_device_map",
           "named_module_tensors", "DeviceMapError"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
#: share of a device's free memory that the default budgets use (the rest is left for activations)
HEADROOM = 0.9


# -- empty init ------------------------------------------------------------------------------
@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter (and, with ``include_buffers=True``, every buffer) of the modules
    built inside this block directly on ``device``.

    With ``device="meta"`` (see :func:`init_empty_weights`) a model of any size is built without
    memory for its weights. Parameters that already live on ``device`` are kept as they are, so
    weights tied by assignment (``lm_head.weight = wte.weight``) stay one parameter. Buffers
    stay on the CPU by default: many are computed in ``__init__`` and are not in checkpoints.
    """
    device = torch.device(device)
    old_param = nn.Module.register_parameter
    old_buffer = nn.Module.register_buffer

    def register_parameter(module, name, param):
        old_param(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device != device:
            kwargs = dict(p.__dict__)
            kwargs["requires_grad"] = p.requires_grad
            module._parameters[name] = type(p)(p.to(device), **kwargs)

    def register_buffer(module, name, tensor, persistent=True):
        old_buffer(module, name, tensor, persistent=persistent)
        if module._buffers.get(name) is not None:
            module._buffers[name] = module._buffers[name].to(device)

    nn.Module.register_parameter = register_parameter
    if include_buffers:
        nn.Module.register_buffer = register_buffer
    ctx = torch.device(device) if include_buffers else contextlib.nullcontext()
    try:
        with ctx:
            yield
    finally:
        nn.Module.register_parameter = old_param
        nn.Module.register_buffer = old_buffer


def init_empty_weights(include_buffers: bool = False):
    """Context manager: build a model with its parameters on the ``meta`` device (no memory).

    >>> with init_empty_weights():
    ...     model = nn.Sequential(*[nn.Linear(10_000, 10_000) for _ in range(100)])   # ~40 GB, instantly

    Load the weights afterwards with :func:`ember.big_modeling.load_checkpoint_and_dispatch`.
    """
    return init_on_device("meta", include_buffers=include_buffers)


# -- sizes -----------------------------------------------------------------------------------
def named_module_tensors(module: nn.Module, recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers of ``module`` (each shared tensor once, under its first name)."""
    yield from module.named_parameters(recurse=recurse)
    yield from module.named_buffers(recurse=recurse)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None, special: dict | None, name: str) -> int:
    if special and name in special:
        return t.numel() * _itemsize(_as_dtype(special[name]))
    if dtype is None or not t.is_floating_point():
        return t.numel() * t.element_size()
    return t.numel() * min(_itemsize(dtype), t.element_size())


def _as_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    d = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise MisconfigurationError(f"dtype={dtype!r} is not a torch dtype; use e.g. torch.float16 or 'bfloat16'")
    return d


def compute_module_sizes(model: nn.Module, dtype: torch.dtype | str | None = None,
                         special_dtypes: dict[str, Any] | None = None) -> dict[str, int]:
    """Bytes of every module, parameter and buffer of ``model`` by name (``""`` is the whole
    model). With ``dtype``, floating-point tensors are counted at that size (or their own if
    smaller): what they will weigh once loaded with ``dtype=``. Tied tensors count once."""
    dtype = _as_dtype(dtype)
    sizes: dict[str, int] = {}
    for name, t in named_module_tensors(model):
        n = _tensor_bytes(t, dtype, special_dtypes, name)
        parts = name.split(".")
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            sizes[key] = sizes.get(key, 0) + n
    sizes.setdefault("", 0)
    return sizes


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (e.g. ``[["lm_head.weight",
    "transformer.wte.weight"]]``), each group sorted."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in by_id.values() if len(names) > 1)


# -- devices and budgets ---------------------------------------------------------------------
def parse_memory(value: int | str, what: str = "max_memory") -> int:
    """``"10GiB"`` -> 10 * 2**30, ``"500MB"`` -> 500 * 10**6; ints are bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if m and m.group(2).upper() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise MisconfigurationError(f"{what}={value!r} is not a size; give bytes (int) or a string such as "
                                "'500MB', '2GB' or '10GiB'")


def _device_key(device: Any, where: str) -> int | str:
    """Normalise a device name to Accelerate's keys: GPU index (int), 'mps', 'xpu:N', 'cpu', 'disk'."""
    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(device, bool):
        raise DeviceMapError(f"{where}: {device!r} is not a device")
    if isinstance(device, int):
        key: int | str = device
    elif isinstance(device, str):
        d = device.strip().lower()
        if d in ("cpu", "disk", "mps", "meta"):
            return d if d != "meta" else _unknown(device, where)
        m = re.fullmatch(r"(cuda|xpu|npu)(?::(\d+))?", d)
        if m is None:
            if d.isdigit():
                key = int(d)
            else:
                _unknown(device, where)
        else:
            idx = int(m.group(2) or 0)
            key = idx if m.group(1) == "cuda" else f"{m.group(1)}:{idx}"
    else:
        _unknown(device, where)
    if isinstance(key, int):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 0 <= key < n:
            raise DeviceMapError(f"{where}: device {device!r} (cuda:{key}) does not exist here; "
                                 f"this machine has {n} CUDA device(s). Use "
                                 f"{'0..' + str(n - 1) + ', ' if n else ''}'cpu' or 'disk'")
    return key


def _unknown(device: Any, where: str):
    raise DeviceMapError(f"{where}: {device!r} is not a device; use a GPU index (0, 1, ...) or "
                         "'cuda:N', 'mps', 'cpu' or 'disk'")


def torch_device(key: int | str) -> torch.device:
    """The ``torch.device`` for a device-map value (``"disk"`` has none)."""
    return torch.device(f"cuda:{key}" if isinstance(key, int) else key)


def _cpu_available() -> int:
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _order(keys) -> list:
    gpus = sorted(k for k in keys if isinstance(k, int))
    others = [k for k in keys if isinstance(k, str) and k not in ("mps", "cpu", "disk")]
    return gpus + sorted(others) + [k for k in ("mps", "cpu", "disk") if k in keys]


def get_max_memory(max_memory: dict | None = None) -> "OrderedDict[int | str, int]":
    """Memory budget per device, in bytes, in placement order (GPUs, then ``mps``, ``cpu``, ``disk``).

    ``None``: 90% of what each CUDA device has free and 90% of the machine's available RAM
    (the rest is left for activations and the CUDA context). A given dict may use ints or
    ``"cuda:N"`` for GPUs and sizes such as ``"10GiB"``; unknown devices raise a
    :class:`DeviceMapError`.
    """
    if max_memory is None:
        out: dict = {}
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                out[i] = int(torch.cuda.mem_get_info(i)[0] * HEADROOM)
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            out["mps"] = int(_cpu_available() * HEADROOM)
        out["cpu"] = int(_cpu_available() * HEADROOM)
        return OrderedDict((k, out[k]) for k in _order(out))
    if not isinstance(max_memory, dict):
        raise MisconfigurationError(f"max_memory must be a dict such as {{0: '10GiB', 'cpu': '30GiB'}}, "
                                    f"got {type(max_memory).__name__}")
    out = {}
    for k, v in max_memory.items():
        out[_device_key(k, "max_memory")] = parse_memory(v, f"max_memory[{k!r}]")
    return OrderedDict((k, out[k]) for k in _order(out))


def get_balanced_memory(model: nn.Module, max_memory: dict | None = None,
                        no_split_module_classes: list[str] | None = None, dtype: Any = None,
                        special_dtypes: dict | None = None, low_zero: bool = False) -> dict:
    """Budgets that spread ``model`` evenly over the GPUs (Accelerate's ``device_map="balanced"``)
    instead of filling the first one: each GPU gets its share plus room for the largest block.
    With ``low_zero=True`` GPU 0 gets as little as possible (room for ``generate()``'s work).
    One GPU or none: the budgets come back unchanged."""
    max_memory = get_max_memory(max_memory)
    gpus = [k for k in max_memory if isinstance(k, int) and max_memory[k] > 0]
    if len(gpus) < 2:
        return max_memory
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (len(gpus) - 1 if low_zero else len(gpus))
    blocks = _leaf_blocks(model, set(no_split_module_classes or ()))
    largest = max((sizes.get(n, 0) for n in blocks), default=0)
    out = OrderedDict(max_memory)
    for i, k in enumerate(gpus):
        if low_zero and i == 0:
            out[k] = min(max_memory[k], largest)
        elif i < len(gpus) - 1:
            out[k] = min(max_memory[k], int(per_gpu * 1.1) + largest)
    return out


# -- the automatic map ------------------------------------------------------------------------
def _leaf_blocks(model: nn.Module, no_split: set[str]) -> list[str]:
    """Names of the units the map never splits: modules of a no-split class and childless modules."""
    out, stack = [], [("", model)]
    while stack:
        name, m = stack.pop()
        kids = list(m.named_children())
        if (name and type(m).__name__ in no_split) or not kids:
            out.append(name)
            continue
        stack += [(f"{name}.{n}" if name else n, c) for n, c in kids]
    return out


def _tensor_names(module: nn.Module, prefix: str) -> list[str]:
    return [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(remove_duplicate=False)]


def infer_auto_device_map(model: nn.Module, max_memory: dict | None = None,
                          no_split_module_classes: list[str] | None = None, dtype: Any = None,
                          special_dtypes: dict | None = None, verbose: bool = False,
                          clean_result: bool = True, offload_buffers: bool = False) -> "OrderedDict[str, int | str]":
    """A device map for ``model``: modules in definition order fill each device of ``max_memory``
    in turn (GPUs, then ``"cpu"``), and what does not fit goes to ``"disk"``.

    - A module that does not fit where the filling stands is split into its direct parameters
      and children, unless its class is in ``no_split_module_classes`` (e.g. a transformer
      block with a residual connection) or it has no children: then it moves to the next device.
    - The main device (first GPU, else CPU) and the CPU keep room for the largest unsplittable
      block, where offloaded blocks are loaded to run (as Accelerate does).
    - Tied parameters (one tensor under several names) go where their first user goes, with
      the modules that hold the other names.
    - ``max_memory`` defaults to :func:`get_max_memory`. If the execution device cannot hold the
      largest unsplittable block, a :class:`DeviceMapError` names it and both sizes.
    - ``clean_result``: children that all went to one device are merged into their parent.
    """
    no_split = set(no_split_module_classes or ())
    budgets = get_max_memory(max_memory)
    devices = [d for d in budgets if d != "disk"] + ["disk"]
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    blocks = _leaf_blocks(model, no_split)
    largest = max(blocks, key=lambda n: sizes.get(n, 0)) if blocks else ""
    largest_size = sizes.get(largest, 0)
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main = gpus[0] if gpus else "cpu"
    room = budgets.get(main, 0)
    if largest_size > room and sizes[""] > 0:
        mod = model.get_submodule(largest) if largest else model
        raise DeviceMapError(
            f"max_memory[{main!r}] = {_fmt(room)} is too small for the largest block that cannot be split, "
            f"{largest or '<model>'!r} ({type(mod).__name__}, {_fmt(largest_size)}): every block runs on "
            f"{main!r}, offloaded ones are loaded there whole. Give {main!r} at least {_fmt(largest_size)}"
            + (f", or take {type(mod).__name__!r} out of no_split_module_classes" if type(mod).__name__ in no_split
               else ""))
    main_devices = {main, "cpu"}
    tied = find_tied_parameters(model)

    queue: list[tuple[str, Any]] = [(n, p) for n, p in model.named_parameters(recurse=False)]
    queue += [(n, c) for n, c in model.named_children()]
    queue += [(n, b) for n, b in model.named_buffers(recurse=False)]
    dmap: OrderedDict[str, int | str] = OrderedDict()
    dev_i, used = 0, 0
    placed: set[str] = set()

    def partners(name: str, obj: Any) -> list[tuple[str, Any]]:
        """Queued entries that hold a name tied to a parameter inside ``name``."""
        mine = set(_tensor_names(obj, name)) if isinstance(obj, nn.Module) else {name}
        want = {n for group in tied if mine & set(group) for n in group if n not in mine}
        out = []
        for qn, qo in queue:
            if any(w == qn or w.startswith(qn + ".") for w in want):
                out.append((qn, qo))
        return out

    while queue:
        name, obj = queue.pop(0)
        if name in placed:
            continue
        device = devices[dev_i]
        size = sizes.get(name, 0)
        friends = partners(name, obj)
        total = size + sum(sizes.get(f, 0) for f, _ in friends)
        limit = None if device == "disk" else budgets[device] - (largest_size if device in main_devices else 0)
        if verbose:
            print(f"Treating {name!r} ({_fmt(size)}{' with ' + str([f for f, _ in friends]) if friends else ''}) "
                  f"-> {device!r}, {_fmt(used)} used of {_fmt(limit) if limit is not None else 'unlimited'}")
        if limit is not None and used + total > limit:
            kids = list(obj.named_children()) if isinstance(obj, nn.Module) else []
            if not kids or type(obj).__name__ in no_split:
                dev_i += 1
                used = 0
                queue.insert(0, (name, obj))
            else:
                sub = [(f"{name}.{n}", p) for n, p in obj.named_parameters(recurse=False)]
                sub += [(f"{name}.{n}", c) for n, c in kids]
                sub += [(f"{name}.{n}", b) for n, b in obj.named_buffers(recurse=False)]
                queue[:0] = sub
            continue
        used += total
        dmap[name] = device
        for f, _ in friends:
            dmap[f] = device
            placed.add(f)
    return clean_device_map(dmap) if clean_result else dmap


def clean_device_map(device_map: dict, module_name: str = "") -> "OrderedDict[str, int | str]":
    """Merge entries under one module that all went to one device into that module
    (``{"a.0": 0, "a.1": 0}`` -> ``{"a": 0}``), keeping the order of the map."""
    dmap = OrderedDict(device_map)
    prefix = f"{module_name}." if module_name else ""
    keys = [k for k in dmap if k == module_name or k.startswith(prefix)]
    if len(keys) > 1 and len({dmap[k] for k in keys}) == 1:
        dev, first = dmap[keys[0]], list(dmap).index(keys[0])
        items = [(k, v) for k, v in dmap.items() if k not in keys]
        items.insert(first, (module_name, dev))
        return OrderedDict(items)
    depth = module_name.count(".") + 1 if module_name else 0
    children = []
    for k in keys:
        if k != module_name:
            child = ".".join(k.split(".")[:depth + 1])
            if child not in children:
                children.append(child)
    for child in children:
        dmap = clean_device_map(dmap, child)
    return dmap


def _fmt(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


# -- checks ----------------------------------------------------------------------------------
def owner_entry(name: str, entries: list[str]) -> str | None:
    """The most specific device-map entry that covers tensor ``name``."""
    best = None
    for e in entries:
        if e == "" or name == e or name.startswith(e + "."):
            if best is None or len(e) > len(best):
                best = e
    return best


def check_device_map(model: nn.Module, device_map: dict) -> "OrderedDict[str, int | str]":
    """Validate ``device_map`` for ``model`` and return it with normalised devices.

    Raises a :class:`DeviceMapError` for an entry that names no module or parameter of the
    model, an unknown device, or parameters/buffers that no entry covers (listed)."""
    if not isinstance(device_map, dict) or not device_map:
        raise DeviceMapError(f"device_map must be 'auto' or a non-empty dict of module name -> device, "
                             f"got {device_map!r}")
    out: OrderedDict[str, int | str] = OrderedDict()
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, dev in device_map.items():
        if not isinstance(name, str) or (name not in modules and name not in tensors):
            close = sorted(modules, key=lambda m: -len(os.path.commonprefix([m, str(name)])))[:3]
            raise DeviceMapError(f"device_map names {name!r}, which is no module or parameter of "
                                 f"{type(model).__name__} (closest: {close})")
        out[name] = _device_key(dev, f"device_map[{name!r}]")
    entries = list(out)
    missing = [n for n in tensors if owner_entry(n, entries) is None]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        tops = sorted({n.split(".")[0] for n in missing})
        raise DeviceMapError(f"device_map does not cover {len(missing)} parameter(s)/buffer(s) of "
                             f"{type(model).__name__}: {shown}. Add entries for them, e.g. "
                             + ", ".join(f"{t!r}: 'cpu'" for t in tops[:3]))
    return out
