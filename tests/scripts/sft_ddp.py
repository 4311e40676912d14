"""Token-exact accumulation over packed supervised fine-tuning rows under DDP (2 processes,
gloo, CPU), run by tests/integrations/test_sft_data.py:

    python -m torch.distributed.run --nproc_per_node 2 sft_ddp.py OUT_DIR

8 packed rows of prompt/completion examples (uneven answer tokens per row), 2 ranks x 2
micro-batches of 2 rows = one optimizer step over all 8; each rank writes the gradients
its optimizer saw to OUT_DIR/grads_rank<R>.pt (they must equal one process on one batch
of the 8 rows).
"""
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sft_tiny  # noqa: E402

from ember import Trainer  # noqa: E402


def main(out):
    torch.set_num_threads(1)
    rows, collate = sft_tiny.packed_rows(8)
    module = sft_tiny.grad_recorder()
    trainer = Trainer(strategy="ddp", devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=out, num_sanity_val_steps=0, precision="32-true",
                      max_steps=1, accumulate_grad_batches=2)
    trainer.fit(module, DataLoader(rows, batch_size=2, collate_fn=collate))
    torch.save(module.seen[0], os.path.join(out, f"grads_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
