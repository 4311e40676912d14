"""Every writer checks its target in one place, the low-level checkpoint writer: no ember
writer replaces or deletes anything it did not create (Fabric.save,
convert_lightning_checkpoint, ModelCheckpoint's ``last``, ``ember report --out``). And
a DCP ``.metadata`` that claims more than its files hold is refused before anything is
allocated."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import ember
from conftest import LinearModule, regression_data
from ember.checkpoint import io as cio
from ember.checkpoint import trust as checks
from ember.errors import CheckpointError
from helpers import reseal


def _tree(root: Path) -> dict:
    """Every file under ``root`` (or ``root`` itself) with its bytes, and every folder."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


def _user_folders(tmp_path: Path) -> dict[str, Path]:
    """What a user keeps next to checkpoints: a results folder, a dataset folder with its
    own ``meta.json``, a notes file, and a folder of checkpoint-like names under ember's own
    staging name (``x.ember-tmp``, which ember did not make)."""
    results = tmp_path / "results"
    (results / "plots").mkdir(parents=True)
    (results / "results.csv").write_text("epoch,acc\n0,0.5\n")
    (results / "plots" / "acc.png").write_bytes(b"\x89PNG")
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "meta.json").write_text(json.dumps({"format_version": 1, "classes": 10}))
    (data / "images" / "0.png").write_bytes(b"\x89PNG")
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    staged = tmp_path / "x.ember-tmp"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"someone else's weights")
    return {"results": results, "data": data, "notes.txt": notes, "x": staged}


def _users_tmp(tmp_path: Path, kind: str) -> Path:
    """A user's ``run.tmp`` (the staging name of earlier ember versions), a folder or a file."""
    run_tmp = tmp_path / "run.tmp"
    if kind == "folder":
        run_tmp.mkdir()
        (run_tmp / "draft.py").write_text("print('mine')")
        (run_tmp / "model.safetensors").write_bytes(b"someone else's weights")
        (run_tmp / ".ember-staging").write_text("")      # even one that looks like an old staging folder
    else:
        run_tmp.write_text("my notes")
    return run_tmp


# -- the one place: the writer itself -----------------------------------------------------------
@pytest.mark.parametrize("target", ["results", "data", "notes.txt", "x"])
def test_the_low_level_writer_refuses_every_user_target(tmp_path, target):
    """``write_checkpoint`` (what every save calls) checks the target itself: a caller that
    skips ``check_save_target`` can no longer replace a folder, a file or a folder under the
    staging name ``NAME.ember-tmp`` that ember did not make."""
    folders = _user_folders(tmp_path)
    before = {k: _tree(v) for k, v in folders.items()}
    path = tmp_path / "x" if target == "x" else folders[target]
    with pytest.raises(CheckpointError, match="refusing to (replace|delete)"):
        cio.write_checkpoint(path, {"w": torch.ones(2)}, {"step": 1}, {})
    assert {k: _tree(v) for k, v in folders.items()} == before


def test_the_staging_name_is_embers_own(tmp_path):
    """Every rank of a sharded save finds the staging folder by name alone: next to ``NAME``
    (one rename commits it), the same for every call, and not a name users give files."""
    path = tmp_path / "run"
    assert cio.tmp_path(path) == cio.tmp_path(str(path) + "/") == str(tmp_path / "run.ember-tmp")
    assert Path(cio.make_staging(path)) == tmp_path / "run.ember-tmp"
    assert os.listdir(tmp_path / "run.ember-tmp") == [cio.STAGING_MARKER]


