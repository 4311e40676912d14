"""Fine-tune MiniLM-L6 on Rotten Tomatoes with ember, and with transformers' Trainer
side by side when it can run here (it needs the ``accelerate`` package).

    python benchmarks/finetune.py                 # 300 steps, batch 32, lr 1e-4, 6% warmup
    python benchmarks/finetune.py --steps 20      # a quick look
    python benchmarks/finetune.py --threads 2 --seeds 0 1 2 3 4   # five splits, means (docs/benchmarks.md)

Same settings for both: 11,752 training / 1,000 test reviews (split fixed by the seed),
AdamW (weight decay 0.01, none on biases and LayerNorm), linear schedule with 6%
warmup, gradient norm clipped at 1.0 (transformers' Trainer default), max length
128 with dynamic padding, fp32. Reports test accuracy and the
seconds per optimizer step of the training loop (tokenisation and model loading
excluded, measured separately).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "finetune"))

from rotten_tomatoes_data import LABELS, load_rotten_tomatoes, minilm_path  # noqa: E402

import ember  # noqa: E402
from ember.integrations.transformers import TextClassificationData, TransformersModule  # noqa: E402


class _StepClock(ember.callbacks.Callback):
    def on_train_start(self, trainer, module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, module):
        self.seconds = time.perf_counter() - self.start
        self.steps = trainer.global_step


def run_ember(args, data: TextClassificationData) -> dict:
    clock = _StepClock()
    t0 = time.perf_counter()
    module = TransformersModule(minilm_path(), task="sequence-classification", lr=args.lr,
                                weight_decay=args.weight_decay, warmup_ratio=args.warmup, scheduler="linear")
    trainer = ember.Trainer(max_steps=args.steps, seed=args.seed, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                            default_root_dir=tempfile.mkdtemp(prefix="ember_bench_"), precision=args.precision,
                            gradient_clip_val=args.clip or None)
    trainer.fit(module, datamodule=data)
    acc = trainer.test(module, datamodule=data)[0]["test/acc"]
    return {"test_acc": acc, "s_per_step": clock.seconds / clock.steps, "steps": clock.steps,
            "total_s": time.perf_counter() - t0}


def run_hf_trainer(args, data: TextClassificationData) -> dict:
    from transformers import (AutoModelForSequenceClassification, DataCollatorWithPadding, Trainer,
                              TrainingArguments, set_seed)
    set_seed(args.seed)
    t0 = time.perf_counter()
    model = AutoModelForSequenceClassification.from_pretrained(
        minilm_path(), num_labels=2, id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})

    def rows(split):   # the same token ids ember trains on
        ds = data.datasets[split]
        return [{"input_ids": ds[i]["input_ids"].tolist(), "labels": int(ds.labels[i])} for i in range(len(ds))]

    fields = TrainingArguments.__dataclass_fields__
    warm = {"warmup_ratio": args.warmup} if "warmup_ratio" in fields else {"warmup_steps": args.warmup}
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_bench_"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size * 2, learning_rate=args.lr, weight_decay=args.weight_decay,
        lr_scheduler_type="linear", seed=args.seed, max_grad_norm=args.clip, report_to="none", save_strategy="no", logging_steps=50,
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
        bf16=args.precision.startswith("bf16"), fp16=args.precision.startswith("16"), **warm)
    trainer = Trainer(model=model, args=targs, train_dataset=rows("train"),
                      data_collator=DataCollatorWithPadding(data.tokenizer))
    out = trainer.train()
    secs = out.metrics["train_runtime"]
    pred = trainer.predict(rows("test"))
    acc = float((torch.as_tensor(pred.predictions).argmax(-1) == torch.as_tensor(pred.label_ids)).float().mean())
    return {"test_acc": acc, "s_per_step": secs / out.global_step, "steps": out.global_step,
            "total_s": time.perf_counter() - t0}


def run_plain_loop(args, data: TextClassificationData) -> dict:
    """The same fine-tuning as a hand-written PyTorch loop (a reference for the numbers
    when transformers' Trainer cannot run): transformers' own warmup schedule, the same
    token ids, batches padded per batch, eval mode for the test."""
    import math

    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup

    from ember.integrations.transformers import PadCollator
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    ids = {id(p) for p in no_decay}
    decay = [p for p in model.parameters() if id(p) not in ids]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, fused=True)
    sched = get_linear_schedule_with_warmup(opt, math.ceil(args.warmup * args.steps), args.steps)
    collate = PadCollator(data.tokenizer.pad_token_id)
    loader = DataLoader(data.datasets["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(args.seed))
    model.train()
    step, start = 0, time.perf_counter()
    while step < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == args.steps:
                break
    secs = time.perf_counter() - start
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in DataLoader(data.datasets["test"], batch_size=args.batch_size * 2, collate_fn=collate):
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
            total += len(labels)
    return {"test_acc": correct / total, "s_per_step": secs / step, "steps": step, "total_s": time.perf_counter() - t0}


def run_seed(args, hf_first: bool) -> dict:
    """One split + training seed: ember and transformers' Trainer (and the plain loop) on the same token ids."""
    t0 = time.perf_counter()
    train, test = load_rotten_tomatoes(test_size=1000, seed=args.seed)
    data = TextClassificationData(minilm_path(), train=train, test=test, max_length=args.max_length,
                                  batch_size=args.batch_size, eval_batch_size=args.batch_size * 2, label_names=LABELS)
    data.setup("fit")
    prep = time.perf_counter() - t0
    majority = max(sum(lab == c for _, lab in test) for c in LABELS) / len(test)
    print(f"seed {args.seed}: {len(data.datasets['train'])} train / {len(data.datasets['test'])} test reviews, "
          f"read + tokenised in {prep:.1f}s; majority class = {majority:.3f} of test; "
          f"{torch.get_num_threads()} threads, device {'cuda' if torch.cuda.is_available() else 'cpu'}", flush=True)
    out = {"seed": args.seed, "hf_first": hf_first, "majority": majority}

    def ember_run():
        out["ember"] = run_ember(args, data)
        print(f"  ember:                test acc {out['ember']['test_acc']:.4f}   "
              f"{out['ember']['s_per_step']:.3f} s/step", flush=True)

    def hf_run():
        if args.skip_hf:
            out["transformers.Trainer"] = "skipped (--skip-hf)"
        elif importlib.util.find_spec("accelerate") is None:
            out["transformers.Trainer"] = "skipped: transformers' Trainer needs the accelerate package, not installed"
        else:
            out["transformers.Trainer"] = run_hf_trainer(args, data)
        hf = out["transformers.Trainer"]
        if isinstance(hf, dict):
            print(f"  transformers.Trainer: test acc {hf['test_acc']:.4f}   {hf['s_per_step']:.3f} s/step", flush=True)
        else:
            print(f"  transformers.Trainer: {hf}", flush=True)

    for run in ((hf_run, ember_run) if hf_first else (ember_run, hf_run)):
        run()
    if args.plain:
        out["plain PyTorch loop"] = plain = run_plain_loop(args, data)
        print(f"  plain PyTorch loop:   test acc {plain['test_acc']:.4f}   {plain['s_per_step']:.3f} s/step", flush=True)
    return out


def summarise(runs: list[dict]) -> dict:
    """Mean and sample standard deviation over seeds of each framework's accuracy and
    s/step, and the per-seed (paired) time ratio ember / Trainer."""
    import statistics

    summary = {}
    for name in ("ember", "transformers.Trainer", "plain PyTorch loop"):
        rows = [r[name] for r in runs if isinstance(r.get(name), dict)]
        if len(rows) < 2:
            continue
        acc = [r["test_acc"] for r in rows]
        sps = [r["s_per_step"] for r in rows]
        summary[name] = {"acc_mean": statistics.mean(acc), "acc_sd": statistics.stdev(acc),
                         "s_per_step_mean": statistics.mean(sps)}
        print(f"{name:22s} over {len(rows)} seeds: test acc {statistics.mean(acc):.4f} "
              f"+- {statistics.stdev(acc):.4f} (min {min(acc):.3f}, max {max(acc):.3f}); "
              f"{statistics.mean(sps):.3f} s/step", flush=True)
    pairs = [(r["ember"], r["transformers.Trainer"]) for r in runs if isinstance(r.get("transformers.Trainer"), dict)]
    if pairs:
        summary["time_ratio_median"] = statistics.median(e["s_per_step"] / h["s_per_step"] for e, h in pairs)
        summary["acc_diff_mean"] = statistics.mean(e["test_acc"] - h["test_acc"] for e, h in pairs)
        print(f"ember / Trainer time per step, median of per-seed ratios: {summary['time_ratio_median']:.3f}; "
              f"accuracy ember - Trainer, mean of per-seed differences: {summary['acc_diff_mean']:+.4f}", flush=True)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (transformers' default 1.0; 0: off)")
    p.add_argument("--precision", default="32-true", help="ember precision string (the HF run follows it)")
    p.add_argument("--seed", type=int, default=0, help="split and training seed")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="several seeds (each its own split and training seed), both frameworks on each, "
                        "alternating which runs first; prints means over seeds")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers' Trainer")
    p.add_argument("--hf-first", action="store_true",
                   help="run transformers' Trainer before ember (run both orders to cancel drifts of the machine)")
    p.add_argument("--plain", action="store_true",
                   help="also run the same fine-tuning as a hand-written PyTorch loop (a reference)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    seeds = args.seeds if args.seeds else [args.seed]
    results = {"runs": []}
    for k, seed in enumerate(seeds):
        args.seed = seed
        # several seeds: alternate which framework goes first, so drifts of the machine cancel
        hf_first = args.hf_first if len(seeds) == 1 else (k % 2 == 1)
        results["runs"].append(run_seed(args, hf_first))
    if len(seeds) > 1:
        results["summary"] = summarise(results["runs"])
    results["settings"] = vars(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
