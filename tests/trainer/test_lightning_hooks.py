"""Lightning's module hooks (issue 15): each is called in Lightning's order with the
values Lightning passes, and the step overrides give the same numbers as a plain
PyTorch loop doing the same thing."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ember.callbacks import Callback
from ember.errors import MisconfigurationError
from conftest import LinearModule

ORDERED = ("prepare_data", "setup", "teardown", "configure_callbacks", "on_fit_start", "on_fit_end",
           "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
           "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
           "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step", "on_before_zero_grad",
           "optimizer_zero_grad", "on_validation_model_eval", "on_validation_model_train",
           "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
           "on_validation_batch_start", "on_validation_batch_end", "on_test_model_eval", "on_test_start",
           "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end",
           "on_predict_model_eval", "on_predict_start", "on_predict_end", "on_predict_epoch_start",
           "on_predict_epoch_end", "on_predict_batch_start", "on_predict_batch_end",
           "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class Recording(LinearModule):
    """Records every hook (name only) and then runs the default behaviour."""

    def __init__(self):
        super().__init__()
        self.calls = []


def _recorder(name):
    base = getattr(LinearModule, name)

    def hook(self, *args, **kwargs):
        self.calls.append(name)
        return base(self, *args, **kwargs)
    return hook


for _n in ORDERED:
    setattr(Recording, _n, _recorder(_n))

TRANSFER = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"]


def test_module_hook_order_fit_test_predict(make_trainer, data):
    m = Recording()
    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, gradient_clip_val=1.0)
    trainer.fit(m, data(n=16, batch_size=8), data(n=8, batch_size=8))
    batch = [*TRANSFER, "on_train_batch_start", "on_before_backward", "on_after_backward",
             "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step",
             "on_before_zero_grad", "optimizer_zero_grad", "on_train_batch_end"]
    assert m.calls == [
        "configure_callbacks", "prepare_data", "setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
        *batch, *batch,
        "on_validation_model_eval", "on_validation_start", "on_validation_epoch_start",
        *TRANSFER, "on_validation_batch_start", "on_validation_batch_end",
        "on_validation_epoch_end", "on_validation_end", "on_validation_model_train",
        "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown"]
    m.calls.clear()
    trainer.test(m, data(n=8, batch_size=8), verbose=False)
    assert m.calls == ["configure_callbacks", "prepare_data", "setup", "on_test_model_eval", "on_test_start",
                       "on_test_epoch_start", *TRANSFER, "on_test_batch_start", "on_test_batch_end",
                       "on_test_epoch_end", "on_test_end", "teardown"]
    m.calls.clear()
    trainer.predict(m, data(n=8, batch_size=8))
    assert m.calls == ["configure_callbacks", "prepare_data", "setup", "on_predict_model_eval", "on_predict_start",
                       "on_predict_epoch_start", *TRANSFER, "on_predict_batch_start", "on_predict_batch_end",
                       "on_predict_epoch_end", "on_predict_end", "teardown"]


def test_hook_arguments_match_lightning(make_trainer, data):
    seen = {}

    class Args(LinearModule):
        def on_before_backward(self, loss):
            seen.setdefault("before_backward", []).append(float(loss.detach()))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.setdefault("outputs", []).append(outputs)

        def on_before_zero_grad(self, optimizer):
            seen.setdefault("zero", []).append(optimizer.optimizer is self.trainer.optimizers[0])

        def on_validation_batch_start(self, batch, batch_idx, dataloader_idx=0):
            seen.setdefault("val", []).append((batch_idx, dataloader_idx))

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            seen.setdefault("loss", []).append(float(loss.detach()))
            return loss

    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0, accumulate_grad_batches=2)
    trainer.fit(Args(), data(n=32, batch_size=8), [data(n=8, batch_size=8), data(n=16, batch_size=8)])
    # the loss that is back-propagated: divided by the accumulation window, as Lightning
    assert seen["before_backward"] == pytest.approx([v / 2 for v in seen["loss"]])
    assert [set(o) for o in seen["outputs"]] == [{"loss"}] * 4
    assert [float(o["loss"].detach()) for o in seen["outputs"]] == pytest.approx(seen["loss"])
    assert seen["zero"] == [True, True]   # once per optimizer step (2 windows of 2)
    assert seen["val"] == [(0, 0), (0, 1), (1, 1)]


def _plain_loop(data, steps_fn, epochs=1, lr=0.1):
    """Reference: the same model trained by hand; ``steps_fn(step, model, opt)`` runs one
    optimizer step after backward."""
    torch.manual_seed(0)
    model = LinearModule(lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    step = 0
    for _ in range(epochs):
        for batch in data:
            model.loss(batch).backward()
            steps_fn(step, model, opt)
            step += 1
    return model


def test_optimizer_step_override_warmup_matches_plain_loop(make_trainer, data):
    closure_values = []

    class Warmup(LinearModule):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            for g in optimizer.param_groups:
                g["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)
            closure_values.append(optimizer_closure())
            optimizer.step(closure=optimizer_closure)

    torch.manual_seed(0)
    m = Warmup()
    make_trainer(max_epochs=2, num_sanity_val_steps=0).fit(m, data(n=48, batch_size=8))

    def warm(step, model, opt):
        for g in opt.param_groups:
            g["lr"] = 0.1 * min(1.0, (step + 1) / 4)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = _plain_loop(data(n=48, batch_size=8), warm, epochs=2)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert len(closure_values) == 12 and all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in closure_values)


def test_optimizer_zero_grad_and_clipping_overrides_match_plain_loop(make_trainer, data):
    class Custom(LinearModule):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            if batch_idx % 2 == 1:   # gradients are kept over two steps
                optimizer.zero_grad()

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            assert (gradient_clip_val, gradient_clip_algorithm) == (0.5, "norm")
            self.clip_gradients(optimizer, 0.05, "value")

    torch.manual_seed(0)
    m = Custom()
    make_trainer(max_epochs=1, num_sanity_val_steps=0, gradient_clip_val=0.5).fit(m, data(n=48, batch_size=8))

    def custom(step, model, opt):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        opt.step()
        if step % 2 == 1:
            opt.zero_grad(set_to_none=True)
    ref = _plain_loop(data(n=48, batch_size=8), custom)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    untouched = _plain_loop(data(n=48, batch_size=8), lambda s, mod, o: (o.step(), o.zero_grad()))
    assert not torch.allclose(m.net.weight, untouched.net.weight)


def test_lr_scheduler_step_override_gets_scheduler_and_metric(make_trainer, data):
    calls = []

    class Sched(LinearModule):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
            step = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return [opt], [{"scheduler": plateau, "monitor": "val/loss"}, {"scheduler": step, "interval": "step"}]

        def lr_scheduler_step(self, scheduler, metric=None):
            calls.append((type(scheduler).__name__, metric))
            super().lr_scheduler_step(scheduler, metric)

    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Sched(), data(n=16, batch_size=8), data(n=8, batch_size=8))
    assert [c[0] for c in calls] == ["StepLR", "StepLR", "ReduceLROnPlateau"]
    assert calls[0][1] is None and calls[2][1] == pytest.approx(float(trainer.callback_metrics["val/loss"]))


def test_setup_builds_layers_teardown_prepare_data(make_trainer, data):
    class Late(LinearModule):
        prepared = 0

        def __init__(self):
            super().__init__()
            self.stages = []
            del self.net

        def prepare_data(self):
            Late.prepared += 1

        def setup(self, stage):
            self.stages.append(("setup", stage))
            if not hasattr(self, "net"):
                self.net = nn.Linear(4, 1)   # built here: the optimizers see it

        def teardown(self, stage):
            self.stages.append(("teardown", stage))

    m = Late()
    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(m, data(n=16, batch_size=8))
    assert m.stages == [("setup", "fit"), ("teardown", "fit")] and Late.prepared == 1
    assert trainer.global_step == 4 and m.net.weight.grad is None   # trained, gradients zeroed


def test_configure_callbacks_replaces_same_type(make_trainer, data):
    class Counter(Callback):
        def __init__(self):
            self.epochs = 0

        def on_train_epoch_end(self, trainer, module):
            self.epochs += 1

    mine, theirs = Counter(), Counter()

    class WithCallbacks(LinearModule):
        def configure_callbacks(self):
            return mine

    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=0, callbacks=[theirs])
    trainer.fit(WithCallbacks(), data(n=16))
    assert (mine.epochs, theirs.epochs) == (2, 0) and mine in trainer.callbacks and theirs not in trainer.callbacks


def test_batch_transfer_hooks_change_the_batch(make_trainer, data):
    seen = []

    class Transfer(LinearModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return [batch[0] * 0, batch[1]]

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            seen.append((str(device), dataloader_idx))
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            return [batch[0] + 1, batch[1]]

        def training_step(self, batch, batch_idx):
            assert torch.equal(batch[0], torch.ones_like(batch[0]))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            assert torch.equal(batch[0], torch.ones_like(batch[0]))

    make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(Transfer(), data(n=16), [data(n=8), data(n=8)])
    assert seen == [("cpu", 0), ("cpu", 0), ("cpu", 0), ("cpu", 1)]


def test_callback_backward_and_zero_grad_hooks_see_gradients(make_trainer, data):
    log = []

    class Grads(Callback):
        def on_before_backward(self, trainer, module, loss):
            log.append(("before", module.net.weight.grad is None))

        def on_after_backward(self, trainer, module):
            log.append(("after", module.net.weight.grad is None))

        def on_before_zero_grad(self, trainer, module, optimizer):
            log.append(("zero", module.net.weight.grad is None))

    make_trainer(max_epochs=1, num_sanity_val_steps=0, accumulate_grad_batches=2,
                 callbacks=[Grads()]).fit(LinearModule(), data(n=16))
    assert log == [("before", True), ("after", False), ("before", False), ("after", False), ("zero", False)]


def test_manual_backward_calls_backward_hooks(make_trainer, data):
    log = []

    class Manual(LinearModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self.loss(batch)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

        def on_before_backward(self, loss):
            log.append("before")

        def on_after_backward(self):
            log.append("after")

    make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(Manual(), data(n=16))
    assert log == ["before", "after"] * 2


def test_short_step_signatures(make_trainer, data):
    class Short(LinearModule):
        def training_step(self, batch):
            return self.loss(batch)

        def validation_step(self, batch):
            self.log("val/loss", self.loss(batch))

        def predict_step(self, batch):
            return self(batch[0])

    trainer = make_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(Short(), data(n=16), data(n=8))
    assert trainer.global_step == 2 and "val/loss" in trainer.callback_metrics
    assert [p.shape for p in trainer.predict(dataloaders=data(n=16))] == [torch.Size([8, 1])] * 2


def test_step_signature_is_read_under_functools_wraps_layers():
    """The short form is recognised through wrappers: FSDP's register_fsdp_forward_method
    re-binds a functools.wraps wrapper of the bound method (its own signature loses ``batch``
    as if it were ``self``), and a decorator in the class wraps the plain function."""
    import functools
    import types

    from ember.trainer.loops import takes_batch_idx

    def deco(f):
        @functools.wraps(f)
        def inner(*args, **kwargs):
            return f(*args, **kwargs)
        return inner

    class M(LinearModule):
        @deco
        def short_step(self, batch):
            return batch

        @deco
        def long_step(self, batch, batch_idx):
            return batch

    for name, full in (("training_step", True), ("short_step", False), ("long_step", True)):
        m = M()
        orig = getattr(m, name)

        @functools.wraps(orig)   # the shape of torch.distributed.fsdp.register_fsdp_forward_method
        def wrapped(self, *args, **kwargs):
            return orig(*args, **kwargs)
        setattr(m, name, types.MethodType(wrapped, m))
        assert takes_batch_idx(orig) is full, name
        assert takes_batch_idx(getattr(m, name)) is full, name


def test_unsupported_lightning_hook_is_named_at_fit(make_trainer, data):
    class Backward(LinearModule):
        def backward(self, loss, *args, **kwargs):
            loss.backward()

    with pytest.warns(UserWarning, match=r"Backward\.backward\(\) is never called.*on_before_backward"):
        make_trainer(max_epochs=1, num_sanity_val_steps=0).fit(Backward(), data(n=8))


def test_eval_runs_under_inference_mode_unless_disabled(make_trainer, data):
    modes = []

    class Mode(LinearModule):
        def validation_step(self, batch, batch_idx):
            modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled(), self.training))

        def on_validation_model_eval(self):   # keep dropout-style train mode on, as Lightning allows
            pass

    for flag in (True, False):
        make_trainer(max_epochs=1, num_sanity_val_steps=0, inference_mode=flag).fit(Mode(), data(n=8), data(n=8))
    assert modes == [(True, False, True), (False, False, True)]
    with pytest.raises(MisconfigurationError, match="inference_mode"):
        make_trainer(inference_mode="yes")


def test_datamodule_save_hyperparameters():
    from ember import DataModule

    class DM(DataModule):
        def __init__(self, batch_size=32, root="data", net=None):
            super().__init__()
            self.save_hyperparameters(ignore="root")

    dm = DM(batch_size=16, net=nn.Linear(1, 1))
    assert dm.hparams == {"batch_size": 16} and dm.hparams.batch_size == 16
    dm.hparams.batch_size = 8
    assert dm.hparams_initial.batch_size == 16


def test_step_metric_reaches_callback_metrics_every_batch(make_trainer, data, tmp_path):
    seen = []

    class Read(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            v = trainer.callback_metrics["train/loss"]
            seen.append((float(v), float(outputs["loss"].detach())))

    ck = ModelCheckpointFor(tmp_path)
    t = make_trainer(max_epochs=2, num_sanity_val_steps=0, log_every_n_steps=50, callbacks=[Read(), ck],
                     enable_checkpointing=True)
    t.fit(LinearModule(), data(n=24))
    assert len(seen) == 6 and all(a == b for a, b in seen)   # the latest step value, at every batch
    assert ck.best_model_score is not None and sorted(p.name for p in tmp_path.iterdir()) != []
    t.test(LinearModule(), data(n=8), verbose=False)
    assert set(t.callback_metrics) == {"test/loss"}   # after test: its own metrics only, as Lightning


def ModelCheckpointFor(path):
    from ember.callbacks import ModelCheckpoint
    return ModelCheckpoint(dirpath=path, monitor="train/loss", save_top_k=1)


def test_missing_metric_message_says_logged_but_no_value_yet(make_trainer, data, tmp_path):
    from ember.callbacks import ModelCheckpoint

    class EpochOnly(LinearModule):
        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("train/epoch_loss", loss, on_step=False, on_epoch=True)
            return loss

    t = make_trainer(max_epochs=1, num_sanity_val_steps=0, enable_checkpointing=True,
                     callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="train/epoch_loss", every_n_train_steps=1)])
    with pytest.warns(UserWarning, match=r"'train/epoch_loss' was logged in training \(on_step=False, "
                                         r"on_epoch=True\) but has no value yet: it appears at the end"):
        t.fit(EpochOnly(), data(n=16))


def test_validation_step_values_reach_the_loggers_per_batch(make_trainer, data):
    from helpers import CaptureLogger

    class StepVal(LinearModule):
        def validation_step(self, batch, batch_idx):
            self.log("val/step_loss", self.loss(batch), on_step=True, on_epoch=False)
            self.log("val/loss", self.loss(batch))

    lg = CaptureLogger()
    m = StepVal()
    t = make_trainer(max_epochs=2, num_sanity_val_steps=1, logger=lg, log_every_n_steps=1)
    t.fit(m, data(n=16), data(n=24))
    steps = [(s, v["val/step_loss"]) for s, v in lg.calls if "val/step_loss" in v]
    assert [s for s, _ in steps] == list(range(6))   # 3 batches x 2 passes, not the sanity check
    x, y = next(iter(data(n=24)))   # the first batch of the last pass, with the final weights
    with torch.no_grad():
        assert steps[3][1] == pytest.approx(float(F.mse_loss(m(x), y)))


def test_16_mixed_on_cpu_warns_that_fp16_runs(make_trainer, data):
    with pytest.warns(UserWarning, match=r"precision='16-mixed' on CPU runs fp16 autocast with a GradScaler \(Lightning switches"):
        make_trainer(max_epochs=1, precision="16-mixed", num_sanity_val_steps=0).fit(LinearModule(), data(n=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make_trainer(max_epochs=1, precision="bf16-mixed", num_sanity_val_steps=0).fit(LinearModule(), data(n=8))


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_optimizer_step_override_keeps_accumulation_scaling_and_clipping(make_trainer, data, precision):
    calls = []

    class Step(LinearModule):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            calls.append(batch_idx)
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    kw = dict(max_epochs=2, num_sanity_val_steps=0, accumulate_grad_batches=3, gradient_clip_val=0.05,
              precision=precision)
    warnings.simplefilter("ignore", UserWarning)   # 16-mixed on CPU
    torch.manual_seed(0)
    plain, hooked = LinearModule(), Step()
    hooked.load_state_dict(plain.state_dict())
    make_trainer(**kw).fit(plain, data(n=56))     # 7 batches: windows of 3, 3 and 1 per epoch
    make_trainer(**kw).fit(hooked, data(n=56))
    assert calls == [2, 5, 6] * 2
    for a, b in zip(plain.parameters(), hooked.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
