"""TransformersModule: fine-tuning tiny Hugging Face models built from configs
(no downloads), token-exact gradient accumulation, export, schedules, errors."""
from __future__ import annotations

import math
import os
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import SCRIPTS

pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember.integrations.transformers import (CausalLMData, ExportBestPretrained, PadCollator,  # noqa: E402
                                             TextClassificationData, TransformersModule)


pytestmark = pytest.mark.usefixtures("one_thread")


def quiet_trainer(tmp_path, **kw):
    args = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)
    args.update(kw)
    return ember.Trainer(**args)


# ------------------------------------------------------------------------------- classification
def test_classification_learns_rule_labels_from_data_and_round_trips(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertModel
    tok = hf_tiny.make_tokenizer()
    base = tmp_path / "base"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=hf_tiny.vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=37, max_position_embeddings=64)).save_pretrained(base)
    tok.save_pretrained(base)
    # the tokenizer by path, string labels, no num_labels: the model is built with the data's classes
    data = TextClassificationData(str(base), train=hf_tiny.sentiment_rows(512, 0, string_labels=True),
                                  val=hf_tiny.sentiment_rows(128, 1, string_labels=True),
                                  predict=["the plot was great", "a dull film"], batch_size=32, max_length=32)
    module = TransformersModule(str(base), lr=3e-3, warmup_ratio=0.1)
    assert module.model is None
    trainer = quiet_trainer(tmp_path, max_epochs=4, seed=0)
    trainer.fit(module, datamodule=data)
    assert module.id2label == {0: "neg", 1: "pos"} and module.model.config.label2id == {"neg": 0, "pos": 1}
    assert module.hparams["num_labels"] == 2
    assert trainer.callback_metrics["val/acc"] >= 0.9
    assert 0.0 <= trainer.callback_metrics["val/f1"] <= 1.0 and trainer.callback_metrics["val/f1"] >= 0.85
    pred = trainer.predict(module, datamodule=data)
    assert [module.id2label[int(i)] for i in pred[0]["label"]] == ["pos", "neg"]
    assert torch.allclose(pred[0]["probs"].sum(-1), torch.ones(2))

    out = module.save_pretrained(tmp_path / "export")
    model2 = AutoModelForSequenceClassification.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    assert model2.config.id2label == {0: "neg", 1: "pos"}
    enc = tok2(["the plot was great", "a dull film and a long one"], padding=True, return_tensors="pt")
    enc_own = tok(["the plot was great", "a dull film and a long one"], padding=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], enc_own["input_ids"])
    module.eval()
    model2.eval()
    with torch.no_grad():
        assert torch.equal(model2(**enc).logits, module.model(**enc).logits)


def test_multiclass_metrics_and_num_labels_from_id2label(tmp_path):
    rows = [(t, ["neg", "pos", "mixed"][(lab + i) % 3]) for i, (t, lab) in enumerate(hf_tiny.sentiment_rows(60))]
    data = TextClassificationData(hf_tiny.make_tokenizer(), train=rows, val=rows[:30], batch_size=16)
    assert data.num_labels == 3 and data.id2label == {0: "mixed", 1: "neg", 2: "pos"}
    module = TransformersModule(hf_tiny.tiny_bert(num_labels=3), id2label=data.id2label, lr=1e-3)
    assert module.num_labels == 3 and module.label2id == {"mixed": 0, "neg": 1, "pos": 2}
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, datamodule=data)
    res = trainer.validate(module, datamodule=data)[0]
    assert set(res) == {"val/loss", "val/acc", "val/f1"}
    # macro F1 of 3 classes, computed independently
    from sklearn.metrics import accuracy_score, f1_score
    preds = torch.cat([p["label"] for p in trainer.predict(module, dataloaders=data.val_dataloader())]).tolist()
    target = data.datasets["val"].labels.tolist()
    assert res["val/acc"] == pytest.approx(accuracy_score(target, preds), abs=1e-6)
    assert res["val/f1"] == pytest.approx(f1_score(target, preds, average="macro"), abs=1e-6)


