"""Accelerate's names in ember (issue 20): Accelerator keywords, DistributedType,
state / PartialState, ember.logging, ember.utils, accelerator.save, clip on a
non-sync step, fp16 on the CPU, notebook_launcher and LocalSGD on 2 real processes."""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember import Accelerator
from ember.errors import MisconfigurationError
from ember.strategies.environments import find_free_port
from ember.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs, DistributedType,
                         GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs, ProfileKwargs,
                         ProjectConfiguration)


def test_accelerate_keywords_work_or_name_themselves(tmp_path):
    acc = Accelerator(cpu=True, device_placement=True, split_batches=False, even_batches=True,
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
                                       InitProcessGroupKwargs(timeout=30), ProfileKwargs(activities=["cpu"])],
                      project_config=ProjectConfiguration(project_dir=str(tmp_path), total_limit=2),
                      rng_types=["generator"], dynamo_backend="no", step_scheduler_with_optimizer=False,
                      gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.device.type == "cpu" and acc.gradient_accumulation_steps == 3
    assert acc.distributed_type == DistributedType.NO == "NO" and acc.state.num_processes == 1
    assert acc.project_dir == acc.logging_dir == str(tmp_path) and not acc.split_batches and acc.even_batches
    assert ember.PartialState().process_index == 0 and ember.PartialState().distributed_type == DistributedType.NO
    assert acc.gradient_state.sync_gradients
    with acc.profile() as prof:
        torch.ones(3).sum()
    assert "aten::sum" in {e.key for e in prof.key_averages()}   # the profiler recorded the op
    # automatic naming with total_limit=2: the oldest go
    net = nn.Linear(2, 1)
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(4):
        acc.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    for kw, word in [(dict(rng_types=["torch"]), "rng_types"), (dict(mixed_precision="fp8"), "fp8"),
                     (dict(dataloader_config=DataLoaderConfiguration(dispatch_batches=True)), "dispatch_batches"),
                     (dict(kwargs_handlers=[InitProcessGroupKwargs(init_method="tcp://x:1")]), "init_method"),
                     (dict(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)),
                      "sync_each_batch"),
                     (dict(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()]), "kwargs_handlers")]:
        with pytest.raises(MisconfigurationError, match=word):
            Accelerator(**kw)


def test_fp16_on_cpu_runs_float32_as_accelerate_and_grad_scaler_kwargs():
    with pytest.warns(UserWarning, match="runs in float32, as in Accelerate"):
        acc = Accelerator(cpu=True, mixed_precision="fp16")
    assert acc.scaler is None
    with acc.autocast():
        assert nn.Linear(2, 2)(torch.randn(1, 2)).dtype == torch.float32
    acc = Accelerator(devices="cpu", precision="16-mixed",
                      kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=7)])
    assert acc.scaler.get_scale() == 1024.0 and acc.scaler.get_growth_interval() == 7


def test_clip_on_a_non_sync_step_returns_the_partial_norm_unclipped():
    acc = Accelerator(devices="cpu", gradient_accumulation_steps=2)
    net = nn.Linear(3, 1)
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    with acc.accumulate(net):
        acc.backward(net(x).pow(2).mean())
        expected = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
        norm = acc.clip_grad_norm_(net.parameters(), 1e-6)
    assert not acc.sync_gradients and torch.equal(norm, expected)
    assert torch.equal(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()]), expected)  # unclipped


def test_save_logger_and_utils(tmp_path, caplog):
    acc = Accelerator(devices="cpu")
    sd = {"w": torch.arange(4.0)}
    acc.save(sd, tmp_path / "w.safetensors")
    acc.save({"step": 3, "t": torch.ones(2)}, tmp_path / "o.pt")
    from safetensors.torch import load_file
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], sd["w"])
    assert torch.load(tmp_path / "o.pt", weights_only=True)["step"] == 3
    with pytest.raises(MisconfigurationError, match="dict of tensors"):
        acc.save({"step": 3}, tmp_path / "x.safetensors")
    from ember.logging import get_logger
    log = get_logger("ember.test.names", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="ember.test.names"):
        log.info("hello %s", "main", main_process_only=True)
        log.info("every", main_process_only=False)
    assert [r.getMessage() for r in caplog.records if r.name == "ember.test.names"] == ["hello main", "every"]
    from ember import utils
    assert utils.gather_object(["a"]) == ["a"] and utils.broadcast_object_list([1, 2]) == [1, 2]
    assert utils.send_to_device({"a": torch.ones(1), "k": "s"}, "cpu", skip_keys="k")["k"] == "s"
    assert utils.pad_across_processes(torch.ones(2)).tolist() == [1.0, 1.0]
    assert utils.set_seed(5) == 5 and torch.initial_seed() == 5
    assert list(utils.tqdm(range(3))) == [0, 1, 2]
    path = utils.write_basic_config("bf16", save_location=str(tmp_path / "cfg.yaml"))
    assert "mixed_precision: bf16" in open(path).read()
    assert utils.write_basic_config(save_location=path) is False


