"""``dispatch_model``: place a model's blocks on the devices of a device map and run it.

Each block named in the map gets a forward pre-hook that moves its inputs to the block's
execution device and, for offloaded weights, loads them there just for that forward (a
forward hook puts the meta placeholders back afterwards, also when the forward raised).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import nn

from ember.distributed.collectives import map_tensors, tensor_leaves
from ember.big_modeling.device_map import (DeviceMapError, check_device_map, infer_auto_device_map,
                                           owner_entry, torch_device, _device_key)

__all__ = ["dispatch_model", "send_to_device", "remove_hook_from_module", "DiskRef"]


class DiskRef(NamedTuple):
    """Where a disk-offloaded tensor lives: tensor ``key`` of the safetensors ``file``, cast to
    ``dtype`` (when not None) as it is loaded."""
    file: str
    key: str
    dtype: torch.dtype | None = None


def send_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor (in nested lists, tuples, dicts, model outputs, other
    mappings) on ``device``; the same object when nothing had to move. Other objects
    (e.g. caches) are left alone."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if all(x.device == device for x in tensor_leaves(obj) if isinstance(x, torch.Tensor)):
        return obj
    return map_tensors(lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t, obj)


def _first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, (list, tuple)):
        obj = list(obj)
    elif isinstance(obj, dict):
        obj = list(obj.values())
    else:
        return None
    for o in obj:
        d = _first_device(o)
        if d is not None:
            return d
    return None


class _Slot:
    """One place a tensor sits in the model (``module._parameters[attr]`` or ``._buffers``)."""
    __slots__ = ("module", "attr", "is_param", "requires_grad", "source", "placeholder")

    def __init__(self, module, attr, is_param, requires_grad, source, placeholder):
        self.module, self.attr, self.is_param = module, attr, is_param
        self.requires_grad, self.source, self.placeholder = requires_grad, source, placeholder

    def put(self, t: torch.Tensor) -> None:
        if self.is_param:
            self.module._parameters[self.attr] = nn.Parameter(t, requires_grad=self.requires_grad) \
                if t.device.type != "meta" else t
        else:
            self.module._buffers[self.attr] = t


class AlignDevicesHook:
    """The hook of one block: inputs to ``execution_device`` (when set); offloaded weights
    (``slots``) loaded there for the forward; with ``io_same_device``, outputs back to the
    device of the inputs (the root of the model, so callers get outputs where they sent inputs)."""

    def __init__(self, name: str, execution_device: torch.device | None, slots: list[_Slot] | None = None,
                 io_same_device: bool = False):
        self.name, self.execution_device = name, execution_device
        self.slots = slots or []
        self.io_same_device = io_same_device
        self._depth = 0
        self._input_devices: list[torch.device | None] = []
        self.handles: list = []

    def attach(self, module: nn.Module) -> None:
        self.handles.append(module.register_forward_pre_hook(self.pre_forward, with_kwargs=True))
        self.handles.append(module.register_forward_hook(self.post_forward, with_kwargs=True, always_call=True))
        module._ember_hook = self

    def pre_forward(self, module, args, kwargs):
        if self.io_same_device:
            self._input_devices.append(_first_device((args, kwargs)))
        if self.execution_device is not None:
            args = send_to_device(args, self.execution_device)
            kwargs = send_to_device(kwargs, self.execution_device)
        if self.slots:
            self._depth += 1
            if self._depth == 1:
                self.load_weights()
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        if self.slots:
            self._depth -= 1
            if self._depth == 0:
                self.unload_weights()
        if self.io_same_device:
            dev = self._input_devices.pop() if self._input_devices else None
            if dev is not None:
                output = send_to_device(output, dev)
        return output

    def load_weights(self) -> None:
        """Bring every offloaded tensor of the block to the execution device."""
        dev = self.execution_device
        cache: dict[int, torch.Tensor] = {}
        by_file: dict[str, list[_Slot]] = {}
        for s in self.slots:
            if isinstance(s.source, DiskRef):
                by_file.setdefault(s.source.file, []).append(s)
            else:
                t = cache.get(id(s.source))
                if t is None:
                    t = cache[id(s.source)] = s.source.to(dev, non_blocking=s.source.is_pinned())
                s.put(t)
        if by_file:
            from ember.checkpoint.rng import keep_rng_states
            with keep_rng_states():   # a first import leaves the user's random streams as they were
                from safetensors import safe_open
            for file, slots in by_file.items():
                # opened and closed per forward: the mapping (and its pages) goes away with it
                with safe_open(file, framework="pt", device="cpu") as f:
                    for s in slots:
                        key = (file, s.source.key)
                        t = cache.get(key)
                        if t is None:
                            t = f.get_tensor(s.source.key)
                            if s.source.dtype is not None and t.is_floating_point():
                                t = t.to(s.source.dtype)
                            t = cache[key] = t.to(dev)
                        s.put(t)

    def unload_weights(self) -> None:
        for s in self.slots:
            s.put(s.placeholder)


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Take the hooks of :func:`dispatch_model` off ``module`` (and its children with
    ``recurse``). Offloaded weights stay offloaded: use it before re-dispatching."""
    for m in (module.modules() if recurse else [module]):
        hook = m.__dict__.pop("_ember_hook", None)
        if hook is not None:
            if hook._depth:
                hook.unload_weights()
            for h in hook.handles:
                h.remove()
    if recurse:
        module.__dict__.pop("hf_device_map", None)
        module.__dict__.pop("_ember_dispatch", None)
    return module