# ------------------------------------------------------------------------------- language models
def test_causal_lm_loss_decreases_and_generates(tmp_path):
    with pytest.warns(UserWarning, match="no pad token"):
        data = CausalLMData(hf_tiny.make_tokenizer(eos_only=True), train=hf_tiny.counting_texts(256),
                            val=hf_tiny.counting_texts(64, 1), predict=["one two", "four five six"],
                            batch_size=16, max_length=16)
    assert data.tokenizer.pad_token == "[EOS]"
    module = TransformersModule(hf_tiny.tiny_gpt2(), lr=3e-3, warmup_ratio=0.1,
                                generate_kwargs={"max_new_tokens": 3, "do_sample": False})
    assert module.task == "causal-lm"
    trainer = quiet_trainer(tmp_path, max_epochs=6, seed=0)
    before = trainer.validate(module, datamodule=data)[0]
    assert before["val/ppl"] == pytest.approx(math.exp(before["val/loss"]), rel=1e-5)
    trainer.fit(module, datamodule=data)
    after = trainer.validate(module, datamodule=data)[0]
    assert after["val/loss"] < 0.5 * before["val/loss"]
    out = trainer.predict(module, datamodule=data)
    assert out[0][0].split()[:2] == ["three", "four"]
    assert module.model.config.pad_token_id == data.tokenizer.pad_token_id


_token_batches = hf_tiny.token_items
_model_for = hf_tiny.model_for
_max_rel_diff = hf_tiny.max_rel_diff


def _run_grads(tmp_path, task, items, batch_sampler=None, batch_size=None, acc=1, steps=2, exact=True,
               precision="32-true"):
    module = hf_tiny.grad_recorder(task, token_exact_accumulation=exact)
    collate = PadCollator(0, lm_labels=task == "causal-lm")
    dl = DataLoader(items, batch_sampler=batch_sampler, collate_fn=collate) if batch_sampler else \
        DataLoader(items, batch_size=batch_size, collate_fn=collate)
    trainer = quiet_trainer(tmp_path, max_steps=steps, accumulate_grad_batches=acc, precision=precision)
    trainer.fit(module, train_dataloaders=dl)
    return module.seen


@pytest.mark.parametrize("task", ["causal-lm", "token-classification", "seq2seq-lm"])
def test_token_exact_accumulation_equals_big_batch(tmp_path, task):
    items = _token_batches(task)
    # reference: one batch per optimizer step (samples 0-5, then 6-9), the model's own mean loss
    big = _run_grads(tmp_path, task, items, batch_sampler=[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]])
    # 5 micro-batches of 2 with k=3: windows of 3 and (the epoch's last) 2 micro-batches
    small = _run_grads(tmp_path, task, items, batch_size=2, acc=3)
    assert len(big) == len(small) == 2
    for b, s in zip(big, small):
        assert _max_rel_diff(s, b) < 1e-5
    # without token-exact accumulation the per-micro-batch means differ from the big batch
    naive = _run_grads(tmp_path, task, items, batch_size=2, acc=3, steps=1, exact=False)
    assert _max_rel_diff(naive[0], big[0]) > 1e-2


def test_a_mean_loss_run_counts_nothing_per_step(tmp_path):
    """Token-exact accumulation is decided once, at train start: where it does not apply
    (one process without accumulation, or turned off) ``loss_count`` is None; a run
    without accumulation then enters no micro-batch context per step, one with
    accumulation enters it for the window (and counts tokens only when exact)."""
    from ember.callbacks import Callback

    class CountWindows(Callback):
        def on_train_start(self, trainer, module):
            self.calls, rules = 0, trainer.step_rules
            inner = rules.micro_batch

            def counted(*a, **k):
                self.calls += 1
                return inner(*a, **k)
            rules.micro_batch = counted

    items = _token_batches("causal-lm")
    collate = PadCollator(0, lm_labels=True)
    for acc, exact, counts, calls in [(1, True, False, 0), (2, False, False, 4), (2, True, True, 4)]:
        module, cb = hf_tiny.grad_recorder("causal-lm", token_exact_accumulation=exact), CountWindows()
        trainer = quiet_trainer(tmp_path, max_steps=2, accumulate_grad_batches=acc, callbacks=[cb])
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=2, collate_fn=collate))
        assert (module.loss_count is not None) == counts and cb.calls == calls, (acc, exact)
    assert module.loss_count(collate(items[:2])) == (collate(items[:2])["labels"][:, 1:] != -100).sum()


