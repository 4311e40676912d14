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


class EpochRecording(LinearModule):
    """Records, per epoch, the first feature of every training sample (identifies it)."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch[0][:, 0].tolist())
        return super().training_step(batch, batch_idx)


def generator_loader(ds, given_to, **kw):
    g = torch.Generator().manual_seed(123)
    if given_to == "sampler":
        return DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=g), **kw)
    return DataLoader(ds, batch_size=8, shuffle=True, generator=g, **kw)   # g also draws the workers' base seed


def assert_resumed_like(full, resumed, step, n):
    """``resumed`` (from the checkpoint at ``step``, in epoch 1 of ``n`` batches of 8) trained
    the rest of epoch 1 and epoch 2 of the uninterrupted run, in its order, to its weights."""
    rest = full.seen[1][8 * (step - n):]
    assert resumed.seen == ({1: rest} if rest else {}) | {2: full.seen[2]}, step
    assert torch.equal(resumed.net.weight, full.net.weight) and torch.equal(resumed.net.bias, full.net.bias), step


@pytest.mark.parametrize("given_to,persistent,limit", [("sampler", False, 1.0), ("dataloader", True, 5)])
def test_user_generator_with_workers_resumes_mid_epoch_exactly(tmp_path, given_to, persistent, limit):
    """num_workers=2: the workers prefetch sampler indices ahead of the training loop, and a
    loader given generator=g draws its workers' base seed from g (with persistent workers only
    at its first pass). A run resumed mid-epoch 1, or after epoch 1's last batch (before its
    end), trains the rest of the uninterrupted 3-epoch run in the same order per epoch, to
    bit-identical weights; with limit_train_batches too (the pass stops before the sampler's end).
    Before, the resumed epoch trained the skipped batches again (with workers, the DataLoader
    iterator's first iter() of the batch sampler took the skip), and later epochs' order
    depended on how far a pass had drawn from g."""
    ds = regression_data(64)
    kw = dict(num_workers=2, persistent_workers=persistent)
    full = EpochRecording()
    make(tmp_path / "a", [ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1)],
         max_epochs=3, limit_train_batches=limit).fit(full, generator_loader(ds, given_to, **kw))
    n = 8 if limit == 1.0 else limit
    assert sorted(full.seen) == [0, 1, 2] and all(len(v) == 8 * n for v in full.seen.values())
    assert full.seen[0] != full.seen[1] and full.seen[1] != full.seen[2]
    if limit == 1.0:   # whole passes: each epoch is a permutation of the data set, the first as in plain torch
        assert all(sorted(v) == sorted(ds.tensors[0][:, 0].tolist()) for v in full.seen.values())
        plain = generator_loader(ds, given_to)
        assert full.seen[0] == [x for b in plain for x in b[0][:, 0].tolist()]
    for step in (n + 3, 2 * n):
        resumed = EpochRecording()
        make(tmp_path / "b", max_epochs=3, limit_train_batches=limit).fit(
            resumed, generator_loader(ds, given_to, **kw), ckpt_path=str(tmp_path / "ck" / f"epoch=1-step={step}"))
        assert_resumed_like(full, resumed, step, n)


def test_checkpoints_without_generator_epoch_still_resume_exactly(tmp_path):
    """Checkpoints written before ``generator_epoch`` was recorded hold the generator's state
    at the start of the loop's epoch (mid-epoch, and after the epoch's last batch before its
    end) or the state the next epoch starts from (at an epoch end): all resume exactly."""
    from conftest import reseal
    ds = regression_data(64)
    full = EpochRecording()
    make(tmp_path / "a", [ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=-1),
                          ModelCheckpoint(dirpath=str(tmp_path / "ends"), save_top_k=-1)],
         max_epochs=3).fit(full, generator_loader(ds, "dataloader"))

    def state(ckpt):
        return torch.load(ckpt / "trainer_state.pt", weights_only=False)
    epoch1_start = state(tmp_path / "ck" / "epoch=1-step=9")["data"]["generator_state"]
    for ckpt, step in [(tmp_path / "ck" / "epoch=1-step=11", 11), (tmp_path / "ck" / "epoch=1-step=16", 16),
                       (tmp_path / "ends" / "epoch=0-step=8", 8)]:
        st = state(ckpt)
        assert st["data"].pop("generator_epoch") == (1 if step > 8 else 0)
        if step == 8:   # the old form at an epoch end: the state epoch 1 starts from
            st["data"]["generator_state"] = epoch1_start
        torch.save(st, ckpt / "trainer_state.pt")
        reseal(ckpt)
        resumed = EpochRecording()
        make(tmp_path / "b", max_epochs=3).fit(resumed, generator_loader(ds, "dataloader"), ckpt_path=str(ckpt))
        if step == 8:
            assert resumed.seen == {1: full.seen[1], 2: full.seen[2]}
            assert torch.equal(resumed.net.weight, full.net.weight)
        else:
            assert_resumed_like(full, resumed, step, 8)


def test_another_sampler_class_warns_on_a_mid_epoch_resume(tmp_path):
    """The checkpoint records the class of the train loader's sampler: resumed mid-epoch with
    another, the skipped batches are not the ones trained, and the warning names both."""
    ds = regression_data(64)
    ck = mid_epoch_checkpoint(tmp_path, generator_loader(ds, "sampler"), every=3)
    other = DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(64), 64,
                                                                       generator=torch.Generator().manual_seed(5)))
    with pytest.warns(UserWarning, match=r"3 batches done\): the train dataloader's sampler was a RandomSampler "
                                         r"and is now a WeightedRandomSampler"):
        make(tmp_path).fit(LinearModule(), other, ckpt_path=str(ck / "epoch=0-step=3"))
