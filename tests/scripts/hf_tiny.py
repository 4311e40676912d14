"""Tiny Hugging Face models (dropout off: deterministic gradients), a word-level
transformers integration tests. Everything is built locally: no downloads."""
from __future__ import annotations

import random

WORDS = ["the", "a", "movie", "film", "plot", "acting", "story", "was", "is", "very", "quite", "and",
         "but", "scene", "music", "cast", "ending", "script", "long", "short", "funny", "dark", "slow",
         "fast", "old", "new", "one", "two", "three", "four", "five", "six", "seven", "eight"]
POSITIVE = ["great", "superb", "wonderful"]
NEGATIVE = ["awful", "boring", "dull"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]


def make_tokenizer(eos_only: bool = False):
    """A WordLevel tokenizer over WORDS + sentiment words. ``eos_only=True`` gives a
    GPT-2-like tokenizer: no pad/cls/sep configured, only an EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + POSITIVE + NEGATIVE)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos_only:
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", unk_token="[UNK]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", eos_token="[EOS]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def vocab_size() -> int:
    return len(SPECIALS) + len(WORDS) + len(POSITIVE) + len(NEGATIVE)


def tiny_bert(num_labels: int = 2, seed: int = 0, head: str = "SequenceClassification"):
    """A 2-layer BERT of width 32 over the tiny vocabulary, dropout off, its weights drawn
    from ``torch.manual_seed(seed)``, with transformers' ``BertFor<head>`` on top."""
    import torch
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=37, max_position_embeddings=128, num_labels=num_labels,
                                  pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return getattr(transformers, f"BertFor{head}")(cfg)


def tiny_bert_token(num_labels: int = 3, seed: int = 0):
    """``tiny_bert`` with a token-classification head (3 labels)."""
    return tiny_bert(num_labels, seed, head="TokenClassification")


def tiny_gpt2(seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size(), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=SPECIALS.index("[EOS]"), eos_token_id=SPECIALS.index("[EOS]"))
    return GPT2LMHeadModel(cfg)


def tiny_t5(seed: int = 0):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab_size(), d_model=32, d_kv=16, d_ff=37, num_layers=2, num_heads=2,
                   dropout_rate=0.0,
                   pad_token_id=0, eos_token_id=SPECIALS.index("[EOS]"), decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


def sentiment_rows(n: int, seed: int = 0, string_labels: bool = False) -> list[tuple[str, object]]:
    """Sentences of 4-12 filler words plus one sentiment word; label 1 when it is positive."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        pos = rng.random() < 0.5
        words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if pos else NEGATIVE))
        label = ("pos" if pos else "neg") if string_labels else int(pos)
        rows.append((" ".join(words), label))
    return rows


def counting_texts(n: int, seed: int = 0) -> list[str]:
    """Runs of consecutive number words ('two three four ...') of uneven length: a causal
    LM can learn the successor rule."""
    rng = random.Random(seed)
    nums = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    out = []
    for _ in range(n):
        start = rng.randrange(len(nums) - 2)
        out.append(" ".join(nums[start:start + rng.randint(2, len(nums) - start)]))
    return out


def token_items(task: str, n: int = 10) -> list[dict]:
    """``n`` samples of uneven lengths for a token-level task ('causal-lm',
    'token-classification', 'seq2seq-lm'), as unpadded dicts for PadCollator."""
    import torch
    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 5, 12, 4, 7, 10, 2, 8, 6, 11, 3]
    items = []
    for i in range(n):
        size = lengths[i % len(lengths)]
        ids = torch.randint(5, vocab_size(), (size,), generator=g)
        if task == "causal-lm":
            items.append({"input_ids": ids})
        elif task == "token-classification":
            lab = torch.randint(0, 3, (size,), generator=g)
            lab[0] = -100   # e.g. a special token
            items.append({"input_ids": ids, "labels": lab})
        else:
            tgt = torch.randint(5, vocab_size(), (max(1, (i * 7) % 9),), generator=g)
            items.append({"input_ids": ids, "labels": tgt})
    return items


def model_for(task: str):
    return {"causal-lm": tiny_gpt2, "token-classification": tiny_bert_token, "seq2seq-lm": tiny_t5}[task]()


def grad_recorder(task: str, **kw):
    """A TransformersModule for ``task`` that records the gradients its optimizer sees
    (after the module's own token-exact rescaling) in ``module.seen``. AdamW with eps=1
    makes an update proportional to the gradient, so later steps do not amplify rounding."""
    from ember.integrations.transformers import TransformersModule

    class GradRecorder(TransformersModule):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.seen.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                              if p.grad is not None})

    args = dict(task=task, lr=1e-3, weight_decay=0.0, warmup_steps=0, adam_eps=1.0, scheduler="constant",
                num_labels=3 if task == "token-classification" else None)
    args.update(kw)
    module = GradRecorder(model_for(task), **args)
    module.seen = []
    return module


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest element difference relative to the largest gradient element (gradients that
    are zero in exact arithmetic, such as attention key biases, hold only rounding noise)."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a) / max(b[k].abs().max().item() for k in b)
