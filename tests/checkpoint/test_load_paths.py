"""Loaders stay inside their folders: every storage path a DCP ``.metadata`` names and
every shard a safetensors index names must be a plain relative name of a regular file
inside the checkpoint (one helper, ``ember.checkpoint.trust.member_file``), checked on
the name before anything is opened."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from conftest import LinearModule, reseal
from ember.checkpoint import io as cio
from ember.errors import CheckpointError


def _dcp_checkpoint(path: Path, module: torch.nn.Module) -> Path:
    """An ember checkpoint whose weights are a DCP folder, as FSDPStrategy writes it
    (``meta.json`` lists the DCP files with their sizes)."""
    import torch.distributed.checkpoint as dcp
    tmp = Path(cio.tmp_path(path))
    dcp.save({"model": module.state_dict()}, checkpoint_id=str(tmp / cio.DCP_WEIGHTS_DIR), no_dist=True)
    files = {f"{cio.DCP_WEIGHTS_DIR}/{p.name}": p.stat().st_size for p in (tmp / cio.DCP_WEIGHTS_DIR).iterdir()}
    cio.write_checkpoint(path, None, None, {"strategy": "fsdp", "hparams": {}}, keep_existing_tmp=True,
                         extra_files=files)
    return path


def _point_storage_at(ckpt: Path, target: str) -> None:
    """Rewrite the checkpoint's DCP metadata so every storage entry reads ``target``."""
    md_file = ckpt / cio.DCP_WEIGHTS_DIR / ".metadata"
    md = pickle.loads(md_file.read_bytes())       # our own file: trusted here
    md.storage_data = {k: dataclasses.replace(v, relative_path=target) for k, v in md.storage_data.items()}
    md_file.write_bytes(pickle.dumps(md))
    reseal(ckpt)


@pytest.fixture
def two_runs(tmp_path):
    torch.manual_seed(0)
    victim_module, ours_module = LinearModule(), LinearModule()
    with torch.no_grad():
        victim_module.net.weight.fill_(7.0)
    victim = _dcp_checkpoint(tmp_path / "other_run" / "ckpt", victim_module)
    ours = _dcp_checkpoint(tmp_path / "run" / "ckpt", ours_module)
    shard = next((victim / cio.DCP_WEIGHTS_DIR).glob("*.distcp")).name
    return victim, ours, shard


def _loaders():
    from ember.strategies.fsdp import load_full_weights
    return {"load_from_checkpoint": lambda p: LinearModule.load_from_checkpoint(str(p)).state_dict(),
            "load_full_weights": lambda p: load_full_weights(str(p))}


@pytest.mark.parametrize("loader", ["load_from_checkpoint", "load_full_weights"])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_dcp_storage_path_outside_the_checkpoint_is_refused(two_runs, loader, where):
    victim, ours, shard = two_runs
    target = f"../../../other_run/ckpt/{cio.DCP_WEIGHTS_DIR}/{shard}" if where == "relative" else \
        str(victim / cio.DCP_WEIGHTS_DIR / shard)
    assert os.path.isfile(ours / cio.DCP_WEIGHTS_DIR / target)      # it does name the victim's shard
    _point_storage_at(ours, target)
    with pytest.raises(CheckpointError, match=r"refusing checkpoint .*\.metadata lists .*(leaves the checkpoint|"
                                              r"is not a relative path)"):
        _loaders()[loader](ours)


def test_dcp_checkpoint_loads_its_own_shards(two_runs):
    victim, ours, _ = two_runs
    for load in _loaders().values():
        assert float(load(victim)["net.weight"].min()) == 7.0
        assert float(load(ours)["net.weight"].abs().max()) < 7.0