def test_find_executable_batch_size_takes_ten_percent_off_as_accelerate(frozen_heap):
    """Accelerate's sequence after each out-of-memory error: int(batch_size * 0.9)
    (its automatic_gradient_accumulation.py divides by it), also on the CPU allocator's message."""
    from ember.utils import find_executable_batch_size
    tried = []

    @find_executable_batch_size(starting_batch_size=40)
    def train(batch_size, limit):
        tried.append(batch_size)
        if batch_size > limit:
            if len(tried) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
        return batch_size
    assert train(24) == 22 and tried == [40, 36, 32, 28, 25, 22]
    tried.clear()
    assert train(24) == 22 and tried == [40, 36, 32, 28, 25, 22]   # each call starts again at 40
    assert ember.find_executable_batch_size is find_executable_batch_size

    # reduce_batch_size_fn: ember's form (given the failed size) and Accelerate's (no argument)
    for fn, expected in ((lambda b: b // 2, [40, 20, 10]), (lambda: 5, [40, 5])):
        tried.clear()
        assert find_executable_batch_size(train.__wrapped__, starting_batch_size=40, reduce_batch_size_fn=fn)(10) == expected[-1]
        assert tried == expected

    @find_executable_batch_size(starting_batch_size=4)
    def never(batch_size):
        raise torch.OutOfMemoryError("out of memory")
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never()

    @find_executable_batch_size(starting_batch_size=4)
    def other(batch_size):
        raise ValueError("not memory")
    with pytest.raises(ValueError):
        other()


def _two_process_fn(out_dir):
    from ember import Accelerator
    from ember.local_sgd import LocalSGD
    from ember.utils import InitProcessGroupKwargs, gather_object
    acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=60)], split_batches=True)
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    net, opt, dl = acc.prepare(net, opt, dl)
    sizes = []
    with LocalSGD(accelerator=acc, model=net, local_sgd_steps=2) as local_sgd:
        for i, (xb, yb) in enumerate(dl):
            sizes.append(len(xb))
            acc.backward(F.mse_loss(net(xb), yb))
            opt.step()
            opt.zero_grad()
            local_sgd.step()
            if i == 2:   # mid-window: the replicas differ
                mid = gather_object([acc.unwrap_model(net).weight.detach().clone()])
    final = gather_object([acc.unwrap_model(net).weight.detach().clone()])
    if acc.is_main_process:
        torch.save({"sizes": sizes, "mid_differ": not torch.equal(*mid), "final_equal": torch.equal(*final),
                    "world": acc.num_processes, "type": str(acc.distributed_type.value)}, out_dir + "/nb.pt")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_notebook_launcher_two_cpu_processes_with_local_sgd(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "EMBER_STRATEGY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ember.notebook_launcher(_two_process_fn, (str(tmp_path),), num_processes=2, use_port=str(find_free_port()))
    res = torch.load(tmp_path / "nb.pt", weights_only=True)
    assert res["world"] == 2 and res["type"] == "MULTI_CPU"
    assert res["sizes"] == [4, 4, 4, 4]   # split_batches: batch 8 is the global batch
    assert res["mid_differ"] and res["final_equal"]


def _accelerate_top_level_names() -> list[str]:
    """The names accelerate/__init__.py binds (its imports, the conditional ``rich`` too)."""
    import ast
    import importlib.util
    src = open(importlib.util.find_spec("accelerate").origin).read()
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return sorted(names)


def test_every_accelerate_top_level_name_is_in_ember_or_names_its_equivalent():
    """``from accelerate import X`` ports to ``from ember import X`` for every X accelerate
    exports, or the import error names what ember has instead."""
    import importlib

    from ember.errors import NotPortedError
    names = _accelerate_top_level_names()
    assert {"Accelerator", "DataLoaderConfiguration", "skip_first_batches", "init_empty_weights"} <= set(names)
    missing, ported, not_ported = [], [], []
    for name in names:
        try:
            value = getattr(importlib.import_module("ember"), name)
        except NotPortedError as e:
            assert name in str(e) and "use " in str(e), str(e)
            not_ported.append(name)
            continue
        except AttributeError:
            missing.append(name)
            continue
        assert value is not None
        ported.append(name)
    assert missing == [], f"Accelerate names with neither a port nor an error naming ember's equivalent: {missing}"
    assert len(ported) >= 17 and len(not_ported) <= 12, (ported, not_ported)
    ns: dict = {}
    exec("from ember import DataLoaderConfiguration, skip_first_batches, dispatch_model", ns)
    assert ns["DataLoaderConfiguration"] is DataLoaderConfiguration
    with pytest.raises(ImportError, match="FSDPStrategy"):
        exec("from ember import FullyShardedDataParallelPlugin", {})
    assert not hasattr(ember, "no_such_name")


def test_skip_first_batches_function_form():
    acc = Accelerator(devices="cpu")
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    assert ember.skip_first_batches(dl, 3) is dl
    assert [b[0].tolist() for b in dl] == [[6, 7], [8, 9]]
    assert [b[0].tolist() for b in dl] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]   # once
    plain = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)
    assert [b[0].tolist() for b in ember.skip_first_batches(plain, 2)] == [[4, 5]]
