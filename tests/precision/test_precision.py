"""Every precision trains on CPU; true precisions hold their dtype; 16-mixed
scales the loss and skips steps with inf gradients; gradient clipping."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from ember.callbacks import Callback
from ember.precision import PRECISIONS, Precision
from conftest import LinearModule, regression_data

TRUE_DTYPES = {"64-true": torch.float64, "32-true": torch.float32, "16-true": torch.float16,
               "bf16-true": torch.bfloat16}
AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def flat(module):
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


class PrecisionProbe(LinearModule):
    def __init__(self, lr=0.05):
        super().__init__(lr=lr)
        self.seen = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.seen.add((x.dtype, out.dtype, torch.is_autocast_enabled("cpu")))
        loss = torch.nn.functional.mse_loss(out.float(), y.float())
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss


class EpochLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_epoch_end(self, trainer, module):
        self.losses.append(trainer.callback_metrics["loss"].item())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_trains_on_cpu(make_trainer, precision):
    torch.manual_seed(0)
    module, losses = PrecisionProbe(), EpochLosses()
    trainer = make_trainer(max_epochs=4, precision=precision, callbacks=[losses])
    assert trainer.precision == precision
    trainer.fit(module, DataLoader(regression_data(64), batch_size=8))
    assert len(losses.losses) == 4
    assert losses.losses[-1] < 0.5 * losses.losses[0], losses.losses
    if precision in TRUE_DTYPES:
        dtype = TRUE_DTYPES[precision]
        assert {p.dtype for p in module.parameters()} == {dtype}
        assert module.seen == {(dtype, dtype, False)}          # inputs cast to the same dtype, no autocast
    else:
        assert {p.dtype for p in module.parameters()} == {torch.float32}   # fp32 master weights
        assert module.seen == {(torch.float32, AUTOCAST[precision], True)}
    if precision == "16-mixed":
        assert isinstance(trainer.strategy.precision.scaler, torch.amp.GradScaler)
    else:
        assert trainer.strategy.precision.scaler is None


def test_precision_aliases_and_instances():
    assert Precision.from_string(16).name == "16-mixed"
    assert Precision.from_string("bf16").name == "bf16-mixed"
    assert Precision.from_string("32").name == "32-true"
    p = Precision.from_string("bf16-true")
    assert Precision.from_string(p) is p and p.param_dtype is torch.bfloat16


def test_trainer_precision_defaults_to_the_launcher_environment(make_trainer, data, monkeypatch):
    """`ember launch --mixed-precision bf16` exports EMBER_PRECISION; a Trainer left at its
    default precision honours it, an explicit argument wins over it."""
    monkeypatch.setenv("EMBER_PRECISION", "bf16-mixed")
    module = PrecisionProbe()
    trainer = make_trainer(max_steps=2)
    assert trainer.precision == "bf16-mixed"
    trainer.fit(module, data())
    assert module.seen == {(torch.float32, torch.bfloat16, True)}
    assert make_trainer(precision="32-true").precision == "32-true"
    monkeypatch.delenv("EMBER_PRECISION")
    assert make_trainer().precision == "32-true"


def test_true_precision_builds_configure_model_layers_in_its_dtype(make_trainer, data):
    class Late(LinearModule):
        def __init__(self):
            super().__init__()
            del self.net

        def configure_model(self):
            self.net = torch.nn.Linear(4, 1)
            self.built_dtype = self.net.weight.dtype

    module = Late()
    make_trainer(max_epochs=1, precision="64-true").fit(module, data(n=16))
    assert module.built_dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32      # restored after configure_model


def mixed16(init_scale: float = 256.0) -> Precision:
    """16-mixed with a smaller initial loss scale than GradScaler's 65536 (which
    overflows fp16 on the first steps of this tiny problem, so those steps are
    skipped as designed)."""
    p = Precision.from_string("16-mixed")
    p.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return p


class StepRecorder(Callback):
    """Parameters and loss scale after every training batch."""

    def __init__(self):
        self.params, self.scales = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.params.append(flat(module))
        self.scales.append(trainer.strategy.precision.scaler.get_scale())


def test_16_mixed_skips_steps_with_inf_gradients(make_trainer, data):
    class InfAtOne(LinearModule):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            return loss * float("inf") if batch_idx == 1 else loss

    module, rec = InfAtOne(), StepRecorder()
    start = flat(module)
    precision = mixed16()
    trainer = make_trainer(max_epochs=1, precision=precision, callbacks=[rec])
    trainer.fit(module, data(n=32, batch_size=8))
    assert trainer.strategy.precision is precision
    assert rec.scales[0] == 256.0
    assert not torch.equal(rec.params[0], start)              # a normal step moved the weights
    assert torch.equal(rec.params[1], rec.params[0])          # the inf step was skipped
    assert not torch.equal(rec.params[2], rec.params[1])      # training goes on
    assert rec.scales[1] == rec.scales[0] * 0.5               # and the scale was lowered
    assert torch.isfinite(rec.params[-1]).all()


def test_16_mixed_scaler_state_is_checkpointed(make_trainer, data):
    trainer = make_trainer(max_epochs=1, precision="16-mixed")
    trainer.fit(LinearModule(), data(n=16))
    state = trainer.strategy.precision.state_dict()
    assert state["scaler"]["scale"] == trainer.strategy.precision.scaler.get_scale()


class ClipProbe(Callback):
    """Raw gradients seen by on_before_optimizer_step, the true gradients (recomputed
    in fp32 on a copy), and the applied update (with SGD lr=1 the update is exactly
    the clipped gradient)."""

    def __init__(self):
        self.raw, self.true, self.updates = [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._batch = batch

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._before = flat(module)
        self.raw.append(torch.cat([p.grad.reshape(-1).double() for p in module.parameters()]))
        ref = copy.deepcopy(module.net).float()
        x, y = self._batch
        (torch.nn.functional.mse_loss(ref(x.float()), y.float()) * 100.0).backward()
        self.true.append(torch.cat([p.grad.reshape(-1).double() for p in ref.parameters()]))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.updates.append(self._before - flat(module))


class BigGrad(LinearModule):
    def __init__(self):
        super().__init__(lr=1.0)

    def training_step(self, batch, batch_idx):
        return self.loss(batch) * 100.0


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "64-true"])
def test_gradient_clip_norm(make_trainer, data, precision):
    probe = ClipProbe()
    trainer = make_trainer(max_steps=3, gradient_clip_val=0.5, callbacks=[probe],
                           precision=mixed16(4.0) if precision == "16-mixed" else precision)
    trainer.fit(BigGrad(), data(n=32, batch_size=8))
    assert len(probe.updates) == 3
    for raw, true, update in zip(probe.raw, probe.true, probe.updates):
        # the hook sees the true gradients (under 16-mixed: already unscaled)
        assert (raw - true).norm() < 0.02 * true.norm()
        assert raw.norm() > 0.5
        torch.testing.assert_close(update.norm().item(), 0.5, rtol=1e-4, atol=0)
        torch.testing.assert_close(update, raw * (0.5 / raw.norm()), rtol=1e-4, atol=1e-6)


def test_gradient_clip_value(make_trainer, data):
    probe = ClipProbe()
    trainer = make_trainer(max_steps=2, gradient_clip_val=0.25, gradient_clip_algorithm="value", callbacks=[probe])
    trainer.fit(BigGrad(), data(n=32, batch_size=8))
    for raw, update in zip(probe.raw, probe.updates):
        torch.testing.assert_close(update, raw.clamp(-0.25, 0.25), rtol=1e-6, atol=1e-7)
        assert update.abs().max().item() == pytest.approx(0.25)


def test_no_clipping_by_default(make_trainer, data):
    probe = ClipProbe()
    make_trainer(max_steps=2, callbacks=[probe]).fit(BigGrad(), data(n=32, batch_size=8))
    for raw, update in zip(probe.raw, probe.updates):
        torch.testing.assert_close(update, raw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_gradient_clipping_covers_every_optimizer(make_trainer, data, precision):
    class TwoOpts(BigGrad):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.head = torch.nn.Linear(1, 1)

        def forward(self, x):
            return self.head(self.net(x))

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net.parameters(), lr=1.0), torch.optim.SGD(self.head.parameters(), lr=1.0)]

    updates = []

    class PerOptimizer(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self._before = [flat(module.net), flat(module.head)]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            updates.append([(b - flat(m)).norm().item() for b, m in zip(self._before, (module.net, module.head))])

    trainer = make_trainer(max_steps=2, gradient_clip_val=0.5, callbacks=[PerOptimizer()],
                           precision=mixed16(4.0) if precision == "16-mixed" else precision)
    trainer.fit(TwoOpts(), data(n=32, batch_size=8))
    assert len(trainer.optimizers) == 2 and len(updates) == 2
    for net_update, head_update in updates:          # each optimizer's gradients clipped to norm 0.5
        assert net_update == pytest.approx(0.5, rel=1e-4)
        assert head_update == pytest.approx(0.5, rel=1e-4)


def test_16_mixed_with_several_optimizers_unscales_each_once(make_trainer, data):
    """One loss, two optimizers: both unscaled with the same scale, one scaler update per step."""
    class TwoOpts(LinearModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

        def forward(self, x):
            return self.head(self.net(x))

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]

    torch.manual_seed(0)
    mixed, full = TwoOpts(), None
    full = copy.deepcopy(mixed)
    make_trainer(max_steps=3, precision=mixed16(64.0)).fit(mixed, data(n=32, batch_size=8))
    make_trainer(max_steps=3).fit(full, data(n=32, batch_size=8))
    # fp16 autocast changes the numbers a little, a wrong unscale by a factor of 64 a lot
    assert (flat(mixed.head) - flat(full.head)).norm() < 0.02 * flat(full.head).norm()
    assert (flat(mixed.net) - flat(full.net)).norm() < 0.02 * flat(full.net).norm()


def test_batch_walks_keep_namedtuples_mappings_model_outputs_and_to_objects():
    """Moving, casting and the float32 cast of outputs walk the same containers (torch's pytree)."""
    from collections import OrderedDict, namedtuple
    from torch.utils._pytree import tree_leaves
    from transformers.modeling_outputs import BaseModelOutput
    from ember.big_modeling import send_to_device
    from ember.precision import _cast_floats
    from ember.precision.forward import _to_float32
    from ember.strategies.base import move_to_device

    Pair = namedtuple("Pair", "x n")

    class Encoding:   # transformers' BatchEncoding: not a container, moves itself
        def to(self, device):
            self.device = device
            return self

    def batch():
        return {"a": [torch.zeros(2, dtype=torch.bfloat16), (torch.arange(3), "text")], "p": Pair(torch.zeros(1), 3),
                "o": OrderedDict(t=torch.zeros(1)), "m": BaseModelOutput(last_hidden_state=torch.zeros(1, 2)),
                "e": Encoding()}

    def check(out, ok):
        assert isinstance(out["p"], Pair) and out["p"].n == 3 and out["a"][1][1] == "text"
        assert type(out["o"]) is OrderedDict and type(out["m"]) is BaseModelOutput
        assert all(ok(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    meta = torch.device("meta")
    moved = move_to_device(batch(), meta)
    check(moved, lambda t: t.is_meta)
    assert moved["e"].device == meta
    check(send_to_device(batch(), meta), lambda t: t.is_meta)
    check(_cast_floats(batch(), torch.float16), lambda t: t.dtype in (torch.float16, torch.long))
    check(_to_float32(batch(), torch.bfloat16), lambda t: t.dtype in (torch.float32, torch.long))


def test_flat_batches_move_without_the_tree_walk():
    """A tensor and flat tuples, lists and dicts of tensors (the usual batches) move on a
    short path of their own, keeping their type; anything else takes the tree walk."""
    import cProfile
    import pstats
    from ember.strategies.base import move_to_device

    meta = torch.device("meta")
    for batch in (torch.zeros(2), (torch.zeros(2), torch.arange(3)), [torch.zeros(1)],
                  {"input_ids": torch.arange(4), "labels": torch.zeros(1)}):
        out = move_to_device(batch, meta)
        assert type(out) is type(batch)
        leaves = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
        assert all(t.is_meta for t in leaves)
    mixed = move_to_device({"ids": torch.arange(2), "n": 3}, meta)
    assert mixed["ids"].is_meta and mixed["n"] == 3
    prof = cProfile.Profile()
    prof.enable()
    move_to_device((torch.zeros(2), torch.arange(3)), meta)
    prof.disable()
    assert pstats.Stats(prof).total_calls <= 8      # the tree walk takes about 90
