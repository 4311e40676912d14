"""A save replaces only what is recognisably an ember checkpoint: a ``meta.json`` with
ember's format marker and nothing but checkpoint files (``trust.not_a_checkpoint``, the
one check every replace and delete uses)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ember
from conftest import LinearModule, regression_data
from ember.checkpoint import io as cio
from ember.errors import CheckpointError


@pytest.fixture
def trainer(tmp_path):
    t = ember.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=str(tmp_path))
    t.fit(LinearModule(), torch.utils.data.DataLoader(regression_data(8), batch_size=4))
    return t


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _dataset(root: Path, meta: dict) -> Path:
    d = root / "data"
    (d / "images").mkdir(parents=True)
    (d / "images" / "0001.png").write_bytes(b"\x89PNG not really")
    (d / "meta.json").write_text(json.dumps(meta))
    return d


@pytest.mark.parametrize("meta", [
    {"name": "cifar-mini", "classes": 10},                     # another program's meta.json
    {"format_version": 1, "files": {}},                        # ember's marker, but other files next to it
])
def test_a_dataset_folder_with_its_own_meta_json_is_never_replaced(tmp_path, trainer, meta):
    d = _dataset(tmp_path, meta)
    before = _tree(d)
    with pytest.raises(CheckpointError, match=rf"save_checkpoint\('{d}'\): {d} is not an ember checkpoint"):
        trainer.save_checkpoint(str(d))
    assert _tree(d) == before and not os.path.exists(cio.tmp_path(d))


def test_a_folder_of_checkpoint_names_without_ember_meta_is_refused(tmp_path, trainer):
    d = tmp_path / "weights"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"someone else's")
    (d / "meta.json").write_text(json.dumps({"format_version": "v2"}))
    with pytest.raises(CheckpointError, match="no ember format_version"):
        trainer.save_checkpoint(str(d))
    assert (d / "model.safetensors").read_bytes() == b"someone else's"


def test_an_ember_checkpoint_is_replaced(tmp_path, trainer):
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(str(path))
    first = json.loads((path / "meta.json").read_text())["created"]
    trainer.save_checkpoint(str(path))          # the same target again: an ember checkpoint
    assert cio.is_checkpoint(path) and json.loads((path / "meta.json").read_text())["created"] >= first


def test_accelerator_save_state_uses_the_same_rule(tmp_path):
    acc = ember.Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 1))
    d = _dataset(tmp_path, {"format_version": 1})
    before = _tree(d)
    with pytest.raises(CheckpointError, match=r"is not an ember checkpoint"):
        acc.save_state(str(d))
    assert _tree(d) == before
    assert model is not None


def test_remove_checkpoint_refuses_a_folder_that_is_not_one(tmp_path, trainer):
    d = _dataset(tmp_path, {"format_version": 1})
    with pytest.raises(CheckpointError, match=rf"refusing to delete {d}"):
        cio.remove_checkpoint(d)
    assert (d / "images" / "0001.png").exists()
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(str(path))
    cio.remove_checkpoint(path)
    assert not path.exists()


@pytest.mark.parametrize("meta_text", ["", '{\n  "created": "2026-11-28T07:', '{"digests": {"model.safetensors": "ab'])
def test_a_staging_folder_left_by_a_kill_inside_meta_json_is_replaced(tmp_path, trainer, meta_text):
    """A save killed while it wrote meta.json leaves NAME.tmp with the start of one; the
    next save to NAME (a resumed run re-saving that step) replaces it. Found by the async
    top-k kill test: the resume refused the folder and failed."""
    path = tmp_path / "epoch=0-step=3"
    tmp = Path(cio.tmp_path(path))
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    (tmp / "trainer_state.pt").write_bytes(b"half")
    (tmp / "meta.json").write_text(meta_text)
    trainer.save_checkpoint(str(path))
    assert cio.is_checkpoint(path) and not tmp.exists()


@pytest.mark.parametrize("meta_text", ['{"name": "cifar-mini"}', "name: cifar-mini\n", "[1, 2"])
def test_a_tmp_folder_with_another_programs_meta_json_is_still_refused(tmp_path, trainer, meta_text):
    path = tmp_path / "data"
    tmp = Path(cio.tmp_path(path))
    tmp.mkdir()
    (tmp / "meta.json").write_text(meta_text)
    with pytest.raises(CheckpointError, match="is not a staging folder of an ember save"):
        trainer.save_checkpoint(str(path))
    assert (tmp / "meta.json").read_text() == meta_text


def test_meta_json_is_renamed_into_place_whole(tmp_path, trainer, monkeypatch):
    """meta.json appears in one rename: a kill at any moment leaves none or all of it."""
    seen = []
    real = os.replace

    def spy(src, dst, *a, **kw):
        if os.path.basename(os.fspath(dst)) == "meta.json":
            seen.append((os.path.basename(os.fspath(src)), json.loads(Path(src).read_text())["format_version"]))
        return real(src, dst, *a, **kw)
    monkeypatch.setattr(os, "replace", spy)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert seen == [(".tmpmeta", cio.FORMAT_VERSION)]
