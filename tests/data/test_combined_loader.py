"""Several train loaders (issue: "Every kind of data resumes exactly", item 5):
``fit(train_dataloaders={"a": ..., "b": ...})`` (or a list) hands ``training_step`` a dict
(or list) of batches, as Lightning does; ``ember.CombinedLoader`` (also
``ember.utilities.CombinedLoader``) gives the batches of Lightning's own ``CombinedLoader``
in each mode, and every mode resumes mid-epoch exactly. The two-process runs (each loader
sharded) are in tests/data/test_stateful_ddp.py."""
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import stateful_cases as sc  # noqa: E402

import ember  # noqa: E402

MODES = ["min_size", "max_size_cycle", "max_size", "sequential"]


def _plain(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _loaders(structure):
    a, b, c = (DataLoader(range(6), batch_size=4), DataLoader(range(15), batch_size=5),
               DataLoader(TensorDataset(torch.arange(6).float(), torch.arange(6)), batch_size=2))
    return {"dict": {"a": a, "b": b}, "list": [a, b, c], "nested": {"x": [a, c], "y": b}, "one": b}[structure]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("structure", ["dict", "list", "nested", "one"])
@pytest.mark.parametrize("limits", [None, 2])
def test_same_batches_as_lightnings_combined_loader(mode, structure, limits):
    lightning = pytest.importorskip("lightning.pytorch.utilities")
    ours, theirs = ember.CombinedLoader(_loaders(structure), mode), lightning.CombinedLoader(_loaders(structure), mode)
    if limits is not None:
        ours.limits = theirs.limits = limits
    got, want = [_plain(t) for t in ours], [_plain(t) for t in theirs]
    assert got == want and len(got) > 1
    assert len(ours) == len(theirs)
    shape = (lambda t: {k: shape(v) for k, v in t.items()} if isinstance(t, dict) else    # noqa: E731
             [shape(v) for v in t] if isinstance(t, (list, tuple)) else type(t).__name__)
    assert shape(ours.sampler) == shape(theirs.sampler)
    assert ours.ember_names() == {"dict": ["a", "b"], "list": ["[0]", "[1]", "[2]"], "nested": ["x[0]", "x[1]", "y"],
                                  "one": ["[0]"]}[structure]   # the names resume states record


def test_importable_where_lightning_users_find_it():
    from ember.data.combined import CombinedLoader
    from ember.utilities import CombinedLoader as FromUtilities
    assert ember.CombinedLoader is FromUtilities is CombinedLoader
    assert ember.CombinedLoader(_loaders("dict")).mode == "min_size"   # Lightning's default
    with pytest.raises(ValueError, match="Unsupported mode 'zip'"):
        ember.CombinedLoader(_loaders("dict"), "zip")


class Batches(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.got = []

    def training_step(self, batch, batch_idx, dataloader_idx=None):
        self.got.append((batch, dataloader_idx))
        flat = list(batch.values()) if isinstance(batch, dict) else batch if isinstance(batch, list) else [batch]
        return sum(self.net(b[0].float().view(-1, 1)).mean() for b in flat)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(train, **kw):
    module = Batches()
    ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, **kw).fit(module, train)
    return module.got


def _data(n):
    return DataLoader(TensorDataset(torch.arange(n).float(), torch.arange(n)), batch_size=2)


def test_fit_with_a_dict_or_list_of_loaders_gives_a_dict_or_list_of_batches():
    """It iterated the dict: training_step got the string 'a'."""
    got = _fit({"a": _data(4), "b": _data(8)})
    assert [sorted(b) for b, _ in got] == [["a", "b"]] * 4                    # max_size_cycle: the longest
    assert [b["a"][1].tolist() for b, _ in got] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [b["b"][1].tolist() for b, _ in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    got = _fit([_data(4), _data(6)])
    assert all(isinstance(b, list) and len(b) == 2 for b, _ in got) and len(got) == 3
    got = _fit(ember.CombinedLoader({"a": _data(4), "b": _data(6)}, "sequential"))
    assert [(b[1].tolist(), i) for b, i in got] == [([0, 1], 0), ([2, 3], 0), ([0, 1], 1), ([2, 3], 1), ([4, 5], 1)]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_resumes_mid_epoch_exactly(tmp_path, mode):
    """A dict of a shuffled map-style loader and a shorter stateful stream (a plain stream in
    min_size mode, which is replayed): resumed in each epoch, the same batches follow and
    the weights are the same as the uninterrupted run's."""
    case = f"combined_{mode}"
    full_w, full_seen, _ = sc.fit(case, str(tmp_path / "full"))
    points = sc.resume_points(full_seen)
    assert len(points) == 2
    for step in points:
        w, seen, replays = sc.fit(case, str(tmp_path / f"r{step}"), ckpt_path=sc.checkpoint(str(tmp_path / "full"),
                                                                                           step))
        assert seen == full_seen[step:], (mode, step)
        assert all(torch.equal(w[k], full_w[k]) for k in full_w), (mode, step)
        assert bool(replays) == (mode == "min_size")   # only the stream without state is read again
