"""N-D parallelism on CPU with gloo: ModelParallelStrategy on a 2x2 (data x tensor)
mesh, resharded resume (2x2 -> 4x1 and -> 1 process), HSDP, per-block FSDP
wrapping, and the per-block helpers (activation checkpointing, compile).

One module-scoped fixture runs tests/scripts/mesh_train.py four times (4 processes on 2x2
with checkpoints, 4 processes on 4x1 resuming the 2x2 epoch-0 checkpoint, one process for
the single-process reference and a 1x1 resume of that checkpoint, 2 processes for HSDP/FSDP
and the asynchronous saves)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import ember
from ember.errors import MisconfigurationError
from ember.strategies.blocks import apply_activation_checkpointing, compile_blocks, find_blocks
from ember.strategies.full_load import load_full_weights
from helpers import SCRIPTS, quiet_env

SCRIPT = str(SCRIPTS / "mesh_train.py")
TOL = 1e-5


def _run(out, run, nproc):
    args = [sys.executable, SCRIPT, out, run] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         SCRIPT, out, run]
    r = subprocess.run(args, env=quiet_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{run} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mesh"))
    for run, nproc in (("2x2", 4), ("4x1", 4), ("ref,1x1", 1), ("hsdp,tp_async", 2)):
        _run(out, run, nproc)

    def get(name):
        with open(os.path.join(out, f"{name}.json")) as f:
            r = json.load(f)
        r["weights"] = {k: torch.tensor(v) for k, v in r["weights"].items()}
        return r
    get.out = out
    return get


def _max_diff(a, b) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multiproc
def test_2x2_mesh_equals_one_process_on_the_global_batch(runs):
    ref, mp = runs("ref"), runs("2x2")
    assert mp["world"] == 4 and mp["mesh"] == [2, 2] and mp["mesh_dims"] == ["data_parallel", "tensor_parallel"]
    assert len(mp["losses"]) == len(ref["losses"]) == 6
    assert max(abs(a - b) for a, b in zip(mp["losses"], ref["losses"])) < TOL
    assert _max_diff(mp["weights"], ref["weights"]) < TOL
    # sharded twice: each rank stores about a quarter of parameters + AdamW states
    assert all(n < ref["local_numel"] / 3 for n in mp["local_numel_per_rank"])
    # the strategy sharded the blocks and the root over the data-parallel dimension
    assert mp["fsdp_units"] == ["<root>", "blocks.0", "blocks.1"]


@pytest.mark.multiproc
@pytest.mark.parametrize("run, mesh", [("4x1", [4, 1]), ("1x1", [1, 1])])
def test_2x2_checkpoint_resumes_on_another_mesh(runs, run, mesh):
    ref, r = runs("ref"), runs(run)
    assert r["mesh"] == mesh and r["global_step"] == 6
    assert len(r["losses"]) == 3        # resumed after epoch 0 (step 3)
    assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"][3:])) < TOL
    assert _max_diff(r["weights"], ref["weights"]) < TOL


@pytest.mark.multiproc
def test_model_parallel_async_save_commits_the_state_of_the_save(runs):
    """ModelParallelStrategy(async_save=True) on a 1x2 (tensor-parallel) mesh: each epoch's
    DCP checkpoint is written in the background (still pending when the next epoch starts),
    committed whole (both ranks' shards listed in meta.json), and holds the weights of the
    moment of the save (those of the synchronous 2x2 run's epoch-0 checkpoint)."""
    import glob
    ref, run = runs("ref"), runs("tp_async")
    assert _max_diff(run["weights"], ref["weights"]) < TOL and run["mesh"] == [1, 2]
    with open(os.path.join(runs.out, "tp_async_pending.json")) as f:
        pending = json.load(f)
    assert pending["tp"] == [False, True]        # epoch 1 began while epoch 0's save was in flight
    found = sorted(glob.glob(os.path.join(runs.out, "ckpt_async", "*")))
    assert len(found) == 2 and not any(p.endswith((".tmp", ".ember-tmp")) for p in found), found
    for path in found:
        with open(os.path.join(path, "meta.json")) as f:
            files = json.load(f)["files"]
        assert {"model/__0_0.distcp", "model/__1_0.distcp", "model/.metadata"} <= set(files), files
    epoch0 = load_full_weights(found[0])
    sync0 = load_full_weights(sorted(glob.glob(os.path.join(runs.out, "ckpt", "epoch=0-*")))[0])
    assert _max_diff(epoch0, sync0) < TOL
    final = {k: v for k, v in load_full_weights(found[1]).items()}
    assert _max_diff(epoch0, final) > 100 * TOL      # training went on after the first save


def test_fsdp_full_state_async_save_writes_on_rank0_in_the_background(runs):
    """FSDPStrategy(state_dict_type="full", async_save=True): rank 0's writer thread
    writes model.safetensors of the moment of the save; the run's numbers are unchanged."""
    import glob
    ref, run = runs("ref"), runs("full_async")
    assert _max_diff(run["weights"], ref["weights"]) < TOL
    with open(os.path.join(runs.out, "tp_async_pending.json")) as f:
        assert json.load(f)["full"] == [False, True]   # rank 0 held the background write into epoch 1
    found = sorted(glob.glob(os.path.join(runs.out, "ckpt_full_async", "*")))
    assert len(found) == 2 and not any(p.endswith((".tmp", ".ember-tmp")) for p in found), found
    assert all(os.path.isfile(os.path.join(p, "model.safetensors")) for p in found)
    sync0 = load_full_weights(sorted(glob.glob(os.path.join(runs.out, "ckpt", "epoch=0-*")))[0])
    assert _max_diff(load_full_weights(found[0]), sync0) < TOL
    assert _max_diff(load_full_weights(found[1]), ref["weights"]) < TOL


def test_hsdp_and_fsdp_equal_one_process_and_fsdp_halves_the_state(runs):
    ref, hsdp, fsdp = runs("ref"), runs("hsdp_2x1"), runs("fsdp_1x2")
    assert hsdp["mesh_dims"] == ["replicate", "shard"] and hsdp["mesh"] == [2, 1] and fsdp["mesh"] == [1, 2]
    for r in (hsdp, fsdp):
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) < TOL
        assert _max_diff(r["weights"], ref["weights"]) < TOL
    assert hsdp["local_numel_per_rank"] == [ref["local_numel"]] * 2       # replicated
    assert fsdp["local_numel_per_rank"] == [ref["local_numel"] // 2] * 2  # 2 shards: half each
    assert fsdp["fsdp_units"] == ["<root>", "blocks.0", "blocks.1"]       # per-block wrapping by default


# -- per-block helpers (one process) -----------------------------------------------------
class _Block(nn.Module):
    calls = 0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        _Block.calls += 1
        return x + torch.tanh(self.lin(x))


class _Stack(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.layers = nn.ModuleList([_Block(), _Block(), _Block()])

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_find_blocks_uses_no_split_modules_then_repeated_children():
    m = _Stack()
    assert find_blocks(m) == list(m.layers)
    m._no_split_modules = ["Linear"]      # transformers' marker wins
    assert len(find_blocks(m)) == 4
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_trainer_activation_checkpointing_recomputes_blocks_and_keeps_results(quiet, tmp_path):
    from torch.utils.data import DataLoader, TensorDataset
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    weights = []
    calls = []
    for ac in (None, True):
        torch.manual_seed(0)
        module = _Stack()
        _Block.calls = 0
        ember.Trainer(max_steps=2, activation_checkpointing=ac, **quiet).fit(module, loader)
        calls.append(_Block.calls)
        weights.append(module.state_dict())
    assert calls == [6, 12]               # 3 blocks x 2 steps, recomputed in backward
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    with pytest.raises(MisconfigurationError, match="activation_checkpointing"):
        ember.Trainer(activation_checkpointing="yes")
    with pytest.raises(MisconfigurationError, match="matched no submodule"):
        apply_activation_checkpointing(nn.Linear(2, 2), (nn.Conv2d,))


def test_compile_blocks_compiles_each_block_before_wrapping():
    import torchmetrics
    m = _Stack()
    m.metric = torchmetrics.MeanMetric()
    assert compile_blocks(m, {"backend": "eager"}) == 3
    assert all(b._compiled_call_impl is not None for b in m.layers)
    assert m.inp._compiled_call_impl is None and getattr(m.metric, "_compiled_call_impl", None) is None


def test_model_parallel_sizes_must_fit_the_world():
    from ember.strategies import ModelParallelStrategy
    with pytest.raises(MisconfigurationError, match="tensor_parallel_size"):
        ModelParallelStrategy(tensor_parallel_size=0)
    s = ModelParallelStrategy(tensor_parallel_size=2, devices=1)
    with pytest.raises(MisconfigurationError, match="does not fit the 1 running processes"):
        s.setup_environment()
    assert ember.Trainer(strategy="model_parallel", devices="cpu", logger=False).strategy.name == "model_parallel"
    import torch.distributed as dist
    assert not dist.is_initialized()     # refused before any process group was created


def test_cuda_index_follows_per_task_gpu_binding():
    from ember.strategies.ddp import cuda_index
    assert cuda_index(3, None, 8) == 3                 # one process per GPU of the node
    assert cuda_index(3, None, 1) == 0                 # srun --gpus-per-task=1: each task sees its own GPU
    assert cuda_index(1, [4, 6], 8) == 6               # explicit devices=[4, 6]
    with pytest.raises(MisconfigurationError, match="sees 2 GPU"):
        cuda_index(3, None, 2)


@pytest.mark.multiproc
def test_full_checkpoint_is_read_on_rank0_only_and_broadcast(tmp_path):
    """A model.safetensors checkpoint (AdamW states included) loaded into FSDP on 2 ranks:
    rank 0 reads the file, rank 1 receives its shards only. Before, every rank read the
    whole checkpoint (peak rises within 5 MB of each other; now rank 0's is higher by
    about the part of the checkpoint rank 1 never holds)."""
    script = str(SCRIPTS / "rank0_load.py")
    for phase in ("save", "load"):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            script, str(tmp_path), phase], env=quiet_env(), capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-4000:]
    r0, r1 = (json.load(open(tmp_path / f"load.rank{i}.json")) for i in (0, 1))
    assert r0["equal"] and r0["global_step"] == r1["global_step"] == 1
    assert r0["rise"] - r1["rise"] > 0.4 * r0["ckpt_bytes"], (r0, r1)


def test_tf32_on_ampere_and_newer_unless_chosen_or_switched_off():
    from ember.precision import tf32_default
    assert tf32_default((8, 0), "highest", None) and tf32_default((9, 0), "highest", "")
    assert not tf32_default((7, 5), "highest", None)          # Turing/Volta: no TF32
    assert not tf32_default((8, 0), "medium", None)           # the user chose already
    assert not tf32_default((9, 0), "highest", "0")           # EMBER_TF32=0
    assert tf32_default((7, 0), "highest", "1")
