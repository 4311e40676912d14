"""sync_dist metrics under several processes (2 real gloo processes, a 10 s
process-group timeout): a metric logged with sync_dist=True on one rank only is an
error on every rank, in seconds, never a hang."""

import pytest

from helpers import rank_results, run_ranks

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(200)
def test_sync_dist_metric_on_one_rank_raises_on_every_rank_naming_metric_and_ranks(tmp_path):
    run_ranks("sync_keys_ddp.py", tmp_path)
    results = rank_results(tmp_path)
    for r in results:
        assert r["step"] is not None and r["step"].startswith("MisconfigurationError")
        assert "'only_rank0' on rank(s) [0], not on rank(s) [1]" in r["step"]
        assert r["epoch"] is not None and "'only_rank1' on rank(s) [1], not on rank(s) [0]" in r["epoch"]
        assert r["step_seconds"] < 9 and r["epoch_seconds"] < 9   # raised, not the 10 s timeout
        # a value logged on rank 0 only in on_train_epoch_end (no sync_dist) does not hang
        assert r["late"] is None and r["late_seconds"] < 9
        # callback_metrics holds a sync_dist step metric's reduced value, on every rank
        assert r["late_seen_v"] == 5.0
        # eval step values with sync_dist: rank-local per batch (said once, on rank 0), reduced per epoch
        assert r["eval_step"] is None
        assert r["eval_step_logged"]["val_v_epoch"] == 5.0
        assert r["eval_step_logged"]["val_v_step"] == 10.0 * results.index(r)
    assert len(results[0]["eval_step_warned"]) == 1 and results[1]["eval_step_warned"] == []
    assert "self.log('val_v', ..., on_step=True, sync_dist=True) in validation_step" in results[0]["eval_step_warned"][0]
    assert "val_v_step" in results[0]["eval_step_warned"][0]
    for where in ("step", "epoch", "late"):      # no such value logged there: no warning
        assert results[0][where + "_warned"] == []
