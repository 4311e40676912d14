"""Lightning names ember offers under its own modules (ember.utilities, ...)."""
import logging
import os
import subprocess
import sys
import warnings

import pytest

from ember import utilities
from ember.utilities import (rank_zero_debug, rank_zero_info, rank_zero_only,
                             rank_zero_warn)


@pytest.fixture
def rank():
    old = rank_zero_only.rank
    yield
    rank_zero_only.rank = old


def test_rank_zero_only_runs_on_rank_zero_only(rank):
    calls = []

    @rank_zero_only
    def f(x):
        calls.append(x)
        return x * 2

    rank_zero_only.rank = 0
    assert f(3) == 6
    rank_zero_only.rank = 1
    assert f(4) is None
    assert calls == [3]
    assert rank_zero_only(lambda: 1, default=7)() == 7
    assert f.__name__ == "f"


@pytest.mark.parametrize("env,expected", [({"RANK": "3", "LOCAL_RANK": "1"}, 3),
                                          ({"LOCAL_RANK": "1"}, 1),
                                          ({"SLURM_PROCID": "2"}, 2), ({}, 0)])
def test_rank_read_from_environment(env, expected):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")}
    out = subprocess.run([sys.executable, "-c",
                          "from ember.utilities import rank_zero_only, rank_zero_warn\n"
                          "import warnings\nwarnings.simplefilter('always')\n"
                          "print(rank_zero_only.rank); rank_zero_warn('hello')"],
                         env={**clean, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)
    assert ("hello" in out.stderr) == (expected == 0)


def test_rank_zero_info_warn_debug(rank, caplog):
    rank_zero_only.rank = 0
    with caplog.at_level(logging.DEBUG, logger="ember.utilities"):
        rank_zero_info("info %d", 1)
        rank_zero_debug("dbg")
    assert [r.getMessage() for r in caplog.records] == ["info 1", "dbg"]
    with pytest.warns(UserWarning, match="careful"):
        rank_zero_warn("careful")
    rank_zero_only.rank = 1
    caplog.clear()
    with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.DEBUG, logger="ember.utilities"):
        warnings.simplefilter("always")
        rank_zero_warn("careful")
        rank_zero_info("info")
    assert w == [] and caplog.records == []
    assert utilities.rank_prefixed_message("m", 2) == "[rank: 2] m"
