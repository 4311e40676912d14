"""Transformers fine-tuning under DDP (2 processes, gloo, CPU), run by
tests/integrations/test_transformers_ddp.py:

    python -m torch.distributed.run --nproc_per_node 2 hf_ddp.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.json and OUT_DIR/exact_grads_rank<R>.pt:
1. token-exact accumulation: 12 causal-LM samples of uneven lengths, 2 ranks x 3
   micro-batches of 2 = one optimizer step over all 12; the gradients must equal one
   process on one batch of 12.
2. sequence classification fit with ModelCheckpoint(monitor=val/acc) and
   ExportBestPretrained: rank zero writes the export once. The data is length-grouped
   (TextClassificationData's default): each rank records the texts of every batch it
   trained on, per epoch (``seen``), so the test checks every sample once per epoch.
"""
import json
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_tiny  # noqa: E402

from ember import Trainer  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.integrations.transformers import (ExportBestPretrained, PadCollator,  # noqa: E402
                                             TextClassificationData, TransformersModule)


def quiet(root, **kw):
    # float32 by hand: the exactness checks compare with float32 runs in one process, and a
    # Trainer given no precision runs TransformersModule in bf16 on a CPU with AMX / AVX512-BF16
    kw.setdefault("precision", "32-true")
    return Trainer(strategy="ddp", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=root, num_sanity_val_steps=0, **kw)


class SeenTexts(Callback):
    """The real tokens of every training sample of this rank, per epoch."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        self.seen.setdefault(str(trainer.current_epoch), []).append(rows)


def main(out):
    torch.set_num_threads(1)
    # 1. token-exact accumulation across micro-batches and ranks
    module = hf_tiny.grad_recorder("causal-lm")
    items = hf_tiny.token_items("causal-lm", 12)
    trainer = quiet(out, max_steps=1, accumulate_grad_batches=3, enable_checkpointing=False)
    trainer.fit(module, DataLoader(items, batch_size=2, collate_fn=PadCollator(0, lm_labels=True)))
    rank = trainer.global_rank
    torch.save(module.seen[0], os.path.join(out, f"exact_grads_rank{rank}.pt"))

    # 2. classification fine-tuning + export of the best checkpoint
    tok = hf_tiny.make_tokenizer()
    data = TextClassificationData(tok, train=hf_tiny.sentiment_rows(512, 0, string_labels=True),
                                  val=hf_tiny.sentiment_rows(63, 1, string_labels=True), batch_size=16)
    module = TransformersModule(hf_tiny.tiny_bert(), lr=3e-3, warmup_ratio=0.1)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), monitor="val/acc", mode="max")
    export = ExportBestPretrained(os.path.join(out, "export"))
    seen = SeenTexts()
    trainer = quiet(out, max_epochs=4, callbacks=[ckpt, export, seen], seed=0)
    trainer.fit(module, datamodule=data)
    res = {"rank": trainer.global_rank, "world": trainer.world_size,
           "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
           "best": ckpt.best_model_path, "exported_from": export.exported_from,
           "id2label": {str(k): v for k, v in module.id2label.items()},
           "sampler": type(trainer.train_dataloader.sampler).__name__, "seen": seen.seen}
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
