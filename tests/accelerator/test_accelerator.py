"""Accelerator in one process: equality with a hand-written loop, accumulation,
schedulers, precision (GradScaler unscale tracking, autocast forward), collectives
on one process, checkpoints (save_state/load_state in a new process), save_model,
trackers writing real files, and the GAN example."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Accelerator
from ember.accelerator import AcceleratedOptimizer, AcceleratedScheduler, DataLoaderShard
from ember.errors import MisconfigurationError


def data(n=56, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 2))


# -- training equals a raw loop -----------------------------------------------------------------
@pytest.mark.parametrize("gas", [1, 2, 3])
def test_training_equals_raw_loop_exactly(gas):
    ds = data()  # 56 samples / 8 = 7 batches: with gas 2 and 3 the last window is partial
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    batches = list(DataLoader(ds, batch_size=8))
    torch.manual_seed(1)  # dropout; the prepared DataLoader draws from the global RNG as this one does
    last = len(batches) - len(batches) % gas    # the short last window divides by its own size
    for i, (x, y) in enumerate(DataLoader(ds, batch_size=8)):
        (F.cross_entropy(net(x), y) / (gas if i < last else len(batches) - last)).backward()
        if (i + 1) % gas == 0 or i == len(batches) - 1:
            opt.step()
            sched.step()
            opt.zero_grad()

    model = mlp()
    aopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    asched = torch.optim.lr_scheduler.StepLR(aopt, step_size=1, gamma=0.9)
    acc = Accelerator(gradient_accumulation_steps=gas)
    loader, asched, model, aopt = acc.prepare(DataLoader(ds, batch_size=8), asched, model, aopt)
    torch.manual_seed(1)
    syncs = []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            syncs.append(acc.sync_gradients)
            aopt.step()
            asched.step()
            aopt.zero_grad()
    expected_steps = -(-len(batches) // gas)
    assert sum(syncs) == expected_steps and syncs[-1]
    assert asched.last_epoch == sched.last_epoch == expected_steps
    for a, b in zip(net.state_dict().values(), acc.unwrap_model(model).state_dict().values()):
        assert torch.equal(a, b)


def test_shuffled_order_follows_seed_and_epoch():
    acc = Accelerator(seed=7)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=5, shuffle=True))
    epochs = [torch.cat([b for (b,) in loader]).tolist() for _ in range(2)]
    for e, order in enumerate(epochs):
        assert order == torch.randperm(20, generator=torch.Generator().manual_seed(7 + e)).tolist()
    assert epochs[0] != epochs[1] and loader.epoch == 2


def test_prepare_any_order_types_and_idempotent():
    acc = Accelerator()
    net = nn.Linear(3, 1)
    opt = torch.optim.Adam(net.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    dl = DataLoader(TensorDataset(torch.zeros(4, 3)), batch_size=2)
    out = acc.prepare(sched, "not prepared", dl, opt, net)
    assert [type(o) for o in out] == [AcceleratedScheduler, str, DataLoaderShard, AcceleratedOptimizer, nn.Linear]
    assert isinstance(out[3], torch.optim.Optimizer) and out[3].optimizer is opt
    again = acc.prepare(*out)
    assert all(a is b for a, b in zip(again, out))
    assert len(acc._models) == len(acc._optimizers) == len(acc._schedulers) == len(acc._dataloaders) == 1
    assert isinstance(acc.prepare(nn.Linear(1, 1)), nn.Linear)   # one object: not a tuple


def test_scheduler_built_on_prepared_optimizer_and_step_with_optimizer_false():
    for with_opt, expected in ((True, 2), (False, 4)):
        acc = Accelerator(gradient_accumulation_steps=2, step_scheduler_with_optimizer=with_opt)
        net = nn.Linear(2, 1)
        net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=1.0))
        sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s))
        for _ in range(4):
            with acc.accumulate(net):
                acc.backward(net(torch.ones(1, 2)).sum())
                opt.step()
                sched.step()
                opt.zero_grad()
        assert sched.last_epoch == expected
        assert opt.param_groups[0]["lr"] == pytest.approx(0.5 ** expected)


def test_accumulation_zero_grad_and_clip_only_on_sync_steps():
    acc = Accelerator(gradient_accumulation_steps=2)
    net = nn.Linear(2, 1, bias=False)
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
    with acc.accumulate(net):
        acc.backward(net(torch.ones(1, 2)).sum())
        assert not acc.sync_gradients
        partial = acc.clip_grad_norm_(net.parameters(), 1e-3)   # not clipped mid-window:
        assert partial.item() == pytest.approx(0.5 * 2 ** 0.5)  # the norm accumulated so far
        opt.zero_grad()                                               # not cleared mid-window
    assert torch.allclose(net.weight.grad, torch.full((1, 2), 0.5))
    with acc.accumulate(net):
        acc.backward(net(torch.ones(1, 2)).sum())
        assert acc.sync_gradients
        norm = acc.clip_grad_norm_(net.parameters(), 1e-3)
    assert norm == pytest.approx(2 ** 0.5)
    assert net.weight.grad.norm() == pytest.approx(1e-3, rel=1e-4)
    opt.zero_grad()
    assert net.weight.grad is None


# -- precision ------------------------------------------------------------------------------------
def test_16_mixed_unscales_once_per_step_with_two_optimizers():
    acc = Accelerator(precision="16-mixed")
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    a, b, oa, ob = acc.prepare(a, b, oa, ob)
    x = torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.float16):   # the same forward, no loss scaling
        ref_loss = ref_b(ref_a(x)).float().pow(2).mean()
    ref_loss.backward()
    acc.backward(b(a(x)).float().pow(2).mean())   # outputs stay float16: the loss in float32
    assert acc.scaler.get_scale() > 1
    true_norm = torch.cat([p.grad.flatten() for p in ref_a.parameters()]).norm()
    n1 = acc.clip_grad_norm_(a.parameters(), 1e6)
    n2 = acc.clip_grad_norm_(a.parameters(), 1e6)     # GradScaler would raise on a second unscale_
    assert n1 == pytest.approx(true_norm.item(), rel=1e-3) and n2 == pytest.approx(n1.item())
    acc.clip_grad_value_(b.parameters(), 1e6)
    w_b, g_b = b.weight.detach().clone(), b.weight.grad.clone()
    assert torch.allclose(g_b, ref_b.weight.grad, rtol=1e-3, atol=1e-6)
    oa.step()
    ob.step()   # its gradients were unscaled before a's step updated the scaler: not unscaled again
    assert torch.allclose(b.weight.detach(), w_b - g_b)
    assert not oa.step_was_skipped and not ob.step_was_skipped


def test_16_mixed_inf_gradients_skip_the_step_and_the_scheduler():
    acc = Accelerator(precision="16-mixed")
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt, sched = acc.prepare(net, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    before = [p.detach().clone() for p in net.parameters()]
    scale = acc.scaler.get_scale()
    acc.backward(net(torch.ones(1, 2)).sum() * float("inf"))
    opt.step()
    sched.step()
    assert opt.step_was_skipped and acc.optimizer_step_was_skipped
    assert sched.last_epoch == 0 and acc.scaler.get_scale() == scale / 2
    assert all(torch.equal(p, q) for p, q in zip(before, net.parameters()))
    opt.zero_grad()
    acc.backward(net(torch.ones(1, 2)).sum())
    opt.step()
    sched.step()
    assert not opt.step_was_skipped and sched.last_epoch == 1


def _raw_fp16_step(net, x, y, lr):
    """The raw loop: the same fp16 autocast forward, no loss scaling, one SGD step."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(x)
    F.mse_loss(out.float(), y).backward()
    opt.step()


