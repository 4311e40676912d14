"""More than one machine, simulated on this host: two torchrun agents (or two ``ember
launch`` commands), each in its own process group with its own "local disk"
(``NODE_DIR``), sharing the checkpoint folder; a test kills a whole node by its group.

Each run is a real Trainer fit (tests/scripts/multinode_train.py: 8 optimizer steps of
a tiny model) on real gloo process groups."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import SCRIPTS, descendants, import_script

pytestmark = pytest.mark.multiproc

SCRIPT = str(SCRIPTS / "multinode_train.py")
TIMEOUT = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(out, node: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EMBER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "GROUP_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1",
               XDG_CONFIG_HOME=os.path.join(out, "xdg"), NODE_DIR=os.path.join(out, f"node{node}"), **extra)
    os.makedirs(env["NODE_DIR"], exist_ok=True)
    return env


class Node:
    """One simulated machine: an agent (torchrun or ember launch) in its own process group."""

    def __init__(self, argv, env, log):
        self.log = log
        self.file = open(log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def signal(self, sig) -> None:
        """``sig`` to the agent's process group and to every worker (torchrun starts each
        worker in a session of its own): the whole node."""
        pids = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        if not self.file.closed:
            self.file.flush()
        with open(self.log) as f:
            return f.read()


def wait_all(nodes, timeout=TIMEOUT) -> list[int]:
    """Exit codes; on a timeout every node's process group is killed and the test fails."""
    deadline = time.monotonic() + timeout
    try:
        for n in nodes:
            n.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for n in nodes:
            n.signal(signal.SIGABRT)    # PYTHONFAULTHANDLER: every stack to the log
        time.sleep(1)
        for n in nodes:
            n.kill()
        pytest.fail(f"the nodes did not finish in {timeout} s:\n" +
                    "\n".join(f"--- node {i}:\n{n.output()[-4000:]}" for i, n in enumerate(nodes)))
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
            n.file.close()
    return [n.proc.returncode for n in nodes]


def torchrun(out, node, port, tag, *script_args, nproc=2, restarts=0, **env):
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={tag}",
            f"--max-restarts={restarts}", "--monitor-interval=0.1", SCRIPT, str(out), tag, *script_args]
    return Node(argv, node_env(out, node, **env), os.path.join(out, f"{tag}.node{node}.log"))


def ember_launch(out, node, port, tag, *args, restarts=0, script_args=(), **env):
    argv = [sys.executable, "-m", "ember", "launch", "--num_machines", "2", "--machine_rank", str(node),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--max_restarts", str(restarts),
            *args, SCRIPT, str(out), tag, *script_args]
    return Node(argv, node_env(out, node, **env), os.path.join(out, f"{tag}.node{node}.log"))


def two_nodes(start) -> list:
    """Node 0 first: its agent hosts the rendezvous store (a test may kill node 1 only)."""
    first = start(0)
    time.sleep(0.5)
    return [first, start(1)]


def ok(nodes, codes):
    assert codes == [0, 0], "\n".join(f"--- node {i}:\n{n.output()[-5000:]}" for i, n in enumerate(nodes))


def weights(out, tag) -> dict:
    return load_file(os.path.join(out, f"{tag}.safetensors"))


def attempts(out, tag) -> list[int]:
    with open(os.path.join(out, f"{tag}.attempts")) as f:
        return [int(s) for s in f.read().split()]


def ranks(out) -> dict[int, dict]:
    """What every rank recorded at its (last) fit start, from the nodes' local folders."""
    found = {}
    for node in (0, 1):
        folder = os.path.join(out, f"node{node}")
        for name in os.listdir(folder):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    found[int(name[4:-5])] = json.load(f)
    return found


