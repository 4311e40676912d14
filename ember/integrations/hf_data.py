"""Data for fine-tuning Hugging Face models: read text (CSV, JSON lines, Python
lists, ``datasets.Dataset``), tokenise once (optionally cached on disk), pad per
batch, optionally group samples of similar length.

Public names are re-exported by :mod:`ember.integrations.transformers`.
"""
from __future__ import annotations

import importlib.util
import os
import re
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from ember.data.sampling import LengthGroupedSampler

from ember.errors import MisconfigurationError
from ember.integrations.collate import PadCollator  # noqa: F401  (public here too)
from ember.integrations.hf_io import (column, data_hash, ensure_pad_token, load_tokenizer, read_columns,
                                      tokenizer_fingerprint)
from ember.module import DataModule

CACHE_FORMAT = 1


# ---------------------------------------------------------------------------------- tokenised data
class TokenizedDataset(Dataset):
    """Ragged token sequences stored flat (one int tensor per feature plus offsets).

    Items are dicts of 1-D tensors (``input_ids``, optional ``token_type_ids``) and,
    when labelled, ``labels`` (a scalar for sequence labels)."""

    def __init__(self, features: dict[str, torch.Tensor], offsets: torch.Tensor, labels: torch.Tensor | None = None):
        self.features, self.offsets, self.labels = features, offsets, labels

    @classmethod
    def from_lists(cls, feats: dict[str, list[list[int]]], labels: list[int] | None = None) -> "TokenizedDataset":
        lengths = [len(x) for x in feats["input_ids"]]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        if lengths:
            offsets[1:] = torch.tensor(lengths, dtype=torch.long).cumsum(0)
        flat = {k: torch.tensor([t for seq in v for t in seq], dtype=torch.long) for k, v in feats.items()}
        lab = torch.tensor(labels, dtype=torch.long) if labels is not None else None
        return cls(flat, offsets, lab)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def __getitem__(self, i: int) -> dict:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        item = {k: v[a:b] for k, v in self.features.items()}
        if self.labels is not None:
            item["labels"] = self.labels[i]
        return item

    def subset(self, indices: list[int]) -> "TokenizedDataset":
        feats = {k: [self.features[k][int(self.offsets[i]):int(self.offsets[i + 1])].tolist() for i in indices]
                 for k in self.features}
        labels = self.labels[indices].tolist() if self.labels is not None else None
        return TokenizedDataset.from_lists(feats, labels)

    # safe on-disk form: plain int tensors, loadable with torch.load(weights_only=True)
    def state(self) -> dict:
        out = {"offsets": self.offsets, **{f"f.{k}": v for k, v in self.features.items()}}
        if self.labels is not None:
            out["labels"] = self.labels
        return out

    @classmethod
    def from_state(cls, state: dict) -> "TokenizedDataset":
        feats = {k[2:]: v for k, v in state.items() if k.startswith("f.")}
        return cls(feats, state["offsets"], state.get("labels"))


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) index lists; the val part is ``round(n * fraction)`` samples drawn with ``seed``."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction < 1:
        raise MisconfigurationError(f"val_split={fraction!r} is not valid; use a fraction in (0, 1) or None")
    k = max(1, int(round(n * fraction)))
    if k >= n:
        raise MisconfigurationError(f"val_split={fraction!r} leaves no training data ({n} samples)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[k:]), sorted(perm[:k])


# ---------------------------------------------------------------------------------- tokenising in processes
#: from this many texts on, a split is tokenised by several processes (``num_proc=None``)
PARALLEL_MIN_TEXTS = 100_000


def _encode_chunk(tokenizer, texts: list[str], pairs: list[str] | None, kw: dict) -> dict[str, list[list[int]]]:
    enc = tokenizer(texts, pairs, **kw) if pairs is not None else tokenizer(texts, **kw)
    out = {"input_ids": list(enc["input_ids"])}
    if "token_type_ids" in enc:
        out["token_type_ids"] = list(enc["token_type_ids"])
    return out


def _encode_in_processes(tokenizer, texts: list[str], pairs: list[str] | None, kw: dict,
                         procs: int) -> dict[str, list[list[int]]]:
    """Tokenise with ``datasets.Dataset.map(num_proc=procs)``, in order: the token ids of one process."""
    from ember.checkpoint.rng import import_optional
    datasets = import_optional("datasets", f"num_proc={procs}", "pip install datasets")
    cols = {"text": texts} if pairs is None else {"text": texts, "pair": pairs}
    out = datasets.Dataset.from_dict(cols).map(
        lambda batch: _encode_chunk(tokenizer, batch["text"], batch.get("pair"), kw), batched=True,
        num_proc=procs, remove_columns=list(cols), new_fingerprint="ember-tokenise")   # no hashing of the tokenizer
    return {k: out[k][:] for k in out.column_names}


# ---------------------------------------------------------------------------------- base DataModule
class _HFTextData(DataModule):
    """What the text DataModules share: sources per split, tokenise-once with a
    disk cache, dynamic padding, length grouping."""

    _SPLITS = ("train", "val", "test", "predict")
    _lm_labels = False

    def __init__(self, tokenizer, *, train=None, val=None, test=None, predict=None, text_column="text",
                 max_length: int = 128, batch_size: int = 32, eval_batch_size: int | None = None,
                 val_split: float | None = None, seed: int = 42, group_by_length: bool = True,
                 cache_dir: str | None = None, num_workers: int = 0, pad_to_multiple_of: int | None = None,
                 local_files_only: bool = True, num_proc: int | None = None):
        super().__init__()
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
            raise MisconfigurationError(f"num_proc={num_proc!r} is not valid; use an int >= 1 or None (automatic)")
        if num_proc is not None and num_proc > 1:
            from ember.checkpoint.rng import require_package
            require_package("datasets", f"num_proc={num_proc}", "pip install datasets", MisconfigurationError)
        self.num_proc = num_proc
        for name, v in (("max_length", max_length), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MisconfigurationError(f"{name}={v!r} is not valid; use an int >= 1")
        if eval_batch_size is not None and (not isinstance(eval_batch_size, int) or eval_batch_size < 1):
            raise MisconfigurationError(f"eval_batch_size={eval_batch_size!r} is not valid; use an int >= 1 or None")
        if val_split is not None:
            if val is not None:
                raise MisconfigurationError("val_split and val are both set; give a validation set or a fraction "
                                            "of train to hold out, not both")
            if train is None:
                raise MisconfigurationError("val_split needs train data to split")
            split_indices(10, val_split, 0)   # validates the fraction
        if all(s is None for s in (train, val, test, predict)):
            raise MisconfigurationError(f"{type(self).__name__}: give at least one of train, val, test, predict")
        self.tokenizer = load_tokenizer(tokenizer, local_files_only)
        ensure_pad_token(self.tokenizer)
        self.sources = {"train": train, "val": val, "test": test, "predict": predict}
        self.text_column, self.max_length = text_column, max_length
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.val_split, self.seed, self.group_by_length = val_split, seed, group_by_length
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self.num_workers, self.pad_to_multiple_of = num_workers, pad_to_multiple_of
        self.datasets: dict[str, TokenizedDataset] = {}
        self._columns: dict[str, dict] = {}

    # -- reading -----------------------------------------------------------------------------
    def _label_column(self) -> str | None:
        return None

    def columns(self, split: str) -> dict[str, list] | None:
        """The raw columns of a split (read once)."""
        if split not in self._columns:
            src = self.sources[split]
            self._columns[split] = None if src is None else read_columns(
                src, f"{type(self).__name__}({split}=...)", self.text_column, self._label_column())
        return self._columns[split]

    # -- tokenising ------------------------------------------------------------------------------
    def _settings(self) -> dict:
        return {"format": CACHE_FORMAT, "class": type(self).__name__, "max_length": self.max_length,
                "text_column": self.text_column}

    def _cache_path(self, split: str, payload) -> str | None:
        if self.cache_dir is None:
            return None
        key = data_hash(tokenizer_fingerprint(self.tokenizer), self._settings(), split, payload)
        return os.path.join(self.cache_dir, f"{split}-{key[:20]}.pt")

    def _tokenized(self, split: str) -> TokenizedDataset | None:
        """Tokenise ``split`` once; with ``cache_dir``, read/write a safe torch file."""
        if split in self.datasets:
            return self.datasets[split]
        cols = self.columns(split)
        if cols is None:
            return None
        payload = self._payload(split, cols)
        path = self._cache_path(split, payload)
        if path is not None and os.path.isfile(path):
            try:
                ds = TokenizedDataset.from_state(torch.load(path, map_location="cpu", weights_only=True))
            except Exception:   # a damaged cache file: rebuild it
                ds = None
            if ds is not None:
                self.datasets[split] = ds
                return ds
        ds = self._tokenize(split, payload)
        if path is not None:
            os.makedirs(self.cache_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            torch.save(ds.state(), tmp)
            os.replace(tmp, path)
        self.datasets[split] = ds
        return ds

    def _encode(self, texts: list[str], pairs: list[str] | None = None, truncation: bool = True,
                add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        kw = dict(truncation=truncation, add_special_tokens=add_special_tokens, return_attention_mask=False)
        if truncation:
            kw["max_length"] = self.max_length
        procs = self._processes(len(texts))
        if procs > 1:
            enc = _encode_in_processes(self.tokenizer, texts, pairs, kw, procs)
        else:
            enc = _encode_chunk(self.tokenizer, texts, pairs, kw)
        feats = {"input_ids": enc["input_ids"]}
        if "token_type_ids" in enc and any(any(t) for t in enc["token_type_ids"]):
            feats["token_type_ids"] = enc["token_type_ids"]
        return feats

    def _processes(self, n: int) -> int:
        """How many processes tokenise ``n`` texts: ``num_proc``, or automatically up to 8
        (the CPUs this process may use) from :data:`PARALLEL_MIN_TEXTS` texts on where
        ``datasets`` is installed."""
        if self.num_proc is not None:
            return max(1, min(self.num_proc, n // 1000 or 1))
        if n < PARALLEL_MIN_TEXTS or importlib.util.find_spec("datasets") is None:
            return 1
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        return max(1, min(8, cpus))

    # -- DataModule hooks ---------------------------------------------------------------------------
    def prepare_data(self) -> None:
        if self.cache_dir is not None:   # tokenise on local rank zero; other ranks read the cache
            for split in self._SPLITS:
                self._tokenized(split)

    def setup(self, stage: str) -> None:
        for split in self._SPLITS:
            self._tokenized(split)
        if self.val_split is not None and "val" not in self.datasets:
            full = self.datasets["train"]
            tr, va = split_indices(len(full), self.val_split, self.seed)
            self.datasets["train"], self.datasets["val"] = full.subset(tr), full.subset(va)

    def _ensure(self, split: str) -> TokenizedDataset | None:
        if split not in self.datasets or (split == "train" and self.val_split is not None and "val" not in self.datasets):
            self.setup("fit")
        return self.datasets.get(split)

    def _collator(self, split: str) -> PadCollator:
        return PadCollator(self.tokenizer.pad_token_id, "right", self.pad_to_multiple_of,
                           lm_labels=self._lm_labels and split != "predict")

    def _loader(self, split: str, shuffle: bool = False):
        ds = self._ensure(split)
        if ds is None:
            return None
        bs = self.batch_size if split == "train" else self.eval_batch_size
        kw = dict(batch_size=bs, collate_fn=self._collator(split), num_workers=self.num_workers,
                  persistent_workers=self.num_workers > 0)
        if split == "train" and self._grouped():   # seeded by the run seed when prepared (Trainer(seed=))
            return DataLoader(ds, sampler=LengthGroupedSampler(ds.lengths, bs), **kw)
        return DataLoader(ds, shuffle=shuffle, **kw)

    def _grouped(self) -> bool:
        """Whether training batches are length-grouped (``group_by_length``)."""
        return bool(self.group_by_length)

    def train_dataloader(self):
        dl = self._loader("train", shuffle=True)
        if dl is None:
            raise MisconfigurationError(f"{type(self).__name__}: no train data; pass train=...")
        return dl

    def val_dataloader(self):
        return self._loader("val")

    def test_dataloader(self):
        dl = self._loader("test")
        if dl is None:
            raise MisconfigurationError(f"{type(self).__name__}: no test data; pass test=...")
        return dl

    def predict_dataloader(self):
        dl = self._loader("predict")
        if dl is None:
            raise MisconfigurationError(f"{type(self).__name__}: no predict data; pass predict=...")
        return dl


def _as_int_label(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v.strip())
    return None


class TextClassificationData(_HFTextData):
    """Text (or text pair) classification data.

    Args:
        tokenizer: a transformers tokenizer, or a local folder / cached Hub name.
        train, val, test, predict: a CSV/TSV/JSON/JSON-lines path, a list of strings, of
            dicts or of ``(text, label)`` pairs, a dict of columns, or a ``datasets.Dataset``.
        text_column, text_pair_column, label_column: column names.
        max_length: truncation length in tokens. Padding is per batch (dynamic).
        batch_size / eval_batch_size: per-process batch sizes.
        val_split: hold out this fraction of ``train`` (drawn with ``seed``) for validation.
        seed: the seed of the ``val_split`` draw (the training order follows the run seed).
        group_by_length: ``True``: order training batches so that similar lengths meet
            (little padding): a :class:`~ember.data.LengthGroupedSampler`, shuffled with the run
            seed (``Trainer(seed=)``), resumable mid-epoch and sharded exactly over DDP ranks.
            ``False``: plain shuffling, each batch padded to its longest sample (or packed,
            ``padding_free``). ``None`` (the default) chooses per run: grouped, except for a
            module that trains adapters (``TransformersModule(peft_config=...)``), which gets
            random batches, padding-free where its model allows: grouped batches mix the labels
            less (a text's length often goes with its label), which cost adapters 2 points of
            accuracy and full fine-tuning none measurable (docs/benchmarks.md).
        cache_dir: keep tokenised splits here (keyed by tokenizer, settings and data).
        label_names: the class names in id order. Without it, integer labels (or integer
            strings) are used as ids and other labels are mapped to ids in sorted order.
        padding_free: batches without padding: the texts of a batch concatenated into one
            row with per-text positions and boundaries (:class:`~ember.integrations.packing.PackCollator`),
            for ``TransformersModule`` with BERT-architecture models. Per text, the logits, the
            loss and the metrics are those of the padded batch. ``None`` (the default): as
            ``group_by_length=None`` chooses (padding-free for adapters on such models).
        num_proc: processes that tokenise a split (``None``: several for splits of 100,000
            texts or more, one otherwise). The result is the same whatever the number.
        num_workers: DataLoader worker processes per loader.
        pad_to_multiple_of: round each padded batch's length up to a multiple of this.
        local_files_only: read a tokenizer named by Hub id from the local cache only (no
            download).
    """

    def __init__(self, tokenizer, train=None, val=None, test=None, predict=None, text_column: str = "text",
                 label_column: str = "label", max_length: int = 128, batch_size: int = 32,
                 eval_batch_size: int | None = None, val_split: float | None = None, seed: int = 42,
                 group_by_length: bool | None = None, cache_dir: str | None = None, num_workers: int = 0,
                 label_names: list[str] | None = None, text_pair_column: str | None = None,
                 pad_to_multiple_of: int | None = None, local_files_only: bool = True,
                 padding_free: bool | None = None,
                 num_proc: int | None = None):
        super().__init__(tokenizer, train=train, val=val, test=test, predict=predict, text_column=text_column,
                         max_length=max_length, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         val_split=val_split, seed=seed, group_by_length=group_by_length, cache_dir=cache_dir,
                         num_workers=num_workers, pad_to_multiple_of=pad_to_multiple_of,
                         local_files_only=local_files_only, num_proc=num_proc)
        for name, value in (("padding_free", padding_free), ("group_by_length", group_by_length)):
            if value is not None and not isinstance(value, bool):
                raise MisconfigurationError(f"{name}={value!r} is not valid; use True, False or None (ember chooses)")
        if padding_free and pad_to_multiple_of:
            raise MisconfigurationError("padding_free=True and pad_to_multiple_of are both set; a padding-free "
                                        "batch has no padding to round up")
        self.padding_free = padding_free
        if label_names is not None and (not isinstance(label_names, (list, tuple)) or len(label_names) < 2
                                        or len(set(map(str, label_names))) != len(label_names)):
            raise MisconfigurationError(f"label_names={label_names!r}: give at least two distinct class names")
        self.label_column, self.text_pair_column = label_column, text_pair_column
        self._label_names = [str(x) for x in label_names] if label_names is not None else None
        self._labels_ready = False

    def _label_column(self) -> str | None:
        return self.label_column

    def _settings(self) -> dict:
        return dict(super()._settings(), label_column=self.label_column, pair=self.text_pair_column,
                    label_names=self.label_names)

    # -- labels --------------------------------------------------------------------------------------
    def _resolve_labels(self) -> None:
        if self._labels_ready:
            return
        self._labels_ready = True
        if self._label_names is not None:
            self._names = list(self._label_names)
            self._int_labels = False
            return
        split = next((s for s in ("train", "val", "test") if self.sources[s] is not None), None)
        if split is None:
            self._names, self._int_labels = None, False
            return
        values = column(self.columns(split), self.label_column, f"the {split} data", "label_column")
        ints = [_as_int_label(v) for v in values]
        if all(i is not None for i in ints):
            if min(ints) < 0:
                raise MisconfigurationError(f"label_column={self.label_column!r}: integer labels must be >= 0; "
                                            f"found {min(ints)} (or give label_names)")
            self._names = [str(i) for i in range(max(max(ints) + 1, 2))]
            self._int_labels = True
        else:
            self._names = sorted({str(v) for v in values})
            self._int_labels = False

    @property
    def label_names(self) -> list[str] | None:
        self._resolve_labels()
        return self._names

    @property
    def num_labels(self) -> int | None:
        names = self.label_names
        return len(names) if names is not None else None

    @property
    def id2label(self) -> dict[int, str] | None:
        names = self.label_names
        return {i: n for i, n in enumerate(names)} if names is not None else None

    @property
    def label2id(self) -> dict[str, int] | None:
        names = self.label_names
        return {n: i for i, n in enumerate(names)} if names is not None else None

    def _label_ids(self, split: str, values: list) -> list[int]:
        names = self.label_names
        l2i = self.label2id
        out = []
        for i, v in enumerate(values):
            as_int = _as_int_label(v)
            if self._int_labels or (as_int is not None and str(v) not in l2i):
                idx = as_int if as_int is not None and 0 <= as_int < len(names) else None
            else:
                idx = l2i.get(str(v))
            if idx is None:
                raise MisconfigurationError(
                    f"{split} row {i}: label {v!r} is not one of the {len(names)} classes {names}"
                    + ("" if self._label_names is not None else " found in the training data; pass label_names=[...] "
                       "to fix the class set"))
            out.append(idx)
        return out

    # -- tokenising ----------------------------------------------------------------------------------
    def _payload(self, split: str, cols: dict) -> dict:
        where = f"the {split} data"
        texts = [str(t) for t in column(cols, self.text_column, where, "text_column")]
        pairs = None
        if self.text_pair_column is not None:
            pairs = [str(t) for t in column(cols, self.text_pair_column, where, "text_pair_column")]
        labels = None
        if split != "predict" or self.label_column in cols:
            if split == "predict" and any(v is None for v in cols[self.label_column]):
                labels = None
            else:
                labels = self._label_ids(split, column(cols, self.label_column, where, "label_column"))
        return {"texts": texts, "pairs": pairs, "labels": labels}

    def _tokenize(self, split: str, payload: dict) -> TokenizedDataset:
        feats = self._encode(payload["texts"], payload["pairs"])
        return TokenizedDataset.from_lists(feats, payload["labels"])

    def batches(self) -> tuple[bool, bool]:
        """``(group_by_length, padding_free)`` for this run: the values given, and for
        ``None`` ember's choice (see the class docstring) from the module the Trainer fits."""
        group, free = self.group_by_length, self.padding_free
        if group is None or free is None:
            module = getattr(self.trainer, "module", None)
            adapters = bool(getattr(module, "trains_adapters", False))
            if free is None:
                free = adapters and group is not True and not self.pad_to_multiple_of and bool(module.packs_texts())
            if group is None:
                group = not adapters
        return group, free

    def _grouped(self) -> bool:
        return self.batches()[0]

    def _collator(self, split: str):
        if self.batches()[1]:
            from ember.integrations.packing import PackCollator
            return PackCollator()
        return super()._collator(split)


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class CausalLMData(_HFTextData):
    """Text for causal language modelling, or supervised fine-tuning data (prompt/completion
    pairs, chats) with the loss on the answers only.

    **Plain text** (``text_column``): each text becomes one training sequence (truncated
    to ``max_length``, with EOS appended when ``add_eos``), or with ``packing=True`` all
    texts are concatenated and cut into blocks of ``max_length`` tokens (no padding at
    all). ``labels`` are the input ids with padding set to -100; the model shifts them.

    **Prompt/completion** (``prompt_column`` and ``completion_column``): the input ids are
    the tokenised ``prompt + completion`` (the strings joined as they are, special tokens
    as the tokenizer adds them) plus EOS when it does not end with it. Only the completion
    tokens and that EOS carry loss: ``labels`` are -100 on the prompt and on padding. The
    completion starts where the tokenised prompt and prompt+completion first differ (as in
    TRL, for tokens that merge across the boundary).

    **Chat** (``messages_column``: lists of ``{"role", "content"}`` dicts): the input ids
    are exactly ``tokenizer.apply_chat_template(messages)``, plus EOS only where it does
    not end with EOS (trailing whitespace tokens aside). Only the assistant turns carry
    loss (their content and the template's end-of-turn tokens; not system, user or tool
    turns, nor the role markers); the added EOS does when the last turn is the assistant's.
    A template with ``{% generation %}`` markers names the assistant tokens itself
    (transformers' ``return_assistant_tokens_mask``, as TRL's ``assistant_only_loss``);
    for any other template, assistant turn ``i`` is what rendering ``messages[:i + 1]``
    adds to rendering ``messages[:i]`` with the generation prompt, which needs a template
    that renders a conversation's beginning the same way whatever follows (an error names
    the row where it does not). ``chat_template`` overrides the tokenizer's template.

    **Truncation** keeps the first ``max_length`` tokens. An example left without an
    answer token (its prompt fills ``max_length``, or it has no assistant turn) is
    dropped, with one warning per split that counts them. A missing value, a message
    without a role or content, or a content that is not a string is an error naming the
    row and the columns found.

    **Packing** (``packing=True``) with prompt/completion or chat data puts several whole
    examples in one row of at most ``max_length`` tokens (best fit decreasing, as TRL's
    ``pack_dataset``; an example is never split). Each row carries ``position_ids`` that
    restart at 0 per example and no attention mask: transformers then keeps every example
    to itself (a block-diagonal causal mask, or varlen flash attention; see
    :mod:`ember.integrations.packing`). The loss is the token-weighted mean over the answer
    tokens, as unpacked.

    ``predict`` data are prompts for ``generate``: left-padded, no EOS; the prompt column,
    or the messages rendered with the generation prompt.

    Args:
        tokenizer: a transformers tokenizer, or a local folder / cached Hub name.
        train, val, test, predict: a CSV/TSV/JSON/JSON-lines path, a list of strings or of
            dicts, a dict of columns, or a ``datasets.Dataset``.
        text_column: the plain-text column.
        prompt_column, completion_column: prompt/completion data (both, or neither).
        messages_column: chat data: a column of lists of ``{"role", "content"}`` messages.
        chat_template: a Jinja chat template used instead of the tokenizer's.
        max_length: truncation length in tokens (the row length with ``packing``).
        batch_size / eval_batch_size: per-process batch sizes.
        val_split: hold out this fraction of ``train`` (drawn with ``seed``) for validation.
        seed: the seed of the ``val_split`` draw.
        packing: plain text: blocks of ``max_length`` tokens; prompt/completion or chat:
            whole examples per row, each attending only to itself.
        add_eos: plain text: append EOS to each text.
        group_by_length: length-grouped training batches (see ``TextClassificationData``).
        cache_dir: keep tokenised splits here (keyed by tokenizer, settings and data).
        num_workers: DataLoader worker processes per loader.
        pad_to_multiple_of: round each padded batch's length up to a multiple of this.
        local_files_only: read a tokenizer named by Hub id from the local cache only.
        num_proc: processes that tokenise a split (``None``: several for large splits).
    """

    _lm_labels = True

    def __init__(self, tokenizer, train=None, val=None, test=None, predict=None, text_column: str = "text",
                 max_length: int = 512, batch_size: int = 8, eval_batch_size: int | None = None,
                 val_split: float | None = None, seed: int = 42, packing: bool = False, add_eos: bool = True,
                 group_by_length: bool = False, cache_dir: str | None = None, num_workers: int = 0,
                 pad_to_multiple_of: int | None = None, local_files_only: bool = True, num_proc: int | None = None,
                 prompt_column: str | None = None, completion_column: str | None = None,
                 messages_column: str | None = None, chat_template: str | None = None):
        super().__init__(tokenizer, train=train, val=val, test=test, predict=predict, text_column=text_column,
                         max_length=max_length, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         val_split=val_split, seed=seed, group_by_length=group_by_length, cache_dir=cache_dir,
                         num_workers=num_workers, pad_to_multiple_of=pad_to_multiple_of,
                         local_files_only=local_files_only, num_proc=num_proc)
        self.packing, self.add_eos = packing, add_eos
        if (prompt_column is None) != (completion_column is None):
            raise MisconfigurationError(
                f"prompt_column={prompt_column!r}, completion_column={completion_column!r}: prompt/completion data "
                "needs both columns")
        if messages_column is not None and prompt_column is not None:
            raise MisconfigurationError("messages_column and prompt_column/completion_column are both set; give "
                                        "chat data or prompt/completion data, not both")
        if chat_template is not None and messages_column is None:
            raise MisconfigurationError("chat_template is set without messages_column; the template renders chat "
                                        "data (lists of {'role', 'content'} messages)")
        self.prompt_column, self.completion_column = prompt_column, completion_column
        self.messages_column, self.chat_template = messages_column, chat_template
        self.mode = "chat" if messages_column is not None else "prompt-completion" if prompt_column is not None \
            else "text"
        if self.mode == "chat" and self._template() is None:
            raise MisconfigurationError(
                f"messages_column={messages_column!r}: the tokenizer {type(self.tokenizer).__name__} has no chat "
                "template; set one with tokenizer.chat_template = \"{% for m in messages %}...{% endfor %}\" (a Jinja "
                "template, e.g. from the model's own tokenizer_config.json) or pass CausalLMData(chat_template=...)")
        if self.mode != "text" and self.add_eos and self.tokenizer.eos_token_id is None:
            raise MisconfigurationError("the tokenizer has no EOS token to end the answers with; set one "
                                        "(tokenizer.eos_token = ...) or pass add_eos=False")

    def _template(self) -> str | None:
        return self.chat_template if self.chat_template is not None else getattr(self.tokenizer, "chat_template", None)

    def _settings(self) -> dict:
        out = dict(super()._settings(), packing=self.packing, add_eos=self.add_eos)
        if self.mode != "text":   # plain text keeps its cache keys
            out.update(mode=self.mode, prompt_column=self.prompt_column, completion_column=self.completion_column,
                       messages_column=self.messages_column,
                       chat_template=self._template() if self.mode == "chat" else None)
        return out

    # -- reading -----------------------------------------------------------------------------------
    def _payload(self, split: str, cols: dict) -> dict:
        if self.mode == "text":
            return {"texts": [str(t) for t in column(cols, self.text_column, f"the {split} data", "text_column")]}
        where = f"the {split} data"
        n = len(next(iter(cols.values()))) if cols else 0

        def found(i: int) -> list[str]:
            return sorted(k for k, v in cols.items() if v[i] is not None)

        def values(name: str, arg: str) -> list:
            vals = cols.get(name)
            for i in range(n):
                v = vals[i] if vals is not None else None
                if v is None:
                    raise MisconfigurationError(f"{where}: row {i} has no {name!r} ({arg}={name!r}); the columns "
                                                f"found in that row are {found(i)}")
            return vals

        if self.mode == "prompt-completion":
            out = {}
            names = [("prompts", self.prompt_column, "prompt_column")]
            if split != "predict":
                names.append(("completions", self.completion_column, "completion_column"))
            for key, name, arg in names:
                vals = values(name, arg)
                bad = next((i for i, v in enumerate(vals) if not isinstance(v, str)), None)
                if bad is not None:
                    raise MisconfigurationError(f"{where}: row {bad}: {name!r} is a {type(vals[bad]).__name__}, not a "
                                                f"string; the columns found in that row are {found(bad)}")
                out[key] = list(vals)
            return out
        chats = values(self.messages_column, "messages_column")
        out = []
        for i, msgs in enumerate(chats):
            if not isinstance(msgs, (list, tuple)) or not msgs:
                raise MisconfigurationError(f"{where}: row {i}: {self.messages_column!r} is {type(msgs).__name__} "
                                            f"{str(msgs)[:60]!r}, not a non-empty list of {{'role', 'content'}} "
                                            f"messages; the columns found in that row are {found(i)}")
            conv = []
            for j, m in enumerate(msgs):
                keys = sorted(m) if isinstance(m, dict) else None
                if not isinstance(m, dict) or m.get("role") is None or m.get("content") is None:
                    raise MisconfigurationError(
                        f"{where}: row {i}, message {j} needs a 'role' and a 'content'; it has "
                        + (f"the keys {keys}" if keys is not None else f"type {type(m).__name__}")
                        + f" (the columns found in that row are {found(i)})")
                if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                    bad = "role" if not isinstance(m["role"], str) else "content"
                    raise MisconfigurationError(f"{where}: row {i}, message {j}: its {bad!r} is a "
                                                f"{type(m[bad]).__name__}, not a string (the columns found in that "
                                                f"row are {found(i)})")
                conv.append(dict(m))
            out.append(conv)
        return {"messages": out}

    # -- tokenising --------------------------------------------------------------------------------
    def _tokenize(self, split: str, payload: dict) -> TokenizedDataset:
        if self.mode != "text":
            return self._tokenize_sft(split, payload)
        texts = payload["texts"]
        if split == "predict":
            return TokenizedDataset.from_lists(self._encode(texts))
        eos = self.tokenizer.eos_token_id if self.add_eos else None
        ids = self._encode(texts, truncation=False)["input_ids"]
        if eos is not None:
            ids = [x + [eos] if (not x or x[-1] != eos) else x for x in ids]
        if self.packing:
            flat = [t for x in ids for t in x]
            n = self.max_length
            ids = [flat[i:i + n] for i in range(0, len(flat), n)]
        else:
            ids = [x[:self.max_length] for x in ids]
        ids = [x for x in ids if x]
        return TokenizedDataset.from_lists({"input_ids": ids})

    def _render(self, conversations: list[list[dict]], **kw) -> list[list[int]]:
        """Token ids of ``apply_chat_template`` for each conversation."""
        if not conversations:
            return []
        enc = self.tokenizer.apply_chat_template(conversations, chat_template=self._template(), tokenize=True,
                                                 return_dict=True, **kw)
        return [list(x) for x in enc["input_ids"]]

    def _ends_with_eos(self, ids: list[int]) -> bool:
        """Whether ``ids`` end with EOS, ignoring trailing whitespace tokens (``<|im_end|>\\n``)."""
        eos = self.tokenizer.eos_token_id
        k = len(ids)
        while k > 0 and ids[k - 1] != eos and not self.tokenizer.decode([ids[k - 1]]).strip():
            k -= 1
        return k > 0 and ids[k - 1] == eos

    def _chat_examples(self, chats: list[list[dict]]) -> tuple[list[list[int]], list[list[int]]]:
        ids = self._render(chats)
        if _GENERATION_TAG.search(self._template() or ""):   # the template marks the assistant tokens
            enc = self.tokenizer.apply_chat_template(chats, chat_template=self._template(), tokenize=True,
                                                     return_dict=True, return_assistant_tokens_mask=True)
            masks = [list(m) for m in enc["assistant_masks"]]
        else:
            masks = [self._assistant_mask(i, conv, x) for i, (conv, x) in enumerate(zip(chats, ids))]
        labels = [[t if keep else -100 for t, keep in zip(x, m)] for x, m in zip(ids, masks)]
        if self.add_eos:
            eos = self.tokenizer.eos_token_id
            for conv, x, lab in zip(chats, ids, labels):
                if not self._ends_with_eos(x):
                    x.append(eos)
                    lab.append(eos if conv[-1]["role"] == "assistant" else -100)
        return ids, labels

    def _assistant_mask(self, row: int, conv: list[dict], ids: list[int]) -> list[int]:
        """1 on the tokens that rendering each assistant turn adds to the conversation
        before it rendered with the generation prompt (the role markers)."""
        mask = [0] * len(ids)
        for j, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            before = self._render([conv[:j]], add_generation_prompt=True)[0] if j else self._opening()
            upto = self._render([conv[:j + 1]])[0]
            if upto != ids[:len(upto)]:
                raise MisconfigurationError(
                    f"row {row}: the chat template renders the conversation up to message {j} differently from the "
                    "beginning of the whole conversation, so the assistant turns cannot be told apart; use a template "
                    "that marks them with {% generation %}...{% endgeneration %} (chat_template=...)")
            start = len(os.path.commonprefix([before, upto]))   # any sequences: token ids here
            mask[start:len(upto)] = [1] * (len(upto) - start)
        return mask

    def _opening(self) -> list[int]:
        """An empty conversation with the generation prompt (what precedes an opening
        assistant turn), or nothing where the template cannot render one."""
        try:
            return self._render([[]], add_generation_prompt=True)[0]
        except Exception:   # templates may index messages[0]
            return []

    def _prompt_completion_examples(self, prompts: list[str], completions: list[str]
                                    ) -> tuple[list[list[int]], list[list[int]]]:
        p_ids = self._encode(prompts, truncation=False)["input_ids"]
        ids = self._encode([p + c for p, c in zip(prompts, completions)], truncation=False)["input_ids"]
        eos = self.tokenizer.eos_token_id if self.add_eos else None
        labels, shifted = [], 0
        for p, x in zip(p_ids, ids):
            k = len(os.path.commonprefix([p, x]))
            shifted += k < len(p)
            if eos is not None and (not x or x[-1] != eos):
                x.append(eos)
            labels.append([-100] * k + x[k:])
        if shifted:
            warnings.warn(f"{shifted} tokenised prompt(s) are not a prefix of their tokenised prompt + completion "
                          "(tokens merge across the boundary); their answers start where the two differ. End the "
                          "prompts on a token boundary (e.g. a space or newline) to avoid it", UserWarning,
                          stacklevel=4)
        return ids, labels

    def _tokenize_sft(self, split: str, payload: dict) -> TokenizedDataset:
        if split == "predict":   # prompts for generate()
            if self.mode == "chat":
                ids = self._render(payload["messages"], add_generation_prompt=True)
            else:
                ids = self._encode(payload["prompts"], truncation=False)["input_ids"]
            return TokenizedDataset.from_lists({"input_ids": ids})
        if self.mode == "chat":
            ids, labels = self._chat_examples(payload["messages"])
        else:
            ids, labels = self._prompt_completion_examples(payload["prompts"], payload["completions"])
        n, total = self.max_length, len(ids)
        keep = [i for i in range(total) if any(t != -100 for t in labels[i][1:n])]   # a target token left
        if len(keep) < total:
            long = sum(1 for i in range(total) if any(t != -100 for t in labels[i][1:]))
            warnings.warn(
                f"CausalLMData: {total - len(keep)} of the {total} examples of the {split} data have no answer token "
                f"within max_length={n} ({long - len(keep)} cut off by truncation, {total - long} with no answer "
                "at all); they are dropped", UserWarning, stacklevel=3)
        if not keep:
            raise MisconfigurationError(f"CausalLMData: no example of the {split} data keeps an answer token within "
                                        f"max_length={n}; raise max_length or shorten the prompts")
        ids, labels = [ids[i][:n] for i in keep], [labels[i][:n] for i in keep]
        if not self.packing:
            return TokenizedDataset.from_lists({"input_ids": ids, "labels": labels})
        from ember.integrations.packing import pack_examples
        rows = pack_examples([len(x) for x in ids], n)
        feats = {"input_ids": [], "labels": [], "position_ids": []}
        for row in rows:
            feats["input_ids"].append([t for i in row for t in ids[i]])
            feats["labels"].append([t for i in row for t in labels[i]])
            feats["position_ids"].append([p for i in row for p in range(len(ids[i]))])
        return TokenizedDataset.from_lists(feats)

    def _collator(self, split: str):
        if split == "predict":   # prompts for generate(): pad on the left
            return PadCollator(self.tokenizer.pad_token_id, "left", self.pad_to_multiple_of)
        if self.mode != "text" and self.packing:
            from ember.integrations.packing import ExamplePackCollator
            return ExamplePackCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
        return super()._collator(split)
