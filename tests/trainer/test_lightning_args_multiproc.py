"""Lightning Trainer arguments that act across ranks (issue 15): two real gloo
processes (tests/scripts/lightning_args_ddp.py) with a 30 s process-group timeout."""

import pytest

from helpers import rank_results, run_ranks

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(200)
def test_sampler_min_epochs_and_sync_batchnorm_under_two_processes(tmp_path):
    p = run_ranks("lightning_args_ddp.py", tmp_path)
    r0, r1 = rank_results(tmp_path)
    # the user's loader as given: both ranks read all 4 batches in order
    assert r0["sampler_False"] == r1["sampler_False"] == [0, 16, 32, 48]
    # ember's sampler: each rank reads every second row (first rows of its batches: 0, 8 / 1, 9)
    assert (r0["sampler_True"], r1["sampler_True"]) == ([0, 32], [4, 36])
    assert r0["min_epochs"] == r1["min_epochs"] == ["should_stop", 2, 4]
    assert r0["helpers"] == r1["helpers"] == [2, [0, 1], 1, 2, "finished"]
    assert p.stdout.count("trainer.print from rank") == 1 and "trainer.print from rank 0" in p.stdout
    assert r0["sync_bn"] == r1["sync_bn"] and "sync_batchnorm=True on CPU processes" in r0["sync_bn"]
