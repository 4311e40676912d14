"""Resuming with changed data (issue 18, item 11): a changed batch size or dataset
length mid-epoch is refused (or accepted with a warning under EMBER_ALLOW_DATA_CHANGE=1);
a user's sampler keeps its own generator and resumes mid-epoch exactly; a sampler
drawing from the global RNG is warned about."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler

import ember
from conftest import LinearModule, regression_data
from ember.callbacks import ModelCheckpoint
from ember.errors import CheckpointError


class Recording(LinearModule):
    """Records the first feature of every training sample, in order (identifies the sample)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].clone())
        return super().training_step(batch, batch_idx)


def make(root, callbacks=(), max_epochs=1, **kw):
    return ember.Trainer(max_epochs=max_epochs, default_root_dir=root, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks),
                         seed=0, **kw)


def mid_epoch_checkpoint(tmp_path, loader, every=3, max_epochs=1):
    t = make(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=every, save_top_k=-1)],
             max_epochs=max_epochs)
    t.fit(LinearModule(), loader)
    t.save_checkpoint(str(tmp_path / "ck" / "end"))   # at the epoch end
    return tmp_path / "ck"


def test_changed_batch_size_or_dataset_length_mid_epoch_is_refused_naming_both_values(tmp_path, monkeypatch):
    ck = mid_epoch_checkpoint(tmp_path, DataLoader(regression_data(64), batch_size=8, shuffle=True))
    path = str(ck / "epoch=0-step=3")
    with pytest.raises(CheckpointError, match=r"mid-epoch.*3 batches done.*batch size 8 -> 16.*"
                                              r"EMBER_ALLOW_DATA_CHANGE=1"):
        make(tmp_path).fit(LinearModule(), DataLoader(regression_data(64), batch_size=16), ckpt_path=path)
    with pytest.raises(CheckpointError, match=r"dataset len 64 -> 48"):
        make(tmp_path).fit(LinearModule(), DataLoader(regression_data(48), batch_size=8), ckpt_path=path)
    monkeypatch.setenv("EMBER_ALLOW_DATA_CHANGE", "1")
    t = make(tmp_path)
    with pytest.warns(UserWarning, match=r"batch size 8 -> 16\), accepted because EMBER_ALLOW_DATA_CHANGE=1"):
        t.fit(LinearModule(), DataLoader(regression_data(64), batch_size=16), ckpt_path=path)
    assert t.global_step == 3 + 1   # batches 3 of 4 (of 16) remained: the 48 samples after the first 48
    monkeypatch.delenv("EMBER_ALLOW_DATA_CHANGE")
    # at an epoch end nothing is skipped or repeated: a new batch size is fine
    t = make(tmp_path, max_epochs=2)
    t.fit(LinearModule(), DataLoader(regression_data(64), batch_size=16), ckpt_path=str(ck / "end"))
    assert t.global_step == 8 + 4


@pytest.mark.parametrize("given_to", ["sampler", "dataloader"])
def test_user_sampler_generator_is_kept_and_resume_is_exact(tmp_path, given_to):
    ds = regression_data(64)

    def loader():
        g = torch.Generator().manual_seed(123)
        if given_to == "sampler":
            return DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=g))
        return DataLoader(ds, batch_size=8, shuffle=True, generator=g)   # g also draws the worker base seed
    # the user's generator and seed decide the order, exactly as in plain PyTorch
    plain = loader()
    expected = torch.cat([b[0][:, 0] for _ in range(3) for b in plain])
    full = Recording()
    make(tmp_path / "a", [ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_top_k=-1),
                          ModelCheckpoint(dirpath=str(tmp_path / "ends"), save_top_k=-1)],
         max_epochs=3).fit(full, loader())
    assert torch.equal(torch.cat(full.seen), expected)
    # mid-epoch (steps 4, 12, 20), after an epoch's last batch but before its end (8, 16: the
    # resumed epoch trains nothing) and at epoch ends
    for ckpt in [tmp_path / "ck" / f"epoch={s // 8 - (s % 8 == 0)}-step={s}" for s in (4, 8, 12, 16, 20)] + \
            [tmp_path / "ends" / f"epoch={e}-step={8 * (e + 1)}" for e in (0, 1)]:
        step = int(ckpt.name.rsplit("=", 1)[1])
        resumed = Recording()
        make(tmp_path / "b", max_epochs=3).fit(resumed, loader(), ckpt_path=str(ckpt))
        assert torch.equal(torch.cat(resumed.seen), torch.cat(full.seen[step:])), ckpt
        assert torch.equal(resumed.net.weight, full.net.weight), ckpt


def test_sampler_drawing_from_the_global_rng_warns_on_a_mid_epoch_resume(tmp_path):
    ds = regression_data(64)

    def loader():
        return DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(64), 64))
    ck = mid_epoch_checkpoint(tmp_path, loader(), every=3)
    with pytest.warns(UserWarning, match=r"WeightedRandomSampler draws its order from the global random generator"
                                         r".*WeightedRandomSampler\(\.\.\., generator=torch.Generator"):
        make(tmp_path).fit(LinearModule(), loader(), ckpt_path=str(ck / "epoch=0-step=3"))
    import warnings
    kept = DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(64), 64,
                                                                      generator=torch.Generator().manual_seed(5)))
    ck2 = mid_epoch_checkpoint(tmp_path / "w", kept, every=3)
    with warnings.catch_warnings():   # with its own generator: no warning
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*log_every_n_steps")
        make(tmp_path / "w").fit(LinearModule(), kept, ckpt_path=str(ck2 / "epoch=0-step=3"))


def test_user_generator_with_workers_warns_on_a_mid_epoch_resume(tmp_path):
    """With num_workers > 0 the workers' prefetching decides how far a user sampler's own
    generator is drawn, so a mid-epoch resume cannot promise the later epochs' order: warn."""
    ds = regression_data(64)

    def loader():
        g = torch.Generator().manual_seed(123)
        return DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=g), num_workers=1)
    make(tmp_path / "a", [ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_top_k=-1)],
         max_epochs=1).fit(Recording(), loader())
    with pytest.warns(UserWarning, match="num_workers=1"):
        make(tmp_path / "b", max_epochs=1).fit(Recording(), loader(), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=4"))
