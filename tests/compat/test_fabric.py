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
from helpers import passes_left_early

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


# -- ports round 4: Lightning Fabric side by side -----------------------------------------------
def _lightning_fabric():
    return pytest.importorskip("lightning.fabric")


def _pass_orders(fabric, passes=3, stop=2, n=20):
    """The first ``stop`` batches of each pass over a shuffled loader, the loop leaving early."""
    fabric.seed_everything(42)
    dl = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=True))
    return passes_left_early(dl, passes, stop)


def test_a_left_pass_gives_a_new_order_next_pass_as_lightning_fabric():
    """build_your_own_trainer leaves each epoch after a few batches: the next pass is a new
    order (it was the same one, training the same samples every epoch), equal to Lightning
    Fabric's, and the global random stream after it is the same too."""
    L = _lightning_fabric()
    ours = _pass_orders(Fabric(accelerator="cpu", devices=1))
    theirs = _pass_orders(L.Fabric(accelerator="cpu", devices=1))
    assert ours == theirs
    firsts = [p[0] for p in ours[0]]
    assert len({tuple(f) for f in firsts}) == 3


def test_set_epoch_chooses_the_pass_and_a_left_pass_is_recorded_for_a_resume():
    fabric = Fabric(accelerator="cpu", devices=1)
    acc = fabric._acc
    dl = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True))
    for i, _ in enumerate(dl):
        if i == 1:
            break
    st = dl.state_dict()
    assert (st["epoch"], st["batches_done"]) == (1, 0)   # the next pass is a new epoch, from its start
    dl.set_epoch(0)
    assert dl.state_dict()["epoch"] == 0
    next(iter(dl))
    assert dl.epoch == 0   # set_epoch chose it: no advance
    assert acc is fabric._acc


def _bf16_model():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

        def training_step(self, x):
            out = self(x)
            return out, out.float().pow(2).mean()
    return Net()


def test_bf16_mixed_follows_lightning_fabric_forward_only_outputs_float32():
    """bf16-mixed: the forward through the set-up model autocasts, its outputs come back in
    float32; model.training_step(...) called through it is not autocast (Lightning's rules)."""
    L = _lightning_fabric()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    got = {}
    for name, cls in (("ember", Fabric), ("lightning", L.Fabric)):
        f = cls(accelerator="cpu", devices=1, precision="bf16-mixed")
        model = f.setup(_bf16_model())
        out = model(x)
        step_out, loss = model.training_step(x)
        got[name] = (out, step_out, loss)
    (o1, s1, l1), (o2, s2, l2) = got["ember"], got["lightning"]
    assert o1.dtype == o2.dtype == torch.float32 and torch.equal(o1, o2)
    assert s1.dtype == s2.dtype == torch.float32 and torch.equal(s1, s2) and torch.equal(l1, l2)
    assert not torch.equal(o1, s1)   # the forward ran in bf16, the training_step in float32
    model = Fabric(accelerator="cpu", devices=1).setup(_bf16_model())
    model.mark_forward_method("training_step")
    with pytest.raises(ValueError, match="forward"):
        model.mark_forward_method("forward")
    with pytest.raises(AttributeError, match="nope"):
        model.mark_forward_method("nope")
    # the Accelerator keeps Accelerate's rule: the model's own forward autocast, outputs in bf16
    acc = ember.Accelerator(devices="cpu", precision="bf16-mixed")
    assert acc.prepare(_bf16_model())(x).dtype == torch.bfloat16


def test_init_module_empty_init_draws_as_lightning_fabric():
    """empty_init=True skips the initialisers (no random numbers drawn), as Lightning Fabric:
    the weights a script initialises afterwards, and the stream after them, are Lightning's."""
    L = _lightning_fabric()
    got = {}
    for name, cls in (("ember", Fabric), ("lightning", L.Fabric)):
        f = cls(accelerator="cpu", devices=1)
        f.seed_everything(7)
        with f.init_module(empty_init=True):
            model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 2))
        for p in model.parameters():   # litgpt's initialize_weights, after the context
            nn.init.normal_(p, std=0.02)
        with f.init_module(empty_init=False):
            plain = nn.Linear(3, 3)
        got[name] = ([p.detach().clone() for p in model.parameters()] + [plain.weight.detach().clone()],
                     torch.rand(3))
    (w1, r1), (w2, r2) = got["ember"], got["lightning"]
    assert all(torch.equal(a, b) for a, b in zip(w1, w2)) and torch.equal(r1, r2)
    with Fabric(accelerator="cpu", devices=1, precision="bf16-true").init_module(empty_init=True):
        assert nn.Linear(2, 2).weight.dtype == torch.bfloat16


