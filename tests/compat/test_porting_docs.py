"""docs/porting.md and docs/accelerator.md say what the code does: the deliberate
difference of ModelCheckpoint(save_last=True) is listed (and is what ember does), the
"not ported" list names no feature that exists now, and clip_grad_norm_ on a micro-batch
that does not sync is described one way only (it returns the norm)."""
from __future__ import annotations

import json
import os
import re

import torch
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelCheckpoint
from tests.conftest import LinearModule, regression_data

DOCS = os.path.join(os.path.dirname(os.path.abspath(ember.__file__)), "..", "docs")


def _doc(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


class Worsening(LinearModule):
    """val/loss grows every epoch: the best checkpoint is the first one."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", float(self.current_epoch))


def test_save_last_keeps_the_newest_state_and_the_docs_say_so(tmp_path):
    dl = DataLoader(regression_data(32), batch_size=8)   # 4 steps per epoch
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_top_k=1, save_last=True)
    t = ember.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      devices="cpu", callbacks=[ckpt])
    t.fit(Worsening(), dl, dl)
    best = json.loads(open(os.path.join(ckpt.best_model_path, "meta.json")).read())
    last = json.loads(open(os.path.join(ckpt.last_model_path, "meta.json")).read())
    assert (best["global_step"], last["global_step"]) == (4, 12)   # last: the newest, not the last top-k save
    doc = _doc("porting.md")
    section = doc[doc.index("**`ModelCheckpoint(save_last=True)`.**"):]
    assert "newest state" in section.split("\n\n")[0] and "Lightning's\n`last.ckpt`" in section.split("\n\n")[0]


def test_not_ported_names_no_feature_that_exists_now():
    doc = _doc("porting.md")
    assert "Not ported yet" not in doc
    for stale in ("needs `Trainer(limit_test_batches=)`", "needs `training_step(self, batch)`", "expected failure"):
        assert stale not in doc, stale
    # the features it named exist: the Trainer argument, and a training_step without batch_idx
    import inspect
    assert "limit_test_batches" in inspect.signature(ember.Trainer.__init__).parameters

    class NoIdx(LinearModule):
        def training_step(self, batch):
            return self.loss(batch)
    t = ember.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, devices="cpu", limit_test_batches=1)
    t.fit(NoIdx(), DataLoader(regression_data(16), batch_size=8))
    assert t.global_step == 2


def test_clip_grad_norm_on_a_micro_batch_that_does_not_sync():
    acc = ember.Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with acc.accumulate(model):
        model(torch.ones(2, 4)).sum().backward()
        assert not acc.sync_gradients
        norm = acc.clip_grad_norm_(model.parameters(), 1e-6)
    assert isinstance(norm, torch.Tensor) and norm.item() > 1e-3    # the norm, unclipped
    assert acc.clip_grad_value_(model.parameters(), 1e-6) is None
    doc = _doc("accelerator.md")
    assert not re.search(r"clipping functions do nothing and return\s+`None`", doc)
    assert "`clip_grad_norm_` returns the norm of the gradients accumulated so far" in doc
