"""``help()`` of every callback describes every constructor argument: each one has its own
entry in the ``Args:`` section of the class (or ``__init__``) docstring."""
from __future__ import annotations

import inspect
import re

import pytest

import ember.callbacks


def documented_args(cls) -> set[str]:
    """Names with an entry ``name: ...`` / ``name (type): ...`` / ``**name: ...`` in an
    ``Args:`` section of the class or ``__init__`` docstring."""
    docs = [inspect.getdoc(cls) or ""]
    if "__init__" in vars(cls) and cls.__init__.__doc__:
        docs.append(inspect.getdoc(cls.__init__))
    names: set[str] = set()
    for doc in docs:
        for section in re.findall(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M):
            names |= set(re.findall(r"^    \**(\w+)(?: \([^)]*\))?:", section, re.M))
    return names


def undocumented(cls) -> list[str]:
    params = [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    return [p for p in params if p not in documented_args(cls)]


CALLBACKS = [n for n in ember.callbacks.__all__ if n not in ("Callback", "ProgressBar", "Event")]


@pytest.mark.parametrize("name", CALLBACKS)
def test_every_callback_argument_is_described(name):
    cls = getattr(ember.callbacks, name)
    assert undocumented(cls) == [], f"{name}: arguments without an Args: entry"


def test_the_arguments_the_issue_named():
    assert not {"unfreeze_backbone_at_epoch", "initial_denom_lr", "train_bn", "verbose", "rounding"} - \
        documented_args(ember.callbacks.BackboneFinetuning)
    doc = inspect.getdoc(ember.callbacks.ThroughputMonitor)
    assert re.search(r"^    log_every_n_steps: log the throughput every N optimizer steps", doc, re.M)