def test_a_staging_folder_ember_made_is_still_replaced_and_carries_no_marker(tmp_path):
    path = tmp_path / "ck"
    tmp = Path(cio.make_staging(path))            # as a save killed midway leaves it
    (tmp / "model.safetensors").write_bytes(b"half")
    cio.write_checkpoint(path, {"w": torch.ones(2)}, {"step": 1}, {})
    assert cio.is_checkpoint(path) and not tmp.exists()
    assert cio.STAGING_MARKER not in os.listdir(path)
    cio.write_checkpoint(path, {"w": torch.zeros(2)}, {"step": 2}, {})   # its own checkpoint: replaced
    assert cio.read_checkpoint(path)[1] == {"step": 2}


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_users_run_tmp_plays_no_part_in_a_save_to_run(tmp_path, kind):
    """``run.tmp`` is the user's (or an earlier version's staging folder): a save to ``run``
    by the low-level writer, ``Trainer.save_checkpoint``, ``ModelCheckpoint``, ``Fabric.save``
    and ``Accelerator.save_state`` succeeds and leaves it byte-identical; checkpoint
    discovery ignores it."""
    from ember.callbacks import ModelCheckpoint
    run_tmp = _users_tmp(tmp_path, kind)
    before = _tree(run_tmp)
    path = tmp_path / "run"
    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path / "root"), devices="cpu",
                      callbacks=[ModelCheckpoint(dirpath=str(tmp_path), filename="run", save_top_k=1)])
    t.fit(LinearModule(), torch.utils.data.DataLoader(regression_data(16), batch_size=4))
    assert t.checkpoint_callback.best_model_path == str(path)
    assert cio.read_checkpoint(path)[2]["global_step"] == 4 and _tree(run_tmp) == before
    t.save_checkpoint(str(path))
    assert cio.list_checkpoints(tmp_path) == [str(path)] and _tree(run_tmp) == before
    cio.write_checkpoint(path, {"w": torch.ones(2)}, {"step": 1}, {})
    cio.write_checkpoint(path, {"w": torch.zeros(2)}, {"step": 2}, {})      # and replaces its own
    assert cio.read_checkpoint(path)[1] == {"step": 2} and _tree(run_tmp) == before

    fabric = ember.Fabric(devices=1)
    model = fabric.setup(nn.Linear(2, 1))
    fabric.save(path, {"model": model, "step": 3})
    assert fabric.load(path)["step"] == 3 and _tree(run_tmp) == before

    acc = ember.Accelerator()
    net = acc.prepare(nn.Linear(2, 1))
    with torch.no_grad():
        net.weight.fill_(5.0)
    acc.save_state(path)
    with torch.no_grad():
        net.weight.fill_(0.0)
    acc.load_state(path)
    assert torch.all(net.weight == 5.0) and _tree(run_tmp) == before
    assert sorted(os.listdir(tmp_path)) == ["run", "run.tmp"]          # no staging folder left either


def test_an_earlier_versions_staging_folder_is_never_touched(tmp_path):
    """A ``NAME.tmp`` left by an earlier version's killed save (its marker and half its files,
    or even a complete ``meta.json``): saves to ``NAME`` leave it alone, discovery skips it."""
    old = tmp_path / "step=3.tmp"
    cio.write_checkpoint(tmp_path / "made-by-old", {"w": torch.ones(2)}, {"step": 3}, {})
    os.rename(tmp_path / "made-by-old", old)
    (old / cio.STAGING_MARKER).write_text("")
    before = _tree(old)
    cio.write_checkpoint(tmp_path / "step=3", {"w": torch.zeros(2)}, {"step": 3}, {})
    cio.remove_staging(tmp_path / "step=3")
    assert _tree(old) == before
    assert cio.list_checkpoints(tmp_path) == [str(tmp_path / "step=3")]


# -- item 1: Fabric.save --------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["results", "data", "notes.txt", "x"])
def test_fabric_save_never_replaces_or_deletes_a_users_files(tmp_path, target):
    folders = _user_folders(tmp_path)
    before = {k: _tree(v) for k, v in folders.items()}
    fabric = ember.Fabric(devices=1)
    model = fabric.setup(nn.Linear(2, 1))
    path = tmp_path / "x" if target == "x" else folders[target]
    with pytest.raises(CheckpointError, match=r"Fabric.save\(.*refusing to (replace|delete)"):
        fabric.save(path, {"model": model, "step": 3})
    assert {k: _tree(v) for k, v in folders.items()} == before
    fabric.save(tmp_path / "ok", {"model": model, "step": 3})
    fabric.save(tmp_path / "ok", {"model": model, "step": 4})       # its own checkpoint: replaced
    assert fabric.load(tmp_path / "ok")["step"] == 4


# -- item 2: convert_lightning_checkpoint ---------------------------------------------------------
def test_convert_lightning_checkpoint_never_replaces_a_project_folder_or_a_file(tmp_path):
    from ember.utils import convert_lightning_checkpoint
    ckpt = tmp_path / "epoch=0.ckpt"
    torch.save({"state_dict": {"net.weight": torch.ones(1, 4), "net.bias": torch.zeros(1)},
                "hyper_parameters": {"lr": 0.1}, "epoch": 0, "global_step": 4}, ckpt)
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("import ember\n")
    (project / "data" / "x.csv").write_text("1,2\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    for out in (project, notes):
        before = _tree(out)
        with pytest.raises(CheckpointError, match=r"convert_lightning_checkpoint\(.*refusing to replace"):
            convert_lightning_checkpoint(str(ckpt), str(out))
        assert _tree(out) == before
    out = convert_lightning_checkpoint(str(ckpt), str(tmp_path / "converted"))
    assert torch.equal(cio.read_checkpoint(out)[0]["net.weight"], torch.ones(1, 4))


# -- item 3: ModelCheckpoint(save_last=True) --------------------------------------------------------
def _fit_with_last(root: Path, dirpath: Path, weights_only: bool = False):
    from ember.callbacks import ModelCheckpoint
    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(root), devices="cpu",
                      callbacks=[ModelCheckpoint(dirpath=str(dirpath), save_last=True, save_weights_only=weights_only)])
    t.fit(LinearModule(), torch.utils.data.DataLoader(regression_data(16), batch_size=4))
    return t


