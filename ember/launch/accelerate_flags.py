"""Accelerate's launcher vocabulary for ``ember launch``: its extra flags
(``--cpu``, ``--multi_gpu``, ``--gpu_ids``, ``--use_deepspeed``, ``--use_fsdp``,
``--num_cpu_threads_per_process``, ``--dynamo_backend``), its config YAML (the file
``accelerate config`` writes, recognised by its ``distributed_type`` key), and the
``ACCELERATE_*`` variables its launcher exports to the workers (exported by ``ember
launch`` too, next to the ``EMBER_*`` ones). Every value either maps onto ember or is
refused with a one-line error; a key ember has no use for is named in a warning.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

DISTRIBUTED_TYPES = {"NO": "no", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}
#: Accelerate config keys with no effect in ember, and the value that is the default there
_IGNORED = {"debug": False, "downcast_bf16": "no", "enable_cpu_affinity": False, "main_training_function": "main",
            "same_network": True, "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
            "compute_environment": "LOCAL_MACHINE", "use_cpu": None, "gpu_ids": None, "dynamo_config": None,
            "distributed_type": None, "ipex_config": None, "mpirun_config": None}
_DIRECT = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
           "rdzv_backend", "mixed_precision")


def _usage(msg: str) -> Exception:
    from ember.errors import UsageError
    return UsageError(msg)


def _positive_int(key: str, value: Any) -> int:
    """An int >= 1 (a YAML int, or a string of digits as Accelerate's own files may hold)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _usage(f"{key}: expected an int >= 1, got {value!r}")
    return value


def is_accelerate_config(data: Any) -> bool:
    return isinstance(data, dict) and ("distributed_type" in data or str(data.get("compute_environment", ""))
                                       in ("LOCAL_MACHINE", "AMAZON_SAGEMAKER"))


def _warn(msg: str) -> None:
    print(f"ember: warning: {msg}", file=sys.stderr)


def from_accelerate_config(data: dict) -> tuple[dict, dict]:
    """(ember launch config keys, Accelerate extras: cpu, gpu_ids, dynamo_backend,
    gradient_accumulation_steps) of an Accelerate config file."""
    if str(data.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        raise _usage(f"config_file: compute_environment={data['compute_environment']!r} is not supported "
                     "(LOCAL_MACHINE only)")
    dtype = str(data.get("distributed_type", "NO")).upper().replace("DISTRIBUTEDTYPE.", "")
    if dtype not in DISTRIBUTED_TYPES:
        raise _usage(f"config_file: distributed_type={dtype!r} is not supported by ember launch; use one of "
                     f"{', '.join(DISTRIBUTED_TYPES)}")
    out: dict = {"strategy": DISTRIBUTED_TYPES[dtype]}
    extras: dict = {}
    for key in _DIRECT:
        if data.get(key) is not None:
            out[key] = data[key]
    if out.get("mixed_precision") is False:
        out["mixed_precision"] = "no"
    if str(out.get("mixed_precision", "no")) == "fp8":
        raise _usage("config_file: mixed_precision='fp8' is not supported; use 'bf16' or 'fp16'")
    if data.get("use_cpu") or dtype == "MULTI_CPU":
        extras["cpu"] = True
    gpu_ids = data.get("gpu_ids")
    if gpu_ids not in (None, "all", "") and not extras.get("cpu"):
        extras["gpu_ids"] = str(gpu_ids)
    dyn = (data.get("dynamo_config") or {}).get("dynamo_backend")
    if dyn and str(dyn).upper() != "NO":
        extras["dynamo_backend"] = str(dyn).lower()
    ds = dict(data.get("deepspeed_config") or {})
    if dtype == "DEEPSPEED":
        sect = {k: ds.pop(k) for k in ("zero_stage", "offload_optimizer_device", "offload_param_device") if k in ds}
        if sect:
            out["deepspeed_config"] = sect
        if ds.get("gradient_accumulation_steps") not in (None, 1):
            extras["gradient_accumulation_steps"] = _positive_int("config_file: deepspeed_config."
                                                                  "gradient_accumulation_steps",
                                                                  ds.pop("gradient_accumulation_steps"))
        ds.pop("gradient_accumulation_steps", None)
        ds.pop("deepspeed_multinode_launcher", None)
        if ds:
            _warn(f"config_file: deepspeed_config keys not used by ember launch: {', '.join(sorted(ds))}")
    fs = dict(data.get("fsdp_config") or {})
    if dtype == "FSDP":
        sect = {}
        if "fsdp_offload_params" in fs:
            sect["cpu_offload"] = bool(fs.pop("fsdp_offload_params"))
        raf = fs.pop("fsdp_reshard_after_forward", None)
        if raf is not None:
            sect["reshard_after_forward"] = raf if isinstance(raf, bool) else str(raf).upper() == "FULL_SHARD"
        if sect:
            out["fsdp_config"] = sect
        fs.pop("fsdp_version", None)
        if fs:
            _warn(f"config_file: fsdp_config keys not used by ember launch (the strategy's defaults apply): "
                  f"{', '.join(sorted(fs))}")
    unknown = [k for k in data if k not in _DIRECT and k not in _IGNORED
               and k not in ("deepspeed_config", "fsdp_config")]
    odd = [k for k, d in _IGNORED.items() if d is not None and k in data and data[k] not in (d, None)]
    if unknown or odd:
        _warn(f"config_file: Accelerate keys without effect in ember launch: {', '.join(sorted(unknown + odd))}")
    return out, extras


def add_accelerate_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Accelerate's launcher flags")
    g.add_argument("--cpu", action="store_true", default=None,
                   help="run on the CPU (gloo), also with GPUs present: CUDA_VISIBLE_DEVICES='' for the workers")
    g.add_argument("--multi_gpu", "--multi-gpu", action="store_true", default=None,
                   help="DDP over the GPUs (default --num_processes: every visible GPU)")
    g.add_argument("--gpu_ids", "--gpu-ids", default=None, metavar="IDS",
                   help="GPUs to use, e.g. 0,1 (CUDA_VISIBLE_DEVICES; default --num_processes: their count)")
    g.add_argument("--use_deepspeed", "--use-deepspeed", action="store_true", default=None,
                   help="same as --strategy deepspeed")
    g.add_argument("--use_fsdp", "--use-fsdp", action="store_true", default=None, help="same as --strategy fsdp")
    g.add_argument("--num_cpu_threads_per_process", "--num-cpu-threads-per-process", type=int, default=None,
                   metavar="N", help="OMP_NUM_THREADS of each worker")
    g.add_argument("--dynamo_backend", "--dynamo-backend", default=None, metavar="BACKEND",
                   help="torch.compile backend for models the Accelerator prepares (no: off)")
    g.add_argument("--gradient_accumulation_steps", "--gradient-accumulation-steps", type=int, default=None,
                   help="ACCELERATE_GRADIENT_ACCUMULATION_STEPS for the Accelerator")


def apply_accelerate_flags(cfg: dict, args: argparse.Namespace) -> None:
    """Merge the flags into ``cfg`` (flags win over the config file) and check them."""
    extras = cfg.setdefault("_accelerate", {})
    given = cfg.setdefault("_given", set())
    for key in ("cpu", "gpu_ids", "dynamo_backend", "num_cpu_threads_per_process", "gradient_accumulation_steps"):
        value = getattr(args, key, None)
        if value is not None:
            if key in ("num_cpu_threads_per_process", "gradient_accumulation_steps"):
                value = _positive_int(f"--{key}", value)
            extras[key] = value
    chosen = [f for f, s in (("use_deepspeed", "deepspeed"), ("use_fsdp", "fsdp"), ("multi_gpu", "ddp"))
              if getattr(args, f, None)]
    if len(chosen) > 1:
        raise _usage(f"launch: --{' and --'.join(chosen)} exclude each other")
    if chosen:
        strategy = {"use_deepspeed": "deepspeed", "use_fsdp": "fsdp", "multi_gpu": "ddp"}[chosen[0]]
        if getattr(args, "strategy", None) not in (None, strategy):
            raise _usage(f"launch: --{chosen[0]} contradicts --strategy {args.strategy}")
        cfg["strategy"] = strategy
        given.add("strategy")
    n_given = "num_processes" in given
    if extras.get("cpu"):
        if extras.get("gpu_ids") or getattr(args, "multi_gpu", None):
            raise _usage("launch: --cpu excludes --gpu_ids / --multi_gpu")
        return
    ids = extras.get("gpu_ids")
    count = None
    if ids:
        count = len([i for i in str(ids).split(",") if i.strip()])
    elif getattr(args, "multi_gpu", None):
        import torch
        count = torch.cuda.device_count()
        if count == 0:
            _multi_gpu_without_gpus(cfg, args, n_given)
            return
    if count is not None:
        machines = cfg.get("num_machines", 1)
        if not n_given:
            cfg["num_processes"] = count * machines    # one per GPU on every machine
        elif machines > 0 and cfg["num_processes"] // machines > count:
            per = (f" ({cfg['num_processes'] // machines} per machine on {machines} machines)"
                   if machines > 1 else "")
            raise _usage(f"launch: --num_processes {cfg['num_processes']}{per} but only {count} GPU(s) "
                         f"({'--gpu_ids ' + str(ids) if ids else 'visible'}); ember never runs fewer processes "
                         "than asked: lower --num_processes or add GPUs")


def _script_asks_for_cpu(args: argparse.Namespace) -> bool:
    """The script's own ``--cpu`` flag (Accelerate's examples take it: ``Accelerator(cpu=args.cpu)``)."""
    return any(a == "--cpu" or a.lower() in ("--cpu=true", "--cpu=1")
               for a in getattr(args, "script_args", None) or [])


def _multi_gpu_without_gpus(cfg: dict, args: argparse.Namespace, n_given: bool) -> None:
    """``--multi_gpu`` on a machine without GPUs. As ``accelerate launch``: when the script
    is given ``--cpu`` it runs its processes on the CPU (gloo); otherwise neither can run, and
    the error names both ways out."""
    n = cfg.get("num_processes")
    if _script_asks_for_cpu(args):
        if not n_given:
            raise _usage("launch: --multi_gpu with the script's --cpu on a machine without GPUs: give the number "
                         "of CPU processes, e.g. `ember launch --multi_gpu --num_processes 2 script.py --cpu`")
        cfg["_accelerate"]["cpu"] = True   # ACCELERATE_USE_CPU=true, CUDA_VISIBLE_DEVICES='' for the workers
        print(f"ember: note: no GPU is visible and the script was given --cpu: running its {n} processes on "
              "the CPU (gloo), as accelerate launch does", file=sys.stderr)
        return
    script = getattr(args, "training_script", None) or "script.py"
    rest = " ".join(getattr(args, "script_args", None) or [])
    n = n if n_given else "N"
    raise _usage(f"launch: --multi_gpu but no GPU is visible here. Run on the CPU instead, either with "
                 f"`ember launch --cpu --num_processes {n} {script}{' ' + rest if rest else ''}`, or by passing the "
                 f"script its own --cpu flag, as Accelerate's examples take it (`ember launch --multi_gpu "
                 f"--num_processes {n} {script} {rest + ' ' if rest else ''}--cpu`); or run where GPUs are visible")


def accelerate_env(cfg: dict) -> dict[str, "str | None"]:
    """The variables Accelerate's launcher exports, for the workers."""
    extras = cfg.get("_accelerate", {})
    given = cfg.get("_given", set())
    env: dict[str, "str | None"] = {}
    if "mixed_precision" in given:
        env["ACCELERATE_MIXED_PRECISION"] = str(cfg["mixed_precision"])
    if "strategy" in given:
        env["ACCELERATE_USE_FSDP"] = "true" if cfg["strategy"] == "fsdp" else None
        env["ACCELERATE_USE_DEEPSPEED"] = "true" if cfg["strategy"] == "deepspeed" else None
    if extras.get("cpu"):
        env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
    if extras.get("gpu_ids"):
        env["CUDA_VISIBLE_DEVICES"] = str(extras["gpu_ids"])
    if extras.get("dynamo_backend"):
        env["ACCELERATE_DYNAMO_BACKEND"] = str(extras["dynamo_backend"]).lower()
    if extras.get("num_cpu_threads_per_process"):
        env["OMP_NUM_THREADS"] = str(int(extras["num_cpu_threads_per_process"]))
    if extras.get("gradient_accumulation_steps"):
        env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(int(extras["gradient_accumulation_steps"]))
    return env
