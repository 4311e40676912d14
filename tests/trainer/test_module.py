"""TrainModule: hyperparameters, configure_optimizers forms, learning-rate
schedulers (intervals, frequency, plateau), manual optimization, helpers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback
from ember.errors import MisconfigurationError
from conftest import LinearModule, regression_data


# ----------------------------------------------------------------------------- hparams
def test_save_hyperparameters_records_init_arguments():
    class M(ember.TrainModule):
        def __init__(self, lr=0.1, hidden=8, *, act="relu", backbone=None, **extra):
            super().__init__()
            self.save_hyperparameters(ignore=["backbone"])

    m = M(lr=0.5, act="gelu", backbone="resnet", tag="x")
    assert dict(m.hparams) == {"lr": 0.5, "hidden": 8, "act": "gelu", "tag": "x"}
    assert m.hparams.lr == 0.5                 # attribute access
    with pytest.raises(AttributeError):
        m.hparams.missing


def test_save_hyperparameters_names_subclass_chain_and_modules():
    class Base(ember.TrainModule):
        def __init__(self, lr=0.1, encoder=None):
            super().__init__()
            self.save_hyperparameters()

    class Child(Base):
        def __init__(self, width=4):
            super().__init__(lr=0.3, encoder=nn.Linear(2, 2))

    assert dict(Child(width=6).hparams) == {"lr": 0.3, "width": 6}      # modules are not hparams

    class Picked(ember.TrainModule):
        def __init__(self, a=1, b=2, c=3):
            super().__init__()
            self.save_hyperparameters("a", "c", ignore="c")

    assert dict(Picked(a=5).hparams) == {"a": 5}


# ----------------------------------------------------------------------------- configure_optimizers
def _sgd(m, lr=0.1):
    return torch.optim.SGD(m.parameters(), lr=lr)


def _step(opt, **kw):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5, **kw)


FORMS = {
    "optimizer": lambda m: _sgd(m),
    "list": lambda m: [_sgd(m)],
    "tuple": lambda m: (_sgd(m),),
    "dict": lambda m: {"optimizer": _sgd(m)},
    "dict+scheduler": lambda m: (lambda o: {"optimizer": o, "lr_scheduler": _step(o)})(_sgd(m)),
    "dict+config": lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _step(o), "interval": "step",
                                                                          "frequency": 2, "name": "s"}})(_sgd(m)),
    "lists": lambda m: (lambda o: ([o], [_step(o)]))(_sgd(m)),
    "lists+config": lambda m: (lambda o: ([o], [{"scheduler": _step(o), "interval": "step"}]))(_sgd(m)),
}
EXPECTED = {"optimizer": None, "list": None, "tuple": None, "dict": None,
            "dict+scheduler": ("epoch", 1), "dict+config": ("step", 2),
            "lists": ("epoch", 1), "lists+config": ("step", 1)}


class Configurable(LinearModule):
    def __init__(self, configure, lr=0.1):
        super().__init__(lr=lr)
        self._configure = configure

    def configure_optimizers(self):
        return self._configure(self)


@pytest.mark.parametrize("form", list(FORMS))
def test_configure_optimizers_forms(make_trainer, data, form):
    trainer = make_trainer(max_epochs=1)
    trainer.fit(Configurable(FORMS[form]), data(n=16))
    assert len(trainer.optimizers) == 1 and isinstance(trainer.optimizers[0], torch.optim.SGD)
    expected = EXPECTED[form]
    if expected is None:
        assert trainer.lr_scheduler_configs == []
    else:
        (cfg,) = trainer.lr_scheduler_configs
        assert (cfg["interval"], cfg["frequency"]) == expected
        assert isinstance(cfg["scheduler"], torch.optim.lr_scheduler.StepLR)


# ----------------------------------------------------------------------------- schedulers
class LrTrace(Callback):
    """The learning rate each optimizer step used."""

    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def _fit_with_schedule(make_trainer, configure, **kw):
    trace = LrTrace()
    trainer = make_trainer(callbacks=[trace], **kw)
    trainer.fit(Configurable(configure), DataLoader(regression_data(40), batch_size=4))   # 10 batches/epoch
    return trainer, trace.lrs


def test_step_scheduler_steps_once_per_optimizer_step_under_accumulation(make_trainer):
    trainer, lrs = _fit_with_schedule(
        make_trainer, lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _step(o), "interval": "step"}})(_sgd(m)),
        max_epochs=2, accumulate_grad_batches=2)
    assert trainer.global_step == 10
    assert lrs == pytest.approx([0.1 * 0.5 ** k for k in range(10)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 10)


def test_lambda_lr_counts_optimizer_steps(make_trainer):
    calls = []

    def lam(step):
        calls.append(step)
        return 1.0 / (step + 1)

    trainer, lrs = _fit_with_schedule(
        make_trainer, lambda m: (lambda o: ([o], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(o, lam),
                                                   "interval": "step"}]))(_sgd(m)),
        max_epochs=1, accumulate_grad_batches=3)           # 10 batches: windows 3, 3, 3, 1
    assert trainer.global_step == 4
    assert calls == [0, 1, 2, 3, 4]                         # construction + one call per optimizer step
    assert lrs == pytest.approx([0.1 / (k + 1) for k in range(4)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 / 5)


def test_step_scheduler_frequency(make_trainer):
    trainer, lrs = _fit_with_schedule(
        make_trainer, lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _step(o), "interval": "step",
                                                                             "frequency": 3}})(_sgd(m)),
        max_epochs=1)
    assert lrs == pytest.approx([0.1 * 0.5 ** (k // 3) for k in range(10)])


@pytest.mark.parametrize("frequency,expected", [(1, [0.1, 0.05, 0.025, 0.0125]), (2, [0.1, 0.1, 0.05, 0.05])])
def test_epoch_scheduler(make_trainer, frequency, expected):
    trainer, lrs = _fit_with_schedule(
        make_trainer, lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _step(o),
                                                                             "frequency": frequency}})(_sgd(m)),
        max_epochs=4)
    assert lrs == pytest.approx([lr for lr in expected for _ in range(10)])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected[-1] * 0.5)


class PlateauModule(LinearModule):
    def __init__(self, values):
        super().__init__()
        self.values = values

    def validation_step(self, batch, batch_idx):
        self.log("val/metric", self.values[self.current_epoch])

    def configure_optimizers(self):
        opt = _sgd(self)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": sched, "monitor": "val/metric"}


@pytest.mark.parametrize("values,final_lr", [([1.0, 1.0, 1.0, 1.0], 0.1 / 8), ([4.0, 3.0, 2.0, 1.0], 0.1),
                                             ([1.0, 2.0, 0.5, 0.6], 0.1 / 4)])
def test_reduce_lr_on_plateau_reads_its_monitor(make_trainer, data, values, final_lr):
    trainer = make_trainer(max_epochs=4, num_sanity_val_steps=0)
    trainer.fit(PlateauModule(values), data(n=16), data(n=8))
    assert trainer.lr_scheduler_configs[0]["monitor"] == "val/metric"
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(final_lr)


def test_scheduler_config_errors(make_trainer, data):
    def plateau_without_monitor(m):
        o = _sgd(m)
        return {"optimizer": o, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o)}

    with pytest.raises(MisconfigurationError, match="ReduceLROnPlateau.*monitor"):
        make_trainer(max_epochs=1).fit(Configurable(plateau_without_monitor), data(n=16))
    bad_interval = lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _step(o), "interval": "batch"}})(_sgd(m))
    with pytest.raises(MisconfigurationError, match=r"interval='batch'.*'step', 'epoch'"):
        make_trainer(max_epochs=1).fit(Configurable(bad_interval), data(n=16))
    bad_key = lambda m: (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": _step(o), "every": 2}})(_sgd(m))
    with pytest.raises(MisconfigurationError, match=r"unknown keys \['every'\]"):
        make_trainer(max_epochs=1).fit(Configurable(bad_key), data(n=16))


def test_monitor_never_logged_lists_the_logged_metrics(make_trainer, data):
    class Missing(PlateauModule):
        def validation_step(self, batch, batch_idx):
            self.log("val/other", 1.0)

    with pytest.raises(MisconfigurationError, match=r"'val/metric' was never logged.*val/other"):
        make_trainer(max_epochs=2, num_sanity_val_steps=0).fit(Missing([1.0] * 2), data(n=16), data(n=8))


def test_estimated_stepping_batches_inside_configure_optimizers(make_trainer):
    seen = []

    class OneCycle(LinearModule):
        def configure_optimizers(self):
            total = self.trainer.estimated_stepping_batches
            seen.append(total)
            opt = _sgd(self)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = make_trainer(max_epochs=2, accumulate_grad_batches=3)
    trainer.fit(OneCycle(), DataLoader(regression_data(40), batch_size=4))   # 10 batches -> 4 steps/epoch
    assert seen == [8] and trainer.global_step == 8


# ----------------------------------------------------------------------------- manual optimization
class TwoNets(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = nn.Linear(4, 1), nn.Linear(4, 1)
        self.autocast_seen = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.autocast_seen.add(torch.is_autocast_enabled("cpu"))
        opt_g, opt_d = self.optimizers()
        loss_g = F.mse_loss(self.g(x).float(), y)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        loss_d = F.mse_loss(self.d(x).float(), -y)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        self.log("loss_g", loss_g)

    def configure_optimizers(self):
        opt_g = torch.optim.SGD(self.g.parameters(), lr=0.1)
        opt_d = torch.optim.SGD(self.d.parameters(), lr=0.05)
        return [opt_g, opt_d]


def test_manual_optimization_two_optimizers(make_trainer):
    torch.manual_seed(0)
    module = TwoNets()
    g, d = copy.deepcopy(module.g), copy.deepcopy(module.d)
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.05)
    ds = regression_data(48)
    for _ in range(2):
        for x, y in DataLoader(ds, batch_size=8):
            og.zero_grad(); F.mse_loss(g(x), y).backward(); og.step()
            od.zero_grad(); F.mse_loss(d(x), -y).backward(); od.step()
    trainer = make_trainer(max_epochs=2, log_every_n_steps=1)
    trainer.fit(module, DataLoader(ds, batch_size=8))
    assert trainer.global_step == 2 * 12                    # every optimizer step counts
    for a, b in ((module.g, g), (module.d, d)):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert "loss_g" in trainer.logged_metrics


def test_manual_optimization_max_steps_and_scheduler(make_trainer, data):
    class WithSched(TwoNets):
        def configure_optimizers(self):
            opt_g, opt_d = super().configure_optimizers()
            return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)]

    trainer = make_trainer(max_steps=6)
    module = WithSched()
    trainer.fit(module, data(n=64))
    assert trainer.global_step == 6                      # 3 batches x 2 optimizers
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert trainer.optimizers[1].param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_manual_optimization_runs_under_autocast(make_trainer, data, precision):
    module = TwoNets()
    before = [p.detach().clone() for p in module.parameters()]
    make_trainer(max_epochs=1, precision=precision).fit(module, data(n=64))
    assert module.autocast_seen == {True}
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


# ----------------------------------------------------------------------------- helpers
def test_module_helpers_outside_and_inside_a_trainer(make_trainer, data, capsys):
    module = LinearModule()
    with pytest.raises(MisconfigurationError, match="not attached to a Trainer"):
        module.trainer
    assert module.device == torch.device("cpu") and module.global_step == 0 and module.current_epoch == 0
    trainer = make_trainer(max_epochs=2)
    trainer.fit(module, data(n=16))
    assert module.trainer is trainer and module.global_step == 4 and module.current_epoch == 2
    module.print("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"
    gathered = module.all_gather({"a": torch.tensor([1.0, 2.0]), "b": 3})
    assert gathered["a"].shape == (1, 2) and gathered["b"].tolist() == [3]
