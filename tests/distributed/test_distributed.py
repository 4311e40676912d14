"""ember.distributed helpers and the GatherMetrics callback in one process (their
two-process behaviour is checked in tests/strategies/test_ddp_multiproc.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember.distributed.collectives as ed
from ember import Trainer, TrainModule
from ember.callbacks import GatherMetrics
from ember.errors import MisconfigurationError


def test_single_process_helpers():
    t = torch.arange(6).view(3, 2)
    assert torch.equal(ed.gather(t), t)
    assert ed.gather(torch.tensor(4.0)).shape == (1,)
    assert ed.all_gather({"a": t})["a"].shape == (1, 3, 2)
    assert ed.reduce(torch.tensor([1, 3]), "mean").dtype == torch.float32
    assert torch.equal(ed.reduce([torch.tensor(2.0)], "max")[0], torch.tensor(2.0))
    with pytest.raises(MisconfigurationError, match="op='median' is not valid; choose one of: 'sum', 'mean'"):
        ed.reduce(t, "median")
    assert ed.pad_across_processes(t, dim=1) is t
    assert ed.broadcast({"x": 1}) == {"x": 1}
    assert ed.all_gather_object(3) == [3]


def test_collectives_keep_namedtuples_and_refuse_a_dict_subclass_pytree_does_not_know():
    from collections import namedtuple
    Pair = namedtuple("Pair", "x y")
    out = ed.gather({"p": Pair(torch.tensor(1.0), [torch.ones(2), "s"])})
    assert isinstance(out["p"], Pair) and out["p"].x.shape == (1,) and out["p"].y[1] == "s"

    class Batch(dict):
        pass

    with pytest.raises(TypeError, match="Batch.*register_pytree_node"):   # its tensors would pass ungathered
        ed.gather(Batch(x=torch.ones(1)))


def test_gather_for_metrics_drops_padding_in_one_process():
    data = {"p": torch.arange(5), "nested": [torch.ones(5, 2)], "names": list("abcde")}
    out = ed.gather_for_metrics(data, num_padded=2)
    assert out["p"].tolist() == [0, 1, 2] and out["nested"][0].shape == (3, 2) and out["names"] == list("abc")
    assert torch.equal(ed.gather_for_metrics(torch.arange(3), num_padded=0), torch.arange(3))
    with pytest.raises(ValueError, match="num_padded=9 is larger than the 5"):
        ed.gather_for_metrics(torch.arange(5), num_padded=9)


@pytest.mark.parametrize("sizes, expected", [
    # rank r holds global positions r, r+W, ...: rows come back in global order
    ([3, 3], [0, 1, 2, 3, 4, 5]),
    ([3, 2], [0, 1, 2, 3, 4]),          # an unpadded sharding: rank 0 has one more
    ([2, 2, 1], [0, 1, 2, 3, 4]),
])
def test_interleave(sizes, expected):
    world, longest = len(sizes), max(sizes)
    padded = torch.full((world, longest), -1)
    for r, n in enumerate(sizes):
        padded[r, :n] = torch.arange(n) * world + r
    assert ed._interleave(padded, sizes).tolist() == expected
    per_rank = [[int(v) for v in padded[r, :n]] for r, n in enumerate(sizes)]
    assert ed._interleave_objects(per_rank) == expected


N = 203


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g))


class _Clf(TrainModule):
    def __init__(self, output="dict"):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 3)
        self.output = output

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        preds = self.net(x).argmax(1)
        return {"preds": preds, "target": y} if self.output == "dict" else preds

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).argmax(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path, callbacks, **kw):
    return Trainer(max_epochs=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, **kw)


def _reference_acc(module):
    x, y = _data().tensors
    with torch.no_grad():
        return (module.net(x).argmax(1) == y).float().mean().item()


def test_gather_metrics_one_process(tmp_path):
    seen = []

    def count(p, t):
        seen.append(len(p))
        return float(len(p))

    cb = GatherMetrics({"val/acc": lambda p, t: (p == t).float().mean(), "val/n": count},
                       stages=("validate", "test", "predict"))
    trainer = _trainer(tmp_path, [cb], num_sanity_val_steps=2, limit_train_batches=3)
    module = _Clf()
    loader = DataLoader(_data(), batch_size=16)
    trainer.fit(module, DataLoader(_data(), batch_size=16), loader)
    assert seen == [N]   # computed once per epoch, not during the sanity check (2 batches)
    acc = _reference_acc(module)
    assert trainer.callback_metrics["val/acc"].item() == pytest.approx(acc, abs=1e-7)
    out = trainer.validate(module, loader)[0]
    assert out["val/n"] == N and out["val/acc"] == pytest.approx(acc, abs=1e-7)
    assert cb.results == {"val/acc": pytest.approx(acc, abs=1e-7), "val/n": N}
    out = trainer.test(module, loader)[0]
    assert out["val/n"] == N
    trainer.predict(module, loader)
    assert len(cb.predictions) == 1 and cb.predictions[0].shape == (N,)


def test_gather_metrics_two_dataloaders(tmp_path):
    cb = GatherMetrics({"n": lambda p, t: len(p)})
    trainer = _trainer(tmp_path, [cb])
    short = torch.utils.data.Subset(_data(), range(50))
    trainer.validate(_Clf(), [DataLoader(_data(), batch_size=32), DataLoader(short, batch_size=32)])
    assert cb.results == {"n/dataloader_idx_0": N, "n/dataloader_idx_1": 50}


def test_gather_metrics_errors(tmp_path):
    with pytest.raises(MisconfigurationError, match="GatherMetrics\\(stages\\)='train' is not valid"):
        GatherMetrics({"a": len}, stages=("train",))
    with pytest.raises(MisconfigurationError, match="must map a name to a callable"):
        GatherMetrics({"a": 3})
    trainer = _trainer(tmp_path, [GatherMetrics({"acc": lambda p, t: 0.0})])
    with pytest.raises(MisconfigurationError, match="validation_step must return a dict holding those keys"):
        trainer.validate(_Clf(output="tensor"), DataLoader(_data(), batch_size=64))
