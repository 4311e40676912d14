"""Where one fine-tuning step goes: ember's ``TransformersModule`` on the tweets corpus of
``finetune.py`` (MiniLM-L6, batch 32, length-grouped batches), profiled with
``torch.profiler`` from step 5 to the last, the self CPU time of the ops grouped into
matrix products, dropout masks, casts, the optimizer and clipping norms.

    .venv/bin/python benchmarks/finetune_profile.py 32-true 25
    .venv/bin/python benchmarks/finetune_profile.py bf16-mixed 25 --table   # + the top ops
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune as F  # noqa: E402

import ember  # noqa: E402

START = 5
GROUPS = {"matrix products (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
          "dropout masks (bernoulli_)": ("aten::bernoulli_",),
          "casts/copies (copy_, _to_copy)": ("aten::copy_", "aten::_to_copy"),
          "AdamW (fused)": ("aten::_fused_adamw_",),
          "clipping norms (linalg_vector_norm)": ("aten::linalg_vector_norm",)}


class Profile(ember.callbacks.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == START:
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, module):
        self.seconds = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("precision", choices=("32-true", "bf16-mixed"))
    p.add_argument("steps", type=int, help=f"optimizer steps in all (profiled from step {START})")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--padding-free", action="store_true")
    p.add_argument("--table", action="store_true", help="also print torch.profiler's table of the top ops")
    args = p.parse_args(argv)
    if args.steps <= START:
        p.error(f"steps must be more than {START}")
    torch.set_num_threads(args.threads)
    (train, test), labels = F.DATASETS["tweets"](0)
    data = F.CountingData(F.minilm_path(), train=train, test=test, max_length=128, batch_size=32,
                          eval_batch_size=64, label_names=labels, group_by_length=True,
                          padding_free=args.padding_free)
    data.setup("fit")
    cb = Profile()
    module = F.TransformersModule(F.minilm_path(), lr=1e-4, weight_decay=0.01, warmup_ratio=0.06, scheduler="linear")
    trainer = ember.Trainer(max_steps=args.steps, seed=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                            default_root_dir=tempfile.mkdtemp(prefix="ember_prof_"), precision=args.precision,
                            gradient_clip_val=1.0)
    trainer.fit(module, datamodule=data)
    n = args.steps - START
    ops = {e.key: e.self_cpu_time_total for e in cb.prof.key_averages()}
    total = sum(ops.values())
    print(f"{args.precision}, {args.threads} threads: {cb.seconds / n * 1e3:.0f} ms/step wall over steps "
          f"{START}-{args.steps}; real tokens / computed {data.counter.real / data.counter.padded:.2f}")
    for name, keys in GROUPS.items():
        v = sum(ops.get(k, 0) for k in keys)
        print(f"  {name:40s} {v / 1e3 / n:7.1f} ms/step  {v / total:6.1%}")
    print(f"  {'every op (self CPU time)':40s} {total / 1e3 / n:7.1f} ms/step")
    if args.table:
        print(cb.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
