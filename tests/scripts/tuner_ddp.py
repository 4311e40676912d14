"""lr_find under 2-process DDP (gloo): every rank writes OUT/lr_rank<R>.json with
its curve and suggestion, which must be the same on both ranks.

    python tuner_ddp.py OUT_DIR
"""
import json
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ember  # noqa: E402
import ember.tuner  # noqa: E402
from helpers import LinearModule, regression_data  # noqa: E402
from ember.strategies import DDPStrategy  # noqa: E402


class Probe(LinearModule):
    first = None

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.first is None:
            self.first = loss.item()
        return loss


def main(out):
    torch.manual_seed(0)
    trainer = ember.Trainer(strategy=DDPStrategy(devices=2, accelerator="cpu", timeout=40), max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=out, seed=3)
    module = Probe(dim=8)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    loader = DataLoader(regression_data(n=512, dim=8), batch_size=16, shuffle=True)
    res = ember.tuner.lr_find(trainer, module, loader, min_lr=1e-5, max_lr=10.0, num_training=60)
    restored = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    first = module.first
    trainer.fit(module, loader)   # the restored trainer trains as usual afterwards
    with open(os.path.join(out, f"lr_rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"suggestion": res.suggestion(), "losses": res.losses, "local_first_loss": first,
                   "restored": restored, "fit_steps": trainer.global_step}, f)


if __name__ == "__main__":
    main(sys.argv[1])
