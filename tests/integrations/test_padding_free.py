"""Padding-free batches (TextClassificationData(padding_free=True)): per text, the
logits, the loss and the metrics equal those of the padded batch; gradients too."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
from ember.data import prepare_dataloader  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember.integrations.packing import ROW_MULTIPLE, PackCollator, packed_forward  # noqa: E402
from ember.integrations.transformers import PadCollator, TextClassificationData, TransformersModule  # noqa: E402

TOL = 1e-5   # float32 rounding: the packed and the padded runs sum in another order


pytestmark = pytest.mark.usefixtures("one_thread")


def _items(n=12, seed=0, pairs=False):
    tok = hf_tiny.make_tokenizer()
    rows = hf_tiny.sentiment_rows(n, seed)
    if pairs:
        enc = tok([t for t, _ in rows], [t[::-1] for t, _ in rows])
        return [{"input_ids": torch.tensor(i), "token_type_ids": torch.tensor(tt), "labels": torch.tensor(lab)}
                for i, tt, (_, lab) in zip(enc["input_ids"], enc["token_type_ids"], rows)]
    enc = tok([t for t, _ in rows])
    return [{"input_ids": torch.tensor(i), "labels": torch.tensor(lab)} for i, (_, lab) in zip(enc["input_ids"], rows)]


def _bert(dropout=0.0):
    model = hf_tiny.tiny_bert(num_labels=3)
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = dropout
    for m in model.modules():   # built with the tiny model's dropout (0); the attention reads its module's p
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    return model


@pytest.mark.parametrize("pairs", [False, True])
def test_per_text_logits_losses_and_gradients_equal_the_padded_batch(pairs):
    """40 texts: attention runs in three length buckets (16, 16 and 8 texts)."""
    from ember.integrations import packing
    items = _items(40, pairs=pairs)
    buckets = PackCollator()(items)["attention_layout"][1]
    assert [n for _, n, _, _ in buckets] == [16, 16, 8]
    assert all(w % packing.ATTENTION_MULTIPLE == 0 for _, _, w, _ in buckets)
    padded, packed = PadCollator(0)(items), PackCollator()(items)
    lengths = [len(it["input_ids"]) for it in items]
    total = sum(lengths)   # the row: the texts' tokens, then a tail of no text up to a multiple of ROW_MULTIPLE
    assert packed["input_ids"].shape == (1, -(-total // ROW_MULTIPLE) * ROW_MULTIPLE) and int(packed["cu_seq_lens"][-1]) == total
    assert total % ROW_MULTIPLE and padded["input_ids"].numel() > total
    model = _bert().train()   # dropout 0: train mode is deterministic
    ref = model(**padded)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = packed_forward(model, packed)
    out.loss.backward()
    assert out.logits.shape == ref.logits.shape == (len(items), 3)
    assert torch.allclose(out.logits, ref.logits, atol=TOL, rtol=0)
    per_text = torch.nn.functional.cross_entropy(out.logits, packed["labels"], reduction="none")
    per_text_ref = torch.nn.functional.cross_entropy(ref.logits, padded["labels"], reduction="none")
    assert torch.allclose(per_text, per_text_ref, atol=TOL, rtol=0)
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) < TOL
    for n, p in model.named_parameters():
        if n in ref_grads:
            assert torch.allclose(p.grad, ref_grads[n], atol=TOL, rtol=1e-4), n
    # the model still runs padded batches afterwards (evaluation with another loader)
    assert torch.allclose(model(**padded).logits, ref.logits, atol=TOL, rtol=0)


def test_the_attention_layout_comes_from_the_collator_not_a_host_read(monkeypatch):
    """The collator builds the attention's buckets on the CPU; packed_forward uses them
    (on a GPU, computing them from the device's boundaries reads them back to the host at
    every forward). A packed batch built by hand, without a layout, gets the same one."""
    from ember.integrations import packing
    items = _items(24)
    packed = PackCollator()(items)
    index, buckets, size = packed["attention_layout"]
    ref_index, ref_buckets, ref_size = packing._layout(packed["cu_seq_lens"])
    assert torch.equal(index, ref_index) and size == ref_size and len(buckets) == 2
    for (o, n, w, keep), (ro, rn, rw, rkeep) in zip(buckets, ref_buckets):
        assert (o, n, w) == (ro, rn, rw) and torch.equal(keep, rkeep)
    model = _bert().eval()
    by_hand = {k: v for k, v in packed.items() if k != "attention_layout"}
    with torch.no_grad():
        expect = packed_forward(model, by_hand).logits

        def no_layout(cu):
            raise AssertionError("packed_forward computed a layout the batch carries")
        monkeypatch.setattr(packing, "_layout", no_layout)
        assert torch.equal(packed_forward(model, packed).logits, expect)


def test_dropout_on_the_cpu_keeps_1_minus_p_from_torchs_generator(monkeypatch):
    """Packed training on the CPU draws dropout masks with one 32-bit number per element
    (keep_scale) instead of aten::bernoulli_: kept with probability 1 - p, scaled by
    1 / (1 - p), reproducible from torch's seed; the model's dropout modules and its
    attention dropout use it; evaluation is unchanged."""
    from ember.integrations import packing
    for p in (0.1, 0.5):
        torch.manual_seed(0)
        m = packing.keep_scale((1000, 1000), p, torch.float32)
        assert m.unique().tolist() == [0.0, pytest.approx(1 / (1 - p))]
        assert abs(float((m > 0).float().mean()) - (1 - p)) < 2e-3
        torch.manual_seed(0)
        assert torch.equal(packing.keep_scale((1000, 1000), p, torch.float32), m)
    # the attention's dropout: SDPA's float32 math with that mask on the probabilities
    q, k, v = (torch.randn(3, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.arange(8)[None, :] < torch.tensor([8, 5, 3])[:, None]
    keep = keep[:, None, None, :]
    torch.manual_seed(1)
    out = packing._attention_with_dropout(q, k, v, keep, 0.25, None)
    torch.manual_seed(1)
    probs = torch.softmax((q.float() @ k.float().transpose(-2, -1) / 2).masked_fill(~keep, float("-inf")), -1)
    expect = (probs * packing.keep_scale(probs.shape, 0.25, torch.float32)) @ v.float()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expect.to(torch.bfloat16))
    # a model with dropout: its nn.Dropout modules become CPUDropout (no weights change)
    items = _items(20)
    model = _bert(dropout=0.1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    packed = PackCollator()(items)
    model.train()
    calls = []
    real = packing._attention_with_dropout

    def counted(*args):   # the packed attention's dropout goes through keep_scale's math
        calls.append(args[-2])
        return real(*args)
    monkeypatch.setattr(packing, "_attention_with_dropout", counted)
    torch.manual_seed(2)
    a = packed_forward(model, packed).logits
    assert calls and set(calls) == {0.1}
    torch.manual_seed(2)
    b = packed_forward(model, packed).logits
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {packing.CPUDropout}
    assert torch.equal(a, b) and model.state_dict().keys() == before.keys()
    drop, x = next(m for m in model.modules() if isinstance(m, packing.CPUDropout)), torch.ones(4, 8)
    torch.manual_seed(3)
    y = drop(x)
    torch.manual_seed(3)
    assert torch.equal(y, x * packing.keep_scale(x.shape, drop.p, x.dtype))   # the modules' masks are keep_scale's
    model.eval()
    with torch.no_grad():
        plain = packed_forward(model, packed).logits
        assert torch.allclose(plain, model(**PadCollator(0)(items)).logits, atol=TOL, rtol=0)
    assert float((a.detach() - plain).abs().max()) > 1e-5   # dropout was applied in training
    a.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_flex_attention_kernel_gives_the_same_logits_without_gradients():
    items = _items(6)
    model = _bert().eval()
    with torch.no_grad():
        ref = model(**PadCollator(0)(items)).logits
        try:
            out = packed_forward(model, PackCollator()(items), attention="flex").logits
        except Exception as err:   # no C++ compiler for the compiled kernel on this machine
            pytest.skip(f"FlexAttention cannot compile here: {err}")
    assert torch.allclose(out, ref, atol=TOL, rtol=0)
    with pytest.raises(MisconfigurationError, match="packed_attention='flex'"):
        packed_forward(model.train(), PackCollator()(items), attention="flex").loss.backward()


def test_validation_and_test_metrics_equal_the_padded_run(tmp_path):
    tok = hf_tiny.make_tokenizer()
    rows, val = hf_tiny.sentiment_rows(64, 0), hf_tiny.sentiment_rows(37, 1)
    results = {}
    for free in (False, True):
        data = TextClassificationData(tok, train=rows, val=val, test=val, batch_size=8, padding_free=free)
        module = TransformersModule(hf_tiny.tiny_bert(), lr=3e-3)
        trainer = ember.Trainer(max_steps=8, logger=False, enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, default_root_dir=tmp_path, seed=0)
        trainer.fit(module, datamodule=data)
        fit = {k: float(v) for k, v in trainer.callback_metrics.items()}
        test = trainer.test(module, datamodule=data)[0]
        results[free] = (fit, test, module.model.classifier.weight.detach().clone())
    (fit0, test0, w0), (fit1, test1, w1) = results[False], results[True]
    assert test0.keys() == test1.keys() and {"test/acc", "test/f1", "test/loss"} <= test0.keys()
    for k in test0:
        assert abs(test0[k] - test1[k]) < TOL, k
    assert abs(fit0["val/loss"] - fit1["val/loss"]) < TOL and fit0["val/acc"] == fit1["val/acc"]
    # the same batches (length-grouped, the same order), so the same training to rounding
    assert torch.allclose(w0, w1, atol=1e-4, rtol=0)


def test_padding_free_batches_and_unsupported_models(tmp_path):
    tok = hf_tiny.make_tokenizer()
    data = TextClassificationData(tok, train=hf_tiny.sentiment_rows(40), batch_size=8, padding_free=True)
    batch = next(iter(prepare_dataloader(data.train_dataloader(), seed=0)))
    assert batch["input_ids"].shape[0] == 1 and batch["cu_seq_lens"].numel() == 9
    assert batch["position_ids"][0, 0] == 0 and batch["input_ids"].shape[1] % ROW_MULTIPLE == 0
    assert 0 <= batch["input_ids"].shape[1] - int(batch["cu_seq_lens"][-1]) < ROW_MULTIPLE
    with pytest.raises(MisconfigurationError, match="pad_to_multiple_of"):
        TextClassificationData(tok, train=hf_tiny.sentiment_rows(8), padding_free=True, pad_to_multiple_of=8)
    gpt = TransformersModule(hf_tiny.tiny_gpt2(), task="causal-lm")
    with pytest.raises(MisconfigurationError, match="padding_free=True supports sequence classification"):
        gpt.training_step(batch, 0)
