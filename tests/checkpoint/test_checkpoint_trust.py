"""Untrusted checkpoints and inputs (docs/checkpoint_format.md, "Untrusted checkpoints"):
crafted checkpoints are refused with nothing outside touched and no code run."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from conftest import LinearModule, regression_data, reseal
from ember.checkpoint import io as cio
from ember.callbacks import ModelCheckpoint
from ember.errors import CheckpointError


class Marker:
    """Unpickling it creates ``path`` (what an attacker's code would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def fit(root, max_epochs=2, ckpt_path=None, **kw):
    ember.seed_everything(0)
    cb = ModelCheckpoint(dirpath=str(root / "ckpts"), save_top_k=-1)
    t = ember.Trainer(max_epochs=max_epochs, default_root_dir=root, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[cb], **kw)
    t.fit(LinearModule(), DataLoader(regression_data(32), batch_size=8), ckpt_path=ckpt_path)
    return t


def tree(root):
    out = {}
    for dp, dirs, files in os.walk(root):
        for f in files + dirs:
            p = os.path.join(dp, f)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def rewrite_state(ckpt: Path, edit) -> None:
    """Edit trainer_state.pt and record its new size: a consistent, crafted checkpoint."""
    sfile = ckpt / cio.STATE_NAME
    state = torch.load(sfile, weights_only=True)
    edit(state)
    torch.save(state, sfile)
    reseal(ckpt)


@pytest.mark.parametrize("dirpath", [None, "same"])
def test_crafted_paths_in_model_checkpoint_state_touch_nothing_outside(tmp_path, dirpath):
    run = tmp_path / "run"
    fit(run)
    victim_dir, victim_file = tmp_path / "victim", tmp_path / "victim.txt"
    victim_dir.mkdir()
    (victim_dir / "data.bin").write_bytes(b"x" * 10)
    victim_file.write_text("keep me")
    ckpt = run / "ckpts" / "epoch=1-step=8"

    def edit(state):
        for s in state["callbacks"].values():
            if "best_k_models" in s:
                s["dirpath"] = None if dirpath is None else str(run / "ckpts")
                s["stale"] = [str(victim_dir), str(run / "ckpts" / ".." / ".." / "victim.txt")]
                s["best_k_models"] = {str(victim_file): 0.0, str(victim_dir): 0.0}
                s["last_model_path"] = str(victim_file)
    rewrite_state(ckpt, edit)
    before = tree(tmp_path / "victim"), victim_file.read_text()
    with pytest.warns(UserWarning, match="outside") if dirpath else _no_warning():
        t = fit(run, max_epochs=5, ckpt_path=str(ckpt))   # save_top_k=-1: evicts nothing of its own either
    assert (tree(tmp_path / "victim"), victim_file.read_text()) == before
    assert t.global_step == 20
    assert all(p.startswith(str(run / "ckpts")) for p in t.checkpoint_callback.best_k_models)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _dcp_checkpoint(root: Path, strategy: str, marker: Path) -> Path:
    ckpt = root / "evil"
    (ckpt / cio.DCP_WEIGHTS_DIR).mkdir(parents=True)
    with open(ckpt / cio.DCP_WEIGHTS_DIR / ".metadata", "wb") as f:
        pickle.dump(Marker(marker), f)
    meta = {"format_version": 1, "strategy": strategy, "hparams": {}, "files": {}}
    (ckpt / cio.META_NAME).write_text(json.dumps(meta))
    return ckpt


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_pickled_dcp_metadata_runs_nothing(tmp_path, strategy):
    marker = tmp_path / "pwned"
    ckpt = _dcp_checkpoint(tmp_path, strategy, marker)
    with pytest.raises(CheckpointError, match="refusing"):
        LinearModule.load_from_checkpoint(str(ckpt))
    assert not marker.exists()


def test_real_dcp_folder_loads_through_the_allow_list_reader(tmp_path):
    import torch.distributed.checkpoint as dcp
    from ember.strategies.fsdp import load_full_weights
    m = LinearModule()
    ckpt = tmp_path / "ok"
    dcp.save({"model": m.state_dict()}, checkpoint_id=str(ckpt / cio.DCP_WEIGHTS_DIR), no_dist=True)
    (ckpt / cio.META_NAME).write_text(json.dumps({"format_version": 1, "strategy": "fsdp", "files": {}}))
    w = load_full_weights(str(ckpt))
    assert torch.equal(w["net.weight"], m.net.weight) and torch.equal(w["net.bias"], m.net.bias)


def _weights_checkpoint(root: Path, meta_extra=None) -> Path:
    ckpt = root / "ck"
    ckpt.mkdir()
    cio.save_safetensors(LinearModule().state_dict(), ckpt / cio.WEIGHTS_NAME)
    meta = {"format_version": 1, "strategy": "single", "hparams": {},
            "files": {cio.WEIGHTS_NAME: os.path.getsize(ckpt / cio.WEIGHTS_NAME)}}
    meta.update(meta_extra or {})
    (ckpt / cio.META_NAME).write_text(json.dumps(meta))
    return ckpt


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "a/../../outside.bin", "link.bin"])
def test_files_entries_outside_the_checkpoint_are_refused(tmp_path, name):
    (tmp_path / "outside.bin").write_bytes(b"x" * 7)
    ckpt = _weights_checkpoint(tmp_path)
    os.symlink(tmp_path / "outside.bin", ckpt / "link.bin")
    meta = json.loads((ckpt / cio.META_NAME).read_text())
    meta["files"][name] = 7
    (ckpt / cio.META_NAME).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="refusing checkpoint"):
        cio.read_checkpoint(ckpt)