def test_16_mixed_optimizer_not_passed_to_prepare_takes_the_true_step():
    """backward() scales the loss; an optimizer that was not prepared is unscaled before its
    own step (it was 65,536x too large)."""
    torch.manual_seed(0)
    net, x, y = nn.Linear(4, 2), torch.randn(8, 4), torch.randn(8, 2)
    ref, fp32, start = copy.deepcopy(net), copy.deepcopy(net), net.weight.detach().clone()
    acc = Accelerator(precision="16-mixed")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)      # not passed to prepare
    model = acc.prepare(net)
    acc.backward(F.mse_loss(model(x), y))
    opt.step()
    _raw_fp16_step(ref, x, y, 0.1)
    assert torch.equal(net.weight, ref.weight) and torch.equal(net.bias, ref.bias)
    F.mse_loss(fp32(x), y).backward()
    torch.optim.SGD(fp32.parameters(), lr=0.1).step()
    move, fp32_move = net.weight.detach() - start, fp32.weight.detach() - start
    assert move.abs().max() > 0.01                       # it trained (0.06), and by the fp32 loop's amount
    torch.testing.assert_close(move, fp32_move, rtol=0, atol=2e-3)


def test_16_mixed_second_optimizer_not_prepared_after_a_prepared_one_and_inf_skip():
    """A GAN-like pair: the prepared optimizer steps first; the unprepared one still
    unscales with the scale its gradients carry, and is skipped on inf like a prepared one."""
    torch.manual_seed(0)
    a, b, x = nn.Linear(4, 4), nn.Linear(4, 1), torch.randn(8, 4)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    acc = Accelerator(precision="16-mixed")
    acc.scaler.set_growth_interval(1)                     # the scale changes after every good step
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)          # not prepared
    a, b, oa = acc.prepare(a, b, oa)
    scale = acc.scaler.get_scale()
    acc.backward(b(a(x)).float().pow(2).mean())
    oa.step()
    ob.step()
    assert acc.scaler.get_scale() == scale * 2            # one update, after both stepped
    ra, rb = torch.optim.SGD(ref_a.parameters(), lr=0.1), torch.optim.SGD(ref_b.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        out = ref_b(ref_a(x))
    out.float().pow(2).mean().backward()
    ra.step()
    rb.step()
    for p, q in zip([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]):
        assert torch.equal(p, q)
    oa.zero_grad()
    ob.zero_grad()
    before = [p.detach().clone() for p in b.parameters()]
    acc.backward(b(a(x)).float().pow(2).mean() * float("inf"))
    oa.step()
    ob.step()                                             # inf gradients: skipped, not applied
    assert all(torch.equal(p, q) for p, q in zip(before, b.parameters()))
    assert oa.step_was_skipped and acc.scaler.get_scale() == scale


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        out = self.lin(x)
        self.seen = out.dtype
        return {"out": out, "n": 3, "idx": torch.arange(2), "full": out.float()}


def test_mixed_forward_keeps_outputs_in_the_autocast_dtype():
    acc = Accelerator(precision="bf16-mixed")
    model = acc.prepare(Probe())
    x = torch.randn(2, 4)
    res = model(x)
    assert model.seen == torch.bfloat16 and res["out"].dtype == torch.bfloat16 and res["n"] == 3
    assert res["idx"].dtype == torch.int64 and res["full"].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expect = model.lin(x)
    assert torch.equal(res["out"], expect)          # the autocast result itself, no round trip


def test_convert_outputs_to_fp32_opt_in_upcasts_as_accelerate():
    acc = Accelerator(precision="bf16-mixed", convert_outputs_to_fp32=True)
    model = acc.prepare(Probe())
    x = torch.randn(2, 4)
    res = model(x)
    assert model.seen == torch.bfloat16 and res["out"].dtype == torch.float32 and res["n"] == 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expect = model.lin(x).float()
    assert torch.equal(res["out"], expect)


def test_mixed_forward_runs_in_autocast_and_unwraps():
    acc = Accelerator(precision="bf16-mixed")
    model = acc.prepare(Probe())
    twin = copy.deepcopy(model)   # the forward wrapper is rebound to the copy
    twin(torch.randn(2, 4))
    assert twin.forward.__self__ is twin and twin.seen == torch.bfloat16
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    plain(torch.randn(2, 4))
    assert plain.seen == torch.float32
    with acc.autocast():
        assert plain.lin(torch.randn(1, 4)).dtype == torch.bfloat16


def test_true_low_precision_casts_inputs():
    acc = Accelerator(precision="bf16-true")
    model = acc.prepare(nn.Linear(3, 1))
    assert model.weight.dtype == torch.bfloat16
    assert model(torch.randn(2, 3)).dtype == torch.bfloat16   # float32 input cast on the way in


# -- one-process collectives and helpers -------------------------------------------------------------
def test_single_process_collectives_and_helpers(capsys):
    acc = Accelerator(debug=True)
    assert acc.debug and acc.num_processes == 1 and acc.is_main_process and acc.process_index == 0
    assert acc.local_process_index == 0 and acc.is_local_main_process and acc.device == torch.device("cpu")
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(1001)), batch_size=64))
    assert torch.cat([acc.gather_for_metrics(b) for (b,) in loader]).tolist() == list(range(1001))
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(acc.gather(t), t) and acc.gather(torch.tensor(3.0)).tolist() == [3.0]
    assert torch.equal(acc.reduce(t), t) and torch.equal(acc.reduce(t, "mean", scale=2.0), 2 * t)
    assert acc.reduce(2.5).item() == 2.5
    assert torch.equal(acc.pad_across_processes(t), t) and acc.broadcast({"a": 1}) == {"a": 1}
    assert acc.gather_object(["x"]) == ["x"]
    with pytest.raises(MisconfigurationError, match="reduction"):
        acc.reduce(t, "avg-ish")
    with acc.split_between_processes({"a": [1, 2, 3], "b": torch.arange(3)}) as part:
        assert part["a"] == [1, 2, 3]
    with acc.main_process_first():
        acc.print("printed once")
    assert acc.on_main_process(lambda: 5)() == 5 and acc.on_local_main_process(lambda: 6)() == 6
    acc.wait_for_everyone()
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()
    assert capsys.readouterr().out == "printed once\n"


