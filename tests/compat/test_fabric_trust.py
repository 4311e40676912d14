"""``Fabric.load`` runs the Trainer's and the Accelerator's checks before anything is
loaded (``check_optimizers``, ``check_compatible``), entries named ``model`` and
``model.ema`` load back apart, and ``Fabric.save`` under two processes raises one error on
every rank."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ember import Fabric
from ember.errors import CheckpointError
from ember.strategies.environments import find_free_port
from helpers import clean_env, run_job

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _adam_checkpoint(fabric, path):
    model = fabric.setup(_net())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-3))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    fabric.save(path, {"model": model, "optimizer": opt})
    return model


def test_adam_state_is_not_loaded_into_adamw_or_sgd(tmp_path):
    fabric = Fabric(devices=1)
    _adam_checkpoint(fabric, tmp_path / "ck")
    model = fabric.setup(_net(1))
    adamw = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    with pytest.raises(CheckpointError, match=r"holds the state of a torch.optim.adam.Adam .*gives 'optimizer' as a torch.optim.adamw.AdamW"):
        fabric.load(tmp_path / "ck", {"model": model, "optimizer": adamw})
    assert adamw.param_groups[0]["weight_decay"] == 0.1 and not adamw.state_dict()["state"]
    sgd = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"torch.optim.adam.Adam .*torch.optim.sgd.SGD"):
        fabric.load(tmp_path / "ck", {"optimizer": sgd})
    adam = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=5.0))
    fabric.load(tmp_path / "ck", {"model": model, "optimizer": adam})
    assert adam.param_groups[0]["lr"] == 1e-3 and adam.state_dict()["state"][0]["step"] == 1


def test_an_sgd_state_is_refused_by_its_groups_even_without_a_recorded_class(tmp_path):
    """A checkpoint that records no optimizer class (an older save): the parameter-group
    options still tell SGD from Adam, with a clear error instead of KeyError: 'momentum'."""
    fabric = Fabric(devices=1)
    _adam_checkpoint(fabric, tmp_path / "ck")
    meta_file = tmp_path / "ck" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["fabric"]["optimizers"]
    meta_file.write_text(json.dumps(meta))
    model = fabric.setup(_net(1))
    sgd = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"other options than the checkpoint's.*momentum"):
        fabric.load(tmp_path / "ck", {"optimizer": sgd})


def test_int32_weights_are_not_loaded_into_a_float_model(tmp_path):
    fabric = Fabric(devices=1)
    ints = nn.Linear(3, 2)
    with torch.no_grad():
        ints.weight = nn.Parameter(torch.ones(2, 3, dtype=torch.int32), requires_grad=False)
    fabric.save(tmp_path / "ck", {"model": ints})
    model = fabric.setup(_net())
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"dtype mismatches.*weight: checkpoint torch.int32 vs model torch.float32"):
        fabric.load(tmp_path / "ck", {"model": model})
    with pytest.raises(CheckpointError, match="dtype mismatches"):
        fabric.load_raw(tmp_path / "ck", model)
    assert torch.equal(model.weight, before)


def test_entries_named_model_and_model_ema_load_back_apart(tmp_path):
    fabric = Fabric(devices=1)
    model, ema = fabric.setup(_net(0)), fabric.setup(nn.Sequential(_net(1)))
    ema_inner = nn.Module()
    ema_inner.ema = _net(2)             # a module whose own keys start with "ema."
    inner = fabric.setup(ema_inner)
    fabric.save(tmp_path / "ck", {"model": inner, "model.ema": ema, "m": model})
    a, b, c = fabric.setup(nn.Module()), fabric.setup(nn.Sequential(_net(5))), fabric.setup(_net(6))
    a.module.ema = _net(7)
    fabric.load(tmp_path / "ck", {"model": a, "model.ema": b, "m": c})
    for x, y in ((a, inner), (b, ema), (c, model)):
        assert x.state_dict().keys() == y.state_dict().keys()
        assert all(torch.equal(x.state_dict()[k], y.state_dict()[k]) for k in x.state_dict())
    full = fabric.load(tmp_path / "ck")
    assert sorted(full["model"]) == ["ema.bias", "ema.weight"] and sorted(full["model.ema"]) == ["0.bias", "0.weight"]


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_an_unsavable_state_raises_the_same_error_on_every_rank(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(find_free_port()), str(SCRIPTS / "fabric_save_ddp.py"), str(tmp_path)]
    proc = run_job(cmd, out_dir=tmp_path / "log", cwd=tmp_path, env=clean_env(), timeout=150)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert "state['bad'] is a builtins.object" in r0["unsavable"] and r0["unsavable"] == r1["unsavable"]
    assert "is not an ember checkpoint" in r0["user_folder"] and r0["user_folder"] == r1["user_folder"]
    assert r1["rank1_only"].startswith("own RecursionError") and \
        r0["rank1_only"].startswith("Fabric.save(") and "on rank 1: RecursionError" in r0["rank1_only"]
    assert max(r0["unsavable_s"], r1["unsavable_s"], r0["user_folder_s"], r1["user_folder_s"],
               r0["rank1_only_s"], r1["rank1_only_s"]) < 10
    assert r0["loaded_step"] == r1["loaded_step"] == 2 and r0["user_file"] == "epoch,acc\n"