@pytest.mark.parametrize("precision,tol", [("16-mixed", 5e-3), ("bf16-mixed", 5e-2)])
def test_token_exact_accumulation_under_mixed_precision(tmp_path, precision, tol):
    """Under 16-mixed the GradScaler's scale is in the backward pass; the rescaled gradients
    still match the fp32 big batch (up to half-precision rounding)."""
    items = _token_batches("causal-lm")
    ref = _run_grads(tmp_path, "causal-lm", items, batch_sampler=[[0, 1, 2, 3, 4, 5]], steps=1)
    mixed = _run_grads(tmp_path, "causal-lm", items, batch_size=2, acc=3, steps=2, precision=precision)
    assert len(mixed) == 2 and all(torch.isfinite(g).all() for step in mixed for g in step.values())
    assert _max_rel_diff(mixed[0], ref[0]) < tol


@pytest.mark.parametrize("task", ["causal-lm", "token-classification", "seq2seq-lm"])
def test_token_loss_matches_the_models_own_loss(task):
    module = TransformersModule(_model_for(task), task=task,
                                num_labels=3 if task == "token-classification" else None)
    batch = PadCollator(0, lm_labels=task == "causal-lm")(_token_batches(task)[:4])
    with torch.no_grad():
        s, n, _ = module._token_loss(batch)
        ref = module.model(**batch).loss
    assert (s / n).item() == pytest.approx(ref.item(), rel=1e-5)


# ------------------------------------------------------------------------------- export
def test_export_best_checkpoint_gpt2_tied_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ember.callbacks import ModelCheckpoint
    with pytest.warns(UserWarning, match="no pad token"):
        data = CausalLMData(hf_tiny.make_tokenizer(eos_only=True), train=hf_tiny.counting_texts(64),
                            val=hf_tiny.counting_texts(16, 1), batch_size=16, max_length=16)
    module = TransformersModule(hf_tiny.tiny_gpt2(), lr=1e-2, warmup_steps=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/loss", save_top_k=1)
    export = ExportBestPretrained(tmp_path / "best")
    trainer = quiet_trainer(tmp_path, max_epochs=3, callbacks=[ckpt, export], enable_checkpointing=True)
    trainer.fit(module, datamodule=data)
    assert export.exported_from == ckpt.best_model_path and os.path.isdir(ckpt.best_model_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "best")
    assert AutoTokenizer.from_pretrained(tmp_path / "best").pad_token == "[EOS]"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    best = TransformersModule.load_from_checkpoint(ckpt.best_model_path)
    assert best.task == "causal-lm"
    batch = next(iter(data.val_dataloader()))
    batch.pop("labels")
    model.eval()
    best.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, best.model(**batch).logits)


# ------------------------------------------------------------------------------- optimization
def _former_factor(kind, step, warm, total):
    """ember's own schedule before it used transformers' get_scheduler."""
    if step < warm:
        return step / max(1, warm)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
def test_schedule_warmup_then_decay_sized_from_the_data(tmp_path, kind):
    data = TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(40), batch_size=4)
    module = TransformersModule(hf_tiny.tiny_bert(), lr=1e-3, warmup_ratio=0.2, scheduler=kind)
    lrs = []

    class Watch(ember.callbacks.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    trainer = quiet_trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2, callbacks=[Watch()])
    trainer.fit(module, datamodule=data)
    total = trainer.estimated_stepping_batches
    assert total == 10 == len(lrs)
    warm = math.ceil(0.2 * total)
    assert lrs == pytest.approx([1e-3 * _former_factor(kind, s, warm, total) for s in range(total)], rel=1e-12)


