"""Dynamic padding of tokenised batches: :class:`PadCollator`, used by the data modules of
:mod:`ember.integrations.hf_data` and, for rows of packed examples, by
:class:`ember.integrations.packing.ExamplePackCollator`."""
from __future__ import annotations

import torch

from ember.errors import MisconfigurationError

__all__ = ["PadCollator"]


class PadCollator:
    """Pads one batch to its longest sequence (dynamic padding).

    ``lm_labels=True`` adds ``labels`` = ``input_ids`` with padded positions set to -100
    (masked by position, so an EOS token used for padding is still learned where it is real).
    """

    def __init__(self, pad_token_id: int, padding_side: str = "right", pad_to_multiple_of: int | None = None,
                 lm_labels: bool = False):
        if padding_side not in ("right", "left"):
            raise MisconfigurationError(f"padding_side={padding_side!r} is not valid; choose one of: 'right', 'left'")
        self.pad_token_id, self.padding_side = int(pad_token_id), padding_side
        self.pad_to_multiple_of, self.lm_labels = pad_to_multiple_of, lm_labels

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        n = max(len(it["input_ids"]) for it in items)
        if self.pad_to_multiple_of:
            n = -(-n // self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(items)
        ids = torch.full((b, n), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, n), dtype=torch.long)
        extra = {k: torch.zeros((b, n), dtype=torch.long) for k in items[0] if k not in ("input_ids", "labels")}
        tok_labels = "labels" in items[0] and items[0]["labels"].ndim == 1
        # per-token labels aligned with the inputs (token classification) are padded like them;
        # target sequences of their own length (seq2seq) are right-padded to their longest
        aligned = tok_labels and all(len(it["labels"]) == len(it["input_ids"]) for it in items)
        labels = None
        if tok_labels and not aligned:
            labels_n = max(len(it["labels"]) for it in items)
            labels = torch.full((b, labels_n), -100, dtype=torch.long)
            for i, it in enumerate(items):
                labels[i, :len(it["labels"])] = it["labels"]
        elif aligned:
            labels = torch.full((b, n), -100, dtype=torch.long)
        for i, it in enumerate(items):
            m = len(it["input_ids"])
            sl = slice(0, m) if self.padding_side == "right" else slice(n - m, n)
            ids[i, sl] = it["input_ids"]
            mask[i, sl] = 1
            for k, t in extra.items():
                t[i, sl] = it[k]
            if aligned:
                labels[i, sl] = it["labels"]
        out = {"input_ids": ids, "attention_mask": mask, **extra}
        if labels is not None:
            out["labels"] = labels
        elif "labels" in items[0]:
            out["labels"] = torch.stack([it["labels"] for it in items])
        elif self.lm_labels:
            out["labels"] = ids.masked_fill(mask == 0, -100)
        return out