def test_ember_fabric_namespace_as_lightnings():
    import ember as L
    from ember.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
    from ember.fabric.strategies import FSDPStrategy, Strategy
    from ember.fabric.utilities import (Throughput, ThroughputMonitor, measure_flops, rank_zero_only,
                                        rank_zero_warn)
    from ember.fabric.utilities.types import LRScheduler, Optimizable
    from ember.fabric.wrappers import _unwrap_objects
    assert L.fabric.Fabric is Fabric and L.fabric.seed_everything is ember.seed_everything
    assert issubclass(FSDPStrategy, Strategy) and issubclass(CSVLogger, Logger)
    assert issubclass(TensorBoardLogger, Logger)
    assert callable(rank_zero_only) and callable(rank_zero_warn) and callable(measure_flops)
    assert issubclass(ThroughputMonitor, Throughput)
    assert isinstance(torch.optim.SGD(_net().parameters(), lr=0.1), Optimizable)
    assert LRScheduler is torch.optim.lr_scheduler.LRScheduler
    f = Fabric(accelerator=L.fabric.accelerators.CPUAccelerator(), devices=1)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    dl0 = DataLoader(_data(), batch_size=4)
    model, optimizer = f.setup(net, opt)
    dl = f.setup_dataloaders(dl0)
    un = _unwrap_objects({"model": model, "opt": optimizer, "loaders": [dl, 3]})
    assert un["model"] is net and un["opt"] is opt and un["loaders"][1] == 3
    assert un["loaders"][0] is dl.base
    from ember import TrainModule

    class M(TrainModule):
        def training_step(self, batch, batch_idx):
            return None
    assert L.fabric.is_overridden("training_step", M()) and not L.fabric.is_overridden("validation_step", M())


def test_fabric_loggers_take_root_dir_and_unknown_keywords_are_errors(tmp_path):
    from ember.fabric.loggers import CSVLogger, TensorBoardLogger
    lg = CSVLogger(root_dir=tmp_path, name="exp")
    f = Fabric(accelerator="cpu", devices=1, loggers=lg)
    f.log("loss", 1.5, step=0)
    lg.finalize("success")
    assert os.path.isfile(tmp_path / "exp" / "version_0" / "metrics.csv")
    assert TensorBoardLogger(root_dir=tmp_path).log_dir == os.path.join(str(tmp_path), "lightning_logs", "version_0")
    with pytest.raises(TypeError, match="root_dir"):
        ember.loggers.TensorBoardLogger(save_dir=tmp_path, root_dir=tmp_path)
    with pytest.raises(TypeError, match="bogus"):
        TensorBoardLogger(root_dir=tmp_path, bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        CSVLogger(root_dir=tmp_path, bogus=1)


def test_throughput_equals_lightnings_and_the_monitor_takes_a_fabric(tmp_path):
    L = _lightning_fabric()
    from lightning.fabric.utilities import Throughput as LThroughput
    from lightning.fabric.utilities import measure_flops as l_measure_flops

    from ember.fabric.loggers import CSVLogger
    from ember.fabric.utilities import Throughput, ThroughputMonitor, measure_flops
    for world in (1, 4):
        ours, theirs = (cls(available_flops=1e9, world_size=world, window_size=3) for cls in (Throughput, LThroughput))
        for i in range(1, 6):
            kw = dict(time=0.5 * i + 0.01 * i * i, batches=i, samples=8 * i, lengths=64 * i, flops=1000 * i)
            ours.update(**kw)
            theirs.update(**kw)
            assert ours.compute() == theirs.compute()
    net = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    flops = measure_flops(net, lambda: net(x), lambda y: y.sum())
    assert flops == l_measure_flops(net, lambda: net(x), lambda y: y.sum()) and flops > 0
    lg = CSVLogger(root_dir=tmp_path)
    f = Fabric(accelerator="cpu", devices=1, loggers=lg)
    mon = ThroughputMonitor(f, window_size=2)
    mon.update(time=1.0, batches=1, samples=4)
    mon.update(time=2.0, batches=2, samples=8)
    assert mon.compute_and_log()["device/samples_per_sec"] == 4.0 and mon.step == 0
    lg.finalize("success")
    rows = list(csv.DictReader(open(os.path.join(lg.log_dir, "metrics.csv"))))
    assert float(rows[-1]["device/samples_per_sec"]) == 4.0
    with pytest.raises(TypeError, match="bogus"):
        ThroughputMonitor(f, bogus=1)
    assert L is not None


def test_fabric_loaders_read_no_batch_ahead_the_accelerators_one():
    """A loop that stops after 3 batches has read 3 under Fabric (as Lightning Fabric); the
    Accelerator reads one ahead, to know the last batch (as Accelerate)."""
    class Counting(torch.utils.data.IterableDataset):
        def __init__(self):
            self.read = 0

        def __iter__(self):
            for i in range(100):
                self.read += 1
                yield torch.tensor([float(i)])

    for make, expected in ((lambda: Fabric(accelerator="cpu", devices=1), 3),):
        ds = Counting()
        f = make()
        dl = f.setup_dataloaders(DataLoader(ds, batch_size=1))
        for i, _ in enumerate(dl):
            if i == 2:
                break
        assert ds.read == expected
    ds = Counting()
    dl = ember.Accelerator(devices="cpu").prepare(DataLoader(ds, batch_size=1))
    for i, _ in enumerate(dl):
        if i == 2:
            break
    assert ds.read == 4
    f = Fabric(accelerator="cpu", devices=1)
    dl = f.setup_dataloaders(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2))
    ends = [dl.end_of_dataloader for _ in dl]
    assert ends == [False, False, True]


def test_fabric_save_error_names_the_users_key_path(tmp_path):
    f = Fabric(accelerator="cpu", devices=1)

    class Sched:
        def state_dict(self):
            return {"lr_lambdas": [lambda e: 0.5]}
    with pytest.raises(ember.errors.CheckpointError) as err:
        f.save(tmp_path / "c", {"model": f.setup(_net()), "scheduler": Sched()})
    assert "state['scheduler']['lr_lambdas'][0]" in str(err.value) and "'fabric'" not in str(err.value)
