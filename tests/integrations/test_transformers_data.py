"""TextClassificationData / CausalLMData: reading, labels, splits, the tokenised
cache, dynamic padding, length grouping (with ember's resumable loaders)."""
from __future__ import annotations

import bz2
import csv
import json
import os
import sys

import pytest
import torch

from helpers import SCRIPTS

pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
import hf_tiny  # noqa: E402
from ember.callbacks import ModelCheckpoint  # noqa: E402
from ember.data import prepare_dataloader, skip_batches  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember.integrations.transformers import (CausalLMData, LengthGroupedSampler,  # noqa: E402
                                             TextClassificationData, TransformersModule)

ROWS = [("the movie was great", "pos"), ("a dull plot", "neg"), ("superb acting and music", "pos"),
        ("boring", "neg"), ("the ending was awful but the cast was wonderful", "pos")]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok():
    return hf_tiny.make_tokenizer()


def _ids(dm, split="train"):
    dm.setup("fit")
    ds = dm.datasets[split]
    return [ds[i]["input_ids"].tolist() for i in range(len(ds))], ds.labels.tolist() if ds.labels is not None else None


def _write_sources(tmp_path):
    paths = {}
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "label"])
        w.writerows([(i, t, lab) for i, (t, lab) in enumerate(ROWS)])
    paths["csv"] = tmp_path / "d.csv"
    with open(tmp_path / "d.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["text", "label"])
        w.writerows(ROWS)
    paths["tsv"] = tmp_path / "d.tsv"
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t, "label": lab}) for t, lab in ROWS) + "\n")
    paths["jsonl"] = tmp_path / "d.jsonl"
    (tmp_path / "d.json").write_text(json.dumps([{"text": t, "label": lab} for t, lab in ROWS]))
    paths["json"] = tmp_path / "d.json"
    with bz2.open(tmp_path / "d.csv.bz2", "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(ROWS)
    paths["csv.bz2"] = tmp_path / "d.csv.bz2"
    return paths


def test_every_source_format_gives_the_same_tokens(tmp_path, tok):
    ref = _ids(TextClassificationData(tok, train=ROWS))
    assert ref[1] == [1, 0, 1, 0, 1]   # neg < pos
    sources = dict(_write_sources(tmp_path))
    sources["dicts"] = [{"text": t, "label": lab} for t, lab in ROWS]
    sources["columns"] = {"text": [t for t, _ in ROWS], "label": [lab for _, lab in ROWS]}
    for name, src in sources.items():
        assert _ids(TextClassificationData(tok, train=src)) == ref, name
    texts_only = TextClassificationData(tok, predict=[t for t, _ in ROWS])
    texts_only.setup("predict")
    assert [texts_only.datasets["predict"][i]["input_ids"].tolist() for i in range(5)] == ref[0]
    assert texts_only.datasets["predict"].labels is None


def test_labels_integers_names_and_errors(tok, tmp_path):
    ints = TextClassificationData(tok, train=[(t, i % 3) for i, (t, _) in enumerate(ROWS)])
    assert ints.num_labels == 3 and ints.id2label == {0: "0", 1: "1", 2: "2"}
    named = TextClassificationData(tok, train=ROWS, label_names=["pos", "neg"])
    assert named.label2id == {"pos": 0, "neg": 1} and _ids(named)[1] == [0, 1, 0, 1, 0]
    csv_ints = tmp_path / "ints.csv"
    csv_ints.write_text("text,label\nthe movie,1\na plot,0\n")
    assert _ids(TextClassificationData(tok, train=csv_ints))[1] == [1, 0]
    with pytest.raises(MisconfigurationError, match=r"val row 0: label 'meh' is not one of the 2 classes \['neg', 'pos'\]"):
        TextClassificationData(tok, train=ROWS, val=[("the plot", "meh")]).setup("fit")
    with pytest.raises(MisconfigurationError, match=r"label_column='label': no such column.*columns are \['id', 'sentence'\]"):
        TextClassificationData(tok, train=[{"id": 1, "sentence": "a"}], text_column="sentence").setup("fit")
    with pytest.raises(MisconfigurationError, match=r"text_column='text': no such column.*\['label', 'review'\]"):
        TextClassificationData(tok, train=[{"review": "a", "label": 1}]).setup("fit")
    with pytest.raises(MisconfigurationError, match="label_names"):
        TextClassificationData(tok, train=ROWS, label_names=["only"])
    with pytest.raises(MisconfigurationError, match="no such file"):
        TextClassificationData(tok, train=tmp_path / "missing.csv").setup("fit")
    with pytest.raises(MisconfigurationError, match="val_split and val are both set"):
        TextClassificationData(tok, train=ROWS, val=ROWS, val_split=0.2)
    with pytest.raises(MisconfigurationError, match="val_split=1.5"):
        TextClassificationData(tok, train=ROWS, val_split=1.5)


def test_val_split_is_fixed_by_the_seed(tok):
    rows = hf_tiny.sentiment_rows(100)

    def split(seed):
        dm = TextClassificationData(tok, train=rows, val_split=0.2, seed=seed)
        dm.setup("fit")
        return [x["input_ids"].tolist() for x in dm.datasets["val"]], len(dm.datasets["train"])

    a, n_train = split(1)
    assert len(a) == 20 and n_train == 80
    assert split(1)[0] == a and split(2)[0] != a


def test_text_pairs_get_token_type_ids(tok):
    dm = TextClassificationData(tok, train={"a": ["the movie", "a plot"], "b": ["was great", "was dull"],
                                            "label": [1, 0]}, text_column="a", text_pair_column="b", batch_size=2)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert batch["token_type_ids"].sum(1).tolist() == [3, 3]   # 'was X [SEP]'


def test_tokenised_cache_is_reused_and_keyed_by_settings(tmp_path, tok):
    cache = tmp_path / "cache"
    TextClassificationData(tok, train=ROWS, cache_dir=cache, max_length=8).setup("fit")
    files = sorted(os.listdir(cache))
    assert len(files) == 1 and files[0].startswith("train-")
    # a second DataModule reads the file instead of tokenising again: alter the file and see it
    state = torch.load(cache / files[0], weights_only=True)
    state["f.input_ids"] = state["f.input_ids"] + 1
    torch.save(state, cache / files[0])
    again = TextClassificationData(tok, train=ROWS, cache_dir=cache, max_length=8)
    assert _ids(again)[0] == [[t + 1 for t in seq] for seq in _ids(TextClassificationData(tok, train=ROWS, max_length=8))[0]]
    # other settings, other data or another tokenizer: other files
    TextClassificationData(tok, train=ROWS, cache_dir=cache, max_length=4).setup("fit")
    TextClassificationData(tok, train=ROWS[:3], cache_dir=cache, max_length=8).setup("fit")
    other_tok = hf_tiny.make_tokenizer()
    other_tok.backend_tokenizer.post_processor = None   # same vocabulary, no [CLS]/[SEP]
    TextClassificationData(other_tok, train=ROWS, cache_dir=cache, max_length=8).setup("fit")
    assert len(os.listdir(cache)) == 4
    # a damaged cache file is rebuilt
    (cache / files[0]).write_bytes(b"junk")
    assert _ids(TextClassificationData(tok, train=ROWS, cache_dir=cache, max_length=8))[0] == \
        _ids(TextClassificationData(tok, train=ROWS, max_length=8))[0]


def test_dynamic_padding_and_truncation(tok):
    dm = TextClassificationData(tok, train=ROWS, batch_size=2, max_length=6)
    lens = [len(x) for x in _ids(dm)[0]]
    assert max(lens) == 6   # truncated, [SEP] kept
    dm2 = TextClassificationData(tok, train=ROWS, batch_size=2, max_length=64, group_by_length=False)
    dl = prepare_dataloader(dm2.train_dataloader(), seed=0, shuffle=False)
    widths = [b["input_ids"].shape[1] for b in dl]
    assert widths == [6, 6, 11]   # each batch padded to its own longest
    b = next(iter(dl))
    assert (b["attention_mask"].sum(1) == torch.tensor([6, 5])).all()
    assert (b["input_ids"][1, 5:] == tok.pad_token_id).all()


def test_length_grouped_sampler_groups_and_resumes(tok):
    rows = hf_tiny.sentiment_rows(200)
    dm = TextClassificationData(tok, train=rows, batch_size=8)   # grouped by default
    dl = dm.train_dataloader()
    assert isinstance(dl.sampler, LengthGroupedSampler)
    plain = TextClassificationData(tok, train=rows, batch_size=8, group_by_length=False)

    def padding(loader):
        return sum(int((b["attention_mask"] == 0).sum()) for b in loader)

    grouped = prepare_dataloader(dl, seed=0)
    assert padding(grouped) < 0.3 * padding(prepare_dataloader(plain.train_dataloader(), seed=0))
    first = [b["input_ids"] for b in grouped]
    real = sorted(int(n) for b in grouped for n in b["attention_mask"].sum(1))
    assert real == sorted(len(x) for x in _ids(dm)[0])   # every sample once
    # resuming mid-epoch skips indices and continues the same order
    skip_batches(grouped, 10)
    rest = [b["input_ids"] for b in grouped]
    assert len(rest) == len(first) - 10 and all(torch.equal(a, b) for a, b in zip(rest, first[10:]))
    # another epoch, another order; the same epoch, the same order
    grouped.sampler.set_epoch(1)
    assert list(grouped.sampler) != list(LengthGroupedSampler(dl.sampler.lengths, 8, 0))
    assert list(LengthGroupedSampler(dl.sampler.lengths, 8, 0)) == list(LengthGroupedSampler(dl.sampler.lengths, 8))
    # the run seed orders it
    assert list(prepare_dataloader(dl, seed=1).sampler) != list(prepare_dataloader(dl, seed=0).sampler)
    # two ranks: disjoint halves that cover the data set
    shards = [list(prepare_dataloader(dm.train_dataloader(), seed=0, num_replicas=2, rank=r).sampler) for r in (0, 1)]
    assert sorted(shards[0] + shards[1]) == list(range(200))


def test_group_by_length_resume_through_the_trainer(tmp_path, tok):
    rows = hf_tiny.sentiment_rows(96)

    class Seen(ember.callbacks.Callback):
        def __init__(self):
            self.batches = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.batches.append(batch["input_ids"].clone())

    def run(max_steps, ckpt=None, callbacks=()):
        seen = Seen()
        dm = TextClassificationData(tok, train=rows, batch_size=8, group_by_length=True)
        trainer = ember.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=tmp_path, callbacks=[seen, *callbacks], seed=0)
        trainer.fit(TransformersModule(hf_tiny.tiny_bert(), lr=1e-3), datamodule=dm, ckpt_path=ckpt)
        return seen.batches

    # 12 batches per epoch; a checkpoint after step 5 (mid-epoch), resumed to step 16 (into epoch 2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    full = run(16, callbacks=[ckpt])
    resumed = run(16, ckpt=str(tmp_path / "ckpt" / "epoch=0-step=5"))
    assert len(full) == 16 and len(resumed) == 11
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[5:]))


