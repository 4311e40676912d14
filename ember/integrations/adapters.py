"""Adapters through ``peft`` for :class:`~ember.integrations.transformers.TransformersModule`
(``peft_config=``): wrapping the model, what a checkpoint of an adapter run holds, the base
model's digest, and the exports (PEFT's adapter folder, or a merged transformers folder).

``peft`` is optional and imported lazily: ``pip install "ember[peft]"``. See
docs/transformers.md, "Adapters (LoRA with peft)".

What trains: the adapter weights and the ``modules_to_save`` copies (peft's choice for the
config; a classification head for ``task_type="SEQ_CLS"``). The frozen base stays as it was
read. A checkpoint holds the state entries that are not frozen base weights (the keys
:func:`wrap` returns), their optimizer state and the trainer state; the base is named by
the module's ``peft_base`` hparam (its folder and :func:`folder_digest`, or, for a model
given as an object, :func:`state_digest` of its weights when it was wrapped), which
:func:`check_base` compares on load.
"""
from __future__ import annotations

import copy
import enum
import hashlib
import importlib.util
import os
from typing import Any

import torch
from torch import nn

from ember.errors import CheckpointError, MisconfigurationError

#: the extra to install for adapters
INSTALL = 'pip install "ember[peft]"'

#: PeftConfig fields a checkpoint's meta.json may not set: they name code to import
#: (``megatron_core`` is imported by name, ``auto_mapping`` names the model class to build)
_CODE_FIELDS = {"megatron_config": None, "megatron_core": "megatron.core", "auto_mapping": None}


def require_peft():
    """``import peft``, or one clear error naming the extra to install."""
    from ember.checkpoint.rng import import_optional
    return import_optional("peft", "peft_config=", INSTALL, error=MisconfigurationError)


def _json_safe(value: Any, where: str) -> Any:
    if isinstance(value, enum.Enum):   # first: peft's PeftType / TaskType are str enums
        return _json_safe(value.value, where)
    if value is None or type(value) in (bool, int, float, str):
        return value
    for kind in (bool, int, float, str):   # subclasses as the plain type (YAML and JSON writers want those)
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, (set, frozenset)):
        items = [_json_safe(v, where) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where} holds a {type(value).__name__}")


def config_to_dict(config: Any) -> dict:
    """A PeftConfig as JSON data (``to_dict()``: enums as their values, sets as sorted lists),
    what the module's hparams and a checkpoint's meta.json hold."""
    return _json_safe(config.to_dict(), "peft_config")


def config_classes() -> dict[str, type]:
    """peft's config class per ``peft_type`` (``"LORA"`` -> ``LoraConfig``, ...)."""
    peft = require_peft()
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    del peft
    return {str(getattr(k, "value", k)): v for k, v in PEFT_TYPE_TO_CONFIG_MAPPING.items()}


def config_from_dict(data: dict, where: str = "peft_config") -> Any:
    """Rebuild a PeftConfig from :func:`config_to_dict`'s data without running code: the
    ``peft_type`` must be one of peft's own config classes, every key one of its fields,
    every value JSON data, and no field that names code to import (``megatron_core``,
    ``megatron_config``, ``auto_mapping``). Give a PeftConfig object yourself to set those."""
    import dataclasses
    if not isinstance(data, dict):
        raise MisconfigurationError(f"{where}: expected a peft.PeftConfig or its to_dict() data, got {data!r}")
    classes = config_classes()
    kind = data.get("peft_type")
    if kind not in classes:
        raise MisconfigurationError(f"{where}: peft_type={kind!r} is not one of peft's methods "
                                    f"{sorted(classes)}")
    cls = classes[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in data if k not in fields)
    if unknown:
        raise MisconfigurationError(f"{where}: {cls.__name__} has no field(s) {unknown}")
    try:
        _json_safe(data, where)
    except TypeError as err:
        raise MisconfigurationError(f"{where}: only JSON data can be rebuilt here; {err}") from err
    code = sorted(k for k, default in _CODE_FIELDS.items() if k in data and data[k] != default)
    if code:
        raise MisconfigurationError(f"{where}: refusing {code}, which name code to import; build the "
                                    f"{cls.__name__} yourself and pass the object if you trust it")
    kwargs = {k: v for k, v in data.items() if fields[k].init}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise MisconfigurationError(f"{where}: {cls.__name__}({sorted(kwargs)}) failed: {err}") from err


def check_config(config: Any) -> Any:
    """``peft_config`` as given (a PeftConfig, or its data) -> a PeftConfig."""
    peft = require_peft()
    if isinstance(config, peft.PeftConfig):
        return config
    return config_from_dict(config)


def check_quantization(model_kwargs: dict) -> None:
    """A ``quantization_config`` that asks for bitsandbytes (QLoRA's 4-bit or 8-bit base)
    on a machine without it: say so now, before any training or weights are read."""
    q = model_kwargs.get("quantization_config")
    if q is None:
        return
    get = q.get if isinstance(q, dict) else (lambda k, d=None: getattr(q, k, d))
    method = str(getattr(get("quant_method"), "value", get("quant_method")) or "")
    if not (get("load_in_4bit") or get("load_in_8bit") or method == "bitsandbytes"):
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MisconfigurationError(
            "model_kwargs['quantization_config'] loads the base in 4/8-bit with bitsandbytes (QLoRA), which is "
            'not installed here; install it with: pip install "ember[qlora]" (bitsandbytes runs on CUDA GPUs '
            "and a few other backends), or drop quantization_config to train the adapters on a float base")