@pytest.mark.parametrize("loader", ["load_from_checkpoint", "load_full_weights"])
def test_dcp_storage_path_naming_a_fifo_is_refused_at_once(two_runs, loader):
    _, ours, _ = two_runs
    fifo = ours / cio.DCP_WEIGHTS_DIR / "__0_9.distcp"
    os.mkfifo(fifo)
    _point_storage_at(ours, fifo.name)
    outcome = {}

    def load():
        try:
            _loaders()[loader](ours)
            outcome["error"] = None
        except Exception as err:   # noqa: BLE001 - inspected below
            outcome["error"] = err

    th = threading.Thread(target=load, daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():                 # blocked opening the FIFO: unblock it, then fail
        with open(fifo, "wb"):
            pass
        th.join(10)
        pytest.fail("the load blocked on a FIFO named by the DCP metadata")
    assert isinstance(outcome["error"], CheckpointError), outcome
    assert "__0_9.distcp" in str(outcome["error"]) and "not a regular file (a FIFO)" in str(outcome["error"])


# -- sharded safetensors indexes -------------------------------------------------------------
@pytest.fixture
def index_runs(tmp_path):
    """``victim/x.safetensors`` (weights 7) and ``ours/`` whose index is edited per test."""
    torch.manual_seed(0)
    victim_module = LinearModule()
    with torch.no_grad():
        victim_module.net.weight.fill_(7.0)
    (tmp_path / "victim").mkdir()
    cio.save_safetensors(victim_module.state_dict(), tmp_path / "victim" / "x.safetensors")
    ours = tmp_path / "ours"
    cio.save_model_sharded(LinearModule().state_dict(), ours, max_shard_size=8)   # several shards + index
    assert (ours / cio.INDEX_NAME).exists()
    return tmp_path / "victim", ours


def _set_shards(ours: Path, name: str) -> None:
    index = json.loads((ours / cio.INDEX_NAME).read_text())
    index["weight_map"] = {k: name for k in index["weight_map"]}
    (ours / cio.INDEX_NAME).write_text(json.dumps(index))


def _index_loaders():
    from ember.big_modeling import load_checkpoint_and_dispatch, load_checkpoint_in_model
    from ember.compat import paths  # noqa: F401  (the old module path below)
    import ember.checkpoint_io as old_io

    def into_model(load):
        def run(p):
            m = LinearModule()
            load(m, str(p))
            return m.state_dict()
        return run
    return {"load_checkpoint_in_model": into_model(load_checkpoint_in_model),
            "load_checkpoint_and_dispatch": into_model(load_checkpoint_and_dispatch),
            "load_model_sharded": lambda p: cio.load_model_sharded(p),
            "checkpoint_io.load_model_sharded": lambda p: old_io.load_model_sharded(p),
            "read_checkpoint": lambda p: cio.read_checkpoint(p)[0]}


@pytest.mark.parametrize("loader", sorted(_index_loaders()))
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_index_shard_outside_the_folder_is_refused(index_runs, loader, where):
    victim, ours = index_runs
    name = "../victim/x.safetensors" if where == "relative" else str(victim / "x.safetensors")
    _set_shards(ours, name)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json lists .*(leaves the checkpoint|"
                                              r"is not a relative path)"):
        _index_loaders()[loader](ours)


def test_index_shard_names_are_refused_before_any_file_is_opened(index_runs):
    """``../../etc/passwd`` and a name that exists nowhere get the same refusal: the error
    tells nothing about the file system outside the folder."""
    _, ours = index_runs
    messages = []
    for name in ("../../etc/passwd", "../../no/such/file.safetensors"):
        _set_shards(ours, name)
        with pytest.raises(CheckpointError) as info:
            cio.load_model_sharded(ours)
        messages.append(str(info.value).replace(name, "NAME"))
    assert messages[0] == messages[1] and "header" not in messages[0], messages


def test_index_inside_the_folder_still_loads(index_runs):
    victim, ours = index_runs
    for name, load in _index_loaders().items():
        w = load(ours)
        assert float(w["net.weight"].abs().max()) < 7.0, name