def test_causal_lm_data_truncation_packing_and_prompts():
    tok = hf_tiny.make_tokenizer(eos_only=True)
    texts = ["one two three", "four five", "six seven eight one two"]
    with pytest.warns(UserWarning, match="no pad token"):
        dm = CausalLMData(tok, train=texts, predict=["one two", "four"], max_length=4, batch_size=3)
    eos = tok.eos_token_id
    ids, _ = _ids(dm)
    assert [len(x) for x in ids] == [4, 3, 4] and ids[1][-1] == eos   # EOS appended, then truncated
    batch = next(iter(prepare_dataloader(dm.train_dataloader(), seed=0, shuffle=False)))
    assert batch["labels"][1].tolist() == ids[1] + [-100]    # padding masked, the real EOS kept
    packed = CausalLMData(tok, train=texts, max_length=4, packing=True)
    pids, _ = _ids(packed)
    flat = [t for x in pids for t in x]
    assert [len(x) for x in pids] == [4, 4, 4, 1] and flat.count(eos) == 3
    dm.setup("predict")
    prompt = next(iter(dm.predict_dataloader()))
    assert "labels" not in prompt and prompt["attention_mask"].tolist() == [[1, 1], [0, 1]]   # left padding
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(MisconfigurationError, match="neither a pad token nor an EOS token"):
        CausalLMData(bare, train=["a"])
