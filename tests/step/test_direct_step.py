"""``step_optimizer`` and ``clear_grads`` (ember/precision): the optimizer's step and
``zero_grad(set_to_none=True)`` without torch's per-call profiling wrapper, taken only
where that wrapper would do nothing else. Each case checks the observable behaviour of
``optimizer.step()`` is kept: the same weights, hooks run, a scheduler's call counter
set, the profiler's events recorded, a user's override called."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import ember
from ember.precision import clear_grads, step_optimizer
from ember.step import StepRules


def _model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net(torch.randn(16, 4)).pow(2).mean().backward()
    return net


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.AdamW(p, lr=0.01),
                                  lambda p: torch.optim.Adam(p, lr=0.01, foreach=False)],
                         ids=["sgd", "adamw", "adam-loop"])
def test_same_weights_as_optimizer_step(make):
    a, b = _model_and_grads(), _model_and_grads()
    oa, ob = make(a.parameters()), make(b.parameters())
    for _ in range(3):
        oa.step()
        step_optimizer(ob)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert oa.state_dict()["state"][0].keys() == ob.state_dict()["state"][0].keys()
    clear_grads(ob)
    assert all(p.grad is None for p in b.parameters())


def test_closure_is_called_and_its_loss_returned():
    net = _model_and_grads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        return torch.tensor(3.0)
    assert step_optimizer(opt, closure).item() == 3.0   # SGD returns the closure's loss
    assert calls == [1]


def test_step_hooks_run_instance_and_global():
    net = _model_and_grads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    step_optimizer(opt)
    assert seen == ["pre", "post"]
    h1.remove(), h2.remove()
    h3 = register_optimizer_step_post_hook(lambda o, a, k: seen.append("global"))
    try:
        step_optimizer(opt)
    finally:
        h3.remove()
    assert seen == ["pre", "post", "global"]
    step_optimizer(opt)   # no hook left: nothing more recorded
    assert seen == ["pre", "post", "global"]


def test_scheduler_sees_the_step_without_a_warning():
    net = _model_and_grads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt._opt_called = False
    step_optimizer(opt)
    assert opt._opt_called is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "lr_scheduler.step() before optimizer.step()" would raise
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_profiler_still_sees_optimizer_step_and_zero_grad():
    net = _model_and_grads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step_optimizer(opt)
        clear_grads(opt)
    names = {e.key for e in prof.key_averages()}
    assert "Optimizer.step#SGD.step" in names
    assert "Optimizer.zero_grad#SGD.zero_grad" in names


def test_overrides_are_called():
    class Mine(torch.optim.SGD):
        zeroed = stepped = 0

        def zero_grad(self, set_to_none: bool = True):
            Mine.zeroed += 1
            super().zero_grad(set_to_none)

        def step(self, closure=None):
            Mine.stepped += 1
            return super().step(closure)

    net = _model_and_grads()
    opt = Mine(net.parameters(), lr=0.1)
    step_optimizer(opt)
    clear_grads(opt)
    assert (Mine.stepped, Mine.zeroed) == (1, 1)
    assert all(p.grad is None for p in net.parameters())

    patched = []
    opt2 = torch.optim.SGD(_model_and_grads().parameters(), lr=0.1)
    inner = opt2.step
    opt2.step = lambda closure=None: (patched.append(1), inner(closure))[1]   # an instance patch
    step_optimizer(opt2)
    assert patched == [1]


def test_a_users_wrapper_around_the_class_step_is_called():
    """A wrapper put around an optimizer class's step after torch's (functools.wraps copies
    torch's attributes onto it) is not skipped."""
    import functools

    class Wrapped(torch.optim.SGD):
        pass
    Wrapped(_model_and_grads().parameters(), lr=0.1)   # torch wraps Wrapped.step here
    calls = []
    torch_step = Wrapped.step

    @functools.wraps(torch_step)
    def counting(self, *args, **kwargs):
        calls.append(1)
        return torch_step(self, *args, **kwargs)
    Wrapped.step = counting
    net = _model_and_grads()
    opt = Wrapped(net.parameters(), lr=0.1)
    ref = _model_and_grads()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    step_optimizer(opt)
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))


