"""A process-group timeout under ``ember launch`` names the rank that never arrived:
rank 0 times out in a collective that is not an agreement point (ModelCheckpoint's
save-point broadcast) while rank 1 is stuck; its error and the launcher's last line
name rank 1 (they named no rank, and the launcher called rank 0 the failing rank)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "failfast_ddp.py"
_STRIP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
          "MASTER_PORT", "EMBER_LAUNCHER_PID", "EMBER_STRATEGY", "EMBER_PRECISION", "EMBER_TEST_DEVICES")


@pytest.mark.timeout(150)
def test_collective_timeout_names_the_rank_that_never_arrived(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", EMBER_CHECKPOINT_FSYNC="0")
    p = subprocess.run([sys.executable, "-m", "ember", "launch", "--num-processes", "2", str(SCRIPT),
                        "collective_timeout", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=140)
    assert p.returncode == 1, p.stderr[-4000:]
    assert "Timed out" in p.stderr                          # gloo's own error, as it was raised
    assert "ember: rank(s) 1 never arrived at a collective that rank 0 waited in " \
           "until the process-group timeout" in p.stderr, p.stderr[-4000:]
    assert "ember: error: launch: rank(s) 1 never arrived at a collective: rank 0 (local rank 0) waited for them " \
           "until the process-group timeout and exited with code 1" in p.stderr, p.stderr[-4000:]
