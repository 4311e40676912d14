"""Cluster environments: where the ranks come from.

A cluster environment answers who this process is (global rank, local rank,
node rank, world size) and where the rendezvous lives (main address and port).
Three are detected, in this order:

- :class:`TorchElasticEnvironment`: started by ``torchrun`` / ``ember launch``
  (``TORCHELASTIC_RUN_ID``, or ``RANK`` + ``WORLD_SIZE`` + ``MASTER_ADDR``).
- :class:`SLURMEnvironment`: one task per process under ``srun``
  (``SLURM_NTASKS`` > 1, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_NODELIST``).
- :class:`LocalEnvironment`: a plain ``python script.py``; ember starts the other
  ranks itself (see :mod:`ember.strategies.launchers`). The ranks it starts carry
  the variables ``torchrun`` would set plus :data:`LAUNCH_MARKER`.

Whatever the method, :meth:`ClusterEnvironment.export` sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in ``os.environ`` (``env://`` rendezvous and DeepSpeed read them).
"""
from __future__ import annotations

import os
import re
import socket

from ember.errors import MisconfigurationError

#: set in the ranks that ember's subprocess launcher starts (value: the launcher's pid)
LAUNCH_MARKER = "EMBER_LAUNCHER_PID"

_DEFAULT_PORT = 29500
#: the environment a strategy of this process has set up (see ClusterEnvironment.export)
_ACTIVE: "ClusterEnvironment | None" = None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ClusterEnvironment:
    """Who this process is and where the rendezvous lives."""

    name = "base"
    #: False when ember must start the other ranks itself
    creates_processes_externally = True

    def __init__(self, world_size: int, global_rank: int, local_rank: int, node_rank: int,
                 local_world_size: int, main_address: str, main_port: int):
        self.world_size = int(world_size)
        self.global_rank = int(global_rank)
        self.local_rank = int(local_rank)
        self.node_rank = int(node_rank)
        self.local_world_size = int(local_world_size)
        self.main_address = main_address
        self.main_port = int(main_port)

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def export(self) -> None:
        """Publish the torchrun-style variables in ``os.environ`` and make this the
        environment of the process (later strategies in the same script reuse it)."""
        global _ACTIVE
        _ACTIVE = self
        os.environ.update({
            "RANK": str(self.global_rank), "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank), "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.main_address, "MASTER_PORT": str(self.main_port),
        })

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.global_rank}, local_rank={self.local_rank}, "
                f"node_rank={self.node_rank}, world_size={self.world_size}, "
                f"main={self.main_address}:{self.main_port})")


def _int_env(name: str, default: int | None = None) -> int:
    """The integer >= 0 in environment variable ``name`` (``default`` when unset or empty)."""
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            raise MisconfigurationError(f"environment variable {name} is not set")
        return default
    try:
        out = int(value.strip())
    except ValueError:
        out = -1
    if out < 0:
        raise MisconfigurationError(f"environment variable {name}={value!r} is not an integer >= 0; it tells "
                                    "this process its place in a distributed run (set by torchrun, srun or "
                                    "ember launch): fix or unset it")
    return out


