"""Manual optimization with two toggled optimizers (the GAN pattern: each backward leaves
the other network without gradients) on N CPU processes, run by tests/strategies/test_manual_ddp.py.

    python manual_ddp.py OUT_DIR N

DDP with find_unused_parameters=True and a 30 s process-group timeout. The global batch
is 8 samples whatever N is (8 // N per rank, interleaved), so the weights after training
equal the single-process run's. Every rank writes OUT_DIR/result_<rank>.json.
"""
import sys
from datetime import timedelta

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from common import ddp_trainer, write_result
import ember
from ember.strategies import DDPStrategy


class TwoNets(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g = torch.nn.Linear(4, 4)
        self.d = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        loss_g = F.mse_loss(self.d(self.g(x)), y)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        loss_d = F.mse_loss(self.d(self.g(x).detach()), -y)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)


def main(out: str, n: int) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    module = TwoNets()
    strategy = DDPStrategy(find_unused_parameters=True, timeout=timedelta(seconds=30)) if n > 1 else "auto"
    trainer = ddp_trainer(out, devices=n, strategy=strategy, max_epochs=2, enable_checkpointing=False)
    trainer.fit(module, DataLoader(data, batch_size=8 // n))
    write_result(out, f"result_{trainer.global_rank}", {
        "world": trainer.world_size, "steps": trainer.global_step,
        "params": {k: p.detach().flatten().tolist() for k, p in module.named_parameters()}})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