def test_not_a_torch_optimizer_goes_through_its_step():
    class Duck:
        param_groups: list = []

        def __init__(self):
            self.n = 0

        def step(self, closure=None):
            self.n += 1

        def zero_grad(self, set_to_none=True):
            self.n += 10
    d = Duck()
    step_optimizer(d)
    clear_grads(d)
    assert d.n == 11


def test_trainer_step_equals_a_raw_loop_with_scheduler(tmp_path):
    """The Trainer's automatic step (direct path) against ``opt.step()`` in a raw loop:
    bit-identical weights and learning rates, with a step-interval scheduler."""
    torch.manual_seed(0)
    xs, ys = torch.randn(48, 4), torch.randn(48, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8)

    def build():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    class M(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = build()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    m = M()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        ember.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path).fit(m, loader)

    net = build()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(2):
        for x, y in loader:
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert all(torch.equal(a, b) for a, b in zip(m.net.parameters(), net.parameters()))
    assert m.trainer.optimizers[0].param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_step_rules_zero_grad_keeps_set_to_none_false():
    net = _model_and_grads()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rules = StepRules(ember.strategies.SingleDeviceStrategy("cpu"))
    rules.zero_grad(opt, set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    rules.zero_grad(opt)
    assert all(p.grad is None for p in net.parameters())


@pytest.fixture
def no_global_step_hooks():
    """No global optimizer step hook in this process while the test runs: ember's 16-mixed
    installs one while a loss-scaling precision is alive, and an earlier test's may not have
    been collected yet; one that is still alive is put back afterwards."""
    import gc

    from torch.optim import optimizer as torch_optimizer
    gc.collect()
    saved = [(h, dict(h)) for h in (torch_optimizer._global_optimizer_pre_hooks,
                                    torch_optimizer._global_optimizer_post_hooks)]
    for h, _ in saved:
        h.clear()
    yield
    for h, items in saved:
        h.update(items)


def test_torch_wrapper_is_skipped_when_idle_in_the_trainer_and_accelerator(tmp_path, monkeypatch,
                                                                          no_global_step_hooks):
    """What the direct path is for: with no profiler and no hook, neither torch's step wrapper
    (it calls ``optimizer._optimizer_step_code()`` on every step) nor a ``record_function``
    of ``zero_grad`` runs, through the Trainer and through an Accelerator."""
    opened = []
    real = torch.autograd.profiler.record_function

    class Counting(real):
        def __init__(self, name, *args, **kwargs):
            opened.append(name)
            super().__init__(name, *args, **kwargs)
    monkeypatch.setattr(torch.autograd.profiler, "record_function", Counting)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    entered = []

    class M(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            opt._optimizer_step_code = lambda: entered.append("trainer")   # runs inside torch's wrapper only
            return opt
    ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=tmp_path).fit(M(), loader)

    acc = ember.Accelerator()
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt._optimizer_step_code = lambda: entered.append("accelerator")
    model, popt = acc.prepare(net, opt)
    for xb, yb in loader:
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        popt.step()
        popt.zero_grad()
    assert entered == []
    assert not [n for n in opened if n.startswith("Optimizer.")], opened

    step_optimizer(opt)   # the same optimizer with a hook: through torch's wrapper
    h = opt.register_step_post_hook(lambda *a: None)
    step_optimizer(opt)
    h.remove()
    assert entered == ["accelerator"]


def test_the_16_mixed_global_hook_goes_with_its_precision():
    """16-mixed watches every optimizer step through one global step pre-hook; once no such
    precision is alive the hook is removed, so later runs in the process get the direct path
    (in a fresh process: no other test's precision is alive there)."""
    import subprocess
    import sys
    code = """
import gc, torch
from torch.optim.optimizer import _global_optimizer_pre_hooks as hooks
from ember.precision import Precision
p = Precision.from_string("16-mixed"); p.setup(torch.device("cpu")); p.setup(torch.device("cpu"))
q = Precision.from_string("16-mixed"); q.setup(torch.device("cpu"))
counts = [len(hooks)]
del p; gc.collect(); counts.append(len(hooks))
del q; gc.collect(); counts.append(len(hooks))
r = Precision.from_string("16-mixed"); r.setup(torch.device("cpu")); counts.append(len(hooks))
print(counts)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[1, 1, 0, 1]"   # one hook while any is alive, none after
