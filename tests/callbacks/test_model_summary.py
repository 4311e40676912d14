"""ModelSummary: Lightning's max_depth values (-1: the whole tree, 0: nothing) and a Mode
column that shows each layer's mode during training."""
from __future__ import annotations

import io

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelSummary
from tests.conftest import LinearModule, regression_data


class Deep(LinearModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)), nn.ReLU(), nn.Linear(8, 1))


class FrozenNorm(Deep):
    """Keeps its batch norm in eval mode while training (a train() override)."""

    def train(self, mode: bool = True):
        super().train(mode)
        self.net[0][1].eval()
        return self


def _rows(module, **kw) -> tuple[dict, str]:
    buf = io.StringIO()
    t = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      devices="cpu", callbacks=[ModelSummary(console=Console(file=buf, width=160), **kw)])
    t.fit(module, DataLoader(regression_data(16), batch_size=8))
    text = buf.getvalue()
    rows = {ln.split("│")[2].strip(): [c.strip() for c in ln.split("│")[3:-1]]
            for ln in text.splitlines() if ln.count("│") >= 6}
    rows.pop("Name", None)
    return rows, text


def test_max_depth_minus_one_lists_the_whole_tree_and_zero_nothing():
    rows, _ = _rows(Deep(), max_depth=-1)
    assert list(rows) == ["net", "net.0", "net.0.0", "net.0.1", "net.1", "net.2"]
    assert rows["net.0.1"][:3] == ["BatchNorm1d", "16", "16"]
    rows, _ = _rows(Deep(), max_depth=2)
    assert list(rows) == ["net", "net.0", "net.1", "net.2"]
    rows, text = _rows(Deep(), max_depth=0)
    assert rows == {} and text == ""


def test_mode_column_is_the_mode_during_training():
    m = Deep()
    m.eval()   # loaded in eval mode (as a from_pretrained model): it trains in train mode
    seen = []

    class Spy(ember.callbacks.Callback):
        def on_fit_start(self, trainer, module):
            seen.append(module.training)

    buf = io.StringIO()
    t = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      devices="cpu", callbacks=[ModelSummary(max_depth=-1, console=Console(file=buf, width=160)), Spy()])
    t.fit(m, DataLoader(regression_data(16), batch_size=8))
    rows = {ln.split("│")[2].strip(): ln.split("│")[6].strip() for ln in buf.getvalue().splitlines()
            if ln.count("│") >= 6}
    assert rows["net"] == rows["net.0.1"] == "train"
    assert seen == [False]   # the summary looked without changing the module's mode
    rows, _ = _rows(FrozenNorm(), max_depth=-1)
    assert rows["net.0.1"][3] == "eval" and rows["net.0.0"][3] == "train"


def test_transformers_model_loaded_in_eval_mode_shows_train():
    transformers = __import__("pytest").importorskip("transformers")
    from ember.callbacks.summary import summarize
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16)
    model = transformers.BertForSequenceClassification(cfg)
    model.eval()   # as from_pretrained leaves it
    modes = {name: mode for name, *_, mode in summarize(model, max_depth=-1)["rows"]}
    assert set(modes.values()) == {"train"} and not model.training and not model.bert.training
    assert len(modes) > 10
