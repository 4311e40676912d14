"""`ember launch` names the rank that failed first (issue 18 item 16): a rank stopped
because of another one (SIGTERM from the agent, or a lost peer with no error file) is not
reported as the cause."""
import json
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ember.launch import first_failure, unordered_failures


def _error_file(tmp_path, name, ts):
    p = tmp_path / name
    p.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {"timestamp": ts}}}))
    return str(p)


def test_the_rank_that_recorded_its_error_is_named(tmp_path):
    now = int(time.time())
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(tmp_path / "none0")),   # lost its peer
        1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=_error_file(tmp_path, "e1", now)),
    }
    assert first_failure(failures)[0] == 1


def test_an_exit_code_wins_over_the_agents_sigterm(tmp_path):
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none0")),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file=str(tmp_path / "none1")),
    }
    assert first_failure(failures)[0] == 1


def test_unrecorded_exits_in_the_same_second_are_not_ordered(tmp_path):
    """A plain torch script records no error: the rank that raised and the rank that then
    lost its peer both exit with code 1, seen in the same poll of the agent. Which came
    first cannot be told, and the launcher says so instead of naming rank 0."""
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(tmp_path / "none0")),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(tmp_path / "none1")),
    }
    failures[0].timestamp = failures[1].timestamp
    assert unordered_failures(failures) == [0, 1]
    failures[1].timestamp -= 1          # rank 1 seen a second earlier: it is the first
    assert first_failure(failures)[0] == 1 and unordered_failures(failures) == [1]
    failures[0].error_file_data = json.loads(open(_error_file(tmp_path, "e0", 0)).read())   # rank 0 recorded its own
    assert first_failure(failures)[0] == 0 and unordered_failures(failures) == [0]
