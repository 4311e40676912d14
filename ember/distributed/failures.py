"""What a failed collective means, and the clean end of a process group: which errors
come from a collective (:func:`is_comm_error`), which only say that another rank went
away (:func:`is_peer_lost_error`) or that a collective timed out
(:func:`is_timeout_error`, :func:`ranks_never_arrived`), and
:func:`shutdown_process_group`."""
from __future__ import annotations

import os
import time

__all__ = ["is_comm_error", "is_peer_lost_error", "is_timeout_error", "ranks_never_arrived",
           "never_arrived_message", "shutdown_process_group"]

_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "econnreset", "epipe", "connection refused", "socket closed",
              "failed to recv", "failed to send", "read error", "write error")


def is_comm_error(exc: BaseException) -> bool:
    """An error raised by a collective / the process group."""
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistNetworkError", None)) if k is not None)
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, kinds) or any(s in text for s in ("gloo", "nccl", "c10d", "processgroup"))


def is_peer_lost_error(exc: BaseException) -> bool:
    """A communication error that says another rank went away (not this rank's fault)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return is_comm_error(exc) and any(s in text for s in _PEER_LOST)


def is_timeout_error(exc: BaseException) -> bool:
    """A collective that gave up waiting (the process-group timeout), not one whose peer
    went away, and not already an error that names the ranks missing."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return (is_comm_error(exc) or "distributedoperationerror" in text) and not is_peer_lost_error(exc) \
        and ("timed out" in text or "timeout" in text) and "never arrived" not in text


_WAITING_KEY = "ember/timed-out/rank{}"


def ranks_never_arrived(window: float = 3.0) -> list[int]:
    """After this rank's collective timed out: the ranks that never arrived there.

    This rank records in the rendezvous store that it was waiting, then gives the others
    ``window`` seconds to record the same (the ranks blocked in that collective time out
    at about the same moment); a rank that records nothing never reached it (stuck, or
    much slower). Store round trips on the error path only; ``[]`` when unknown (no
    process group or store, or every rank was waiting: a collective called on some ranks
    only, or in another order)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        if not dist.is_available() or not dist.is_initialized():
            return []
        rank, world = dist.get_rank(), dist.get_world_size()
        store = c10d._get_default_store()
        store.set(_WAITING_KEY.format(rank), "1")
        deadline = time.monotonic() + window
        while True:
            missing = [r for r in range(world) if r != rank and not store.check([_WAITING_KEY.format(r)])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.1)
    except Exception:   # the store is gone too: say nothing rather than something wrong
        return []


def never_arrived_message(exc: BaseException, missing: list[int]) -> str:
    """The one-line report of a collective timeout naming the ranks that never arrived."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "?")
    who = ", ".join(map(str, missing))
    line = (str(exc).strip().splitlines() or [""])[0]
    return (f"rank(s) {who} never arrived at a collective that rank {rank} waited in until the process-group "
            f"timeout: rank(s) {who} hang, are stuck in other work, or are much slower (see their own output; "
            f"if they are only slow, raise the strategy's timeout=). ({type(exc).__name__}: {line[:300]})")


#: seconds the main thread lets go of the GIL after the exit barrier (see shutdown_process_group)
_DRAIN_S = 0.1


def shutdown_process_group(barrier: bool = True) -> None:
    """Barrier (optional), then destroy the default process group. Idempotent.

    A gloo barrier waits for every earlier collective of the group to complete.
    Each completed work is then dropped by the gloo worker thread that ran it, and
    when it holds the last reference to a tensor that Python owned, dropping it
    takes the GIL. Once the interpreter is finalising, taking the GIL ends that
    thread inside a noexcept destructor: ``std::terminate``, SIGABRT. So after the
    barrier the main thread sleeps briefly with the GIL released and the worker
    threads drop their works while the interpreter is fully alive."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return
    try:
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
            time.sleep(_DRAIN_S)
    finally:
        dist.destroy_process_group()
