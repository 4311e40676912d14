"""Padding-free batches for sequence classification: no compute on padding.

A padded batch of B texts is a ``(B, L)`` tensor, ``L`` its longest text: the
embeddings, every linear layer, the layer norms and the MLPs run over the padding
too. :class:`PackCollator` concatenates the B texts instead into one ``(1, T)`` row
of ``T`` real tokens, with ``position_ids`` restarting at 0 for each text and
``cu_seq_lens`` (the ``B + 1`` text boundaries). :func:`packed_forward` runs a
Hugging Face model on it:

- every per-token layer runs on the T real tokens only;
- attention stays within each text: the attention function registered here
  (``"ember_packed"``) scatters queries, keys and values into buckets of texts of
  similar length, each a ``(n, heads, L_bucket, d)`` block, runs PyTorch's SDPA
  (``torch.nn.functional.scaled_dot_product_attention``) on each with a key-padding
  mask, and gathers the T rows back; padded batches (evaluation with another loader,
  ``generate``) fall through to the plain SDPA path;
- dropout on the CPU (the model's ``nn.Dropout`` modules and the attention's) draws
  its mask with :func:`keep_scale`, about half the time of ``aten::bernoulli_``;
- the classification head reads the first token of each text (a forward hook on the
  base model hands the head a ``(B, 1, hidden)`` sequence), so the logits, the
  loss and the metrics are per text what the padded batch gives (to float rounding:
  tested to 1e-5).

FlexAttention with a document mask is the other PyTorch kernel for this; on CPU in
torch 2.13 it has no backward (``NotImplementedError``), and its compiled forward
took 33 ms against 12 ms for the SDPA path above on MiniLM shapes
(docs/benchmarks.md), so SDPA is what training uses; ``attention="flex"`` is
offered for inference only.

Supported: sequence classification with BERT-architecture encoders (``model_type``
``"bert"``: BERT, MiniLM, most sentence-transformers checkpoints), whose position
ids start at 0 and whose head reads the first token. Anything else raises, naming
the argument.

Packed rows of whole examples for causal language models (supervised fine-tuning,
``CausalLMData(packing=True)`` with prompt/completion or chat data) take another
route, transformers' own: rows of whole examples (:func:`pack_examples`) whose
``position_ids`` restart at 0 for every example, with no ``attention_mask``
(:class:`ExamplePackCollator`). From such position ids transformers' masking utilities
(``find_packed_sequence_indices``) build a block-diagonal causal mask for the SDPA,
eager and flex kernels, and the flash-attention kernels run varlen over them (on one
flattened row: :func:`example_packed_inputs`).
"""
from __future__ import annotations

import math
import sys
import threading
from bisect import bisect_left, insort
from collections import defaultdict, deque
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ember.errors import MisconfigurationError
from ember.integrations.collate import PadCollator

#: model types whose packed form is supported (absolute positions from 0, head on the first token)
PACKABLE_MODEL_TYPES = frozenset({"bert"})
ATTENTION = ("sdpa", "flex")
_IMPL = "ember_packed"
_registered = threading.Lock()
_done: list[bool] = []


#: a packed row's length is rounded up to a multiple of this: the tokens added belong to no
#: text (no text attends to them, no output reads them). Without it every batch has a new
#: length, and oneDNN's per-shape kernel cache grew a LoRA run's memory by a gigabyte
#: over 300 steps (docs/benchmarks.md, "LoRA adapters")
ROW_MULTIPLE = 64


