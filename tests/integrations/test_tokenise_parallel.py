"""Tokenising a split in several processes gives the token ids of one process, and the
disk cache it builds is the one a single process reads back."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import hf_tiny  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember.integrations.transformers import TextClassificationData  # noqa: E402


def _state(dm, split="train"):
    dm.setup("fit")
    return dm.datasets[split].state()


@pytest.mark.parametrize("pair", [None, "pair"])
def test_processes_give_the_same_tokens_and_cache(tmp_path, pair):
    tok = hf_tiny.make_tokenizer()
    rows = [{"text": t, "pair": t[::-1], "label": lab} for t, lab in hf_tiny.sentiment_rows(3000)]
    one = _state(TextClassificationData(tok, train=rows, text_pair_column=pair, num_proc=1))
    cache = tmp_path / "cache"
    many_dm = TextClassificationData(tok, train=rows, text_pair_column=pair, num_proc=3, cache_dir=cache)
    assert many_dm._processes(3000) == 3
    many = _state(many_dm)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    assert ("f.token_type_ids" in one) == (pair is not None)
    # the cache written by the processes is read back by a one-process DataModule
    assert len(os.listdir(cache)) == 1
    again = _state(TextClassificationData(tok, train=rows, text_pair_column=pair, num_proc=1, cache_dir=cache))
    assert all(torch.equal(one[k], again[k]) for k in one)


def test_automatic_process_count():
    tok = hf_tiny.make_tokenizer()
    dm = TextClassificationData(tok, train=hf_tiny.sentiment_rows(10))
    assert dm._processes(10) == 1 and dm._processes(99_999) == 1
    assert 1 <= dm._processes(100_000) <= 8
    assert TextClassificationData(tok, train=hf_tiny.sentiment_rows(10), num_proc=4)._processes(10) == 1
    with pytest.raises(MisconfigurationError, match="num_proc"):
        TextClassificationData(tok, train=hf_tiny.sentiment_rows(10), num_proc=0)


def test_without_datasets_one_process_and_num_proc_names_the_package(monkeypatch):
    tok = hf_tiny.make_tokenizer()
    monkeypatch.setitem(sys.modules, "datasets", None)   # not installed
    assert TextClassificationData(tok, train=hf_tiny.sentiment_rows(10))._processes(200_000) == 1
    with pytest.raises(MisconfigurationError, match=r"num_proc=2 needs the `datasets` package.*pip install datasets"):
        TextClassificationData(tok, train=hf_tiny.sentiment_rows(10), num_proc=2)
