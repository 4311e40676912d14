"""Batches prefetched one step ahead (ember/data/prefetch.py): used by the training loop on
CUDA; here forced on with EMBER_PREFETCH=1 on the CPU, where the same logic runs
without streams or pinning."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

from resume_common import EPOCHS, STEPS_PER_EPOCH, Interrupt, differences, fit, snapshot  # noqa: E402

import ember  # noqa: E402
from ember.checkpoint import io as cio  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.data.prefetch import DevicePrefetch, prefetch_enabled  # noqa: E402


class Recorder:
    """A ``to_device`` that records the order of its calls."""

    def __init__(self):
        self.sent = []

    def __call__(self, batch):
        self.sent.append(int(batch[0][0]))
        return batch


def _numbers(n):
    return DataLoader(TensorDataset(torch.arange(n, dtype=torch.float32)), batch_size=1)


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_same_batches_in_order_and_the_last_one_kept(n):
    rec = Recorder()
    pre = DevicePrefetch(_numbers(n), rec, torch.device("cpu"))
    got = []
    for batch in pre:
        got.append(int(batch[0][0]))
        # batch i + 1 was already sent when batch i is handed out (but for the last one)
        assert rec.sent == list(range(min(len(got) + 1, n)))
    assert got == list(range(n)) and len(pre) == n
    assert pre.batch_size == 1                      # the loader's attributes


class Stream(IterableDataset):
    def __init__(self, n):
        self.n, self.produced = n, 0

    def __iter__(self):
        self.produced = 0
        for x in torch.arange(self.n, dtype=torch.float32).view(-1, 1):
            self.produced += 1
            yield x


def test_iterable_dataset_passes_through_whole():
    rec = Recorder()
    loader = DataLoader(Stream(5), batch_size=2)
    got = [b.flatten().tolist() for b in DevicePrefetch(loader, lambda b: rec((b.flatten(),)) and b,
                                                         torch.device("cpu"))]
    assert got == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert rec.sent == [0, 2, 4]


def test_enabled_on_cuda_only_unless_forced(monkeypatch):
    monkeypatch.delenv("EMBER_PREFETCH", raising=False)
    assert prefetch_enabled(torch.device("cuda", 0)) and not prefetch_enabled(torch.device("cpu"))
    monkeypatch.setenv("EMBER_PREFETCH", "1")
    assert prefetch_enabled(torch.device("cpu"))
    monkeypatch.setenv("EMBER_PREFETCH", "0")
    assert not prefetch_enabled(torch.device("cuda", 0))


class SeenBatches(Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])


def _run(root, monkeypatch, prefetch, **kw):
    monkeypatch.setenv("EMBER_PREFETCH", "1" if prefetch else "0")
    seen = SeenBatches()
    module, trainer = fit(root, callbacks=[seen, *kw.pop("callbacks", [])], **kw)
    return module, trainer, seen


def test_loop_with_prefetch_trains_identically(tmp_path, monkeypatch):
    m0, t0, s0 = _run(tmp_path / "off", monkeypatch, False)
    m1, t1, s1 = _run(tmp_path / "on", monkeypatch, True)
    assert differences(snapshot(m0, t0), snapshot(m1, t1)) == []
    assert len(s1.batches) == len(s0.batches) and differences(s0.batches, s1.batches) == []
    assert t1.global_step == EPOCHS * STEPS_PER_EPOCH


def test_resume_mid_epoch_with_prefetch_is_exact(tmp_path, monkeypatch):
    ref_m, ref_t, _ = _run(tmp_path / "ref", monkeypatch, False)
    ckpt = lambda: ModelCheckpoint(every_n_train_steps=1, save_last=True)  # noqa: E731
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(tmp_path / "run", monkeypatch, True, callbacks=[Interrupt(1, 4)], checkpoint=ckpt())
    loop = cio.read_checkpoint(os.path.join(tmp_path, "run", "checkpoints", "last"))[1]["loop"]
    assert (loop["epoch"], loop["batches_done"]) == (1, 3)      # mid-epoch
    m, t, _ = _run(tmp_path / "run", monkeypatch, True, ckpt_path="last", checkpoint=ckpt())
    assert differences(snapshot(ref_m, ref_t), snapshot(m, t)) == []


class Regression(ember.TrainModule):
    def __init__(self, data):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.data, self.produced = data, []

    def training_step(self, batch, batch_idx):
        self.produced.append(self.data.produced)    # samples read from the stream so far
        return (self.lin(batch) - 2 * batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_iterable_dataset_in_the_loop_with_accumulation(tmp_path, monkeypatch):
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("EMBER_PREFETCH", flag)
        torch.manual_seed(0)
        data = Stream(7)
        module = Regression(data)
        t = ember.Trainer(max_epochs=2, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
        t.fit(module, DataLoader(data, batch_size=2))      # 4 batches: windows of 2 and 2
        out[flag] = ({k: v.clone() for k, v in module.state_dict().items()}, t.global_step, module.produced)
    assert differences(out["0"][0], out["1"][0]) == [] and out["0"][1] == out["1"][1] == 4
    # with prefetch the stream is one batch (2 samples) further at every step, up to its end
    assert out["1"][2] == [min(n + 2, 7) for n in out["0"][2]] and out["1"][2] != out["0"][2]


def test_prefetch_runs_the_modules_batch_transfer_hooks(tmp_path, monkeypatch):
    """With prefetch on (as on CUDA), the batch-transfer hooks still shape the training
    batches: the prefetcher sends batches through them, not around them."""
    from conftest import LinearModule, regression_data

    class Zeroed(LinearModule):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_before_batch_transfer(self, batch, dataloader_idx):
            return [b * 0 for b in batch]

        def training_step(self, batch, batch_idx):
            self.seen.append(float(batch[0].abs().sum()))
            return super().training_step(batch, batch_idx)

    for flag in ("0", "1"):
        monkeypatch.setenv("EMBER_PREFETCH", flag)
        m = Zeroed()
        ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path).fit(
            m, DataLoader(regression_data(16), batch_size=4))
        assert m.seen == [0.0] * 4, flag