def test_symlinked_weights_pointing_outside_are_refused(tmp_path):
    ckpt = _weights_checkpoint(tmp_path)
    os.replace(ckpt / cio.WEIGHTS_NAME, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", ckpt / cio.WEIGHTS_NAME)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        LinearModule.load_from_checkpoint(str(ckpt))


@pytest.mark.parametrize("kind", ["huge", "deep", "empty", "version", "files-list", "size-str"])
def test_meta_json_limits_and_shape(tmp_path, kind):
    ckpt = _weights_checkpoint(tmp_path)
    meta_file = ckpt / cio.META_NAME
    meta = json.loads(meta_file.read_text())
    if kind == "huge":
        meta["pad"] = "x" * (5 * 2**20)
    elif kind == "deep":
        meta_file.write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    elif kind == "empty":
        meta = {}
    elif kind == "version":
        meta["format_version"] = 99
    elif kind == "files-list":
        meta["files"] = [cio.WEIGHTS_NAME]
    elif kind == "size-str":
        meta["files"][cio.WEIGHTS_NAME] = str(meta["files"][cio.WEIGHTS_NAME])
    if kind != "deep":
        meta_file.write_text(json.dumps(meta))
    match = {"huge": "bytes, more than", "deep": "nests deeper", "empty": r"empty \(\{\}\)",
             "version": "format_version 99 .*upgrade ember", "files-list": "'files' is list",
             "size-str": "not a byte count"}[kind]
    with pytest.raises(CheckpointError, match=match):
        cio.read_checkpoint(ckpt)


def test_transformers_hparams_cannot_enable_remote_code(tmp_path):
    pytest.importorskip("transformers")
    from ember.integrations.transformers import TransformersModule
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "custom", "auto_map": {"AutoConfig": "evil.Config",
                                             "AutoModelForSequenceClassification": "evil.Model"}}))
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    for hp, match in (({"model": str(model_dir), "model_kwargs": {"trust_remote_code": True}}, "trust_remote_code"),
                      ({"model": str(model_dir)}, "auto_map"),
                      ({"model": "org/any-hub-repo", "model_kwargs": {"revision": "main"}}, "revision"),
                      ({"model_config": {"model_type": "bert", "auto_map": {}}}, "auto_map"),
                      ({"model": str(model_dir), "task": "os.system"}, "task")):
        ckpt = _weights_checkpoint(_fresh(tmp_path), {"hparams": hp})
        with pytest.raises(CheckpointError, match=match):
            TransformersModule.load_from_checkpoint(str(ckpt))
    assert not marker.exists()
    hp = TransformersModule.checkpoint_hparams({"lr": 1e-3, "local_files_only": False, "evil": 1}, "p")
    assert hp == {"lr": 1e-3, "local_files_only": True}


