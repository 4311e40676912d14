"""The ranks' agreement on a torchrun worker group's attempt (ember.distributed.elastic),
in a real TCPStore standing for the agents' shared store; each rank is a thread with its
own client, as each worker process has. The multi-machine runs that need it are in
tests/launch/test_multinode.py."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from ember.distributed import elastic
from ember.errors import DistributedOperationError

TIMEOUT = timedelta(seconds=10)


def group(port: int, restarts: list[int], timeout=TIMEOUT) -> list[tuple[int, int]]:
    """One worker group: rank r with its agent's restart count restarts[r]."""
    def rank(r):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        return elastic.exchange(store, r, len(restarts), restarts[r], timeout)
    with ThreadPoolExecutor(len(restarts)) as pool:
        return list(pool.map(rank, range(len(restarts))))


def test_every_rank_gets_a_fresh_generation_and_the_same_attempt():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    assert group(server.port, [0, 0, 0, 0]) == [(1, 0)] * 4
    # the busy-peer restart: node 0's agent counted nothing, node 1's one restart
    assert group(server.port, [0, 0, 1, 1]) == [(2, 1)] * 4
    # a token left by a rank that died before rank 0 answered it (stale), then a group
    # whose agents all counted nothing (a membership change): still a new generation
    server.queue_push("/ember/elastic/hello", "dead-rank-token")
    assert group(server.port, [0, 0, 0, 0]) == [(3, 2)] * 4
    # the agents' counts may run ahead of the generations (attempts that failed before
    # building a strategy): the largest count wins
    assert group(server.port, [5, 0, 0, 0]) == [(4, 5)] * 4


def test_a_rank_that_never_arrives_is_named():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    with pytest.raises(DistributedOperationError, match=r"rank\(s\) 1, 2 of the torchrun worker group never arrived"):
        elastic.exchange(store, 0, 3, 0, timedelta(seconds=1))


def test_outside_torchrun_the_own_count_is_the_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert not elastic.under_agent_store() and elastic.agreed_attempt() == 2
