"""The attempt number of a torchrun worker group, agreed by every rank of every node.

torchrun's elastic agent gives each worker ``TORCHELASTIC_RESTART_COUNT``: the restarts
*its own agent* counted. On several machines the counts differ: when the workers of one
node fail, that node's agent counts a restart and joins the next rendezvous round, and
the agents of the other nodes, whose workers are still running (busy computing, not yet
in a collective with the dead rank), restart their workers for the waiting node without
counting one (a membership change). One node then says 1 and the others 0. Anything
keyed on the count (the store prefix of the new process group, "is this a restart?")
differs between the nodes: the restarted group failed with gloo's ``connectFullMesh ...
Connection refused`` on the previous attempt's keys, and the ranks would disagree on
whether to resume.

What every node does agree on is the agents' shared TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``, at ``MASTER_ADDR:MASTER_PORT``), which outlives
the worker groups. In it, rank 0 of each new group draws the next generation number and
hands it to every other rank; :func:`agreed_attempt` runs that exchange once per process.

The exchange cannot trust anything a previous attempt left in the store, so every
answer is keyed on something fresh:

1. each rank ``r > 0`` pushes a random token onto a queue and waits for the key
   ``ack/<token>``, which only this attempt's rank 0 can write;
2. rank 0 draws ``g = add("generation", 1)`` (a value no earlier attempt had), pops
   every token on the queue and writes ``ack/<token> = g`` (tokens of dead processes are
   answered too, harmlessly), until every rank ``r`` has written ``confirm/g/r`` (its own
   restart count), which only a rank that received ``g`` can do;
3. rank 0 publishes ``decision/g``: the attempt number, ``max(g - 1, the largest
   restart count of any rank)``; every rank reads it.

This relies on what torchrun's c10d rendezvous guarantees: a node's agent stops its
workers before it joins the next round, so no worker of an earlier attempt is still
waiting in the exchange when a new one starts. Under the static rendezvous (fixed node
ranks, no rounds) a node that failed restarts on its own while the others keep running;
its new ranks then wait in the exchange until the other nodes' workers fail too and
restart, and all meet in the same generation.

The exchange costs each rank two store round trips, once per process, and is bounded by
the process-group timeout.
"""
from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

_PREFIX = "/ember/elastic/"
#: (generation, attempt) once agreed in this process
_AGREED: "tuple[int, int] | None" = None
_STORE = None


def under_agent_store() -> bool:
    """True in a worker that torchrun's elastic agent started with its shared store."""
    env = os.environ
    return (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RUN_ID" in env
            and bool(env.get("MASTER_ADDR")) and bool(env.get("MASTER_PORT")))


def own_restart_count() -> int:
    """``TORCHELASTIC_RESTART_COUNT`` as torchrun's agent of this node set it (0 when unset)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if _AGREED is not None:   # this process replaced it with the agreed number
        value = os.environ.get("EMBER_AGENT_RESTART_COUNT", value)
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def agent_store(timeout: "timedelta | float" = timedelta(minutes=30)):
    """A client of the agents' shared TCPStore (``MASTER_ADDR:MASTER_PORT``); one per process."""
    global _STORE
    import torch.distributed as dist
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if _STORE is None:
        _STORE = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               int(os.environ.get("WORLD_SIZE", "1")), is_master=False, timeout=timeout)
    else:
        _STORE.set_timeout(timeout)
    return _STORE


def agreed_attempt(timeout: "timedelta | float" = timedelta(minutes=30)) -> int:
    """The attempt number of this worker group (0: the first), the same on every rank.

    Under torchrun's elastic agent with its shared store (the default of ``torchrun`` and
    ``ember launch``), the ranks agree on it once per process through the store (see the
    module's docstring), and ``TORCHELASTIC_RESTART_COUNT`` in ``os.environ`` is set to it,
    so that code reading the variable (the Trainer's resume after a restart, a script's
    own "first attempt only" logic) agrees across nodes; the agent's own count stays in
    ``EMBER_AGENT_RESTART_COUNT``. Elsewhere: ``TORCHELASTIC_RESTART_COUNT`` as it is.
    Every rank must call it (ember's strategies do, when they are built); a rank that
    does not arrive within ``timeout`` makes the others raise ``DistributedOperationError``
    naming it."""
    if not under_agent_store():
        return own_restart_count()
    return _agree(timeout)[1]


def agreed_generation(timeout: "timedelta | float" = timedelta(minutes=30)) -> int:
    """The generation number of this worker group in the agents' store (1, 2, ...): a value
    no earlier worker group of the job had, the same on every rank. ``DDPStrategy`` keys
    its process group's store prefix on it."""
    return _agree(timeout)[0]


def _agree(timeout) -> "tuple[int, int]":
    global _AGREED
    if _AGREED is not None:
        return _AGREED
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    store = agent_store(timeout)
    mine = own_restart_count()
    generation, attempt = exchange(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), mine, timeout)
    os.environ["EMBER_AGENT_RESTART_COUNT"] = str(mine)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    _AGREED = (generation, attempt)
    return _AGREED


def exchange(store, rank: int, world: int, restarts: int, timeout: timedelta) -> "tuple[int, int]":
    """One rank's part of the exchange (see the module's docstring) in ``store``, the
    agents' shared store: ``(generation, attempt)``, the same on every rank of the group.
    ``restarts``: this rank's agent's restart count."""
    if rank == 0:
        return _lead(store, world, restarts, timeout)
    token = uuid.uuid4().hex
    store.queue_push(_PREFIX + "hello", token)
    generation = int(_get(store, f"{_PREFIX}ack/{token}", timeout, rank))
    store.set(f"{_PREFIX}confirm/{generation}/{rank}", str(restarts))
    return generation, int(_get(store, f"{_PREFIX}decision/{generation}", timeout, rank))


def _get(store, key: str, timeout: timedelta, rank: int) -> str:
    try:
        return store.get(key).decode()
    except Exception as err:   # the store's timeout (DistStoreError) or a lost store
        from ember.errors import DistributedOperationError
        raise DistributedOperationError(
            f"rank {rank}: the ranks of the restarted torchrun worker group did not agree on its attempt "
            f"number within {timeout.total_seconds():g} s (rank 0 never answered in the agents' store at "
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}): {err}") from err


def _lead(store, world: int, mine: int, timeout: timedelta) -> "tuple[int, int]":
    generation = store.add(_PREFIX + "generation", 1)
    confirms = [f"{_PREFIX}confirm/{generation}/{r}" for r in range(1, world)]
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.002
    while True:
        for _ in range(store.queue_len(_PREFIX + "hello")):
            token = store.queue_pop(_PREFIX + "hello").decode()
            store.set(f"{_PREFIX}ack/{token}", str(generation))
        if not confirms or store.check(confirms):
            break
        if time.monotonic() > deadline:
            from ember.errors import DistributedOperationError
            missing = [r for r, key in enumerate(confirms, 1) if not store.check([key])]
            raise DistributedOperationError(
                f"rank 0: rank(s) {', '.join(map(str, missing[:20]))}{' ...' if len(missing) > 20 else ''} of "
                f"the torchrun worker group never arrived to agree on its attempt number within "
                f"{timeout.total_seconds():g} s (every rank builds its Trainer/Accelerator, or strategy, "
                "at start-up)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    counts = [int(v) for v in store.multi_get(confirms)] if confirms else []
    attempt = max([generation - 1, mine, *counts])
    store.set(f"{_PREFIX}decision/{generation}", str(attempt))
    return generation, attempt