class PackCollator:
    """Concatenate a batch of tokenised texts into one padding-free row.

    Returns ``input_ids``, ``position_ids`` and ``token_type_ids`` of shape ``(1, T)``
    (T: the batch's real tokens, rounded up to a multiple of :data:`ROW_MULTIPLE` with
    tokens of no text), ``cu_seq_lens`` (``B + 1`` cumulative lengths, from 0),
    ``labels`` (one per text) and ``attention_layout`` (the attention's buckets, built
    here on the CPU so that a forward on a GPU never reads the lengths back to the
    host). :func:`packed_forward` runs a model on it."""

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        ids = [it["input_ids"] for it in items]
        lens = torch.tensor([len(x) for x in ids], dtype=torch.long)
        cu = torch.zeros(len(ids) + 1, dtype=torch.long)
        cu[1:] = lens.cumsum(0)
        tail = torch.zeros(-int(cu[-1]) % ROW_MULTIPLE, dtype=torch.long)   # belongs to no text
        out = {"input_ids": torch.cat(ids + [tail]).unsqueeze(0),
               "position_ids": torch.cat([torch.arange(n) for n in lens.tolist()] + [tail]).unsqueeze(0),
               "cu_seq_lens": cu, "attention_layout": _layout(cu)}
        if "token_type_ids" in items[0]:
            out["token_type_ids"] = torch.cat([it["token_type_ids"] for it in items] + [tail]).unsqueeze(0)
        else:
            out["token_type_ids"] = torch.zeros_like(out["input_ids"])
        if "labels" in items[0]:
            if items[0]["labels"].ndim != 0:
                raise MisconfigurationError("padding_free=True packs sequence-classification batches (one label per "
                                            "text); these items have per-token labels")
            out["labels"] = torch.stack([it["labels"] for it in items])
        return out


def is_packed(batch: Any) -> bool:
    return isinstance(batch, dict) and "cu_seq_lens" in batch


def num_texts(batch: dict) -> int:
    return int(batch["cu_seq_lens"].numel() - 1)


# -- attention -------------------------------------------------------------------------------------
#: attention runs per bucket of this many texts of similar length, each bucket padded to its
#: longest text rounded up to ATTENTION_MULTIPLE (few shapes for the kernel caches): on random
#: batches of tweets a third fewer attention elements than one (B, L) layout
BUCKET_TEXTS = 16
ATTENTION_MULTIPLE = 8