def one_process(tmp_path, monkeypatch) -> dict:
    """The same fit in this process (one rank, the global batch of 16)."""
    mt = import_script("multinode_train")
    import ember
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("NODE_DIR", str(tmp_path))
    trainer = ember.Trainer(max_epochs=mt.EPOCHS, devices=1, seed=7, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    module = mt.SineNet(log_loss=True)
    trainer.fit(module, datamodule=mt.Data(16))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def close(a: dict, b: dict, atol=1e-5) -> bool:
    return sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def bit_equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- two agents
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_two_torchrun_agents_equal_one_process(tmp_path, monkeypatch, strategy):
    """DDP over 2 x 2 ranks, and HSDP (2, 2): one replica per node, sharded inside it."""
    out, port = tmp_path / "run", free_port()
    nodes = two_nodes(lambda n: torchrun(out, n, port, strategy, "--strategy", strategy))
    ok(nodes, wait_all(nodes))
    seen = ranks(out)
    assert sorted(seen) == [0, 1, 2, 3] and {r["world"] for r in seen.values()} == {4}
    assert {r["node"] for r in seen.values()} == {"0", "1"} and {r["attempt"] for r in seen.values()} == {0}
    # prepare_data ran once on each node (its local rank 0), on that node's disk
    for node in (0, 1):
        assert len((out / f"node{node}" / "prepared").read_text().split()) == 1
    # the rank-0 writes happened once: one log folder, every checkpoint once, each step logged once
    root = out / strategy
    assert sorted(os.listdir(root / "checkpoints")) == ["epoch=0-step=2", "epoch=0-step=4", "epoch=1-step=6",
                                                       "epoch=1-step=8"]
    assert os.listdir(root / "ember_logs") == ["version_0"]
    rows = (root / "ember_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and len(set(rows)) == len(rows), rows    # a header, steps 2, 4, 6, 8 once
    assert close(weights(out, strategy), one_process(tmp_path / "one", monkeypatch))


# ----------------------------------------------------------------------------- ember launch, two machines
@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The fit on two machines of one process each, `ember launch` with Accelerate's
    flags (``--num_processes`` is the total): the uninterrupted reference of the
    node-loss tests below."""
    out, port = tmp_path_factory.mktemp("launched"), free_port()
    nodes = two_nodes(lambda n: ember_launch(out, n, port, "plain", "--num_processes", "2"))
    return out, nodes, wait_all(nodes)


def test_ember_launch_on_two_machines_with_flags(launched):
    out, nodes, codes = launched
    ok(nodes, codes)
    seen = ranks(out)
    assert sorted(seen) == [0, 1] and {r["world"] for r in seen.values()} == {2}     # 2 in total, not 2 each
    assert [seen[0]["node"], seen[1]["node"]] == ["0", "1"]                          # one process per machine
    assert sorted(os.listdir(out / "node0")) == ["prepared", "rank0.json"]
    assert sorted(os.listdir(out / "node1")) == ["prepared", "rank1.json"]
    assert attempts(out, "plain") == [1]


ACCELERATE_WORKER = textwrap.dedent("""
    import json, os
    import torch
    import torch.distributed as dist
    from ember import Accelerator
    acc = Accelerator()
    t = torch.tensor([float(acc.process_index + 1)])
    dist.all_reduce(t)
    with open(os.path.join(os.environ["NODE_DIR"], f"rank{acc.process_index}.json"), "w") as f:
        json.dump({"world": acc.num_processes, "local": acc.local_process_index, "sum": t.item(),
                   "node": os.environ["GROUP_RANK"], "local_world": os.environ["LOCAL_WORLD_SIZE"]}, f)
    acc.wait_for_everyone()
""")


@pytest.mark.timeout(200)
def test_ember_launch_on_two_machines_with_an_accelerate_config_file(tmp_path):
    """A file written by `accelerate config` for machine R of 2, ``num_processes: 4`` (the total)."""
    port = free_port()
    (tmp_path / "worker.py").write_text(ACCELERATE_WORKER)
    for rank in (0, 1):
        (tmp_path / f"machine{rank}.yaml").write_text(textwrap.dedent(f"""\
            compute_environment: LOCAL_MACHINE
            distributed_type: MULTI_CPU
            machine_rank: {rank}
            main_process_ip: 127.0.0.1
            main_process_port: {port}
            mixed_precision: 'no'
            num_machines: 2
            num_processes: 4
            rdzv_backend: static
            same_network: true
            use_cpu: true
            """))

    def start(n):
        argv = [sys.executable, "-m", "ember", "launch", "--config_file", str(tmp_path / f"machine{n}.yaml"),
                str(tmp_path / "worker.py")]
        return Node(argv, node_env(tmp_path, n), os.path.join(tmp_path, f"machine{n}.log"))

    nodes = two_nodes(start)
    ok(nodes, wait_all(nodes))
    seen = ranks(tmp_path)
    assert sorted(seen) == [0, 1, 2, 3]
    assert {(r["world"], r["sum"], r["local_world"]) for r in seen.values()} == {(4, 10.0, "2")}   # 1+2+3+4
    assert [(seen[r]["node"], seen[r]["local"]) for r in range(4)] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]


# ----------------------------------------------------------------------------- node loss
@pytest.mark.timeout(300)
def test_node_loss_with_a_busy_peer_under_torchrun(tmp_path, launched):
    """A worker of node 1 is SIGKILLed after step 3 while node 0's workers compute for up to 25 s
    (not in a collective): node 1's agent counts a restart, node 0's agent restarts its
    workers for the waiting node without counting one. Every rank agrees it is attempt 1
    (the store prefix and the resume are agreed), and the fit resumes from the step-2
    checkpoint and ends bit-exactly like the uninterrupted run."""
    out, port = tmp_path, free_port()
    nodes = two_nodes(lambda n: torchrun(out, n, port, "busy", "--kill-at", "3", "--busy", "25", nproc=1,
                                         restarts=1, EMBER_ELASTIC_RESUME="1"))
    ok(nodes, wait_all(nodes))
    seen = ranks(out)
    assert {r["attempt"] for r in seen.values()} == {1}, seen
    assert {r["node"]: r["agent_restarts"] for r in seen.values()} == {"0": "0", "1": "1"}    # the busy-peer case
    assert attempts(out, "busy") == [1, 3]          # the restart resumed the step-2 checkpoint
    assert bit_equal(weights(out, "busy"), weights(launched[0], "plain"))


@pytest.mark.timeout(300)
def test_node_loss_with_a_busy_peer_under_ember_launch(tmp_path, launched):
    """The same under `ember launch --rdzv_backend c10d --max_restarts 1` on two machines
    (which sets EMBER_ELASTIC_RESUME itself): killed after step 5, resumed from step 4."""
    out, port = tmp_path, free_port()
    nodes = two_nodes(lambda n: ember_launch(out, n, port, "busy", "--num_processes", "2", "--rdzv_backend", "c10d",
                                             "--rdzv_id", "busy", restarts=1,
                                             script_args=("--kill-at", "5", "--busy", "25")))
    ok(nodes, wait_all(nodes))
    seen = ranks(out)
    assert {r["attempt"] for r in seen.values()} == {1}, seen
    assert {r["node"]: r["agent_restarts"] for r in seen.values()} == {"0": "0", "1": "1"}
    assert attempts(out, "busy") == [1, 5]
    assert bit_equal(weights(out, "busy"), weights(launched[0], "plain"))


# ----------------------------------------------------------------------------- an elastic group that shrinks
@pytest.mark.timeout(300)
def test_a_lost_machine_shrinks_an_elastic_group_and_the_rest_resumes_keeping_the_global_batch(tmp_path, monkeypatch):
    """``torchrun --nnodes 1:2`` on two machines of one process each (batch 8, global batch
    16). Once the step-2 checkpoint is written, machine 1 is lost whole (its agent and its
    worker SIGKILLed) while machine 0's worker computes. That worker fails at its next
    collective; its agent restarts it in a rendezvous round of one machine (the minimum),
    and the Trainer resumes the step-2 checkpoint on one process with no action
    (EMBER_ELASTIC_RESUME): batch 16 there, so accumulate_grad_batches stays 1 and the
    global batch 16; the rest of the run follows the same global order, so the weights are
    those of one uninterrupted process up to float summation order."""
    out, port = tmp_path / "run", free_port()

    def start(node):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shrink",
                "--rdzv-conf=last_call_timeout=3", "--max-restarts=1", "--monitor-interval=0.1",
                SCRIPT, str(out), "shrink", "--busy-at", "2", "--busy", "4"]
        return Node(argv, node_env(out, node, EMBER_ELASTIC_RESUME="1"), os.path.join(out, f"shrink.node{node}.log"))

    nodes = two_nodes(start)
    ckpt = out / "shrink" / "checkpoints" / "epoch=0-step=2"
    deadline = time.monotonic() + TIMEOUT
    while not ckpt.exists() and time.monotonic() < deadline and nodes[0].proc.poll() is None:
        time.sleep(0.05)
    first = ranks(out)
    # machine 1 is the rendezvous' node 1 (machine 0, started first, hosts the stores: losing it ends the job)
    assert ckpt.exists() and {r: d["node"] for r, d in first.items()} == {0: "0", 1: "1"}, \
        (first, nodes[0].output()[-3000:])
    assert {d["world"] for d in first.values()} == {2}
    nodes[1].kill()
    nodes[1].file.close()
    codes = wait_all(nodes[:1])
    assert codes == [0], nodes[0].output()[-5000:]
    after = json.loads((out / "node0" / "rank0.json").read_text())   # machine 0's rank at its last fit start
    assert (after["attempt"], after["world"]) == (1, 1), after
    assert attempts(out, "shrink") == [1, 3]    # the restart resumed the step-2 checkpoint
    assert close(weights(out, "shrink"), one_process(tmp_path / "one", monkeypatch))
