"""Ports of the patterns of Accelerate's example scripts (``nlp_example.py`` and
``examples/by_feature/*``: gradient_accumulation, checkpointing, tracking,
multi_process_metrics, early_stopping, memory, automatic_gradient_accumulation,
local_sgd, cross_validation, profiler), and their shuffled loop left at a step limit
(``shuffled_passes``), written against ember's Accelerate names.
The import lines below are the only ember-specific lines: run under
``run_with_accelerate.py`` the same file runs on Accelerate itself (it maps the
``ember`` modules to ``accelerate``'s), so the printed metrics can be compared.

A tiny BERT from a config and synthetic token data stand in for GLUE MRPC (no
downloads). ``shuffle=False`` for training, as in the first rounds (on one process
ember's shuffled order equals Accelerate's: tests/data/test_pass_orders.py, and
docs/porting.md).

    python tests/ports/accelerate/by_feature.py OUT.json [PATTERN ...]
    ember launch --num_processes 2 --cpu tests/ports/accelerate/by_feature.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from torch.utils.data import DataLoader

from ember import Accelerator, DistributedType  # noqa: F401  (from accelerate import ...)
from ember.local_sgd import LocalSGD  # (from accelerate.local_sgd import LocalSGD)
from ember.logging import get_logger  # (from accelerate.logging import get_logger)
from ember.utils import ProfileKwargs, find_executable_batch_size, set_seed  # (from accelerate.utils import ...)

logger = get_logger(__name__)
EVAL_BATCH_SIZE = 8
VOCAB, SEQ = 64, 8


def synthetic(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    labels = ((ids[:, 0] + ids[:, 1]) % 2).long()
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]}
            for i in range(n)]


def get_dataloaders(accelerator, batch_size: int = 8, train=None, evald=None):
    train = synthetic(64, 1) if train is None else train
    evald = synthetic(36, 2) if evald is None else evald
    train_dl = DataLoader(train, shuffle=False, batch_size=batch_size, drop_last=True)
    eval_dl = DataLoader(evald, shuffle=False, batch_size=EVAL_BATCH_SIZE, drop_last=False)
    return train_dl, eval_dl


def get_model():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=SEQ, num_labels=2)
    return BertForSequenceClassification(cfg)


def evaluate(accelerator, model, eval_dl):
    model.eval()
    correct = total = 0
    for batch in eval_dl:
        with torch.no_grad():
            outputs = model(**batch)
        predictions = outputs.logits.argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += (predictions == references).sum().item()
        total += references.numel()
    return {"accuracy": round(correct / total, 6), "n_eval": total}


def training_function(config, args, **acc_kwargs):
    """nlp_example.py's loop (the base of every by_feature script)."""
    accelerator = Accelerator(cpu=args.get("cpu", False), mixed_precision="no", **acc_kwargs)
    set_seed(config["seed"])
    train_dl, eval_dl = get_dataloaders(accelerator, config["batch_size"])
    model = get_model()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config["lr"])
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=len(train_dl) * config["epochs"])
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler)
    losses = []
    for epoch in range(config["epochs"]):
        model.train()
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        metric = evaluate(accelerator, model, eval_dl)
        accelerator.print(f"epoch {epoch}:", metric)
    accelerator.end_training()
    return {"last_loss": round(losses[-1], 6), **metric, "world": accelerator.num_processes}


CONFIG = {"lr": 2e-3, "epochs": 2, "seed": 42, "batch_size": 8}


def nlp_example(args):
    return training_function(CONFIG, args)


def gradient_accumulation(args):
    return training_function(CONFIG, args, gradient_accumulation_steps=2)


