"""Models larger than one device: empty-weight init, device maps, CPU and disk offload.

The names and arguments are Hugging Face Accelerate's, so code ports by renaming
``accelerate`` to ``ember.big_modeling``::

    from ember.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = MyModel(config)                       # no memory used
    model = load_checkpoint_and_dispatch(model, "ckpt_folder", device_map="auto",
                                         max_memory={0: "10GiB", "cpu": "30GiB"},
                                         no_split_module_classes=["Block"], offload_folder="offload")
    print(model.hf_device_map)

See docs/big_models.md.
"""
from ember.big_modeling.device_map import (DeviceMapError, check_device_map, clean_device_map,
                                           compute_module_sizes, find_tied_parameters, get_balanced_memory,
                                           get_max_memory, infer_auto_device_map, init_empty_weights,
                                           init_on_device)
from ember.big_modeling.hooks import DiskRef, dispatch_model, remove_hook_from_module, send_to_device
from ember.big_modeling.loading import load_checkpoint_and_dispatch, load_checkpoint_in_model

__all__ = ["init_empty_weights", "init_on_device", "compute_module_sizes", "get_max_memory",
           "get_balanced_memory", "infer_auto_device_map", "find_tied_parameters", "check_device_map",
           "clean_device_map", "dispatch_model", "load_checkpoint_and_dispatch", "load_checkpoint_in_model",
           "remove_hook_from_module", "send_to_device", "DiskRef", "DeviceMapError", "is_dispatched",
           "check_prepare", "describe_device_map"]


def is_dispatched(model) -> bool:
    """True when ``model`` or one of its submodules was placed by :func:`dispatch_model` (or by
    transformers with a ``device_map``) over more than one device, or with offloaded weights."""
    for m in model.modules():
        dmap = getattr(m, "hf_device_map", None)
        if dmap and (len(set(dmap.values())) > 1 or "disk" in dmap.values()
                     or ("cpu" in dmap.values()
                         and str(getattr(m, "_ember_dispatch", {}).get("main_device", "cpu")) != "cpu")):
            return True
    return False


def check_prepare(model, strategy_name: str) -> bool:
    """For ``Accelerator.prepare``: True when ``model`` is dispatched (leave it where its map put
    it); a :class:`DeviceMapError` when the strategy would wrap it for several processes."""
    if not is_dispatched(model):
        return False
    if strategy_name != "single":
        devices = sorted({str(d) for m in model.modules() for d in (getattr(m, "hf_device_map", None) or {}).values()})
        raise DeviceMapError(
            f"this model was dispatched by a device map over {devices} (model.hf_device_map), so the "
            f"{strategy_name!r} strategy cannot wrap it: a model split over devices or offloaded runs in one "
            f"process. Load it whole on each process's device (no device_map) to use {strategy_name!r}, or "
            "use strategy='single' to run the dispatched model")
    return True


def describe_device_map(model=None) -> str:
    """One line for reports (``ember env``): the model's device map, or what the automatic map
    would use on this machine by default."""
    if model is not None and getattr(model, "hf_device_map", None) is not None:
        return f"{type(model).__name__} dispatched: {dict(model.hf_device_map)}"
    mem = get_max_memory()
    return ("ember.big_modeling: device_map='auto' places on " +
            ", ".join(f"{'cuda:' + str(k) if isinstance(k, int) else k} {v / 2**30:.1f} GiB" for k, v in mem.items())
            + ", then disk (safetensors offload)")