class TorchElasticEnvironment(ClusterEnvironment):
    """Ranks started by ``torchrun`` (or anything that sets its variables)."""

    name = "torchelastic"

    @staticmethod
    def detect() -> bool:
        env = os.environ
        return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))

    @classmethod
    def from_env(cls) -> "TorchElasticEnvironment":
        world = _int_env("WORLD_SIZE")
        rank = _int_env("RANK")
        local_world = _int_env("LOCAL_WORLD_SIZE", world)
        local_rank = _int_env("LOCAL_RANK", rank % max(1, local_world))
        node_rank = _int_env("GROUP_RANK", _int_env("NODE_RANK", rank // max(1, local_world)))
        return cls(world, rank, local_rank, node_rank, local_world,
                   os.environ.get("MASTER_ADDR", "127.0.0.1"), _int_env("MASTER_PORT", _DEFAULT_PORT))


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu-a,x[1-2]-ib"`` ->
    ``["node01", "node02", "node03", "node07", "gpu-a", "x1-ib", "x2-ib"]``."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            values = [part]
        for v in values:
            out.extend(_expand_one(prefix + v + suffix))
    return out


def _first_count(tasks_per_node: str, name: str = "SLURM_NTASKS_PER_NODE") -> int:
    """``"2(x3),1"`` -> 2 (the count on the first node); ``name``: the variable it came from."""
    m = re.match(r"\s*(\d+)(\(x\d+\))?(,|$)", tasks_per_node)
    if m is None or int(m.group(1)) < 1:
        raise MisconfigurationError(f"environment variable {name}={tasks_per_node!r} is not a SLURM task count "
                                    "(like '2' or '2(x3),1'); fix or unset it")
    return int(m.group(1))


class SLURMEnvironment(ClusterEnvironment):
    """One task per process under ``srun``; the first host of the allocation is the main node."""

    name = "slurm"

    @staticmethod
    def detect() -> bool:
        env = os.environ
        if "SLURM_NTASKS" not in env or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
            return False
        return _int_env("SLURM_NTASKS", 0) > 1

    @staticmethod
    def main_address_from_nodelist(nodelist: str) -> str:
        hosts = expand_hostlist(nodelist)
        return hosts[0] if hosts else "127.0.0.1"

    @staticmethod
    def main_port_from_job_id(job_id: str | None) -> int:
        """As Lightning does: the last four digits of the job id, plus 15000."""
        if not job_id:
            return _DEFAULT_PORT
        digits = re.sub(r"\D", "", job_id)[-4:]
        return 15000 + int(digits) if digits else _DEFAULT_PORT

    @classmethod
    def from_env(cls) -> "SLURMEnvironment":
        env = os.environ
        world = _int_env("SLURM_NTASKS")
        rank = _int_env("SLURM_PROCID")
        nodelist = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        nnodes = _int_env("SLURM_NNODES", _int_env("SLURM_JOB_NUM_NODES", 1))
        if env.get("SLURM_NTASKS_PER_NODE"):
            local_world = _first_count(env["SLURM_NTASKS_PER_NODE"], "SLURM_NTASKS_PER_NODE")
        elif env.get("SLURM_TASKS_PER_NODE"):
            local_world = _first_count(env["SLURM_TASKS_PER_NODE"], "SLURM_TASKS_PER_NODE")
        else:
            local_world = max(1, world // max(1, nnodes))
        addr = env.get("MASTER_ADDR") or cls.main_address_from_nodelist(nodelist)
        port = _int_env("MASTER_PORT") if env.get("MASTER_PORT") else cls.main_port_from_job_id(env.get("SLURM_JOB_ID"))
        return cls(world, rank, _int_env("SLURM_LOCALID", 0), _int_env("SLURM_NODEID", 0),
                   local_world, addr, port)


class LocalEnvironment(ClusterEnvironment):
    """A plain ``python script.py``: rank 0 starts ranks 1..N-1 on this machine."""

    name = "local"

    def __init__(self, num_processes: int, global_rank: int = 0, main_address: str = "127.0.0.1",
                 main_port: int | None = None):
        port = main_port if main_port is not None else (
            _int_env("MASTER_PORT") if os.environ.get("MASTER_PORT") else find_free_port(main_address))
        super().__init__(num_processes, global_rank, global_rank, 0, num_processes, main_address, port)
        # the original process launches; the ranks it started were launched
        self.creates_processes_externally = LAUNCH_MARKER in os.environ

    @staticmethod
    def is_launched_child() -> bool:
        return LAUNCH_MARKER in os.environ

    @classmethod
    def from_env(cls) -> "LocalEnvironment":
        """In a rank started by ember's launcher."""
        return cls(_int_env("WORLD_SIZE"), _int_env("RANK"), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   _int_env("MASTER_PORT"))


def detect_environment(num_processes: int, num_nodes: int = 1) -> ClusterEnvironment:
    """The environment of this process. ``num_processes`` is the number of ranks
    per node the user asked for (used only when ember launches them itself)."""
    if _ACTIVE is not None:
        return _ACTIVE
    if LocalEnvironment.is_launched_child():
        return LocalEnvironment.from_env()
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment.from_env()
    if SLURMEnvironment.detect():
        return SLURMEnvironment.from_env()
    if num_nodes > 1:
        raise MisconfigurationError(
            f"num_nodes={num_nodes} needs a multi-machine launcher: start the script on every node "
            "with `torchrun --nnodes ... --node_rank ...` (or `ember launch`), or under SLURM with `srun`")
    return LocalEnvironment(num_processes)