def test_debug_env_and_argument_errors(monkeypatch):
    monkeypatch.setenv("EMBER_DEBUG", "1")
    assert Accelerator().debug
    monkeypatch.setenv("EMBER_DEBUG", "0")
    assert not Accelerator().debug
    with pytest.raises(MisconfigurationError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=0)
    with pytest.raises(MisconfigurationError, match="precision"):
        Accelerator(precision="fp8-ish")
    with pytest.raises(MisconfigurationError, match="log_with.*tensorboard"):
        Accelerator(log_with="mlflow-ish")
    with pytest.raises(MisconfigurationError, match="state_dict"):
        Accelerator().register_for_checkpointing(object())
    with pytest.raises(MisconfigurationError, match="max_shard_size"):
        Accelerator().save_model(nn.Linear(1, 1), "unused", max_shard_size="lots")


def test_free_memory():
    acc = Accelerator()
    net = nn.Linear(2, 2)
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert acc.free_memory(net, opt) == [None, None]
    assert acc._models == [] and acc._optimizers == []


@pytest.mark.parametrize("shuffle", [False, True])
def test_prepared_dataloader_leaves_global_rng_where_a_plain_loader_does(shuffle):
    """A plain DataLoader draws its workers' base seed (and RandomSampler its seed) from
    the global RNG at each pass; the prepared one keeps its (seed, epoch) order but draws
    as many, so dropout / torch.rand in the loop see the raw loop's stream."""
    from ember import Accelerator
    ds = TensorDataset(torch.arange(12.0))

    def draws(loader):
        return [torch.rand(1).item() for _ in range(2) for _ in loader]
    torch.manual_seed(0)
    raw = draws(DataLoader(ds, batch_size=4, shuffle=shuffle))
    torch.manual_seed(0)
    acc = Accelerator(devices="cpu")
    ours = draws(acc.prepare(DataLoader(ds, batch_size=4, shuffle=shuffle)))
    assert ours == raw
    if not shuffle:   # the figures of the report: 0.0885, 0.1320, ...
        assert [round(v, 4) for v in raw[:2]] == [0.0885, 0.132]
    torch.manual_seed(0)   # a loader with its own generator draws nothing from the global RNG
    g = torch.Generator().manual_seed(5)
    raw = draws(DataLoader(ds, batch_size=4, shuffle=shuffle, generator=g))
    torch.manual_seed(0)
    assert draws(acc.prepare(DataLoader(ds, batch_size=4, shuffle=shuffle, generator=g))) == raw
