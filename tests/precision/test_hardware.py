"""The bfloat16 hardware check and the one-time bf16-mixed suggestion at fit start."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from ember.precision import hardware


def _flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pytest.skip("no /proc/cpuinfo")


@pytest.fixture(autouse=True)
def _fresh():
    hardware._suggested.clear()
    yield
    hardware._suggested.clear()


def test_feature_is_read_from_the_cpu_flags():
    flags = _flags()
    want = "amx_bf16" if "amx_bf16" in flags else ("avx512_bf16" if "avx512_bf16" in flags else None)
    assert hardware.cpu_bf16_feature() == want


def test_suggests_once_for_float32_on_such_a_cpu_and_never_otherwise():
    has = hardware.cpu_bf16_feature() is not None
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert hardware.suggest_bf16("bf16-mixed", "cpu") is False
        assert hardware.suggest_bf16("32-true", "cuda") is False
        assert hardware.suggest_bf16("32-true", "cpu") is has
        assert hardware.suggest_bf16("32-true", "cpu") is False   # once per process
    texts = [str(w.message) for w in got]
    assert len(texts) == int(has)
    if has:
        assert 'precision="bf16-mixed"' in texts[0] and hardware.cpu_bf16_feature() in texts[0]


def test_transformers_fit_start_suggests_bf16_once(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import hf_tiny

    import ember
    from ember.integrations.transformers import TextClassificationData, TransformersModule
    torch.set_num_threads(1)
    tok = hf_tiny.make_tokenizer()

    def fit(precision):
        data = TextClassificationData(tok, train=hf_tiny.sentiment_rows(16), batch_size=8)
        trainer = ember.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, default_root_dir=tmp_path, precision=precision)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            trainer.fit(TransformersModule(hf_tiny.tiny_bert()), datamodule=data)
        return [w for w in got if "bfloat16 matrices" in str(w.message)]

    expected = int(hardware.cpu_bf16_feature() is not None)
    assert len(fit("bf16-mixed")) == 0
    assert len(fit("32-true")) == expected
    assert len(fit("32-true")) == 0   # once per process
