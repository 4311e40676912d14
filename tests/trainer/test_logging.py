"""``self.log`` semantics: epoch reductions weighted by batch size, reduce_fx,
step/epoch naming, torchmetrics objects, log_dict, and when values reach loggers."""
from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ember.callbacks import Callback
from ember.errors import MisconfigurationError
from conftest import LinearModule, regression_data
from helpers import CaptureLogger


def values_data(n=100, batch_size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(n, generator=g) * 10
    return DataLoader(TensorDataset(v), batch_size=batch_size), v


class StatModule(LinearModule):
    """Validation logs a per-batch statistic of the values (the default is mean)."""

    def __init__(self, **log_kw):
        super().__init__()
        self.log_kw = log_kw

    def validation_step(self, batch, batch_idx):
        (v,) = batch
        fx = self.log_kw.get("reduce_fx", "mean")
        fx = {torch.max: "max"}.get(fx, fx)
        stat = {"mean": v.mean(), "sum": v.sum(), "max": v.max(), "min": v.min()}[fx]
        self.log("stat", stat, **self.log_kw)


# ----------------------------------------------------------------------------- epoch reductions
def test_epoch_mean_is_dataset_weighted_with_uneven_last_batch(make_trainer):
    loader, v = values_data(100, 32)          # batches of 32, 32, 32, 4
    out = make_trainer().validate(StatModule(), loader)
    exact = v.double().mean().item()
    naive = torch.stack([b[0].mean() for b in loader]).mean().item()
    assert abs(naive - exact) > 1e-3            # the unweighted mean of batch means would be wrong
    assert out[0]["stat"] == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("fx", ["sum", "max", "min"])
def test_reduce_fx(make_trainer, fx):
    loader, v = values_data(100, 32)
    out = make_trainer().validate(StatModule(reduce_fx=fx), loader)
    exact = {"sum": v.double().sum(), "max": v.max(), "min": v.min()}[fx].item()
    assert out[0]["stat"] == pytest.approx(exact, rel=1e-6)


def test_reduce_fx_torch_functions_accepted(make_trainer):
    loader, v = values_data(64, 16)
    out = make_trainer().validate(StatModule(reduce_fx=torch.max), loader)
    assert out[0]["stat"] == pytest.approx(v.max().item())


def test_explicit_batch_size_weights_the_mean(make_trainer):
    class Weighted(LinearModule):
        def validation_step(self, batch, batch_idx):
            # the batch is a dict whose first entry is not per-sample: infer nothing, say it
            self.log("w", float(batch_idx), batch_size=batch_idx + 1)

    loader = DataLoader([{"meta": torch.zeros(3), "x": torch.ones(2)}] * 5, batch_size=1)
    out = make_trainer().validate(Weighted(), loader)
    exact = sum(i * (i + 1) for i in range(5)) / sum(i + 1 for i in range(5))
    assert out[0]["w"] == pytest.approx(exact)


def test_train_epoch_value_and_step_epoch_naming(make_trainer):
    class Both(LinearModule):
        def training_step(self, batch, batch_idx):
            (v,) = batch
            self.log("v", v.mean(), on_step=True, on_epoch=True, prog_bar=True)
            self.log("only_epoch", v.max(), on_step=False, on_epoch=True, reduce_fx="max")
            return self.net.weight.sum() * 0 + v.mean()

    loader, v = values_data(100, 32)
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1)
    trainer.fit(Both(), loader)
    lm, cm = trainer.logged_metrics, trainer.callback_metrics
    last_batch = v[96:]
    assert lm["v_step"] == pytest.approx(last_batch.mean().item(), rel=1e-6)
    assert lm["v_epoch"] == pytest.approx(v.double().mean().item(), rel=1e-6)
    assert "v" not in lm
    assert cm["v"].item() == pytest.approx(v.double().mean().item(), rel=1e-6)
    assert cm["v_epoch"].item() == pytest.approx(v.double().mean().item(), rel=1e-6)
    assert cm["v_step"].item() == pytest.approx(last_batch.mean().item(), rel=1e-6)
    assert lm["only_epoch"] == pytest.approx(v.max().item())
    assert "only_epoch_step" not in lm and "only_epoch_epoch" not in lm
    # the bar shows the latest step value and the logged epoch value, as named in the logs
    assert trainer.progress_bar_metrics == {"v_step": pytest.approx(last_batch.mean().item(), rel=1e-6),
                                            "v_epoch": cm["v_epoch"].item()}


