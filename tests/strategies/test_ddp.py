"""DDPStrategy configuration, cluster environments and launcher helpers, in one
process (the multi-process behaviour is in test_ddp_multiproc.py)."""
import copy
import os
import pickle
import sys
import types
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ember import Trainer, TrainModule
from ember.errors import MisconfigurationError
from ember.strategies import environments as envs
from ember.strategies import launchers
from ember.strategies.ddp import DDPStrategy, route_through_forward

_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RUN_ID", "EMBER_LAUNCHER_PID")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and no environment recorded by an earlier strategy."""
    for k in set(_VARS) | {k for k in os.environ if k.startswith("SLURM_")}:
        monkeypatch.setenv(k, "")   # recorded, so that whatever a test sets is undone
        monkeypatch.delenv(k)
    monkeypatch.setattr(envs, "_ACTIVE", None)
    return monkeypatch


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
    ("gpu-a,x[1-2]-ib", ["gpu-a", "x1-ib", "x2-ib"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("single", ["single"]),
])
def test_expand_hostlist(nodelist, hosts):
    assert envs.expand_hostlist(nodelist) == hosts


def test_slurm_environment(clean_env):
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_NODEID", "1")
    clean_env.setenv("SLURM_NNODES", "2")
    clean_env.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    clean_env.setenv("SLURM_NODELIST", "node[07-08]")
    clean_env.setenv("SLURM_JOB_ID", "123456")
    env = envs.detect_environment(1)
    assert isinstance(env, envs.SLURMEnvironment)
    assert (env.world_size, env.global_rank, env.local_rank, env.node_rank, env.local_world_size) == (8, 5, 1, 1, 4)
    assert (env.main_address, env.main_port) == ("node07", 15000 + 3456)
    clean_env.setenv("MASTER_PORT", "29123")
    assert envs.SLURMEnvironment.from_env().main_port == 29123
    env.export()
    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                       "MASTER_PORT")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node07",
        "MASTER_PORT": str(15000 + 3456)}
    # a later strategy in the same process reuses the environment
    assert envs.detect_environment(1) is env


@pytest.mark.parametrize("ntasks, job_name", [("1", "train"), ("4", "bash"), ("4", "interactive")])
def test_slurm_not_used(clean_env, ntasks, job_name):
    """One task (ember launches the rest itself) and interactive shells are not SLURM jobs of ranks."""
    clean_env.setenv("SLURM_NTASKS", ntasks)
    clean_env.setenv("SLURM_JOB_NAME", job_name)
    clean_env.setenv("SLURM_PROCID", "0")
    assert isinstance(envs.detect_environment(2), envs.LocalEnvironment)


def test_torchelastic_environment_wins(clean_env):
    for k, v in dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
                     MASTER_ADDR="10.0.0.1", MASTER_PORT="29400", TORCHELASTIC_RUN_ID="x",
                     SLURM_NTASKS="4", SLURM_PROCID="0").items():
        clean_env.setenv(k, v)
    env = envs.detect_environment(1)
    assert isinstance(env, envs.TorchElasticEnvironment)
    assert (env.global_rank, env.local_rank, env.node_rank, env.world_size, env.num_nodes) == (3, 1, 1, 4, 2)
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29400)
    with pytest.raises(MisconfigurationError, match="devices=3 does not match the 2 process"):
        DDPStrategy(devices=3, accelerator="cpu")
    s = DDPStrategy(accelerator="cpu")
    assert (s.world_size, s.global_rank, s.local_rank, s.node_rank) == (4, 3, 1, 1)
    assert s.distributed_sampler_kwargs() == {"num_replicas": 4, "rank": 3}
    assert s.root_device == torch.device("cpu") and s.process_group_backend == "gloo"


def test_local_environment(clean_env):
    env = envs.detect_environment(2)
    assert isinstance(env, envs.LocalEnvironment) and not env.creates_processes_externally
    assert (env.world_size, env.global_rank, env.main_address) == (2, 0, "127.0.0.1") and env.main_port > 0
    with pytest.raises(MisconfigurationError, match="num_nodes=2 needs a multi-machine launcher"):
        envs.detect_environment(2, num_nodes=2)


def test_ddp_devices_1_warns_and_runs_single(clean_env):
    with pytest.warns(UserWarning, match="devices=1 means one process"):
        s = DDPStrategy(devices=1, accelerator="cpu")
    s.setup_environment()
    assert s.world_size == 1 and s.distributed_sampler_kwargs() is None
    m = s.setup_module(nn.Linear(2, 2))
    assert isinstance(m, nn.Linear)
    t = torch.tensor([1, 2])
    assert s.all_gather(t).shape == (1, 2) and s.all_gather_cat(t) is t
    assert s.reduce(t, "mean").dtype == torch.float32 and s.broadcast({"a": 1}) == {"a": 1}
    with pytest.raises(MisconfigurationError, match="op='avg_pool'"):
        s.reduce(t, "avg_pool")