_n = [0]


def _fresh(tmp_path: Path) -> Path:
    _n[0] += 1
    d = tmp_path / f"c{_n[0]}"
    d.mkdir()
    return d


def test_cli_checks_class_paths_before_building_and_never_imports_from_the_config_folder(tmp_path, cli):
    marker = tmp_path / "pwned"
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    (downloaded / "helpers_next_to_config.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Cb: pass\n")
    base = {"model": {"class_path": "toy.ToyRegressor"}, "data": {"class_path": "toy.ToyData"}}
    popen = {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(marker)]}}
    for key, value in (("callbacks", [popen]), ("logger", popen), ("strategy", popen)):
        cfg = downloaded / f"{key}.yaml"
        cfg.write_text(json.dumps({**base, "trainer": {key: value}}))
        r = cli("fit", "--config", cfg)
        assert r.returncode == 2 and "is not a subclass of" in r.stderr, r.stderr
        assert not marker.exists()
    cfg = downloaded / "helpers.yaml"
    cfg.write_text(json.dumps({**base, "trainer": {"callbacks": [{"class_path": "helpers_next_to_config.Cb"}]}}))
    r = cli("fit", "--config", cfg, "--print_config")
    assert r.returncode == 2 and "No module named 'helpers_next_to_config'" in r.stderr, r.stderr
    assert not marker.exists() and str(downloaded) not in sys.path


def test_cli_class_path_in_an_untyped_argument_is_checked_before_building(tmp_path, cli):
    marker = tmp_path / "pwned"
    (tmp_path / "untyped_args_model.py").write_text(
        "from typing import Any\nfrom toy import ToyRegressor\n\n\nclass Wrapped(ToyRegressor):\n"
        "    def __init__(self, hidden: int, extra=None, anything: Any = None, **kw):\n"
        "        super().__init__(hidden)\n        self.extra = extra\n")
    popen = {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(marker)]}}
    base = {"data": {"class_path": "toy.ToyData"}}
    for key in ("extra", "anything", "via_kwargs"):
        cfg = tmp_path / f"{key}.yaml"
        model = {"class_path": "untyped_args_model.Wrapped", "init_args": {"hidden": 2, key: {"nested": [popen]}}}
        cfg.write_text(json.dumps({**base, "model": model}))
        r = cli("fit", "--config", cfg, "--trainer.max_epochs", "1")
        assert r.returncode == 2, r.stderr
        assert f"model.init_args.{key}.nested[0].class_path: 'subprocess.Popen' is given for an argument without " \
               "a type, where ember builds only subclasses of Module, Dataset, Callback" in r.stderr, r.stderr
        assert not marker.exists()
    linear = {"class_path": "torch.nn.Linear", "init_args": {"in_features": 2, "out_features": 1}}
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(json.dumps({**base, "model": {"class_path": "untyped_args_model.Wrapped",
                                                 "init_args": {"hidden": 2, "extra": linear}}}))
    r = cli("fit", "--config", cfg, "--print_config")
    assert r.returncode == 0 and "torch.nn.modules.linear.Linear" in r.stdout, r.stderr
    # a wrong type for a typed argument of a class given by class_path: one line, no traceback
    cfg.write_text(json.dumps({**base, "model": {"class_path": "toy.ToyRegressor", "init_args": {"hidden": 2}},
                               "trainer": {"logger": {"class_path": "CSVLogger", "init_args": {"save_dir": 5}}}}))
    r = cli("fit", "--config", cfg)
    assert r.returncode == 2 and "trainer.logger.init_args.save_dir: expected str | os.PathLike, got 5" in r.stderr
    assert "Traceback" not in r.stderr