def _slots(model: nn.Module):
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, t in m._parameters.items():
            if t is not None:
                yield (f"{mname}.{attr}" if mname else attr), m, attr, True, t
        for attr, t in m._buffers.items():
            if t is not None:
                yield (f"{mname}.{attr}" if mname else attr), m, attr, False, t


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    # torch.empty, not empty_like: the latter loads torch's Python meta kernels (~35 MB) on first use
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _pin(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu")
    return t.pin_memory() if torch.cuda.is_available() else t


def dispatch_model(model: nn.Module, device_map: dict | str = "auto", main_device: Any = None,
                   state_dict: dict | None = None, offload_dir: str | os.PathLike | None = None,
                   offload_index: dict[str, DiskRef] | None = None, offload_buffers: bool = False,
                   skip_keys: Any = None, preload_module_classes: list[str] | None = None,
                   force_hooks: bool = False, max_memory: dict | None = None,
                   no_split_module_classes: list[str] | None = None) -> nn.Module:
    """Place ``model``'s blocks as ``device_map`` says and hook them so that it runs as one model.

    Args:
        device_map: ``{"module.name": device}`` with devices ``0``/``"cuda:0"``..., ``"mps"``,
            ``"cpu"`` or ``"disk"`` (every parameter covered; the most specific entry wins), or
            ``"auto"`` (:func:`infer_auto_device_map` with ``max_memory`` and
            ``no_split_module_classes``).
        main_device: where ``"cpu"``/``"disk"`` blocks run; default the first accelerator in the
            map, else ``"cpu"``.
        offload_dir: folder for the weights of ``"disk"`` blocks, written as safetensors files
            (one per block) and memory-mapped per block at each forward.
        offload_index: name -> :class:`DiskRef` for weights that already sit in safetensors
            files (what :func:`load_checkpoint_in_model` returns); they are read from there.
        state_dict: weights to use instead of the module's own (same names).
        offload_buffers, skip_keys, preload_module_classes: Accelerate's; only their defaults
            are supported (buffers stay on the execution device; every output tensor moves).

    Blocks on ``"cpu"`` while an accelerator runs them stay in CPU memory (pinned when CUDA is
    present) and are copied to the execution device just for their forward; with no
    accelerator they simply run on the CPU. Buffers stay on the execution device.
    ``model.hf_device_map`` is set. Returns ``model``.
    """
    if offload_buffers or skip_keys is not None or preload_module_classes:
        raise DeviceMapError("dispatch_model: offload_buffers=True, skip_keys and preload_module_classes are not "
                             "supported here; leave them at their defaults (buffers stay on the execution device)")
    if hasattr(model, "_ember_dispatch"):
        raise DeviceMapError(f"{type(model).__name__} is already dispatched (model.hf_device_map = "
                             f"{model.hf_device_map}); build or load the model again to use another map")
    if isinstance(device_map, str):
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise DeviceMapError(f"device_map={device_map!r}: use 'auto', 'balanced', 'balanced_low_0', "
                                 "'sequential' or a dict")
        device_map = infer_auto_device_map(model, max_memory=max_memory,
                                           no_split_module_classes=no_split_module_classes)
    dmap = user_map = check_device_map(model, device_map)
    dmap = _expand_containers(model, dmap)
    if main_device is None:
        accel = [d for d in dmap.values() if d not in ("cpu", "disk")]
        main_device = accel[0] if accel else "cpu"
    main_key = _device_key(main_device, "main_device")
    if main_key == "disk":
        raise DeviceMapError("main_device='disk': blocks run on a device; use a GPU index or 'cpu'")
    main = torch_device(main_key)
    offloaded = {"disk"} if main_key == "cpu" else {"cpu", "disk"}
    offload_index = dict(offload_index or {})
    entries = list(dmap)

    groups: dict[int, list] = {}
    for full, m, attr, is_param, t in _slots(model):
        if state_dict is not None and full in state_dict:
            t = state_dict[full]
        groups.setdefault(id(t), []).append((full, m, attr, is_param, t))

    def exec_of(entry: str) -> torch.device:
        d = dmap[entry]
        return main if d in ("cpu", "disk") else torch_device(d)

    for members in groups.values():      # every error before anything is moved
        t, names = members[0][4], [m[0] for m in members]
        devs = {dmap[owner_entry(n, entries)] for n in names}
        has_ref = any(n in offload_index for n in names)
        if t.device.type == "meta" and not has_ref:
            raise DeviceMapError(f"{names[0]} has no weights (it is on the meta device): load a checkpoint "
                                 "into the model first, e.g. with load_checkpoint_and_dispatch")
        if devs == {"disk"} and members[0][3] and not has_ref and offload_dir is None:
            raise DeviceMapError(f"device_map puts {owner_entry(names[0], list(user_map))!r} on 'disk': pass "
                                 "offload_dir= (a folder for its weights)")
    to_write: dict[str, dict[str, torch.Tensor]] = {}
    jit: dict[int, tuple[nn.Module, torch.device, str, list]] = {}   # id(block module) -> hook parts

    def block_of(entry: str, m_of_tensor: nn.Module) -> nn.Module:
        if entry == "":
            return model
        try:
            return model.get_submodule(entry)
        except AttributeError:
            return m_of_tensor   # the entry names a parameter: its module runs it

    for members in groups.values():
        t = members[0][4]
        placed = [(full, m, attr, is_param, owner_entry(full, entries)) for full, m, attr, is_param, _ in members]
        is_param = members[0][3]
        resident = [p for p in placed if dmap[p[4]] not in offloaded or not is_param]
        ref = next((offload_index[p[0]] for p in placed if p[0] in offload_index), None)
        if ref is not None and resident and is_param:
            raise DeviceMapError(f"{placed[0][0]} is in offload_index but mapped to {dmap[resident[0][4]]!r}")
        if resident:
            home = exec_of(resident[0][4])
            if t.device.type == "meta":
                raise DeviceMapError(f"{placed[0][0]} has no weights (it is on the meta device): load a "
                                     "checkpoint into the model first, e.g. with load_checkpoint_and_dispatch")
            if t.device == home:
                source = t
            else:
                moved = t.detach().to(home)
                source = nn.Parameter(moved, requires_grad=t.requires_grad) if is_param else moved
        elif ref is not None:
            source = ref
        elif any(dmap[p[4]] == "cpu" for p in placed):
            if t.device.type == "meta":
                raise DeviceMapError(f"{placed[0][0]} has no weights (it is on the meta device): load a "
                                     "checkpoint into the model first, e.g. with load_checkpoint_and_dispatch")
            source = _pin(t)
        else:
            if t.device.type == "meta":
                raise DeviceMapError(f"{placed[0][0]} has no weights (it is on the meta device) and no entry "
                                     "in offload_index: load a checkpoint first (load_checkpoint_and_dispatch)")
            if offload_dir is None:
                raise DeviceMapError(f"device_map puts {placed[0][4]!r} on 'disk': pass offload_dir= "
                                     "(a folder for its weights)")
            entry = placed[0][4]
            to_write.setdefault(entry, {})[placed[0][0]] = t.detach()
            source = DiskRef(_block_file(offload_dir, entry), placed[0][0], None)
        placeholder = None
        for full, m, attr, p_is_param, entry in placed:
            dev = exec_of(entry)
            if isinstance(source, torch.Tensor) and (source.device == dev or not p_is_param):
                (m._parameters if p_is_param else m._buffers)[attr] = source if source.device == dev \
                    else source.to(dev)
                continue
            if placeholder is None:
                placeholder = nn.Parameter(_meta_like(t), requires_grad=t.requires_grad)
            m._parameters[attr] = placeholder
            src = source.detach() if isinstance(source, torch.Tensor) else source
            block = block_of(entry, m)
            jit.setdefault(id(block), (block, dev, entry, []))[3].append(
                _Slot(m, attr, True, t.requires_grad, src, placeholder))

    if to_write:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from safetensors.torch import save_file
        os.makedirs(os.fspath(offload_dir), exist_ok=True)
        for entry, tensors in to_write.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, _block_file(offload_dir, entry))
        to_write.clear()

    hooks: dict[int, AlignDevicesHook] = {}
    for entry in entries:
        m = block_of(entry, None)
        if m is None:       # a parameter entry: its module's hook comes from the jit table
            m = model.get_submodule(entry.rsplit(".", 1)[0]) if "." in entry else model
        if id(m) not in hooks:
            hooks[id(m)] = AlignDevicesHook(entry, exec_of(entry))
    for key, (block, dev, entry, slots) in jit.items():
        hook = hooks.setdefault(key, AlignDevicesHook(entry, dev))
        hook.slots += slots
    multi = len({exec_of(e) for e in entries}) > 1 or force_hooks
    if id(model) in hooks:
        hooks[id(model)].io_same_device = multi
    elif multi:
        hooks[id(model)] = AlignDevicesHook("", None, io_same_device=True)
    mods = {id(m): m for m in model.modules()}
    mods[id(model)] = model
    for key, hook in hooks.items():
        hook.attach(mods[key])
    model.hf_device_map = dict(user_map)
    model._ember_dispatch = {"main_device": main, "offload_dir": os.fspath(offload_dir) if offload_dir else None}
    return model


def _expand_containers(model: nn.Module, dmap: dict) -> dict:
    """Entries naming a ModuleList/ModuleDict (never called itself, so its hooks would never
    run) become one entry per child, so each child block gets the hook."""
    out: dict = {}
    for name, dev in dmap.items():
        todo = [name]
        while todo:
            n = todo.pop(0)
            try:
                m = model.get_submodule(n) if n else model
            except AttributeError:
                m = None
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and n:
                todo[:0] = [f"{n}.{c}" for c, _ in m.named_children() if f"{n}.{c}" not in dmap]
            else:
                out[n] = dev
    return out


def _block_file(offload_dir: str | os.PathLike, entry: str) -> str:
    return os.path.join(os.fspath(offload_dir), f"{entry or 'model'}.safetensors")
