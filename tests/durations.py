"""The suite's files by their run time, so that pytest-xdist starts the slowest first.

``make test`` runs whole files on each of its workers, taking them in collection order; a
long file drawn last keeps one worker busy alone at the end. ``conftest.py`` orders the
files by the seconds recorded in ``durations.json`` (longest first; files not listed, the
quick ones, keep their order after them). The figures only steer that order: stale ones
cost a little balance, never a result. Refresh them from a run's ``--durations=0`` report:

    make test PYTEST_ARGS="--durations=0" | tee /tmp/run.log
    python tests/durations.py /tmp/run.log
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
_LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def load() -> dict[str, float]:
    """``{path relative to the repository: seconds}``; empty when the file is missing."""
    try:
        return json.loads(FILE.read_text())
    except (OSError, ValueError):
        return {}


def parse(report: str, at_least: float = 5.0) -> dict[str, int]:
    """Seconds per test file from pytest's ``--durations=0`` lines (setup, call, teardown)."""
    total: Counter = Counter()
    for line in report.splitlines():
        m = _LINE.match(line)
        if m:
            total[m.group(2)] += float(m.group(1))
    return {f: round(t) for f, t in sorted(total.items(), key=lambda kv: -kv[1]) if t >= at_least}


if __name__ == "__main__":
    found = parse(Path(sys.argv[1]).read_text())
    if not found:
        raise SystemExit(f"no --durations lines in {sys.argv[1]}")
    FILE.write_text(json.dumps(found, indent=0) + "\n")
    print(f"{len(found)} files, {sum(found.values())} s, written to {FILE}")