def test_log_dict(make_trainer):
    class Dict(LinearModule):
        def validation_step(self, batch, batch_idx):
            (v,) = batch
            self.log_dict({"a": v.mean(), "b": v.max()}, reduce_fx="max")

    loader, v = values_data(40, 16)
    out = make_trainer().validate(Dict(), loader)
    batch_means = [b[0].mean().item() for b in loader]
    assert out[0] == {"a": pytest.approx(max(batch_means)), "b": pytest.approx(v.max().item())}


def test_logging_outside_a_loop_is_a_no_op():
    module = LinearModule()
    module.log("x", 1.0)          # no trainer attached: nothing to record, no error


def test_bad_log_arguments_are_named(make_trainer):
    class Bad(LinearModule):
        def __init__(self, kind):
            super().__init__()
            self.kind = kind

        def validation_step(self, batch, batch_idx):
            if self.kind == "shape":
                self.log("vec", torch.ones(3))
            elif self.kind == "fx":
                self.log("m", 1.0, reduce_fx="median")
            else:
                self.log("s", "text")

    loader, _ = values_data(8, 8)
    with pytest.raises(MisconfigurationError, match=r"'vec'.*scalar.*\(3,\)"):
        make_trainer().validate(Bad("shape"), loader)
    with pytest.raises(MisconfigurationError, match=r"reduce_fx.*'median'.*'mean', 'sum', 'max', 'min'"):
        make_trainer().validate(Bad("fx"), loader)
    with pytest.raises(MisconfigurationError, match=r"'s'.*str"):
        make_trainer().validate(Bad("value"), loader)


# ----------------------------------------------------------------------------- torchmetrics
class Classifier(LinearModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="macro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="macro")
        self.batch_values = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.batch_values.append((len(y), self.val_acc(logits, y).item()))
        self.log("val/acc", self.val_acc)


def classification_data(n=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def test_torchmetrics_epoch_value_equals_whole_set(make_trainer):
    x, y = classification_data(100)
    torch.manual_seed(0)   # the weights (the gap asserted below is a property of them, not of test order)
    module = Classifier()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1)
    out = trainer.validate(module, DataLoader(TensorDataset(x, y), batch_size=32))
    with torch.no_grad():
        whole = torchmetrics.functional.classification.multiclass_accuracy(
            module(x), y, num_classes=3, average="macro").item()
    assert out[0]["val/acc"] == pytest.approx(whole, rel=1e-6)
    # macro accuracy does not decompose over batches: a weighted mean of batch values differs
    weighted = sum(n * a for n, a in module.batch_values) / sum(n for n, _ in module.batch_values)
    assert abs(weighted - whole) > 1e-4


def test_torchmetrics_in_training_step_and_epoch(make_trainer):
    x, y = classification_data(64, seed=1)
    module = Classifier()
    logger = CaptureLogger()
    frozen = []

    class Snapshot(Callback):
        def on_train_batch_start(self, trainer, m, batch, batch_idx):
            with torch.no_grad():
                frozen.append((m(batch[0]).clone(), batch[1].clone()))

    trainer = make_trainer(max_epochs=1, log_every_n_steps=1, logger=logger, callbacks=[Snapshot()])
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    step_vals = [c[1]["train/acc_step"] for c in logger.calls if "train/acc_step" in c[1]]
    per_batch = [torchmetrics.functional.classification.multiclass_accuracy(lg, t, num_classes=3, average="macro").item()
                 for lg, t in frozen]
    assert step_vals == pytest.approx(per_batch, rel=1e-6)
    all_logits = torch.cat([f[0] for f in frozen])
    epoch = torchmetrics.functional.classification.multiclass_accuracy(all_logits, y, num_classes=3, average="macro")
    assert trainer.logged_metrics["train/acc_epoch"] == pytest.approx(epoch.item(), rel=1e-6)


# ----------------------------------------------------------------------------- emission points
class StepLoss(LinearModule):
    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.detach().clone())
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss


