"""Tiny models and data for the adapter (peft) tests: a Llama-style causal LM built from
a config, a LoRA config, and short causal-LM samples. Everything is built locally."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_tiny  # noqa: E402


def tiny_llama(seed: int = 0, hidden: int = 32, layers: int = 2, vocab: int | None = None, dtype=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab or hf_tiny.vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden + 5,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=128, pad_token_id=0, bos_token_id=4, eos_token_id=4,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    return model.to(dtype) if dtype is not None else model


def lora(target_modules="all-linear", task_type="CAUSAL_LM", **kw):
    from peft import LoraConfig
    return LoraConfig(task_type=task_type, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules,
                      init_lora_weights=kw.pop("init_lora_weights", False), **kw)


def lm_items(n: int = 8) -> list[dict]:
    return hf_tiny.token_items("causal-lm", n)
