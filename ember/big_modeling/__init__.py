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
           "remove_hook_from_module", "send_to_device", "DiskRef", "DeviceMapError", "is_dispatched"]


def is_dispatched(model) -> bool:
    """True when ``model`` was placed by :func:`dispatch_model` (or by transformers with a
    ``device_map``) over more than one device, or with offloaded weights."""
    dmap = getattr(model, "hf_device_map", None)
    return bool(dmap) and (len(set(dmap.values())) > 1 or "disk" in dmap.values()
                           or (set(dmap.values()) == {"cpu"} and hasattr(model, "_ember_dispatch")
                               and str(model._ember_dispatch.get("main_device")) != "cpu"))
