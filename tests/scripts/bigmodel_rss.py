"""Peak resident memory while loading and running a model 4x larger than its CPU budget.

make CKPT: write the weights (safetensors) and a reference output (run in its own process).
run CKPT OFFLOAD CAP_BYTES: build the model empty, load_checkpoint_and_dispatch with
max_memory={"cpu": CAP}, run it twice; print one JSON line with the RSS figures.
"""
from __future__ import annotations

import json
import os
import resource
import sys

import torch
from torch import nn

WIDTH, DEPTH = 1024, 32          # 32 blocks of 2 x 1024x1024 fp32 = 8 MiB each: 256 MiB


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x))) * 0.1


def build() -> nn.Module:
    return nn.Sequential(*[Block() for _ in range(DEPTH)])


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """This process's peak RSS (VmHWM). Not getrusage's ru_maxrss: Linux carries that over
    from the parent across fork + exec, so it shows the test runner's own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _input() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))


def make(ckpt: str) -> None:
    """Write random weights to ``ckpt`` and the in-memory model's output to ``ckpt.out.pt``."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(DEPTH):
        for fc in ("fc1", "fc2"):
            state[f"{i}.{fc}.weight"] = torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5
            state[f"{i}.{fc}.bias"] = torch.randn(WIDTH, generator=g) * 0.01
    save_file(state, ckpt)
    model = build().eval()
    model.load_state_dict(state)
    with torch.no_grad():
        torch.save(model(_input()), ckpt + ".out.pt")


def main() -> None:
    torch.set_num_threads(1)
    cmd, ckpt = sys.argv[1], sys.argv[2]
    x = _input()
    if cmd == "make":
        make(ckpt)
        return
    from ember.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    offload, cap = sys.argv[3], int(sys.argv[4])
    with torch.no_grad():   # page in the kernels' code first: that is baseline, not weights
        torch.tanh(nn.functional.linear(x, torch.randn(64, WIDTH), torch.randn(64)))
    base = rss_now()
    with init_empty_weights():
        model = build()
    model = load_checkpoint_and_dispatch(model, ckpt, device_map="auto", max_memory={"cpu": cap},
                                         no_split_module_classes=["Block"], offload_folder=offload)
    after_load = rss_now()
    with torch.no_grad():
        y = model(x)
        y2 = model(x)
    ref = torch.load(ckpt + ".out.pt", weights_only=True)
    peak = rss_peak()
    devices = sorted(set(map(str, model.hf_device_map.values())))
    print(json.dumps({"base": base, "after_load": after_load, "peak": peak, "equal": bool(torch.equal(y, ref))
                      and bool(torch.equal(y2, ref)), "devices": devices,
                      "on_disk": sum(v == "disk" for v in model.hf_device_map.values()),
                      "block": 2 * (WIDTH * WIDTH + WIDTH) * 4,
                      "weights": sum(p.numel() * 4 for p in model.parameters())}))


if __name__ == "__main__":
    main()
