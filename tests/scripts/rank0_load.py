"""Peak memory of loading a full checkpoint under FSDP, for tests/strategies/test_model_parallel.py.

    torchrun --nproc_per_node 2 rank0_load.py OUT save     # fit 1 step, save model.safetensors + AdamW states
    torchrun --nproc_per_node 2 rank0_load.py OUT load     # a new Trainer resumes it (max_steps reached:
                                                           # nothing trains, only the load runs)
    torchrun --nproc_per_node 2 rank0_load.py OUT control  # the same fit without a checkpoint (1 step)

The big layers are built in configure_model (meta device), so no rank ever holds the
full model except while loading. "load" writes OUT/load.rank{R}.json: the rise of
peak resident memory (VmHWM) over the resident memory just before fit, and on rank 0
whether the loaded weights equal the file; "control" writes OUT/control.rank{R}.json,
the same rise for a fit that loads nothing, so load - control is what loading cost.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies import FSDPStrategy

WIDTH, DEPTH = 768, 12           # 12 x 768 x 768 floats = 27 MiB of weights, 81 MiB with AdamW's states


class Big(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.layers = None

    def configure_model(self):
        if self.layers is None:
            self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)])

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=2)
    strategy = FSDPStrategy(state_dict_type="full", timeout=60)
    trainer = ember.Trainer(strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = Big()
    ckpt = os.path.join(out, "full")
    if phase == "save":
        trainer.fit(module, loader)
        trainer.save_checkpoint(ckpt)
        return
    before = _status("VmRSS")
    trainer.fit(module, loader, ckpt_path=ckpt if phase == "load" else None)
    rise = _status("VmHWM") - before
    weights = trainer.strategy.module_state_dict(trainer.model)        # full, on rank 0 (a collective)
    result = {"rise": rise, "global_step": trainer.global_step,
              "ckpt_bytes": sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))}
    if trainer.is_global_zero and phase == "load":
        from safetensors.torch import load_file
        saved = load_file(os.path.join(ckpt, "model.safetensors"))
        result["equal"] = sorted(saved) == sorted(weights) and all(torch.equal(saved[k], weights[k]) for k in saved)
    with open(os.path.join(out, f"{phase}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