def test_values_reach_loggers_only_at_log_points(make_trainer, data):
    logger = CaptureLogger()
    seen = []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append((trainer.global_step, dict(trainer.logged_metrics)))

    module = StepLoss()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=3, logger=logger, callbacks=[Watch()])
    trainer.fit(module, data(n=80, batch_size=8), data(n=16, batch_size=8))   # 10 steps
    steps = [s for s, _ in logger.calls]
    assert steps == [3, 6, 9, 10, 10]         # step values; then train epoch values and validation at the end
    for step, metrics in logger.calls[:3]:
        assert set(metrics) == {"loss_step", "epoch"}
        assert type(metrics["loss_step"]) is float
        assert metrics["loss_step"] == pytest.approx(module.losses[step - 1].item())
        assert metrics["epoch"] == 0.0
    assert set(logger.calls[3][1]) == {"loss_epoch", "epoch"}
    assert logger.calls[3][1]["loss_epoch"] == pytest.approx(torch.stack(module.losses).mean().item(), rel=1e-5)
    assert set(logger.calls[4][1]) == {"val/loss", "epoch"}
    # between log points the trainer's logged values do not move
    for step, logged in seen:
        last_log_point = (step // 3) * 3
        if last_log_point:
            assert logged["loss_step"] == pytest.approx(module.losses[last_log_point - 1].item())
        else:
            assert "loss_step" not in logged
    assert logger.status == "success"


def test_log_points_count_optimizer_steps_under_accumulation(make_trainer, data):
    logger = CaptureLogger()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=2, accumulate_grad_batches=2, logger=logger)
    trainer.fit(StepLoss(), data(n=64, batch_size=8))         # 8 batches -> 4 optimizer steps
    assert [s for s, m in logger.calls if "loss_step" in m] == [2, 4]


def test_logger_false_and_logger_flag(make_trainer, data):
    class NoLogger(LinearModule):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("hidden", loss, logger=False, on_epoch=True)
            self.log("shown", loss, on_epoch=True)
            return loss

    logger = CaptureLogger()
    trainer = make_trainer(max_epochs=1, log_every_n_steps=1, logger=logger)
    trainer.fit(NoLogger(), data(n=16))
    sent = set().union(*(m for _, m in logger.calls))
    assert "shown_step" in sent and "shown_epoch" in sent
    assert not any(k.startswith("hidden") for k in sent)
    assert "hidden" in trainer.callback_metrics          # callbacks still see it


def test_hyperparameters_reach_the_logger(make_trainer, data):
    class H(LinearModule):
        def __init__(self, lr=0.05, width=3):
            super().__init__(lr=lr)
            self.save_hyperparameters()

    logger = CaptureLogger()
    make_trainer(max_epochs=1, logger=logger).fit(H(width=5), data(n=16))
    assert logger.hparams == [{"lr": 0.05, "width": 5}]


def test_metrics_logged_in_on_validation_epoch_end(make_trainer):
    class EpochEnd(LinearModule):
        def __init__(self):
            super().__init__()
            self.seen = []

        def validation_step(self, batch, batch_idx):
            self.seen.append(batch[0])

        def on_validation_epoch_end(self):
            self.log("val/total", torch.cat(self.seen).sum())
            self.seen.clear()

    loader, v = values_data(50, 16)
    out = make_trainer().validate(EpochEnd(), loader)
    assert out[0]["val/total"] == pytest.approx(v.sum().item(), rel=1e-6)


def test_metrics_logged_in_on_train_epoch_end(make_trainer, data):
    class EpochEnd(LinearModule):
        def __init__(self):
            super().__init__()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach())
            return loss

        def on_train_epoch_end(self):
            self.log("train/mean_of_epoch", torch.stack(self.losses).mean())
            self.losses.clear()

    logger = CaptureLogger()
    module = EpochEnd()
    trainer = make_trainer(max_epochs=2, log_every_n_steps=100, logger=logger)
    trainer.fit(module, data(n=32, batch_size=8))
    # logged as an epoch value (not a step value) and emitted at each epoch's end
    epoch_calls = [(s, m["train/mean_of_epoch"]) for s, m in logger.calls if "train/mean_of_epoch" in m]
    assert [s for s, _ in epoch_calls] == [4, 8]
    assert trainer.callback_metrics["train/mean_of_epoch"].item() == pytest.approx(epoch_calls[-1][1])
    assert "train/mean_of_epoch_step" not in trainer.logged_metrics


