"""kill -9 during a background save with ModelCheckpoint(save_top_k=1, save_last=True):
the superseded checkpoint is deleted and ``last`` moved only after the new checkpoint is
committed, so a kill at any moment leaves a complete checkpoint that ``ckpt_path="last"``
resumes bit for bit (tests/scripts/async_topk_kill.py: real SIGKILLs, several timings)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "async_topk_kill.py"
TIMINGS = ["gate", "0", "0.01", "0.02", "0.05", "0.1"]


@pytest.mark.timeout(240)
def test_kill_during_an_async_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_",
                                                                    "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *TIMINGS], env=env, capture_output=True,
                       text=True, timeout=220)
    assert p.returncode == 0, p.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    killed_mid_write = 0
    for timing in TIMINGS:
        r = result[timing]
        assert r["status"] in (-9, 0), (timing, r)          # SIGKILLed (0: the fit ended first)
        assert r["complete"], (timing, r)                   # at least one complete checkpoint is left
        assert r["resume_code"] == 0 and r["resumed"]["equal"] is True, (timing, r.pop("resume_error"), r)
        assert r["resumed"]["global_step"] == 5
        killed_mid_write += r["status"] == -9 and any(n.endswith(".ember-tmp") for n in r["left"])
    # the gate kills inside the write for certain; the timed kills land wherever the run is then
    assert result["gate"]["status"] == -9 and any(n.endswith(".ember-tmp") for n in result["gate"]["left"])
    assert killed_mid_write >= 1, result
