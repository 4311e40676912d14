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


def main() -> None:
    torch.set_num_threads(1)
    cmd, ckpt = sys.argv[1], sys.argv[2]
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    if cmd == "make":
        from safetensors.torch import save_file
        torch.manual_seed(0)
        model = build().eval()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt)
        with torch.no_grad():
            torch.save(model(x), ckpt + ".out.pt")
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    devices = sorted(set(map(str, model.hf_device_map.values())))
    print(json.dumps({"base": base, "after_load": after_load, "peak": peak, "equal": bool(torch.equal(y, ref))
                      and bool(torch.equal(y2, ref)), "devices": devices,
                      "on_disk": sum(v == "disk" for v in model.hf_device_map.values()),
                      "block": 2 * (WIDTH * WIDTH + WIDTH) * 4,
                      "weights": sum(p.numel() * 4 for p in model.parameters())}))


if __name__ == "__main__":
    main()