@pytest.mark.parametrize("kind", ["folder", "file", "safetensors"])
def test_save_last_never_replaces_a_users_last(tmp_path, kind):
    dirpath = tmp_path / "ck"
    dirpath.mkdir()
    if kind == "folder":
        last = dirpath / "last"
        last.mkdir()
        (last / "notes.md").write_text("my notes")
        (last / "model.safetensors").write_bytes(b"mine")
    else:
        last = dirpath / ("last" if kind == "file" else "last.safetensors")
        last.write_bytes(b"my own weights, not ember's")
    before = _tree(last)
    with pytest.raises(CheckpointError, match=r"ModelCheckpoint\(save_last=True\): refusing to replace"):
        _fit_with_last(tmp_path, dirpath, weights_only=kind == "safetensors")
    assert _tree(last) == before


def test_save_last_appearing_during_the_run_is_left_alone(tmp_path):
    """A ``last`` created after setup (another program) is not replaced: a warning says so."""
    from ember.callbacks import Callback
    dirpath = tmp_path / "ck"

    class MakeLast(Callback):
        def on_train_start(self, trainer, module):
            (dirpath / "last").mkdir()
            (dirpath / "last" / "notes.md").write_text("mine")

    from ember.callbacks import ModelCheckpoint
    t = ember.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), devices="cpu",
                      callbacks=[MakeLast(), ModelCheckpoint(dirpath=str(dirpath), save_last=True)])
    with pytest.warns(UserWarning, match="not updating .*last"):
        t.fit(LinearModule(), torch.utils.data.DataLoader(regression_data(16), batch_size=4))
    assert (dirpath / "last" / "notes.md").read_text() == "mine"


@pytest.mark.parametrize("weights_only", [False, True])
def test_save_last_still_follows_its_own_link_and_folder(tmp_path, weights_only):
    dirpath = tmp_path / "ck"
    last = dirpath / ("last.safetensors" if weights_only else "last")
    _fit_with_last(tmp_path / "a", dirpath, weights_only)
    assert os.path.islink(last) and (weights_only or cio.is_checkpoint(last))
    _fit_with_last(tmp_path / "b", dirpath, weights_only)            # a second run replaces its own link
    assert os.path.islink(last)
    os.remove(last)                                   # where symlinks fail: a copy, replaced again
    if weights_only:
        shutil.copy2(next(p for p in dirpath.glob("epoch=*.safetensors")), last)
    else:
        shutil.copytree(cio.list_checkpoints(dirpath)[-1], last)
    _fit_with_last(tmp_path / "c", dirpath, weights_only)
    assert os.path.islink(last)


# -- item 4: ember report --out ---------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,step,train/loss\n0,1,1.0\n0,2,0.5\n")
    return run


def test_report_out_follows_predict_outputs_rules(tmp_path, run_dir):
    from ember.cli import main as cli_main
    ckpt = cio.write_checkpoint(tmp_path / "ckpt", {"w": torch.ones(2)}, None, {})
    weights = Path(ckpt) / "model.safetensors"
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    before = weights.read_bytes()
    for out, extra in ((weights, []), (notes, []), (tmp_path, []), (weights, ["--overwrite"])):
        assert cli_main(["report", str(run_dir), "--out", str(out), *extra]) == 2
    assert weights.read_bytes() == before and notes.read_text() == "precious"
    assert not (Path(ckpt) / "model_charts").exists()
    assert cli_main(["report", str(run_dir)]) == 0
    assert cli_main(["report", str(run_dir)]) == 0                       # its own report: replaced
    assert cli_main(["report", str(run_dir), "--out", str(notes), "--overwrite"]) == 0
    assert notes.read_text().startswith("<!DOCTYPE html>")