def checkpointing(args):
    """Save every epoch, then resume from epoch 0's checkpoint in fresh objects and
    finish: the final metric equals the uninterrupted run's."""
    out = tempfile.mkdtemp() if args["rank0_dir"] is None else args["rank0_dir"]
    results = []
    for resume in (False, True):
        accelerator = Accelerator(cpu=args.get("cpu", False))
        set_seed(CONFIG["seed"])
        train_dl, eval_dl = get_dataloaders(accelerator, CONFIG["batch_size"])
        model = get_model()
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        start = 0
        if resume:
            accelerator.load_state(os.path.join(out, "epoch_0"))
            start = 1
        for epoch in range(start, CONFIG["epochs"]):
            model.train()
            for batch in train_dl:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if not resume:
                accelerator.save_state(os.path.join(out, f"epoch_{epoch}"))
        results.append(evaluate(accelerator, model, eval_dl))
        accelerator.end_training()
    return {"uninterrupted": results[0], "resumed": results[1]}


def tracking(args):
    with tempfile.TemporaryDirectory() as d:
        accelerator = Accelerator(cpu=args.get("cpu", False), log_with="tensorboard", project_dir=d)
        accelerator.init_trackers("nlp_example", {"lr": CONFIG["lr"], "epochs": CONFIG["epochs"]})
        set_seed(CONFIG["seed"])
        train_dl, eval_dl = get_dataloaders(accelerator, CONFIG["batch_size"])
        model = get_model()
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        for epoch in range(CONFIG["epochs"]):
            model.train()
            total_loss = 0
            for batch in train_dl:
                loss = model(**batch).loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            metric = evaluate(accelerator, model, eval_dl)
            accelerator.log({"accuracy": metric["accuracy"], "train_loss": total_loss.item() / len(train_dl),
                             "epoch": epoch}, step=epoch)
        accelerator.end_training()
        files = sum(len(f) for _, _, f in os.walk(d))
    return {**metric, "tracker_files": int(files > 0) if accelerator.is_main_process else 1}


def multi_process_metrics(args):
    """The manual form: gather, then cut the duplicated samples of the last batch."""
    accelerator = Accelerator(cpu=args.get("cpu", False))
    set_seed(CONFIG["seed"])
    _, eval_dl = get_dataloaders(accelerator, CONFIG["batch_size"])
    model = get_model()
    model, eval_dl = accelerator.prepare(model, eval_dl)
    model.eval()
    samples_seen = correct = total = 0
    for step, batch in enumerate(eval_dl):
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(dim=-1)
        predictions, references = accelerator.gather((predictions, batch["labels"]))
        if accelerator.use_distributed:
            if step == len(eval_dl) - 1:
                predictions = predictions[: len(eval_dl.dataset) - samples_seen]
                references = references[: len(eval_dl.dataset) - samples_seen]
            else:
                samples_seen += references.shape[0]
        correct += (predictions == references).sum().item()
        total += references.numel()
    return {"accuracy": round(correct / total, 6), "n_eval": total}


def early_stopping(args):
    accelerator = Accelerator(cpu=args.get("cpu", False))
    set_seed(CONFIG["seed"])
    train_dl, _ = get_dataloaders(accelerator, CONFIG["batch_size"])
    model = get_model()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    steps = 0
    for batch in train_dl:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps == 3 and accelerator.is_main_process:   # "the loss stopped improving" on one process
            accelerator.set_trigger()
        if accelerator.check_trigger():
            break
    return {"stopped_after": steps}


def memory(args):
    accelerator = Accelerator(cpu=args.get("cpu", False))
    tried = []

    @find_executable_batch_size(starting_batch_size=32)
    def inner_training_loop(batch_size):
        accelerator.free_memory()
        tried.append(batch_size)
        if batch_size > 8:   # stands in for a CUDA OOM of the real script
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        set_seed(CONFIG["seed"])
        train_dl, eval_dl = get_dataloaders(accelerator, batch_size)
        model = get_model()
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        for batch in train_dl:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        return evaluate(accelerator, model, eval_dl)
    return {**inner_training_loop(), "tried": tried}


def automatic_gradient_accumulation(args):
    observed_batch_size = 16
    accelerator = Accelerator(cpu=args.get("cpu", False))

    @find_executable_batch_size(starting_batch_size=observed_batch_size)
    def inner(batch_size):
        accelerator.free_memory()
        if batch_size > 8:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        accelerator.gradient_accumulation_steps = observed_batch_size // batch_size
        set_seed(CONFIG["seed"])
        train_dl, eval_dl = get_dataloaders(accelerator, batch_size)
        model = get_model()
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        for batch in train_dl:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
        return {**evaluate(accelerator, model, eval_dl), "gas": accelerator.gradient_accumulation_steps}
    return inner()