def test_torchmetrics_state_does_not_leak_from_the_sanity_check_or_other_stages(make_trainer):
    x, y = classification_data(100, seed=3)
    val_x, val_y = classification_data(60, seed=4)

    class Shared(Classifier):
        def test_step(self, batch, batch_idx):
            xb, yb = batch
            self.val_acc(self(xb), yb)             # the same Metric object as validation
            self.log("test/acc", self.val_acc)

    module = Shared()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=1, log_every_n_steps=1)
    val_loader = DataLoader(TensorDataset(val_x, val_y), batch_size=16)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=32), val_loader)

    def whole(inputs, targets):
        with torch.no_grad():
            return torchmetrics.functional.classification.multiclass_accuracy(
                module(inputs), targets, num_classes=3, average="macro").item()

    # the sanity check updated val_acc with one batch; the epoch value must not include it
    assert trainer.callback_metrics["val/acc"].item() == pytest.approx(whole(val_x, val_y), rel=1e-6)
    out = trainer.test(module, DataLoader(TensorDataset(x, y), batch_size=32))
    assert out[0]["test/acc"] == pytest.approx(whole(x, y), rel=1e-6)


@pytest.mark.parametrize("precision, dtype", [("16-true", torch.float16), ("bf16-true", torch.bfloat16)])
def test_epoch_means_of_low_precision_values_accumulate_in_fp32(make_trainer, precision, dtype):
    """200 validation batches of 32 logging 66.14 in fp16 summed to inf (fp16's max is
    65504), and bf16's 8-bit mantissa stalled the sum: the epoch mean must be the value."""
    class Const(LinearModule):
        def validation_step(self, batch, batch_idx):
            self.log("val/const", torch.tensor(66.14, dtype=dtype))

    loader = DataLoader(TensorDataset(torch.randn(6400, 4), torch.randn(6400, 1)), batch_size=32)
    out = make_trainer(precision=precision).validate(Const(), loader)
    assert out[0]["val/const"] == pytest.approx(float(torch.tensor(66.14, dtype=dtype)), rel=1e-6)


# ----------------------------------------------------------------------------- conflicting options
@pytest.mark.parametrize("opt, first, second", [("on_step", True, False), ("on_epoch", False, True),
                                                ("reduce_fx", "mean", "max"), ("sync_dist", False, True)])
def test_conflicting_log_options_in_one_epoch_are_an_error_naming_metric_and_option(make_trainer, opt, first, second):
    class Twice(LinearModule):
        def training_step(self, batch, batch_idx):
            self.log("twice", 1.0, **{opt: first if batch_idx == 0 else second})
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationError, match=rf"self.log\('twice', \.\.\., {opt}={second!r}\) conflicts with "
                                                    rf"an earlier .* with {opt}={first!r}"):
        make_trainer(max_epochs=1).fit(Twice(), DataLoader(regression_data(32), batch_size=8))


def test_same_options_resolved_and_a_new_run_with_other_options_are_accepted(make_trainer):
    class Same(LinearModule):   # explicit values equal to the training defaults: the same options
        def training_step(self, batch, batch_idx):
            kw = {"on_step": True, "on_epoch": False, "reduce_fx": torch.mean} if batch_idx % 2 else {}
            self.log("same", float(batch_idx), **kw)
            return super().training_step(batch, batch_idx)

    t = make_trainer(max_epochs=1, log_every_n_steps=1)
    t.fit(Same(), DataLoader(regression_data(32), batch_size=8))
    assert float(t.callback_metrics["same"]) == 3.0
    loader, v = values_data(100, 32)
    out = [t.validate(StatModule(reduce_fx=fx), loader)[0]["stat"] for fx in ("sum", "max")]   # one trainer
    assert out == [pytest.approx(v.double().sum().item(), rel=1e-6), pytest.approx(v.max().item())]