# -- item 12: DCP metadata claiming huge tensors ----------------------------------------------------
def test_dcp_metadata_claiming_a_huge_tensor_is_refused_before_allocating(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from ember.strategies.fsdp import load_full_weights
    path = tmp_path / "ck"
    tmp = Path(cio.tmp_path(path))       # as FSDPStrategy stages it: every rank writes its DCP shards here
    tmp.mkdir()
    module = LinearModule()
    dcp.save({"model": module.state_dict()}, checkpoint_id=str(tmp / cio.DCP_WEIGHTS_DIR), no_dist=True)
    files = {f"{cio.DCP_WEIGHTS_DIR}/{p.name}": p.stat().st_size for p in (tmp / cio.DCP_WEIGHTS_DIR).iterdir()}
    cio.write_checkpoint(path, None, None, {"strategy": "fsdp", "hparams": {}}, keep_existing_tmp=True,
                         extra_files=files)
    assert torch.equal(load_full_weights(str(path))["net.weight"], module.state_dict()["net.weight"])
    md_file = path / cio.DCP_WEIGHTS_DIR / ".metadata"
    md = pickle.loads(md_file.read_bytes())       # our own file: trusted here
    key = "model.net.weight"
    big = torch.Size([2**20, 2**20])
    md.state_dict_metadata[key] = dataclasses.replace(
        md.state_dict_metadata[key], size=big,
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=big)])
    md_file.write_bytes(pickle.dumps(md))
    reseal(path)
    with pytest.raises(CheckpointError, match=r"claims the tensor 'model.net.weight' is \[1048576, 1048576\]"):
        load_full_weights(str(path))


# -- weights files and exports -----------------------------------------------------------------------
def test_weights_files_replace_only_what_ember_wrote(tmp_path):
    from safetensors.torch import save_file
    theirs = tmp_path / "hf"
    theirs.mkdir()
    save_file({"w": torch.ones(2)}, str(theirs / "model.safetensors"), metadata={"format": "pt"})
    single = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(2)}, str(single))
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to replace .*model.safetensors: .* ember did not write"):
        cio.save_model_sharded({"w": torch.zeros(2)}, theirs)
    with pytest.raises(CheckpointError, match="refusing to replace .*w.safetensors"):
        cio.save_weights_file(single, {"w": torch.zeros(2)})
    assert _tree(tmp_path) == before
    ours = tmp_path / "export"
    cio.save_model_sharded({"a": torch.ones(64), "b": torch.ones(64)}, ours, max_shard_size=300)
    assert sorted(os.listdir(ours)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                        "model.safetensors.index.json"]
    cio.save_model_sharded({"a": torch.zeros(64), "b": torch.zeros(64)}, ours)      # its own export: replaced
    assert sorted(os.listdir(ours)) == ["model.safetensors"]
    assert torch.equal(cio.load_model_sharded(ours)["a"], torch.zeros(64))


def test_a_weights_index_is_replaced_only_when_ember_wrote_it(tmp_path):
    """save_model_sharded removes a stale index and replaces one: only its own (the marker
    in its metadata, or, written before the marker, every shard it names is ember's)."""
    index = "model.safetensors.index.json"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / index).write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": {"w": "w.bin"}}))
    before = _tree(tmp_path)
    for size in ("10GB", 300):   # one file (the index would be removed) and shards (replaced)
        with pytest.raises(CheckpointError, match=f"refusing to replace .*{index}: .* ember did not write"):
            cio.save_model_sharded({"a": torch.ones(64), "b": torch.ones(64)}, theirs, max_shard_size=size)
    assert _tree(tmp_path) == before
    ours = tmp_path / "ours"
    cio.save_model_sharded({"a": torch.ones(64), "b": torch.ones(64)}, ours, max_shard_size=300)
    written = json.loads((ours / index).read_text())
    assert written["metadata"][checks.WEIGHTS_MARKER] == str(cio.FORMAT_VERSION)
    del written["metadata"][checks.WEIGHTS_MARKER]   # as an export before the marker: its shards decide
    (ours / index).write_text(json.dumps(written))
    cio.save_model_sharded({"a": torch.zeros(64), "b": torch.zeros(64)}, ours, max_shard_size=300)
    assert torch.equal(cio.load_model_sharded(ours)["b"], torch.zeros(64))
    assert checks.WEIGHTS_MARKER in json.loads((ours / index).read_text())["metadata"]


def test_a_deepspeed_checkpoint_with_its_recovery_scripts_is_still_ember_s(tmp_path):
    """DeepSpeed copies zero_to_fp32.py and zero_to_torch.py next to its files (into the
    staging folder, so into the checkpoint): a save over it, a failed save's clean-up and
    ModelCheckpoint's top-k deletion still recognise the folder as ember's."""
    path = tmp_path / "step=3"
    tmp = Path(cio.make_staging(path))
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        (tmp / name).write_text("# DeepSpeed's recovery script\n")
    cio.remove_staging(path)
    assert not tmp.exists()
    cio.write_checkpoint(path, {"w": torch.ones(2)}, {"step": 3}, {})
    (path / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    cio.write_checkpoint(path, {"w": torch.zeros(2)}, {"step": 4}, {})
    (path / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    cio.remove_checkpoint(path)
    assert not path.exists()