def is_quantized(model: nn.Module) -> bool:
    """Whether transformers loaded ``model`` quantized (bitsandbytes 4/8-bit, GPTQ, ...)."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
                or getattr(model, "is_quantized", False) or getattr(model, "quantization_method", None))


def wrap(model: nn.Module, config: Any, gradient_checkpointing: bool) -> tuple[nn.Module, frozenset]:
    """``peft.get_peft_model`` on ``model`` (a quantized base is first made ready for
    training by ``peft.prepare_model_for_kbit_training``) -> (PeftModel, the state keys,
    relative to the PeftModel, that hold the base's own tensors). The config is copied:
    peft fills it in (``"all-linear"`` becomes the module names), the user's stays as given.
    LoRA's initialisation draws from torch's stream, which is left as it was."""
    peft = require_peft()
    from ember.checkpoint.rng import keep_rng_states
    if is_quantized(model):
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    own = {id(t) for t in model.state_dict(keep_vars=True).values()}
    with keep_rng_states():
        wrapped = peft.get_peft_model(model, copy.deepcopy(config))
    base = frozenset(k for k, t in wrapped.state_dict(keep_vars=True).items() if id(t) in own)
    return wrapped, base


# ----------------------------------------------------------------------------- the base's digest
_FILE_DIGESTS: dict = {}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")


def _file_digest(path: str) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _FILE_DIGESTS:
        from ember.checkpoint.trust import file_digest
        _FILE_DIGESTS[key] = file_digest(path, "sha256").partition(":")[2]   # the hex digits
    return _FILE_DIGESTS[key]


def folder_of(name: str) -> str | None:
    """The local folder of a model given by name: the folder itself, or its snapshot in the
    Hugging Face cache (never the network)."""
    if os.path.isdir(name):
        return name
    try:
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():
            from huggingface_hub import snapshot_download
        return snapshot_download(name, local_files_only=True)
    except Exception:   # not cached: no digest can be taken without downloading
        return None


def folder_digest(folder: str) -> str:
    """sha256 over ``config.json`` and every weight file of ``folder`` (names and bytes).
    Each file is read once per process (cached by path, size and modification time)."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(folder)
                   if n == "config.json" or n.endswith(_WEIGHT_SUFFIXES) or n.endswith(".index.json"))
    for n in names:
        h.update(n.encode() + b"\0" + _file_digest(os.path.join(folder, n)).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def state_digest(model: nn.Module) -> str:
    """sha256 over a model's state (names, dtypes, shapes and bytes), for a model given as
    an object. Meta tensors (a rank that builds the model empty) cannot be digested."""
    h = hashlib.sha256()
    for k, t in sorted(model.state_dict().items()):
        if t.is_meta:
            return "unknown (meta tensors)"
        t = t.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def check_base(saved: Any, current: dict, path: str) -> None:
    """Raise CheckpointError when the checkpoint at ``path`` was trained on another base
    than this module's (their digests differ), naming both."""
    if not isinstance(saved, dict) or "digest" not in saved:
        saved = {"model": None, "digest": "unknown (no 'peft_base' in its meta.json hparams)"}
    unknown = [d for d in (saved.get("digest"), current.get("digest")) if not str(d).startswith("sha256:")]
    if unknown:   # e.g. a model given by a name that is not in a local folder, or built on the meta device
        import warnings
        warnings.warn(f"{path}: the base model cannot be checked against the one the adapters were trained on "
                      f"(digest {unknown[0]}); make sure it is the same", UserWarning, stacklevel=3)
        return
    if saved.get("digest") == current.get("digest"):
        return

    def name(rec):
        where = rec.get("model") or "a model given as an object"
        return f"{where} (digest {rec.get('digest')})"
    hint = ("; pass the same pretrained model object as model= (a model given as an object is not stored in "
            "the checkpoint)" if not saved.get("model") else "")
    raise CheckpointError(f"{path} holds adapters trained on the base {name(saved)}, but this module's base is "
                          f"{name(current)}: the adapters would be applied to other weights{hint}")


# ----------------------------------------------------------------------------- export
def save_adapter(model: nn.Module, directory: str, state_dict: dict | None = None, **kwargs) -> None:
    """PEFT's own adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    if state_dict is None and _sharded(model):
        raise MisconfigurationError(
            "save_pretrained: the model is sharded (FSDP); pass the gathered weights "
            "(state_dict=trainer.strategy.module_state_dict(trainer.model), a collective every rank calls) or "
            "use the ExportBestPretrained callback")
    # peft picks the adapter entries out of the given state (keys relative to the PeftModel)
    model.save_pretrained(directory, state_dict=state_dict, **kwargs)


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


def check_mergeable(model: nn.Module) -> None:
    """A merged export copies the whole model in this process: not a sharded one."""
    if _sharded(model):
        raise MisconfigurationError(
            "merged=True: the model is sharded (FSDP), and merging needs the whole base in one process. Export "
            "the adapters (merged=False), or merge in one process: TransformersModule.load_from_checkpoint(ckpt)"
            ".save_pretrained(dir, merged=True)")


def save_merged(model: nn.Module, directory: str, state_dict: dict | None = None, **kwargs) -> None:
    """A plain transformers folder with the adapters merged into the base weights. The
    live model is not touched: a copy is merged (``merge_and_unload``) and written."""
    merged = _with_weights(model, state_dict) if state_dict is not None else copy.deepcopy(model)
    merged = merged.merge_and_unload()
    merged.save_pretrained(directory, **kwargs)


def _with_weights(model: nn.Module, state_dict: dict) -> nn.Module:
    """A copy of the PeftModel ``model`` with ``state_dict`` (keys relative to it, as a
    checkpoint of an adapter run holds: the trainable entries) loaded over it."""
    clone = copy.deepcopy(model)
    result = clone.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"the checkpoint's weights do not fit this adapter model: unexpected keys "
                              f"{result.unexpected_keys[:10]}")
    return clone
