"""LoRA adapters under DDP or FSDP2 (2 processes, gloo, CPU), run by
tests/integrations/test_peft_dist.py:

    python -m torch.distributed.run --nproc_per_node 2 peft_dist.py ddp|fsdp|deepspeed OUT_DIR BASE_DIR

Three fits, each 2 optimizer steps of 2 samples per rank with gradient clipping engaged:
1. a tiny Llama causal LM, LoRA on ``target_modules="all-linear"`` (token-exact loss
   over both ranks);
2. the same LoRA on q_proj and v_proj of a Llama given by its folder (BASE_DIR);
3. a tiny BERT classifier, LoRA on a list (``["query", "value"]``) plus the head
   (``modules_to_save``).
The first fit exports its adapters (ExportBestPretrained) to OUT_DIR/<STRATEGY>.named.export.
Rank 0 writes OUT_DIR/<STRATEGY>.<fit>.pt (the full trainable state, gathered) and each
fit saves a checkpoint (FSDP: sharded) at OUT_DIR/<STRATEGY>.<fit>.ckpt; the test
compares both with one process on the combined batches. The Llama fit (DeepSpeed: the
BERT one) is then resumed from its checkpoint for a third step, and run for 3 steps in
one go: OUT_DIR/<STRATEGY>.resume.pt.
"""
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_tiny  # noqa: E402
import peft_common as pc  # noqa: E402

from ember import Trainer  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember.integrations.transformers import ExportBestPretrained, PadCollator, TransformersModule  # noqa: E402
from ember.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy  # noqa: E402

CLIP = 0.002
#: AdamW with eps=1 (and no weight decay) makes a step proportional to the clipped
#: gradient, so a wrong clipping norm shows in the weights (with eps=1e-8 Adam's step
#: would not depend on the gradient's scale)
OPT = dict(lr=1.0, adam_eps=1.0, weight_decay=0.0, warmup_steps=0, scheduler="constant")


def fits(base_dir):
    """(name, module, loader of the per-rank batches): the test builds the same modules
    with the combined batches (batch size 4) in one process. ``base_dir`` holds a saved
    tiny Llama: a model given by name is read in configure_model (under FSDP on rank 0
    only, built on the meta device elsewhere, wrapped, then sent from rank 0)."""
    return [("named", lambda: TransformersModule(base_dir, task="causal-lm", **OPT,
                                                 peft_config=pc.lora(["q_proj", "v_proj"])),
             lambda bs: DataLoader(pc.lm_items(8), batch_size=bs, collate_fn=PadCollator(0, lm_labels=True))),
            ("llama", lambda: TransformersModule(pc.tiny_llama(), **OPT, peft_config=pc.lora("all-linear")),
             lambda bs: DataLoader(pc.lm_items(8), batch_size=bs, collate_fn=PadCollator(0, lm_labels=True))),
            ("bert", lambda: TransformersModule(hf_tiny.tiny_bert(), **OPT, peft_config=pc.lora(["query", "value"], task_type="SEQ_CLS")),
             lambda bs: DataLoader(cls_items(), batch_size=bs, collate_fn=PadCollator(0)))]


def cls_items():
    tok = hf_tiny.make_tokenizer()
    rows = hf_tiny.sentiment_rows(8, 3)
    return [{**{k: torch.tensor(v) for k, v in tok(text).items()}, "labels": torch.tensor(label)}
            for text, label in rows]


def make_strategy(kind):
    if kind == "deepspeed":
        return DeepSpeedStrategy(stage=2, timeout=60)
    return DDPStrategy(timeout=60) if kind == "ddp" else FSDPStrategy(timeout=60)


def main(kind, out, base_dir):
    torch.set_num_threads(1)
    for name, make_module, make_loader in fits(base_dir):
        if kind == "deepspeed" and name != "bert":
            continue
        strategy = make_strategy(kind)
        module = make_module()
        # no checkpoint callback: the export is of the current weights (gathered under FSDP)
        export = [ExportBestPretrained(os.path.join(out, f"{kind}.{name}.export"))] if name == "named" else []
        trainer = Trainer(strategy=strategy, devices=2, max_steps=2, precision="32-true", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=out, gradient_clip_val=CLIP, seed=0, callbacks=export)
        trainer.fit(module, train_dataloaders=make_loader(2))
        if name == "named" and kind == "fsdp":   # merging needs the whole base in one process
            try:
                module.save_pretrained(os.path.join(out, "merged"), merged=True)
            except MisconfigurationError as err:
                with open(os.path.join(out, f"merged_error.rank{trainer.global_rank}.txt"), "w") as f:
                    f.write(str(err))
        weights = trainer.strategy.module_state_dict(trainer.model)   # collective; the trainable entries
        trainer.save_checkpoint(os.path.join(out, f"{kind}.{name}.ckpt"))
        if trainer.is_global_zero:
            torch.save({k: v.detach().cpu() for k, v in weights.items()}, os.path.join(out, f"{kind}.{name}.pt"))
        if name == ("bert" if kind == "deepspeed" else "llama"):   # resumed for one more step, and 3 steps in one go
            runs = {}
            for run, ckpt in (("resumed", os.path.join(out, f"{kind}.{name}.ckpt")), ("straight", None)):
                strategy = make_strategy(kind)
                module = make_module()
                trainer = Trainer(strategy=strategy, devices=2, max_steps=3, precision="32-true", logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  default_root_dir=out, gradient_clip_val=CLIP, seed=0)
                trainer.fit(module, train_dataloaders=make_loader(2), ckpt_path=ckpt)
                runs[run] = trainer.strategy.module_state_dict(trainer.model)
            if trainer.is_global_zero:
                torch.save(runs, os.path.join(out, f"{kind}.resume.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
