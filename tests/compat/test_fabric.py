"""``from ember import Fabric``: Lightning Fabric's names on ember's Accelerator, on one
process (the ports in tests/ports/fabric/ run on two, next to Lightning Fabric itself:
tests/compat/test_fabric_ports.py)."""
from __future__ import annotations

import csv
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import Fabric
from ember.compat.fabric import FabricModule
from ember.errors import MisconfigurationError

NAMES = ["launch", "setup", "setup_module", "setup_optimizers", "setup_dataloaders", "backward", "clip_gradients",
         "no_backward_sync", "autocast", "to_device", "all_gather", "all_reduce", "barrier", "broadcast",
         "rank_zero_first", "is_global_zero", "global_rank", "local_rank", "node_rank", "world_size", "device",
         "print", "log", "log_dict", "save", "load", "load_raw", "call", "loggers", "seed_everything"]


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_every_fabric_name_is_there_with_lightnings_arguments():
    import inspect
    missing = [n for n in NAMES if not hasattr(Fabric, n)]
    assert missing == []
    assert list(inspect.signature(Fabric.__init__).parameters)[1:] == [
        "accelerator", "strategy", "devices", "num_nodes", "precision", "plugins", "callbacks", "loggers"]
    assert ember.Fabric is Fabric


def test_a_fabric_loop_equals_the_raw_loop():
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    assert (fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank) == (1, 0, 0, 0)
    assert fabric.is_global_zero and fabric.device == torch.device("cpu")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    assert isinstance(model, FabricModule) and isinstance(opt, torch.optim.SGD.__mro__[1])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)   # built on the set-up optimizer
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=8))
    norms = []
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, opt, max_norm=0.5))
        opt.step()
        opt.zero_grad()
    sched.step()

    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_norms = []
    for x, y in DataLoader(_data(), batch_size=8):
        F.cross_entropy(ref(x), y).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert torch.equal(torch.stack(norms), torch.stack(ref_norms))
    assert list(model.state_dict()) == list(ref.state_dict())          # no wrapper prefix
    assert opt.param_groups[0]["lr"] == 0.05
    model.module[0].weight.grad = torch.full_like(model.module[0].weight, float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, opt, max_norm=1.0)
    assert fabric.clip_gradients(model, opt, clip_val=0.1) is None
    for bad in ({}, {"clip_val": 1.0, "max_norm": 1.0}):
        with pytest.raises(ValueError):
            fabric.clip_gradients(model, opt, **bad)


def test_collectives_on_one_process_follow_fabric():
    fabric = Fabric(devices=1)
    out = fabric.all_gather(3.0)
    assert isinstance(out, torch.Tensor) and out.shape == () and out.item() == 3.0   # no new dimension
    assert torch.equal(fabric.all_gather({"a": torch.ones(2)})["a"], torch.ones(2))
    assert fabric.all_reduce(2.0).item() == 2.0 and fabric.all_reduce(torch.ones(2), reduce_op="sum").tolist() == [1, 1]
    with pytest.raises(MisconfigurationError, match="reduce_op"):
        fabric.all_reduce(1.0, reduce_op="product")
    assert fabric.broadcast({"x": 1}) == {"x": 1}
    fabric.barrier("here")
    with fabric.rank_zero_first(), fabric.rank_zero_first(local=True):
        pass
    model = fabric.setup_module(_net())
    with fabric.no_backward_sync(model), fabric.autocast():
        F.cross_entropy(model(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
    assert fabric.to_device({"t": torch.ones(1)})["t"].device == fabric.device
    assert isinstance(fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)), torch.optim.Optimizer)


def test_save_and_load_use_embers_checkpoint_format(tmp_path):
    fabric = Fabric(devices=1)
    model, opt = fabric.setup(_net(), torch.optim.Adam(_net().parameters(), lr=1e-3))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    F.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 0, 1])).backward()
    opt.step()
    path = tmp_path / "run" / "step-10.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 10, "note": "x", "t": torch.arange(3)})
    assert sorted(os.listdir(path)) == ["meta.json", "model.safetensors", "trainer_state.pt"]
    assert not os.path.exists(str(path) + ".ember-tmp")

    model2 = fabric.setup_module(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt2 = fabric.setup_optimizers(torch.optim.Adam(model2.parameters(), lr=5e-1))
    state = {"model": model2, "optimizer": opt2, "step": 0}
    rest = fabric.load(path, state)
    assert state["step"] == 10 and set(rest) == {"note", "t"} and rest["note"] == "x"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.state_dict()["state"][0]["step"] == 1
    full = fabric.load(path)
    assert set(full) == {"model", "optimizer", "step", "note", "t"} and "0.weight" in full["model"]
    with pytest.raises(KeyError, match="not in the checkpoint"):
        fabric.load(path, {"model": model2, "ema": 1})
    assert fabric.load(path, {"ema": 1}, strict=False)["step"] == 10

    model3 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fabric.save(tmp_path / "weights", {"model": model}, filter={"model": lambda k, v: "weight" in k})
    fabric.load_raw(tmp_path / "weights", model3, strict=False)
    assert torch.equal(model3[0].weight, model.module[0].weight) and not torch.equal(model3[0].bias, model.module[0].bias)
    from ember.checkpoint.io import save_torch
    save_torch(model.state_dict(), tmp_path / "raw.pt")
    fabric.load_raw(tmp_path / "raw.pt", model3)
    assert torch.equal(model3[2].bias, model.module[2].bias)


def test_log_call_and_arguments(tmp_path):
    from ember.loggers import CSVLogger

    class Counter:
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, loss, **kw):
            self.seen.append((loss, kw))

    cb = Counter()
    logger = CSVLogger(tmp_path)
    fabric = Fabric(devices=1, callbacks=cb, loggers=logger, precision="bf16")
    assert fabric.loggers == [logger] and fabric.logger is logger
    assert fabric.strategy.precision.name == "bf16-mixed"
    fabric.log("loss", torch.tensor(0.5))
    fabric.log_dict({"loss": 0.25, "acc": torch.tensor(0.75)}, step=7)
    fabric.call("on_train_epoch_end", 0.1, epoch=3)
    fabric.call("no_such_hook")
    assert cb.seen == [(0.1, {"epoch": 3})]
    logger.finalize("success")
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    assert [(r["step"], r["loss"]) for r in rows] == [("0", "0.5"), ("7", "0.25")] and rows[1]["acc"] == "0.75"
    assert Fabric.seed_everything(3) == 3 and torch.initial_seed() == 3
    for bad in ({"strategy": "ddp_spawn"}, {"plugins": object()}, {"precision": "transformer-engine"}):
        with pytest.raises(MisconfigurationError):
            Fabric(devices=1, **bad)
