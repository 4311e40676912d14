"""What the CPU can do in bfloat16, and a one-time suggestion to use it.

CPUs with AVX512-BF16 (Cooper Lake, Zen 4 and later) or AMX (Sapphire Rapids and
later) multiply bfloat16 matrices in hardware: PyTorch's oneDNN kernels then run
``precision="bf16-mixed"`` (CPU autocast in bfloat16) several times faster than
float32 for the matrix products that dominate transformer training. Without them,
bfloat16 on the CPU is emulated and usually slower than float32.

:func:`native_bf16` answers the same for any device (CUDA: compute capability 8.0 and
later).
"""
from __future__ import annotations

import functools
import warnings

#: the /proc/cpuinfo flags that mean bfloat16 matrix products in hardware, best first
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
_suggested: list[bool] = []


@functools.lru_cache(maxsize=1)
def cpu_bf16_feature() -> str | None:
    """``"amx_bf16"`` or ``"avx512_bf16"`` when this CPU multiplies bfloat16 in
    hardware (read from ``/proc/cpuinfo``, then from torch's CPU capability), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return next((fl for fl in BF16_FLAGS if fl in flags), None)
    except OSError:
        pass
    try:   # other systems: torch names the widest vector unit it dispatches to
        import torch
        cap = str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return None
    return "amx_bf16" if "AMX" in cap else ("avx512_bf16" if "BF16" in cap else None)


def native_bf16(device: "str | torch.device") -> str | None:
    """What multiplies bfloat16 matrices in hardware on ``device``, or None: the CPU's
    flag (:func:`cpu_bf16_feature`), or ``"cuda sm_XY"`` for a GPU of compute capability
    8.0 or later (Ampere: bfloat16 tensor cores). Other devices: None."""
    import torch
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_bf16_feature()
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor}" if major >= 8 else None
    return None


def suggest_bf16(precision: str, device_type: str, *, what: str = "fine-tuning") -> bool:
    """Warn once per process when a float32 run on the CPU could use ``bf16-mixed``.

    ``precision`` is the Trainer's precision name (``trainer.precision``) and
    ``device_type`` the device the model trains on. Returns True when it warned."""
    if _suggested or device_type != "cpu" or precision not in ("32-true", "32", "32-mixed"):
        return False
    feature = cpu_bf16_feature()
    if feature is None:
        return False
    _suggested.append(True)
    warnings.warn(
        f"this CPU multiplies bfloat16 matrices in hardware ({feature}), and {what} runs in float32: "
        "Trainer(precision=\"bf16-mixed\") (what a Trainer given no precision picks here) took 0.64-0.71x of "
        "float32's time per step in ember's fine-tuning benchmark on such a CPU, at the same accuracy "
        "(docs/transformers.md, \"bf16 on the CPU\"). This is said once per process", UserWarning, stacklevel=3)
    return True
