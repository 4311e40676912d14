"""The training functions of tests/integrations/test_ray.py, run by Ray Train's workers
(which import them by module name: this folder is on their PYTHONPATH)."""
from __future__ import annotations

import os

import torch


def _data():
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def trainer_loop(config):
    """An ordinary ember fit; the default strategy trains on Ray's process group."""
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    import ember
    from ember.callbacks import ModelCheckpoint
    from ember.integrations.ray import RayTrainReport, resume_path

    class Net(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    root = config["root"]
    strategy = "auto"
    if config.get("async_save"):
        from ember.strategies import DDPStrategy
        strategy = DDPStrategy(async_save=True)
    trainer = ember.Trainer(max_epochs=2, devices="cpu", seed=7, log_every_n_steps=2, logger=False, strategy=strategy,
                            callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"),
                                                       every_n_train_steps=2, save_top_k=-1), RayTrainReport()],
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    module = Net()
    trainer.fit(module, DataLoader(_data(), batch_size=4, shuffle=True),
                ckpt_path=resume_path(config.get("resume_from")))
    if trainer.is_global_zero:
        with open(os.path.join(root, "info.txt"), "w") as f:
            f.write(f"{trainer.world_size} {trainer.strategy.name}\n")
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, os.path.join(root, "final.safetensors"))


def accelerator_loop(config):
    """A hand-written Accelerator loop: ``save_state`` at each epoch end, reported to Ray."""
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    from ember import Accelerator
    from ember.integrations.ray import report, resume_path

    root = config["root"]
    acc = Accelerator(project_dir=root, seed=7)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, loader = acc.prepare(model, opt, DataLoader(_data(), batch_size=4, shuffle=True))
    start = resume_path(config.get("resume_from"))
    first = 0
    if start is not None:
        acc.load_state(start)
        with open(os.path.join(start, "epoch.txt")) as f:
            first = int(f.read()) + 1
    for epoch in range(first, 2):
        total = torch.zeros(())
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.detach()
        folder = os.path.join(root, f"epoch_{epoch}")
        acc.save_state(folder)
        if acc.is_main_process:
            with open(os.path.join(folder, "epoch.txt"), "w") as f:
                f.write(str(epoch))
        acc.wait_for_everyone()
        report({"loss": acc.reduce(total, "mean").item() / len(loader), "epoch": epoch}, folder)
    if acc.is_main_process:
        with open(os.path.join(root, "info.txt"), "w") as f:
            f.write(f"{acc.num_processes} {acc.distributed_type.value}\n")
        save_file({k: v.contiguous() for k, v in acc.unwrap_model(model).state_dict().items()},
                  os.path.join(root, "final.safetensors"))

