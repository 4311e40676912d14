"""help() of the Hugging Face data modules names every constructor argument in its
``Args:`` section (entries may name several: ``train, val, test, predict:``)."""
from __future__ import annotations

import inspect
import re

import pytest

pytest.importorskip("transformers")

from ember.integrations.transformers import CausalLMData, TextClassificationData  # noqa: E402


def documented(cls) -> set[str]:
    names: set[str] = set()
    for section in re.findall(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", inspect.getdoc(cls) or "", re.M):
        for entry in re.findall(r"^    (\w+(?:(?:, | / )\w+)*):", section, re.M):
            names |= set(re.split(r", | / ", entry))
    return names


@pytest.mark.parametrize("cls", [TextClassificationData, CausalLMData])
def test_every_data_argument_is_described(cls):
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert [p for p in params if p not in documented(cls)] == []
