"""ModelSummary: a rich table of the module's layers, parameter counts and size,
printed once at the start of fit."""
from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ember.callbacks.base import Callback


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}".rstrip() if unit else f"{int(n)}"
        n /= 1000
    return f"{n:.1f} P"


def training_modes(module: nn.Module) -> dict[str, bool]:
    """``{submodule name: training?}`` as they will be while training: the Trainer calls
    ``module.train()`` at each epoch's start, so a model loaded in eval mode (a transformers
    ``from_pretrained`` model) trains in train mode, and a ``train()`` override that keeps some
    layers in eval mode (frozen batch norm) shows them so. ``module`` is left as it was."""
    before = [(m, m.training) for _, m in module.named_modules()]
    try:
        module.train()
        return {name: m.training for name, m in module.named_modules()}
    finally:
        for m, mode in before:
            m.training = mode


def summarize(module: nn.Module, max_depth: int = 1) -> dict:
    """Rows (name, type, params, trainable, mode during training) for submodules down to
    ``max_depth`` (-1: every level), plus totals and the size in MB."""
    rows = []
    modes = training_modes(module)
    for name, m in module.named_modules():
        depth = name.count(".") + 1 if name else 0
        if not name or (max_depth >= 0 and depth > max_depth):
            continue
        n = sum(p.numel() for p in m.parameters())
        t = sum(p.numel() for p in m.parameters() if p.requires_grad)
        rows.append((name, type(m).__name__, n, t, "train" if modes.get(name, m.training) else "eval"))
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    size = sum(p.numel() * p.element_size() for p in params) + sum(b.numel() * b.element_size() for b in module.buffers())
    return {"rows": rows, "total": total, "trainable": trainable, "non_trainable": total - trainable,
            "size_mb": size / 1e6}


class ModelSummary(Callback):
    """Print a table of the module's layers (name, type, parameters, mode), the parameter
    totals and the size at the start of ``fit`` (global rank 0). The Mode column is each
    layer's mode during training (the Trainer calls ``module.train()`` at each epoch's
    start), not the mode the model was loaded in.

    Args:
        max_depth: how deep to list submodules, as in Lightning: 1 lists the direct
            children, N goes N levels down, -1 lists every layer, 0 prints nothing.
        console: a ``rich.console.Console`` to print on (default: stderr).
    """

    def __init__(self, max_depth: int = 1, console: Any = None) -> None:
        self.max_depth = max_depth
        self._console = console

    def on_fit_start(self, trainer, module):
        if not trainer.is_global_zero or self.max_depth == 0:   # 0: no summary (-1: every layer)
            return
        from ember.checkpoint.rng import keep_rng_states
        with keep_rng_states():   # a first import leaves the user's random streams as they were
            from rich.console import Console
            from rich.table import Table
        s = summarize(module, self.max_depth)
        table = Table(title=f"{type(module).__name__}", title_justify="left")
        for col, just in (("", "right"), ("Name", "left"), ("Type", "left"), ("Params", "right"),
                          ("Trainable", "right"), ("Mode", "left")):
            table.add_column(col, justify=just)
        for i, (name, typ, n, t, mode) in enumerate(s["rows"]):
            table.add_row(str(i), name, typ, _human(n), _human(t), mode)
        console = self._console or Console(file=sys.stderr)
        console.print(table)
        console.print(f"[bold]{_human(s['trainable'])}[/] trainable params, {_human(s['non_trainable'])} "
                      f"non-trainable, {_human(s['total'])} total, {s['size_mb']:.2f} MB "
                      f"({trainer.precision}, {trainer.strategy.name} on {trainer.strategy.root_device})")
