"""Manual optimization under DDP with toggled optimizers (Lightning's GAN example): two real
gloo processes (tests/scripts/manual_ddp.py) end with the single-process weights, as each
manual_backward prepares DDP's gradient reduction (as Lightning does)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import SCRIPTS, child_env

pytestmark = pytest.mark.multiproc
SCRIPT = SCRIPTS / "manual_ddp.py"


def run(tmp_path: Path, n: int) -> list[dict]:
    env = child_env(EMBER_CHECKPOINT_FSYNC="0")
    out = tmp_path / f"n{n}"
    out.mkdir()
    p = subprocess.run([sys.executable, str(SCRIPT), str(out), str(n)], cwd=out, env=env, capture_output=True,
                       text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((out / f"result_{r}.json").read_text()) for r in range(n)]


@pytest.mark.timeout(200)
def test_toggled_manual_optimization_on_two_processes_equals_one(tmp_path):
    (one,), (r0, r1) = run(tmp_path, 1), run(tmp_path, 2)
    assert r0["world"] == r1["world"] == 2 and r0["steps"] == r1["steps"] == one["steps"] == 16
    assert r0["params"] == r1["params"]                 # the ranks agree (gradients all-reduced)
    for k, v in one["params"].items():                  # and average to the full batch's gradient
        torch.testing.assert_close(torch.tensor(r0["params"][k]), torch.tensor(v), rtol=1e-5, atol=1e-6)
