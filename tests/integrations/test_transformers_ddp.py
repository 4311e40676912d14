"""TransformersModule under DDP: 2 real processes (torchrun, gloo, CPU) running
tests/scripts/hf_ddp.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import SCRIPTS, child_env

pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
from ember.integrations.transformers import PadCollator, TextClassificationData, TransformersModule  # noqa: E402
from ember.strategies.environments import find_free_port  # noqa: E402

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_ddp")
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "hf_ddp.py"), str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_token_exact_accumulation_across_ranks(ddp_run, tmp_path, one_thread):
    out, _ = ddp_run
    grads = [torch.load(out / f"exact_grads_rank{r}.pt", weights_only=True) for r in range(2)]
    assert hf_tiny.max_rel_diff(grads[0], grads[1]) == 0.0
    # one process (one torch thread), one batch of all 12 samples, the model's own mean loss
    module = hf_tiny.grad_recorder("causal-lm")
    items = hf_tiny.token_items("causal-lm", 12)
    trainer = ember.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path, precision="32-true")
    trainer.fit(module, DataLoader(items, batch_size=12, collate_fn=PadCollator(0, lm_labels=True)))
    assert hf_tiny.max_rel_diff(grads[0], module.seen[0]) < 1e-5


def test_ddp_fine_tuning_exports_the_best_checkpoint_once(ddp_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    out, (r0, r1) = ddp_run
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["metrics"]["val/acc"] == r1["metrics"]["val/acc"] >= 0.9
    assert r0["best"] == r1["best"] and os.path.isdir(r0["best"])
    assert r0["exported_from"] == r0["best"] and r1["exported_from"] is None   # rank zero wrote it
    assert r0["id2label"] == {"0": "neg", "1": "pos"}
    model = AutoModelForSequenceClassification.from_pretrained(out / "export").eval()
    tok = AutoTokenizer.from_pretrained(out / "export")
    assert model.config.id2label == {0: "neg", 1: "pos"}
    best = TransformersModule.load_from_checkpoint(r0["best"]).eval()
    enc = tok(["the plot was superb", "a boring film"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, best.model(**enc).logits)
        assert model(**enc).logits.argmax(-1).tolist() == [1, 0]


def test_length_grouped_ddp_trains_every_sample_once_per_epoch(ddp_run):
    """TextClassificationData groups by length by default; over the two ranks each epoch
    trains on every one of the 512 samples exactly once, each rank on 16 batches of
    similar lengths, and the epochs differ in order."""
    _, (r0, r1) = ddp_run
    assert r0["sampler"] == r1["sampler"] == "LengthGroupedSampler"
    data = TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(512, 0, string_labels=True))
    data.setup("fit")
    ds = data.datasets["train"]
    expected = sorted(ds[i]["input_ids"].tolist() for i in range(len(ds)))
    assert sorted(r0["seen"]) == sorted(r1["seen"]) == ["0", "1", "2", "3"]
    orders = []
    for epoch in r0["seen"]:
        b0, b1 = r0["seen"][epoch], r1["seen"][epoch]
        assert len(b0) == len(b1) == 16
        rows = [row for b in b0 + b1 for row in b]
        assert sorted(rows) == expected   # every sample once: none twice, none left out
        # the two ranks' j-th batches are one global batch of similar lengths
        spread = [max(map(len, x + y)) - min(map(len, x + y)) for x, y in zip(b0, b1)]
        assert sum(spread) / len(spread) <= 2
        orders.append([row for b in b0 for row in b])
    assert orders[0] != orders[1]