def test_schedule_without_a_trainer():
    module = TransformersModule(hf_tiny.tiny_bert(), lr=1.0, scheduler="constant", warmup_steps=4)
    sched = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert [sched.lr_lambdas[0](s) for s in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]
    with pytest.raises(MisconfigurationError, match="estimated_stepping_batches"):
        TransformersModule(hf_tiny.tiny_bert(), scheduler="cosine").configure_optimizers()


def test_no_weight_decay_on_biases_and_norms_and_freeze_base():
    no_total = dict(scheduler="constant", warmup_steps=0)   # no Trainer sizes the schedule here
    module = TransformersModule(hf_tiny.tiny_bert(), weight_decay=0.1, **no_total)
    opt = module.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in module.model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert "bert.encoder.layer.0.attention.self.query.weight" in decayed
    assert "bert.embeddings.LayerNorm.weight" in plain and "classifier.bias" in plain
    assert not any(n.endswith("bias") or "LayerNorm" in n for n in decayed)
    assert opt.defaults["fused"] is True   # one fused AdamW kernel per step, as transformers' Trainer
    frozen = TransformersModule(hf_tiny.tiny_bert(), freeze_base=True, **no_total)
    params = [p for g in frozen.configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    assert {id(p) for p in params} == {id(p) for p in frozen.model.classifier.parameters()}


def test_gradient_checkpointing_gives_the_same_gradients():
    batch = PadCollator(0, lm_labels=True)(_token_batches("causal-lm")[:4])
    grads = []
    for gc in (False, True):
        module = TransformersModule(hf_tiny.tiny_gpt2(), gradient_checkpointing=gc)
        module.train()
        module.model(**batch).loss.backward()
        grads.append({n: p.grad for n, p in module.model.named_parameters()})
    assert _max_rel_diff(grads[1], grads[0]) < 1e-5


# ------------------------------------------------------------------------------- errors
def test_unknown_task_lists_the_valid_ones():
    with pytest.raises(MisconfigurationError, match="task='translation'.*'sequence-classification'.*'causal-lm'"):
        TransformersModule(hf_tiny.tiny_bert(), task="translation")


def test_unknown_model_name_fails_fast_without_network(tmp_path):
    start = time.monotonic()
    with pytest.raises(MisconfigurationError, match="no-such-org/no-such-model.*not available locally.*local folder"):
        TransformersModule("no-such-org/no-such-model", num_labels=2)
    with pytest.raises(MisconfigurationError, match="tokenizer='no-such-org/no-such-model'.*not available locally"):
        TextClassificationData("no-such-org/no-such-model", train=["a"])
    assert time.monotonic() - start < 10


def test_num_labels_disagreeing_with_the_data(tmp_path):
    data = TextClassificationData(hf_tiny.make_tokenizer(), train=hf_tiny.sentiment_rows(16), batch_size=8)
    module = TransformersModule(hf_tiny.tiny_bert(num_labels=3), num_labels=3)
    with pytest.raises(MisconfigurationError, match="num_labels=3 but the data has 2 classes"):
        quiet_trainer(tmp_path, max_steps=1).fit(module, datamodule=data)
    with pytest.raises(MisconfigurationError, match="num_labels=2 but the model has 3 outputs"):
        TransformersModule(hf_tiny.tiny_bert(num_labels=3), num_labels=2)
    with pytest.raises(MisconfigurationError, match="num_labels=3 disagrees with id2label"):
        TransformersModule(hf_tiny.tiny_bert(), num_labels=3, id2label={0: "a", 1: "b"})


def test_bad_arguments():
    with pytest.raises(MisconfigurationError, match="scheduler='step'.*'linear', 'cosine', 'constant'"):
        TransformersModule(hf_tiny.tiny_bert(), scheduler="step")
    with pytest.raises(MisconfigurationError, match="warmup_ratio"):
        TransformersModule(hf_tiny.tiny_bert(), warmup_ratio=1.5)
    with pytest.raises(MisconfigurationError, match=r"model=\.\.\.\) is missing"):
        TransformersModule()
    module = TransformersModule(hf_tiny.tiny_bert())
    with pytest.raises(MisconfigurationError, match="no loss.*'labels'"):
        module.training_step({"input_ids": torch.ones(1, 3, dtype=torch.long)}, 0)
