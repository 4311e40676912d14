"""Every cross-rank decision is made once and agreed (issue 12 items 1, 2, 3, 5): two real
gloo processes (tests/scripts/agree_ddp.py) with a 30 s process-group timeout, so a
disagreement fails in seconds instead of hanging."""

import pytest

from helpers import rank_results, run_ranks

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(200)
def test_ranks_agree_on_stop_checkpoint_run_folder_and_resume_path(tmp_path):
    run_ranks("agree_ddp.py", tmp_path, EMBER_CHECKPOINT_FSYNC="0")
    r0, r1 = rank_results(tmp_path)
    # 1. rank 0's request stops both ranks at the next log point (step 4), mid-epoch
    assert r0["should_stop"] == r1["should_stop"] == ["should_stop", 4, 0, 4]
    # 2. max_time with one slow rank: same step on both, no hang
    assert r0["max_time"] == r1["max_time"] and r0["max_time"][0] == "max_time"
    # 3. top-k decided once (rank 0's metric) 4. one run folder 5. one resume checkpoint
    assert r0["topk"] == r1["topk"] and len(r0["topk"]) == 2 and r0["best"] == r1["best"]
    assert r0["log_dir"] == r1["log_dir"] and r0["log_dir"].endswith("version_0")
    assert r0["resumed"] == r1["resumed"] and r0["resumed"]