def _layout(cu: torch.Tensor) -> tuple[torch.Tensor, list, int]:
    """The attention layout of a packed row (``cu``: its text boundaries, on the CPU):
    texts sorted by length into buckets of :data:`BUCKET_TEXTS`, bucket ``g`` a
    ``(n_g, L_g)`` block of one flat buffer. Returns (the buffer position of each packed
    token, ``[(offset, n_g, L_g, key mask (n_g, 1, 1, L_g))]``, the buffer's length)."""
    lens = cu[1:] - cu[:-1]
    order = torch.argsort(lens, stable=True)
    start = torch.empty_like(lens)   # each text's first position in the buffer
    buckets, offset = [], 0
    for group in order.split(BUCKET_TEXTS):
        n, width = group.numel(), -(-int(lens[group].max()) // ATTENTION_MULTIPLE) * ATTENTION_MULTIPLE
        start[group] = offset + torch.arange(n) * width
        keep = torch.arange(width)[None, :] < lens[group][:, None]
        buckets.append((offset, n, width, keep[:, None, None, :]))
        offset += n * width
    pos = torch.arange(int(cu[-1])) - cu[:-1].repeat_interleave(lens)   # each token's place in its text
    return start.repeat_interleave(lens) + pos, buckets, offset


# -- dropout on the CPU ----------------------------------------------------------------------------
def keep_scale(shape: tuple, p: float, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Dropout's scaled mask: ``1 / (1 - p)`` where an element is kept (probability
    ``1 - p``, to 2**-32), else 0. One 32-bit draw of torch's default generator per
    element (half an int64 ``random_``); on the CPU ``aten::bernoulli_`` draws a double
    per element in a serial loop, and was a quarter to a third of a LoRA step's time
    (docs/benchmarks.md, "LoRA adapters"): this mask takes about half of its time."""
    n = math.prod(shape)
    bits = torch.empty((n + 1) // 2, dtype=torch.int64, device=device).random_(torch.iinfo(torch.int64).min, None)
    threshold = round(p * 2 ** 32) - 2 ** 31   # an int32 half is uniform over [-2**31, 2**31)
    return (bits.view(torch.int32)[:n] >= threshold).view(shape).to(dtype).mul_(1.0 / (1.0 - p))


class CPUDropout(nn.Dropout):
    """``nn.Dropout`` whose mask, on the CPU, is :func:`keep_scale` (elsewhere, and in
    evaluation, ``nn.Dropout`` itself). :func:`packed_forward` gives a model's
    ``nn.Dropout`` modules this class; they hold no state, so weights and checkpoints
    are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.device.type != "cpu" or self.inplace:
            return super().forward(x)
        return x * keep_scale(x.shape, self.p, x.dtype, x.device)


def _attention_with_dropout(query, key, value, keep, dropout: float, scaling):
    """SDPA's math (what it runs on the CPU when ``dropout_p > 0``: float32 scores and
    softmax, the result in the inputs' dtype) with :func:`keep_scale`'s dropout."""
    dtype = query.dtype
    q, k, v = query.float(), key.float(), value.float()
    scores = (q @ k.transpose(-2, -1)).mul_(scaling if scaling is not None else q.shape[-1] ** -0.5)
    probs = torch.softmax(scores.masked_fill_(~keep, float("-inf")), dim=-1)
    probs = probs * keep_scale(probs.shape, dropout, probs.dtype, probs.device)
    return (probs @ v).to(dtype)


def _packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: per-text attention on a packed (1, heads, T, d)
    row; plain SDPA for a padded batch."""
    layout = kwargs.get("ember_layout")
    if layout is None:   # transformers' own SDPA function (imported at registration)
        return _sdpa_forward[0](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    index, buckets, size = layout
    heads, d = query.shape[1], query.shape[-1]
    if kwargs.get("ember_attention") == "flex":
        return _packed_flex(query, key, value, kwargs["ember_doc"], scaling)

    def spread(x):   # (1, heads, T, d) -> the buffer (heads, size, d), zeros at padding (the row's tail left out)
        return x.new_zeros(heads, size, d).index_copy(1, index, x[0, :, :index.numel()])

    q, k, v = spread(query), spread(key), spread(value)
    outs = []
    for offset, n, width, keep in buckets:
        qb, kb, vb = (x[:, offset:offset + n * width].view(heads, n, width, d).transpose(0, 1) for x in (q, k, v))
        if dropout > 0 and query.device.type == "cpu":
            o = _attention_with_dropout(qb, kb, vb, keep, dropout, scaling)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep, dropout_p=dropout, scale=scaling)
        outs.append(o.transpose(0, 1).reshape(heads, n * width, d))
    out = torch.cat(outs, dim=1).index_select(1, index)   # (heads, T, d)
    out = F.pad(out, (0, 0, 0, query.shape[2] - out.shape[1]))   # the row's tokens of no text: zeros
    return out.transpose(0, 1).unsqueeze(0), None   # (1, T, heads, d), as transformers expects


_flex_cache: dict = {}
_sdpa_forward: list = []   # transformers' sdpa_attention_forward, set by register_attention


def _packed_flex(query, key, value, doc: torch.Tensor, scaling):
    if query.requires_grad or key.requires_grad or value.requires_grad:
        raise MisconfigurationError("packed_attention='flex' runs without gradients only: FlexAttention has no "
                                    "backward on CPU in this torch; use packed_attention='sdpa' for training")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _flex_cache:
        _flex_cache["fn"] = torch.compile(flex_attention, dynamic=True)

    def same_text(b, h, q, k):
        return doc[q] == doc[k]

    n = doc.numel()
    mask = create_block_mask(same_text, None, None, n, n, device=doc.device)
    out = _flex_cache["fn"](query, key, value, block_mask=mask, scale=scaling)
    return out.transpose(1, 2), None


def register_attention() -> str:
    """Register ``"ember_packed"`` with transformers (attention and mask functions), once."""
    with _registered:
        if not _done:
            from ember.checkpoint.rng import keep_rng_states
            with keep_rng_states():   # a first import leaves the user's random streams as they were
                from transformers import AttentionInterface
                from transformers.integrations.sdpa_attention import sdpa_attention_forward
                from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
            _sdpa_forward.append(sdpa_attention_forward)
            AttentionInterface.register(_IMPL, _packed_sdpa)
            AttentionMaskInterface.register(_IMPL, sdpa_mask)
            _done.append(True)
    return _IMPL


# -- the model -------------------------------------------------------------------------------------
def check_packable(model, task: str) -> None:
    """Raise unless ``model`` can run padding-free batches for ``task``."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if task != "sequence-classification" or mtype not in PACKABLE_MODEL_TYPES:
        raise MisconfigurationError(
            f"padding_free=True supports sequence classification with {sorted(PACKABLE_MODEL_TYPES)} models; this "
            f"is task={task!r} with model_type={mtype!r}. Use padding_free=False (length-grouped padded batches, "
            "the default, also leave little padding)")
    if getattr(cfg, "is_decoder", False):
        raise MisconfigurationError("padding_free=True needs an encoder (bidirectional attention); this model has "
                                    "is_decoder=True")


class _FirstTokens:
    """Forward hook on the base model: during a packed call, hand the head the first
    token of each text as a (B, 1, hidden) sequence (and the pooler's output of it)."""

    def __init__(self):
        self.starts: torch.Tensor | None = None

    def __call__(self, base, args, output):
        if self.starts is None:
            return output
        first = output[0][0].index_select(0, self.starts.to(output[0].device)).unsqueeze(1)   # (B, 1, hidden)
        output["last_hidden_state"] = first
        pooler = getattr(base, "pooler", None)
        if pooler is not None and output.get("pooler_output") is not None:
            output["pooler_output"] = pooler(first)
        return output


def _prepare(model) -> _FirstTokens:
    hook = getattr(model, "_ember_first_tokens", None)
    if hook is None:
        impl = register_attention()
        if getattr(model.config, "_attn_implementation", None) != impl:
            model.set_attn_implementation(impl)
        hook = _FirstTokens()
        model.base_model.register_forward_hook(hook)
        for m in model.modules():
            if type(m) is nn.Dropout:
                m.__class__ = CPUDropout
        model._ember_first_tokens = hook
    return hook


def packed_forward(model, batch: dict, attention: str = "sdpa"):
    """Run a sequence-classification model on a :class:`PackCollator` batch: the model's
    output with ``logits`` of shape ``(B, num_labels)`` and, when the batch has labels,
    the model's own ``loss`` over the B texts."""
    if attention not in ATTENTION:
        raise MisconfigurationError(f"packed_attention={attention!r} is not valid; choose one of {list(ATTENTION)}")
    hook = _prepare(model)
    cu = batch["cu_seq_lens"]
    ids = batch["input_ids"]
    layout = batch.get("attention_layout")
    if layout is None:   # a packed batch built by hand: its layout from its boundaries (a host read)
        index, buckets, size = _layout(cu.cpu())
        layout = (index.to(ids.device), [(o, n, w, keep.to(ids.device)) for o, n, w, keep in buckets], size)
    extra = {"ember_layout": layout, "ember_attention": attention}
    if attention == "flex":
        lens = cu[1:] - cu[:-1]
        doc = torch.repeat_interleave(torch.arange(lens.numel(), device=ids.device), lens.to(ids.device))
        extra["ember_doc"] = F.pad(doc, (0, ids.shape[1] - doc.numel()), value=lens.numel())   # the tail: its own
    hook.starts = cu[:-1]
    try:
        return model(input_ids=ids, position_ids=batch["position_ids"], token_type_ids=batch["token_type_ids"],
                     labels=batch.get("labels"), **extra)
    finally:
        hook.starts = None



# -- whole examples packed into rows (causal LM) ----------------------------------------------------
def pack_examples(lengths: list[int], max_length: int) -> list[list[int]]:
    """Bins of example indices, each bin's total length at most ``max_length``: best fit
    decreasing (the longest example first, each into the fullest row it fits in; ties in
    the order given). The same rows, in the same order, as TRL's ``pack_dataset(...,
    strategy="bfd")``. Every length must be in ``[1, max_length]`` (truncate first)."""
    bad = next((n for n in lengths if not 1 <= n <= max_length), None)
    if bad is not None:
        raise ValueError(f"pack_examples: an example of {bad} tokens does not fit max_length={max_length}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])   # stable: ties keep their order
    bins: list[list[int]] = []
    spaces: list[int] = []                      # sorted free spaces of open rows (< max_length)
    by_space: dict[int, deque] = defaultdict(deque)
    for i in order:
        n = lengths[i]
        j = bisect_left(spaces, n)
        if j < len(spaces):                     # the row with the least room that still fits
            space = spaces[j]
            row = by_space[space].popleft()
            if not by_space[space]:
                spaces.pop(j)
        else:
            space, row = max_length, []
            bins.append(row)
        row.append(i)
        left = space - n
        if left > 0:
            if not by_space[left]:
                insort(spaces, left)
            by_space[left].append(row)
    return bins


class ExamplePackCollator:
    """Rows of whole packed examples (``input_ids``, ``labels``, ``position_ids`` that
    restart at 0 per example) -> a batch of ``(B, L)`` tensors with **no**
    ``attention_mask``: transformers reads the example boundaries from the position ids
    (see the module docs). Padding is ``pad_token_id`` with label -100 and position 0 on
    every padded token (each its own one-token example, attending only to itself). The
    label of every example's first token is set to -100: no example is the target of the
    one packed before it."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id, self.pad_to_multiple_of = int(pad_token_id), pad_to_multiple_of
        self._pad = PadCollator(self.pad_token_id, "right", pad_to_multiple_of)

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        out = self._pad(items)
        del out["attention_mask"]   # the examples are read from the position ids
        out["labels"][out["position_ids"] == 0] = -100
        return out


def is_example_packed(batch: Any) -> bool:
    """A batch of :class:`ExamplePackCollator` rows: ``position_ids``, no ``attention_mask``."""
    return (isinstance(batch, dict) and "position_ids" in batch and "attention_mask" not in batch
            and "cu_seq_lens" not in batch)


def check_example_packable(model) -> None:
    """Raise unless ``model`` isolates packed examples: its attention masks must come from
    transformers' masking utilities (``create_causal_mask``, which finds the examples in
    the position ids), or its kernel must be flash attention (varlen over them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model   # a peft model
    cfg = getattr(base, "config", None)
    impl = str(getattr(cfg, "_attn_implementation", None) or "")
    from ember.checkpoint.rng import keep_rng_states
    with keep_rng_states():
        from transformers import masking_utils
    uses_masks = any(getattr(sys.modules.get(type(m).__module__), "create_causal_mask", None)
                     is masking_utils.create_causal_mask for m in (base, getattr(base, "model", None)) if m is not None)
    if not (uses_masks or "flash" in impl):
        raise MisconfigurationError(
            f"packing=True needs a causal LM whose attention keeps packed examples apart: "
            f"{type(base).__name__} (attn_implementation={impl!r}) builds its masks without transformers' "
            "masking utilities, so packed examples would attend to each other. Use CausalLMData(packing=False), "
            "or a model class that calls transformers.masking_utils.create_causal_mask")


def example_packed_inputs(model, batch: dict, labels: bool = False) -> dict:
    """The model inputs (``labels`` too when asked) for a batch of :class:`ExamplePackCollator` rows:
    ``use_cache=False`` (with a cache, transformers does not look for packed examples in
    the position ids), and for the flash-attention kernels, whose varlen path needs one
    row, the rows flattened into one (the padding's position 0 makes each padded token
    its own example)."""
    inputs = {k: v for k, v in batch.items() if labels or k != "labels"}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "flash" in str(getattr(getattr(base, "config", None), "_attn_implementation", "") or ""):
        inputs = {k: v.reshape(1, -1) if torch.is_tensor(v) and v.dim() == 2 else v for k, v in inputs.items()}
    inputs["use_cache"] = False
    return inputs
