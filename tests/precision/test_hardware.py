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


def _hf():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import hf_tiny
    return hf_tiny


def _fit(tmp_path, precision):
    """A one-step TransformersModule fit -> (trainer, the bf16 suggestions it warned)."""
    hf_tiny = _hf()
    import ember
    from ember.integrations.transformers import TextClassificationData, TransformersModule
    data = TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(16), batch_size=8)
    trainer = ember.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=tmp_path, precision=precision)
    module = TransformersModule(hf_tiny.tiny_bert())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    return trainer, [w for w in got if "bfloat16 matrices" in str(w.message)]


@pytest.fixture
def cpu_has_bf16(monkeypatch):
    """Pretend this CPU has (True) or lacks (False) AMX-BF16: the choice depends on nothing else."""
    monkeypatch.delenv("EMBER_PRECISION", raising=False)

    def set_to(has: bool):
        monkeypatch.setattr(hardware, "cpu_bf16_feature", lambda: "amx_bf16" if has else None)
    return set_to


def test_native_bf16_by_device(cpu_has_bf16):
    cpu_has_bf16(True)
    assert hardware.native_bf16("cpu") == "amx_bf16" and hardware.native_bf16(torch.device("meta")) is None
    cpu_has_bf16(False)
    assert hardware.native_bf16("cpu") is None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        assert hardware.native_bf16("cuda:0") == (f"cuda sm_{major}{minor}" if major >= 8 else None)


def test_transformers_fit_given_no_precision_runs_bf16_where_the_cpu_has_it(tmp_path, cpu_has_bf16, one_thread):
    cpu_has_bf16(True)
    trainer, said = _fit(tmp_path, None)
    assert trainer.precision == "bf16-mixed" and said == []   # chosen, so nothing to suggest
    cpu_has_bf16(False)
    trainer, said = _fit(tmp_path, None)
    assert trainer.precision == "32-true" and said == []


def test_transformers_keeps_float32_for_regression_and_non_float32_weights(cpu_has_bf16):
    hf_tiny = _hf()
    from ember.integrations.transformers import TransformersModule
    cpu_has_bf16(True)
    cpu = torch.device("cpu")
    assert TransformersModule(hf_tiny.tiny_bert()).configure_precision(cpu) == "bf16-mixed"
    assert TransformersModule(hf_tiny.tiny_bert(num_labels=1)).configure_precision(cpu) is None
    assert TransformersModule(hf_tiny.tiny_bert().to(torch.float64)).configure_precision(cpu) is None
    assert TransformersModule(hf_tiny.tiny_gpt2(), task="causal-lm").configure_precision(cpu) == "bf16-mixed"
    cpu_has_bf16(False)
    assert TransformersModule(hf_tiny.tiny_bert()).configure_precision(cpu) is None


def test_transformers_model_given_by_name_is_not_read_to_choose(tmp_path, cpu_has_bf16):
    """A model given by name: its config.json and model_kwargs' dtype decide; the weights
    are not read (under FSDP only rank 0 reads them)."""
    hf_tiny = _hf()
    from ember.integrations.transformers import TransformersModule
    cpu_has_bf16(True)
    cpu = torch.device("cpu")
    hf_tiny.tiny_bert().save_pretrained(tmp_path / "cls")
    reg = hf_tiny.tiny_bert()
    reg.config.problem_type = "regression"   # read from config.json only
    reg.save_pretrained(tmp_path / "reg")
    by_name = TransformersModule(str(tmp_path / "cls"))
    assert by_name.configure_precision(cpu) == "bf16-mixed" and "model" not in by_name._modules
    regression = TransformersModule(str(tmp_path / "reg"), num_labels=2)
    assert regression.configure_precision(cpu) is None and "model" not in regression._modules
    half = TransformersModule(str(tmp_path / "cls"), model_kwargs={"dtype": torch.bfloat16})
    assert half.configure_precision(cpu) is None and "model" not in half._modules
    assert TransformersModule(str(tmp_path / "cls"), model_kwargs={"dtype": torch.float32}
                              ).configure_precision(cpu) == "bf16-mixed"


def test_transformers_fit_start_in_float32_suggests_bf16_once(tmp_path, one_thread):
    expected = int(hardware.cpu_bf16_feature() is not None)
    assert len(_fit(tmp_path, "bf16-mixed")[1]) == 0
    assert len(_fit(tmp_path, "32-true")[1]) == expected
    assert len(_fit(tmp_path, "32-true")[1]) == 0   # once per process
