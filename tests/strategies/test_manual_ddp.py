"""Manual optimization under DDP with toggled optimizers (Lightning's GAN example): two real
gloo processes (tests/scripts/manual_ddp.py) end with the single-process weights, as each
manual_backward prepares DDP's gradient reduction (as Lightning does)."""
from pathlib import Path

import pytest
import torch

from helpers import rank_results, run_ranks

pytestmark = pytest.mark.multiproc


def run(tmp_path: Path, n: int) -> list[dict]:
    out = tmp_path / f"n{n}"
    out.mkdir()
    run_ranks("manual_ddp.py", out, n, timeout=150, EMBER_CHECKPOINT_FSYNC="0")
    return rank_results(out, n)


@pytest.mark.timeout(200)
def test_toggled_manual_optimization_on_two_processes_equals_one(tmp_path):
    (one,), (r0, r1) = run(tmp_path, 1), run(tmp_path, 2)
    assert r0["world"] == r1["world"] == 2 and r0["steps"] == r1["steps"] == one["steps"] == 16
    assert r0["params"] == r1["params"]                 # the ranks agree (gradients all-reduced)
    for k, v in one["params"].items():                  # and average to the full batch's gradient
        torch.testing.assert_close(torch.tensor(r0["params"][k]), torch.tensor(v), rtol=1e-5, atol=1e-6)
