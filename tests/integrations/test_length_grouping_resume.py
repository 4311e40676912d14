"""Fine-tuning with length-grouped batches (the TextClassificationData default) stops
mid-epoch and resumes bit-exactly: the same batches, the same weights, in float32 and
in bf16-mixed (what a Trainer given no precision runs on a CPU with bfloat16 units)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
from ember.callbacks import ModelCheckpoint  # noqa: E402
from ember.integrations.transformers import TextClassificationData, TransformersModule  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(root, max_steps, ckpt=None, callbacks=(), precision=None, **data_kw):
    tok = hf_tiny.make_tokenizer()
    dm = TextClassificationData(tok, train=hf_tiny.sentiment_rows(96), batch_size=8, **data_kw)
    module = TransformersModule(hf_tiny.tiny_bert(), lr=1e-3)
    trainer = ember.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=root, callbacks=list(callbacks), seed=0, precision=precision)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    return module, trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("data_kw", [{}, {"padding_free": True}], ids=["grouped", "grouped+padding_free"])
def test_stop_mid_epoch_and_resume_gives_the_same_weights(tmp_path, data_kw, precision):
    # 12 batches per epoch; a checkpoint after step 5 (mid-epoch), resumed to step 16 (into epoch 2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    full, trainer = _fit(tmp_path / "full", 16, callbacks=[ckpt], precision=precision, **data_kw)
    loader = trainer.train_dataloader
    assert type(loader.sampler).__name__ == "LengthGroupedSampler" and trainer.precision == precision
    resumed, _ = _fit(tmp_path / "resumed", 16, ckpt=str(tmp_path / "ckpt" / "epoch=0-step=5"),
                      precision=precision, **data_kw)
    a, b = full.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the run is not a no-op: the weights moved from the start
    start = hf_tiny.tiny_bert().state_dict()
    assert not torch.equal(start["classifier.weight"], full.model.classifier.weight)
