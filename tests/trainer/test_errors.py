"""Bad input gets a MisconfigurationError that names the argument or hook and
what would be valid, raised before any work is lost."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.errors import EmberError, MisconfigurationError, invalid_choice
from conftest import LinearModule


def test_error_types():
    assert issubclass(MisconfigurationError, EmberError) and issubclass(MisconfigurationError, ValueError)
    e = invalid_choice("colour", "mauve", ["red", "blue"])
    assert isinstance(e, MisconfigurationError)
    assert str(e) == "colour='mauve' is not valid; choose one of: 'red', 'blue'"


@pytest.mark.parametrize("kwargs,pattern", [
    ({"precision": "fp8-magic"}, r"precision='fp8-magic'.*'64-true', '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true'"),
    ({"precision": "16-true-ish"}, r"precision=.*'bf16-mixed'"),
    ({"precision": ["bf16"]}, r"precision=\['bf16'\] is not valid.*'bf16-mixed'"),
    ({"strategy": "horovod"}, r"strategy='horovod'.*'auto', 'single', 'ddp', 'fsdp', 'deepspeed'"),
    ({"strategy": 3}, r"strategy=3.*'ddp'"),
    ({"devices": "tpu"}, r"devices='tpu'.*'auto', 'cpu', 'cuda'"),
    ({"devices": 0}, r"devices=0 .*positive.*'auto'"),
    ({"devices": -1}, r"devices=-1 .*positive.*'auto'"),
    ({"devices": "-2"}, r"devices=-2 .*positive"),
    ({"devices": None}, r"devices=None.*'auto'"),
    pytest.param({"devices": [0]}, r"devices=\[0\] names CUDA devices, but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
    ({"num_nodes": 0}, r"num_nodes=0.*positive int"),
    ({"limit_train_batches": -1}, r"limit_train_batches=-1 .*>= 0.*\[0.0, 1.0\]"),
    ({"limit_train_batches": 1.5}, r"limit_train_batches=1.5 .*\[0.0, 1.0\]"),
    ({"limit_val_batches": -0.5}, r"limit_val_batches=-0.5 .*\[0.0, 1.0\]"),
    ({"limit_val_batches": "all"}, r"limit_val_batches='all' .*int number of batches.*float"),
    ({"val_check_interval": 0}, r"val_check_interval=0 .*\(0.0, 1.0\].*int >= 1"),
    ({"val_check_interval": 1.5}, r"val_check_interval=1.5 .*\(0.0, 1.0\]"),
    ({"val_check_interval": -2}, r"val_check_interval=-2 "),
    ({"val_check_interval": "half"}, r"val_check_interval='half' "),
    ({"check_val_every_n_epoch": 0}, r"check_val_every_n_epoch=0 .*int >= 1 or None"),
    ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches=0 .*int >= 1"),
    ({"accumulate_grad_batches": 2.0}, r"accumulate_grad_batches=2.0 "),
    ({"gradient_clip_algorithm": "l2"}, r"gradient_clip_algorithm='l2'.*'norm', 'value'"),
    ({"gradient_clip_val": -1.0}, r"gradient_clip_val=-1.0 .*positive"),
    ({"max_steps": -5}, r"max_steps=-5 .*-1"),
    ({"max_epochs": -3}, r"max_epochs=-3 "),
    ({"max_time": "soon"}, r"max_time='soon'.*DD:HH:MM:SS"),
    ({"max_time": -1}, r"max_time=-1 "),
    ({"log_every_n_steps": 0}, r"log_every_n_steps=0 .*int >= 1"),
    ({"num_sanity_val_steps": -2}, r"num_sanity_val_steps=-2 .*-1"),
    ({"fast_dev_run": -1}, r"fast_dev_run=-1 .*True, False or a positive int"),
    ({"callbacks": [object()]}, r"callbacks:.*not an ember.callbacks.Callback"),
])
def test_bad_trainer_arguments_are_named(tmp_path, kwargs, pattern):
    with pytest.raises(MisconfigurationError, match=pattern):
        ember.Trainer(default_root_dir=tmp_path, **kwargs)


def test_good_argument_forms_are_accepted(tmp_path):
    t = ember.Trainer(default_root_dir=tmp_path, max_time="00:00:01:30", precision=16, devices="cpu",
                      limit_train_batches=0.0, val_check_interval=1.0, logger=False)
    assert t.max_time == 90.0 and t.precision == "16-mixed"
    assert ember.Trainer(default_root_dir=tmp_path, max_time={"minutes": 2}).max_time == 120.0
    assert ember.Trainer(default_root_dir=tmp_path, devices=1, strategy="single").world_size == 1


def test_bad_logger_argument(make_trainer):
    # checked at construction, before any work
    with pytest.raises(MisconfigurationError, match=r"logger='not-a-logger' is not valid.*True.*False.*Logger"):
        make_trainer(logger="not-a-logger")


class Returns(LinearModule):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def training_step(self, batch, batch_idx):
        return self.value


@pytest.mark.parametrize("value,pattern", [
    ({"logits": torch.zeros(1)}, r"training_step returned a dict without a 'loss' key \(keys: \['logits'\]\)"),
    ("loss", r"training_step returned str; return a loss tensor, a dict with 'loss', or None"),
    (3.5, r"training_step returned float"),
])
def test_training_step_without_a_loss(make_trainer, data, value, pattern):
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(MisconfigurationError, match=pattern):
        trainer.fit(Returns(value), data())
    assert trainer.global_step == 0


def test_training_step_dict_with_loss_is_fine(make_trainer, data):
    class DictLoss(LinearModule):
        def training_step(self, batch, batch_idx):
            return {"loss": self.loss(batch), "extra": 1}

    trainer = make_trainer(max_epochs=1)
    trainer.fit(DictLoss(), data(n=16))
    assert trainer.global_step == 2


def test_empty_train_dataloader(make_trainer):
    empty = DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1)), batch_size=4)
    with pytest.raises(MisconfigurationError, match=r"train dataloader has no batches"):
        make_trainer(max_epochs=1).fit(LinearModule(), empty)


def test_limit_rounding_to_zero_batches(make_trainer, data):
    with pytest.raises(MisconfigurationError, match=r"no batches.*limit_train_batches"):
        make_trainer(max_epochs=1, limit_train_batches=0.01).fit(LinearModule(), data(n=16))


def test_empty_iterable_train_data(make_trainer):
    class Nothing(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    with pytest.raises(MisconfigurationError, match=r"train dataloader yielded no batches"):
        make_trainer(max_epochs=1).fit(LinearModule(), DataLoader(Nothing(), batch_size=2))


def test_missing_data(make_trainer, data):
    with pytest.raises(MisconfigurationError, match=r"fit\(\) needs training data.*train_dataloaders="):
        make_trainer(max_epochs=1).fit(LinearModule())
    with pytest.raises(MisconfigurationError, match=r"validate\(\) needs data.*val_dataloader"):
        make_trainer().validate(LinearModule())
    with pytest.raises(MisconfigurationError, match=r"predict\(\) needs data"):
        make_trainer().predict(LinearModule())


def test_missing_hooks_are_named(make_trainer, data):
    class NoOpt(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

    with pytest.raises(MisconfigurationError, match=r"NoOpt.configure_optimizers is missing: return an optimizer"):
        make_trainer(max_epochs=1).fit(NoOpt(), data())

    class NoStep(ember.TrainModule):
        def configure_optimizers(self):
            return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    with pytest.raises(MisconfigurationError, match=r"NoStep must implement training_step"):
        make_trainer(max_epochs=1).fit(NoStep(), data())
    with pytest.raises(MisconfigurationError, match=r"has no validation_step"):
        make_trainer().validate(NoStep(), data())
    with pytest.raises(MisconfigurationError, match=r"has no test_step"):
        make_trainer().test(NoStep(), data())
    with pytest.raises(MisconfigurationError, match=r"has no predict_step"):
        make_trainer().predict(NoStep(), data())


def test_validation_data_without_validation_step_skips_validation(make_trainer, data):
    """As Lightning: fit with validation data but no validation_step warns and trains
    (Lightning's GAN example has a datamodule with a val_dataloader and no validation_step)."""
    class TrainOnly(ember.TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = make_trainer(max_epochs=2, num_sanity_val_steps=2)
    with pytest.warns(UserWarning, match=r"TrainOnly has no validation_step: validation is skipped"):
        trainer.fit(TrainOnly(), data(), data(n=16))
    assert trainer.global_step == 16 and trainer.current_epoch == 2
    assert not any(k.startswith("val") for k in trainer.callback_metrics)


@pytest.mark.parametrize("returned,pattern", [
    (None, r"configure_optimizers returned None"),
    ("adam", r"configure_optimizers returned str; return an optimizer"),
    ([], r"configure_optimizers returned no optimizer"),
    ({"lr_scheduler": None}, r"configure_optimizers returned dict"),
])
def test_bad_configure_optimizers(make_trainer, data, returned, pattern):
    class Bad(LinearModule):
        def configure_optimizers(self):
            return returned

    with pytest.raises(MisconfigurationError, match=pattern):
        make_trainer(max_epochs=1).fit(Bad(), data())


def test_not_a_module(make_trainer, data):
    with pytest.raises(MisconfigurationError, match=r"expected a ember.TrainModule, got Linear"):
        make_trainer().fit(torch.nn.Linear(2, 2), data())
    with pytest.raises(MisconfigurationError, match=r"trainer.validate\(\) needs a module"):
        make_trainer().validate()


def test_errors_leave_the_trainer_usable(make_trainer, data):
    """An error in one run does not poison the next one (state, hooks, sampler)."""
    trainer = make_trainer(max_epochs=1)
    with pytest.raises(MisconfigurationError):
        trainer.fit(Returns("bad"), data())
    out = trainer.validate(LinearModule(), data(n=16))
    assert set(out[0]) == {"val/loss"}
