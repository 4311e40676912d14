"""A Trainer given no precision runs in the module's choice (``TrainModule.configure_precision``);
a precision given by hand, or ``$EMBER_PRECISION``, always wins."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import LinearModule, regression_data


class Chooses(LinearModule):
    """Asks for ``choice`` and records the dtype its forward computes in and what it was asked."""

    def __init__(self, choice):
        super().__init__()
        self.choice, self.asked, self.dtypes = choice, [], []

    def configure_precision(self, device):
        self.asked.append(device)
        return self.choice

    def training_step(self, batch, batch_idx):
        self.dtypes.append(self(batch[0]).dtype)
        return super().training_step(batch, batch_idx)


def loader():
    return DataLoader(regression_data(n=16), batch_size=8)


@pytest.mark.parametrize("choice, name, dtype", [(None, "32-true", torch.float32),
                                                 ("bf16-mixed", "bf16-mixed", torch.bfloat16),
                                                 ("bf16", "bf16-mixed", torch.bfloat16),
                                                 ("64-true", "64-true", torch.float64)])
def test_no_precision_given_runs_the_modules_choice(make_trainer, monkeypatch, choice, name, dtype):
    monkeypatch.delenv("EMBER_PRECISION", raising=False)
    module = Chooses(choice)
    trainer = make_trainer(max_steps=2)
    trainer.fit(module, loader())
    assert module.asked == [torch.device("cpu")]   # asked once, with the device it trains on
    assert trainer.precision == name and set(module.dtypes) == {dtype}
    # later runs of the same Trainer keep the choice (the device is set up once)
    trainer.validate(module, loader())
    assert module.asked == [torch.device("cpu")] and trainer.precision == name


@pytest.mark.parametrize("given", ["32-true", "auto-env"])
def test_a_precision_given_wins_over_the_modules_choice(make_trainer, monkeypatch, given):
    if given == "auto-env":    # ember launch --mixed-precision no
        monkeypatch.setenv("EMBER_PRECISION", "32-true")
        trainer = make_trainer(max_steps=2)
    else:
        monkeypatch.delenv("EMBER_PRECISION", raising=False)
        trainer = make_trainer(max_steps=2, precision=given)
    module = Chooses("bf16-mixed")
    trainer.fit(module, loader())
    assert module.asked == [] and trainer.precision == "32-true" and set(module.dtypes) == {torch.float32}


def test_a_resume_under_another_choice_says_so(make_trainer, monkeypatch, tmp_path):
    """A run whose choice depended on the machine (bf16 here, float32 on the next one)
    resumes with a warning that names the change, not silently."""
    monkeypatch.delenv("EMBER_PRECISION", raising=False)
    first = make_trainer(max_steps=2, default_root_dir=tmp_path)
    first.fit(Chooses("bf16-mixed"), loader())
    ckpt = tmp_path / "bf16.ckpt"
    first.save_checkpoint(ckpt)
    again = make_trainer(max_steps=4, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        again.fit(Chooses(None), loader(), ckpt_path=ckpt)
    said = [str(w.message) for w in got if "different setup" in str(w.message)]
    assert len(said) == 1 and "precision 'bf16-mixed' -> '32-true'" in said[0], [str(w.message) for w in got]
    assert again.global_step == 4