def local_sgd(args):
    accelerator = Accelerator(cpu=args.get("cpu", False))
    set_seed(CONFIG["seed"])
    train_dl, eval_dl = get_dataloaders(accelerator, CONFIG["batch_size"])
    model = get_model()
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2, enabled=True) as local:
        for batch in train_dl:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
                local.step()
    return evaluate(accelerator, model, eval_dl)


def cross_validation(args):
    accelerator = Accelerator(cpu=args.get("cpu", False))
    data = synthetic(64, 1)
    folds = [data[:32], data[32:]]
    test_dl = accelerator.prepare(DataLoader(synthetic(20, 3), batch_size=EVAL_BATCH_SIZE))
    fold_logits = []
    for i in range(2):
        set_seed(CONFIG["seed"])
        train_dl, eval_dl = get_dataloaders(accelerator, CONFIG["batch_size"], folds[i], folds[1 - i])
        model = get_model()
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        for batch in train_dl:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        logits = []
        for batch in test_dl:
            with torch.no_grad():
                logits.append(accelerator.gather_for_metrics(model(**batch).logits))
        fold_logits.append(torch.cat(logits))
        accelerator.free_memory(model, optimizer)
    test_labels = torch.stack([d["labels"] for d in synthetic(20, 3)])
    preds = torch.stack(fold_logits).sum(0).argmax(-1)
    return {"ensemble_accuracy": round((preds == test_labels).float().mean().item(), 6), "n_test": len(preds)}


def profiler(args):
    accelerator = Accelerator(cpu=args.get("cpu", False),
                              kwargs_handlers=[ProfileKwargs(activities=["cpu"], record_shapes=True)])
    set_seed(CONFIG["seed"])
    model = accelerator.prepare(get_model())
    batch = next(iter(get_dataloaders(accelerator, 4)[0]))
    with accelerator.profile() as prof:
        with torch.no_grad():
            model(**batch)
    return {"profiled_ops": int(len(prof.key_averages()) > 0)}


def shuffled_passes(args):
    """The loop as Accelerate's examples ship it: ``shuffle=True``, ``set_seed`` after the
    Accelerator, and each epoch left after a step limit (run_clm_no_trainer's
    ``max_train_steps``; build_your_own_trainer's ``limit_train_batches``): a new order every
    pass, the same one in two identical runs, and on one process Accelerate's order and losses."""
    runs = []
    for _ in range(2):
        accelerator = Accelerator(cpu=args.get("cpu", False))
        set_seed(CONFIG["seed"])
        train_dl = DataLoader(synthetic(64, 1), shuffle=True, batch_size=CONFIG["batch_size"])
        model = get_model()
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=CONFIG["lr"])
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
        losses, first_rows = [], []
        for epoch in range(3):
            model.train()
            for step, batch in enumerate(train_dl):
                if step == 0:
                    first_rows.append(batch["input_ids"][0].tolist())
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(round(loss.item(), 6))
                if step + 1 == 3:   # the step limit: the pass is left here
                    break
        runs.append({"losses": losses, "first_rows": first_rows})
        accelerator.free_memory()
    return {**runs[0], "same_twice": runs[0] == runs[1], "world": accelerator.num_processes}


PATTERNS = ["nlp_example", "gradient_accumulation", "checkpointing", "tracking", "multi_process_metrics",
            "early_stopping", "memory", "automatic_gradient_accumulation", "local_sgd", "cross_validation",
            "profiler", "shuffled_passes"]


def main():
    out, names = sys.argv[1], sys.argv[2:] or PATTERNS
    ckpt = os.environ.get("PORT_CKPT_DIR")
    results = {}
    for name in names:
        results[name] = globals()[name]({"cpu": True, "rank0_dir": ckpt})
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
