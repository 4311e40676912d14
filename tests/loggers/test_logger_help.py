"""``help()`` of every logger describes every constructor argument (an ``Args:`` entry each)."""
from __future__ import annotations

import pytest

import ember.loggers
from tests.callbacks.test_callback_help import undocumented

LOGGERS = [n for n in ember.loggers.__all__ if n != "Logger" and isinstance(getattr(ember.loggers, n), type)]


@pytest.mark.parametrize("name", LOGGERS)
def test_every_logger_argument_is_described(name):
    assert undocumented(getattr(ember.loggers, name)) == [], name
