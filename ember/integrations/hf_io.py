"""Reading text data and loading tokenizers for the Hugging Face integration:
files (CSV/TSV/JSON/JSON lines/TXT, optionally compressed), Python lists and dicts,
``datasets.Dataset``; local-only loading with clear errors; cache keys."""
from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import json
import lzma
import os
import warnings
from typing import Any

from ember.errors import MisconfigurationError


# ---------------------------------------------------------------------------------- hub loading
def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def not_found_error(what: str, name: str, err: BaseException | None, local_files_only: bool) -> MisconfigurationError:
    """The error for a model/tokenizer name that cannot be loaded."""
    if os.path.isdir(name):
        return MisconfigurationError(f"{what}={name!r}: the folder exists but could not be loaded "
                                     f"({type(err).__name__}: {err})")
    if _offline():
        how = "unset HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE and pass local_files_only=False to download it"
    elif local_files_only:
        how = "pass local_files_only=False to download it from the Hugging Face Hub"
    else:
        how = "check the name and your network connection"
    return MisconfigurationError(
        f"{what}={name!r} is not available locally: it is not a folder and not in the Hugging Face "
        f"cache. Pass the path of a local folder holding config.json and the weights (e.g. one written "
        f"by save_pretrained), or {how}.")


def load_tokenizer(tokenizer: Any, local_files_only: bool = True):
    """A tokenizer object, or one loaded with ``AutoTokenizer.from_pretrained`` from a
    local folder / the Hugging Face cache (no network unless ``local_files_only=False``)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        if not callable(tokenizer) or not hasattr(tokenizer, "convert_tokens_to_ids"):
            raise MisconfigurationError(f"tokenizer={tokenizer!r}: expected a path/name string or a "
                                        "transformers tokenizer")
        return tokenizer
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():   # a first import leaves the user's random streams as they were
        from transformers import AutoTokenizer
    name = os.fspath(tokenizer)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=local_files_only or _offline())
    except (OSError, ValueError) as err:
        raise not_found_error("tokenizer", name, err, local_files_only) from err


def ensure_pad_token(tokenizer) -> None:
    """Dynamic padding needs a pad token: borrow EOS (with a warning) when there is none."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise MisconfigurationError(
            f"the tokenizer {type(tokenizer).__name__} has neither a pad token nor an EOS token; set one, "
            "e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'}) and resize the model's embeddings")
    warnings.warn(f"the tokenizer has no pad token; using its EOS token {tokenizer.eos_token!r} for padding "
                  "(padded positions are masked out of attention and loss)", UserWarning, stacklevel=3)
    tokenizer.pad_token = tokenizer.eos_token


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything about the tokenizer that changes its output ids."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)   # runtime state set by the last call, not the vocabulary
        spec.pop("padding", None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([str(getattr(tokenizer, "name_or_path", "")), tokenizer.all_special_tokens,
                         getattr(tokenizer, "truncation_side", "right")]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------- reading
def _open_text(path: str):
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(os.path.splitext(path)[1].lower())
    return opener(path, "rt", encoding="utf-8", newline="") if opener else open(path, encoding="utf-8", newline="")


def _rows_to_columns(rows: list, where: str) -> dict[str, list]:
    cols: dict[str, list] = {}
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise MisconfigurationError(f"{where}: row {i} is a {type(r).__name__}; expected every row to be a dict")
        for k in r:
            if k not in cols:
                cols[k] = [None] * i
        for k in cols:
            cols[k].append(r.get(k))
    return cols


def read_columns(source: Any, where: str, text_column: str = "text", label_column: str | None = "label") -> dict[str, list]:
    """``source`` as a dict of equally long column lists.

    Accepts a CSV/TSV/JSON/JSON-lines/TXT path (optionally .gz/.bz2/.xz), a list of
    strings, of dicts, or of ``(text, label)`` pairs, a dict of columns, or a
    ``datasets.Dataset``.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise MisconfigurationError(f"{where}={path!r}: no such file")
        base = path
        if os.path.splitext(base)[1].lower() in (".gz", ".bz2", ".xz"):
            base = os.path.splitext(base)[0]
        ext = os.path.splitext(base)[1].lower()
        with _open_text(path) as f:
            if ext in (".csv", ".tsv"):
                rows = list(csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ","))
                return _rows_to_columns(rows, where)
            if ext in (".json", ".jsonl", ".ndjson"):
                text = f.read()
                stripped = text.lstrip()
                if stripped.startswith("["):
                    return read_columns(json.loads(text), where, text_column, label_column)
                if stripped.startswith("{") and ext == ".json":
                    try:
                        obj = json.loads(text)
                        if all(isinstance(v, list) for v in obj.values()):
                            return read_columns(obj, where, text_column, label_column)
                    except json.JSONDecodeError:
                        pass  # JSON lines in a .json file
                rows = []
                for n, line in enumerate(io.StringIO(text), 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            raise MisconfigurationError(f"{where}={path!r}: line {n} is not valid JSON: {err}") from err
                return _rows_to_columns(rows, where)
            if ext == ".txt":
                return {text_column: [ln.rstrip("\n") for ln in f if ln.strip()]}
        raise MisconfigurationError(f"{where}={path!r}: unknown file type {ext!r}; use .csv, .tsv, .json, "
                                    ".jsonl or .txt (optionally compressed .gz/.bz2/.xz)")
    if hasattr(source, "column_names") and hasattr(source, "to_dict"):   # datasets.Dataset
        return {k: list(v) for k, v in source.to_dict().items()}
    if isinstance(source, dict):
        cols = {str(k): list(v) for k, v in source.items()}
        lens = {len(v) for v in cols.values()}
        if len(lens) > 1:
            raise MisconfigurationError(f"{where}: columns have different lengths {sorted(lens)}")
        return cols
    if isinstance(source, (list, tuple)):
        if not source:
            raise MisconfigurationError(f"{where}: the data is empty")
        first = source[0]
        if isinstance(first, str):
            return {text_column: list(source)}
        if isinstance(first, dict):
            return _rows_to_columns(list(source), where)
        if isinstance(first, (list, tuple)) and len(first) == 2:
            if label_column is None:
                raise MisconfigurationError(f"{where}: (text, label) pairs given, but this data has no labels")
            return {text_column: [r[0] for r in source], label_column: [r[1] for r in source]}
        raise MisconfigurationError(f"{where}: rows must be strings, dicts or (text, label) pairs; got "
                                    f"{type(first).__name__}")
    raise MisconfigurationError(f"{where}: expected a file path, a list, a dict of columns or a datasets.Dataset; "
                                f"got {type(source).__name__}")


def column(cols: dict[str, list], name: str, where: str, arg: str) -> list:
    if name not in cols:
        raise MisconfigurationError(f"{arg}={name!r}: no such column in {where}; its columns are {sorted(cols)}")
    values = cols[name]
    bad = next((i for i, v in enumerate(values) if v is None), None)
    if bad is not None:
        raise MisconfigurationError(f"{where}: row {bad} has no value in column {name!r}")
    return values


def data_hash(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()