class _Tiny(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_ddp_devices_1_runs_single(clean_env, tmp_path):
    with pytest.warns(UserWarning, match="devices=1"):
        trainer = Trainer(devices=1, strategy="ddp", max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4))
    assert trainer.global_step == 2 and trainer.world_size == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(start_method="spawn"), "start_method='spawn' is not valid; choose one of: 'popen'"),
    (dict(process_group_backend="mpix"), "process_group_backend='mpix'"),
    (dict(devices=0), "devices=0 is not valid"),
    (dict(num_nodes=0), "num_nodes=0 is not valid"),
    (dict(accelerator="tpu"), "accelerator='tpu'"),
])
def test_ddp_bad_arguments(clean_env, kwargs, match):
    with pytest.raises(MisconfigurationError, match=match):
        DDPStrategy(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_ddp_cuda_without_cuda(clean_env):
    with pytest.raises(MisconfigurationError, match="CUDA is not available"):
        DDPStrategy(devices=2, accelerator="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ddp_more_devices_than_gpus(clean_env):
    n = torch.cuda.device_count()
    with pytest.raises(MisconfigurationError, match=f"devices={n + 1} but only {n} CUDA device"):
        DDPStrategy(devices=n + 1)


def test_cpu_any_number_of_processes(clean_env):
    s = DDPStrategy(devices=5, accelerator="cpu")   # processes, not devices: any count is allowed
    assert s.world_size == 5 and s.global_rank == 0 and s.root_device == torch.device("cpu")


@pytest.mark.parametrize("cls", ["DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy"])
def test_trainer_devices_configure_a_strategy_instance(clean_env, cls):
    """Trainer(strategy=FSDPStrategy(), devices=2) runs two processes, as in Lightning."""
    import importlib
    if cls == "DeepSpeedStrategy" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed not installed")
    from ember import strategies
    strategy = getattr(strategies, cls)(accelerator="cpu")
    trainer = Trainer(strategy=strategy, devices=2, logger=False)
    assert trainer.strategy is strategy and strategy.world_size == 2 and strategy.num_processes == 2
    with pytest.raises(MisconfigurationError, match=f"devices=3 conflicts with {cls}\\(devices=2\\)"):
        Trainer(strategy=strategy, devices=3, logger=False)
    assert Trainer(strategy=strategy, logger=False).strategy.world_size == 2   # "auto" keeps the instance's


def test_single_device_strategy_instance_refuses_several_devices(clean_env):
    from ember.strategies import SingleDeviceStrategy
    with pytest.raises(MisconfigurationError, match="runs one process, but devices=2"):
        Trainer(strategy=SingleDeviceStrategy(torch.device("cpu")), devices=2, logger=False)


def test_launch_refused_inside_pytest(clean_env):
    s = DDPStrategy(devices=2, accelerator="cpu")
    with pytest.raises(MisconfigurationError, match="cannot start its ranks from inside pytest"):
        s.setup_environment()
    assert "WORLD_SIZE" not in os.environ and envs._ACTIVE is None   # nothing changed


def test_relaunch_command(monkeypatch, tmp_path):
    import __main__
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(__main__, "__spec__", None, raising=False)
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    assert launchers.relaunch_command() == [sys.executable, str(script), "--lr", "0.1"]
    # `python -m pytest` with __main__ replaced by a shell (IPython's): argv[0] still names pytest
    monkeypatch.setattr(sys, "argv", [os.path.join("site-packages", "pytest", "__main__.py"), "-q"])
    with pytest.raises(MisconfigurationError, match="cannot start its ranks from inside pytest"):
        launchers.relaunch_command()
    monkeypatch.setattr(sys, "argv", [str(script), "--lr", "0.1"])
    monkeypatch.setattr(__main__, "__spec__", types.SimpleNamespace(name="mypkg.train"), raising=False)
    assert launchers.relaunch_command() == [sys.executable, "-m", "mypkg.train", "--lr", "0.1"]
    monkeypatch.setattr(__main__, "__spec__", types.SimpleNamespace(name="mypkg.__main__"), raising=False)
    assert launchers.relaunch_command()[:3] == [sys.executable, "-m", "mypkg"]
    monkeypatch.setattr(__main__, "__spec__", None, raising=False)
    monkeypatch.setattr(sys, "argv", ["-c"])
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)     # `python -c` outside a pytest-xdist worker
    with pytest.raises(MisconfigurationError, match="no script to re-run"):
        launchers.relaunch_command()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")               # a pytest-xdist worker: `python -c` + xdist
    monkeypatch.setitem(sys.modules, "xdist", types.ModuleType("xdist"))
    with pytest.raises(MisconfigurationError, match="cannot start its ranks from inside pytest"):
        launchers.relaunch_command()


def test_peer_lost_errors():
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4751: "
                        "Connection reset by peer.")
    assert launchers.is_peer_lost_error(lost)
    assert launchers.is_comm_error(RuntimeError("ProcessGroupGloo: invalid tensor size"))
    assert not launchers.is_peer_lost_error(RuntimeError("ProcessGroupGloo: invalid tensor size"))
    assert not launchers.is_peer_lost_error(RuntimeError("Connection reset by peer"))  # not a collective's
    assert not launchers.is_comm_error(ValueError("boom"))


class _Wrapper(nn.Module):
    """Stands in for DistributedDataParallel: counts the calls that pass through it."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


class _CallsForward(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, x):
        return self.net(x) * 2

    def training_step(self, batch, batch_idx):
        return self(batch).sum()   # calls the real forward, inside the routed call


def test_route_through_forward():
    m = _CallsForward()
    w = _Wrapper(m)
    route_through_forward(w, m, "training_step")
    x = torch.ones(1, 2)
    expected = (m.net(x) * 2).sum()
    assert torch.equal(m.training_step(x, 0), expected) and w.calls == 1
    assert "forward" not in m.__dict__ and torch.equal(m(x), m.net(x) * 2)   # forward restored
    with torch.no_grad():
        m.training_step(x, 0)
    assert w.calls == 1   # evaluation does not need the gradient hooks
    # routing again (a second Trainer) wraps the original method, not the routed one
    w2 = _Wrapper(m)
    route_through_forward(w2, m, "training_step")
    m.training_step(x, 0)
    assert (w.calls, w2.calls) == (1, 1)
    # a copy or a pickle of the module gets the plain method, bound to itself
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        with torch.no_grad():
            clone.net.weight.add_(1.0)
        assert torch.equal(clone.training_step(x, 0), (clone.net(x) * 2).sum())
        assert (w.calls, w2.calls) == (1, 1)
