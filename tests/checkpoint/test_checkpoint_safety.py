"""Saving never destroys data, two runs never share a checkpoint folder, and
ckpt_path="last" resumes this run's newest checkpoint (issue: checkpoints you can trust)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

import ember
from conftest import LinearModule, regression_data, reseal
from ember.checkpoint import trust as checks
from ember.checkpoint import io as cio
from ember.callbacks import ModelCheckpoint
from ember.errors import CheckpointError, MisconfigurationError
from helpers import ROOT


def make(root, callbacks=(), max_epochs=2, **kw):
    args = dict(max_epochs=max_epochs, default_root_dir=root, logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kw)
    return ember.Trainer(callbacks=list(callbacks), **args)


def loader(n=32, bs=8, **kw):
    return DataLoader(regression_data(n), batch_size=bs, **kw)


def snapshot(root):
    out = {}
    for dp, dirs, files in os.walk(root):
        for f in files + dirs:
            p = os.path.join(dp, f)
            out[os.path.relpath(p, root)] = os.lstat(p).st_size if os.path.isfile(p) else -1
    return out


# -- 6: saving over something that is not a checkpoint ------------------------------------------
@pytest.mark.parametrize("target", ["logs", "file", "tmp"])
def test_save_checkpoint_refuses_to_replace_what_is_not_a_checkpoint(tmp_path, target):
    t = make(tmp_path, enable_checkpointing=False, max_epochs=1)
    t.fit(LinearModule(), loader())
    dest = tmp_path / "dest"
    if target == "logs":
        (dest / "version_0").mkdir(parents=True)
        (dest / "version_0" / "events.out").write_text("precious")
    elif target == "file":
        dest.write_text("precious")
    else:
        (tmp_path / "dest.ember-tmp").mkdir()          # ember's staging name, not made by ember
        (tmp_path / "dest.ember-tmp" / "notes.txt").write_text("precious")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to"):
        t.save_checkpoint(str(dest))
    assert snapshot(tmp_path) == before
    if target != "tmp":   # an ember checkpoint (or an empty folder) can be replaced
        return
    t.save_checkpoint(str(tmp_path / "ok"))
    t.save_checkpoint(str(tmp_path / "ok"))
    assert cio.is_checkpoint(tmp_path / "ok")


def test_accelerator_save_state_refuses_a_non_checkpoint_folder(tmp_path):
    from ember import Accelerator
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(2, 1))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("a,b\n")
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="not an ember checkpoint"):
        acc.save_state(str(tmp_path / "data"))
    assert snapshot(tmp_path) == before and model is not None


# -- 7: reserved names ---------------------------------------------------------------------
@pytest.mark.parametrize("filename", ["last", "{epoch}.tmp", "{epoch}.ember-tmp", "x.old-1a"])
def test_reserved_checkpoint_names(filename):
    with pytest.raises(MisconfigurationError, match="reserved"):
        ModelCheckpoint(filename=filename, save_last=True)


# -- 8: one run per checkpoint folder --------------------------------------------------------
_HOLDER = """
import sys, time
from ember.checkpoint.lock import DirLock
lock = DirLock(sys.argv[1]); lock.acquire()
print("locked", flush=True)
sys.stdin.readline()
"""


def test_two_trainers_on_one_dirpath_get_a_clear_error_and_a_dead_owner_is_taken_over(tmp_path):
    ckdir = tmp_path / "ckpts"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    other = subprocess.Popen([sys.executable, "-c", _HOLDER, str(ckdir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline().strip() == "locked"
        t = make(tmp_path, [ModelCheckpoint(dirpath=str(ckdir))])
        with pytest.raises(CheckpointError, match=rf"in use by another run \(process {other.pid}"):
            t.fit(LinearModule(), loader())
        assert t.global_step == 0 and not [n for n in os.listdir(ckdir) if not n.startswith(".")]
    finally:
        other.kill()
        other.wait()
    t = make(tmp_path, [ModelCheckpoint(dirpath=str(ckdir))])   # the owner died: its lock is stale
    t.fit(LinearModule(), loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=1-step=8"]     # the lock is released at the end


def test_unwritable_dirpath_is_reported_at_setup(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        dirpath = blocker / "ckpts"        # a path under a file: never writable, even for root
    else:
        dirpath = tmp_path / "ro"
        dirpath.mkdir(mode=0o500)
    counted = []

    class Count(ember.callbacks.Callback):
        def on_train_batch_start(self, *a):
            counted.append(1)
    t = make(tmp_path, [Count(), ModelCheckpoint(dirpath=str(dirpath))])
    with pytest.raises(CheckpointError, match="cannot write checkpoints to"):
        t.fit(LinearModule(), loader())
    assert not counted


# -- 9: ckpt_path="last" is this run's newest checkpoint by global_step ----------------------------
def _run(root, name, epochs, lr=0.1, ckpt_path=None):
    from ember.loggers import CSVLogger
    t = ember.Trainer(max_epochs=epochs, default_root_dir=root, logger=CSVLogger(root, name=name),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[ModelCheckpoint(save_top_k=-1)])
    t.fit(LinearModule(lr=lr), loader(), ckpt_path=ckpt_path)
    return t


def test_last_resumes_this_runs_newest_by_step_not_another_run_or_mtime(tmp_path, capsys):
    _run(tmp_path, "a", 2)                     # a: steps 4, 8
    _run(tmp_path, "b", 1)                     # b: step 4, written later
    ck_a = tmp_path / "a" / "version_0" / "checkpoints"
    now = time.time()
    for i, name in enumerate(sorted(os.listdir(ck_a))):   # scramble: the older checkpoint looks newest
        os.utime(ck_a / name / cio.META_NAME, (now + 100 - 50 * i, now + 100 - 50 * i))
    t = _run(tmp_path, "b", 2, ckpt_path="last")
    assert t.ckpt_path == str(tmp_path / "b" / "version_0" / "checkpoints" / "epoch=0-step=4")
    t = _run(tmp_path, "a", 3, ckpt_path="last")
    assert t.ckpt_path == str(ck_a / "epoch=1-step=8") and t.global_step == 12
    assert "ckpt_path='last' resumes" in capsys.readouterr().err


# -- 10: compatibility before anything is loaded -----------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    t = make(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "ck"))], max_epochs=1)
    t.fit(AdamModule(), loader())
    return tmp_path / "ck" / "epoch=0-step=4"


class AdamModule(LinearModule):
    def __init__(self, opt: str = "AdamW", **kw):
        super().__init__(**kw)
        self.opt = opt

    def configure_optimizers(self):
        return getattr(torch.optim, self.opt)(self.parameters(), lr=0.01)


def _meta(ckpt, **changes):
    meta = json.loads((ckpt / cio.META_NAME).read_text())
    meta.update(changes)
    (ckpt / cio.META_NAME).write_text(json.dumps(meta))


@pytest.mark.parametrize("opt", ["SGD", "Adam"])
def test_optimizer_class_mismatch_is_refused_before_loading(saved, opt):
    module = AdamModule(opt=opt)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"AdamW.*{opt}"):
        make(saved.parent.parent, max_epochs=3, enable_checkpointing=False).fit(module, loader(), ckpt_path=str(saved))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())   # nothing loaded


def test_dtype_change_in_safetensors_header_is_refused(saved):
    wfile = saved / cio.WEIGHTS_NAME
    raw = wfile.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'"F32"', b'"I32"')
    wfile.write_bytes(raw[:8] + header + raw[8 + n:])
    reseal(saved)   # a consistent checkpoint whose header lies about the dtype
    with pytest.raises(CheckpointError, match="dtype mismatches"):
        AdamModule.load_from_checkpoint(str(saved))


def test_versions_newer_ember_and_other_torch_are_warned(saved):
    _meta(saved, ember_version="99.0.0", torch_version="1.0.0")
    with pytest.warns(UserWarning, match="newer than this ember") as rec:
        AdamModule.load_from_checkpoint(str(saved))
    assert any("torch 1.0.0" in str(w.message) for w in rec)


# -- 12: corruption and a full disk --------------------------------------------------------------
def test_disk_full_while_writing_names_the_path_and_keeps_older_checkpoints(tmp_path, monkeypatch):
    import errno
    t = make(tmp_path, enable_checkpointing=False, max_epochs=1)
    t.fit(LinearModule(), loader())
    t.save_checkpoint(str(tmp_path / "good"))
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):   # what the kernel answers when the disk fills mid-write
        real_save(obj, f, *a, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"the disk is full: writing checkpoint .*new"):
        t.save_checkpoint(str(tmp_path / "new"))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["good"] and cio.is_checkpoint(tmp_path / "good")


def test_corrupt_rng_state_and_one_file_mode(saved):
    modes = {oct(os.stat(saved / n).st_mode & 0o777) for n in os.listdir(saved)}
    assert len(modes) == 1, modes
    sfile = saved / cio.STATE_NAME
    state = torch.load(sfile, weights_only=True)
    state["rng"][0]["python"] = (3, [1, 2], None)
    torch.save(state, sfile)
    reseal(saved)
    with pytest.raises(CheckpointError, match="RNG state is corrupt"):
        make(saved.parent.parent, max_epochs=3, enable_checkpointing=False).fit(AdamModule(), loader(),
                                                                               ckpt_path=str(saved))


def test_swapped_same_size_trainer_state_is_refused_by_its_digest(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    t = make(tmp_path, max_epochs=1, enable_checkpointing=False)
    t.fit(LinearModule(), loader())
    t.save_checkpoint(str(first))
    t = make(tmp_path, max_epochs=2, enable_checkpointing=False)
    t.fit(LinearModule(), loader(), ckpt_path=str(first))
    t.save_checkpoint(str(second))
    assert os.path.getsize(first / cio.STATE_NAME) == os.path.getsize(second / cio.STATE_NAME)
    meta = json.loads((second / cio.META_NAME).read_text())
    assert set(meta["digests"]) == {cio.WEIGHTS_NAME, cio.STATE_NAME}
    assert all(v.split(":")[0] in ("xxh3_128", "sha256") for v in meta["digests"].values())
    (second / cio.STATE_NAME).write_bytes((first / cio.STATE_NAME).read_bytes())   # same run, same size
    with pytest.raises(CheckpointError, match=rf"{cio.STATE_NAME} does not hold the content.*recorded"):
        make(tmp_path, max_epochs=3, enable_checkpointing=False).fit(LinearModule(), loader(),
                                                                      ckpt_path=str(second))
    raw = bytearray((first / cio.WEIGHTS_NAME).read_bytes())   # one flipped bit in the weights
    raw[-1] ^= 1
    (first / cio.WEIGHTS_NAME).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"{cio.WEIGHTS_NAME} does not hold the content"):
        LinearModule.load_from_checkpoint(str(first))


def test_checkpoints_without_digests_still_load_and_bad_digest_entries_are_named(tmp_path):
    t = make(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "ck"))], max_epochs=1)
    t.fit(LinearModule(), loader())
    ckpt = tmp_path / "ck" / "epoch=0-step=4"
    meta = json.loads((ckpt / cio.META_NAME).read_text())
    old = {k: v for k, v in meta.items() if k != "digests"}   # as written before digests were recorded
    (ckpt / cio.META_NAME).write_text(json.dumps(old))
    t2 = make(tmp_path, max_epochs=2, enable_checkpointing=False)
    t2.fit(LinearModule(), loader(), ckpt_path=str(ckpt))
    assert t2.global_step == 8
    # sha256 digests (what ember records where xxhash is not installed) are verified too
    sha = {n: checks.file_digest(ckpt / n, "sha256") for n in meta["digests"]}
    (ckpt / cio.META_NAME).write_text(json.dumps(dict(old, digests=sha)))
    cio.read_checkpoint(ckpt)
    sha[cio.STATE_NAME] = "sha256:" + "0" * 64
    (ckpt / cio.META_NAME).write_text(json.dumps(dict(old, digests=sha)))
    with pytest.raises(CheckpointError, match=r"trainer_state.pt does not hold the content .*\(sha256 "):
        cio.read_checkpoint(ckpt)
    for bad, match in (([1], "'digests' is list"), ({cio.STATE_NAME: "md5:00"}, "digest recorded for"),
                       ({"../x": "sha256:" + "0" * 64}, "leaves the checkpoint")):
        (ckpt / cio.META_NAME).write_text(json.dumps(dict(old, digests=bad)))
        with pytest.raises(CheckpointError, match=match):
            cio.read_checkpoint(ckpt)


def test_xxh3_digests_where_xxhash_is_missing_are_warned_and_sizes_still_checked(tmp_path, monkeypatch):
    pytest.importorskip("xxhash")
    t = make(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "ck"))], max_epochs=1)
    t.fit(LinearModule(), loader())
    ckpt = tmp_path / "ck" / "epoch=0-step=4"
    assert json.loads((ckpt / cio.META_NAME).read_text())["digests"][cio.STATE_NAME].startswith("xxh3_128:")
    monkeypatch.setattr(checks, "digest_algorithm", lambda: "sha256")   # as without the package
    checks._verified.clear()
    with pytest.warns(UserWarning, match="xxh3_128, which needs the xxhash package.*sizes checked only"):
        cio.read_checkpoint(ckpt)
    with open(ckpt / cio.STATE_NAME, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        cio.read_checkpoint(ckpt)


def test_accelerator_load_state_refuses_symlinked_model_files_and_checks_their_digests(tmp_path):
    def build():
        acc = ember.Accelerator(cpu=True)
        torch.manual_seed(0)
        return acc, acc.prepare(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    acc, (_m0, m1) = build()
    path = tmp_path / "state"
    acc.save_state(str(path))
    meta = json.loads((path / cio.META_NAME).read_text())
    assert "model_1.safetensors" in meta["digests"] and "model_1.safetensors" in meta["files"]
    outside = tmp_path / "outside.safetensors"
    os.replace(path / "model_1.safetensors", outside)
    os.symlink(outside, path / "model_1.safetensors")
    with torch.no_grad():
        m1.weight.add_(1)
    before = m1.weight.detach().clone()
    acc2, (_n0, n1) = build()
    with torch.no_grad():
        n1.weight.add_(1)
    with pytest.raises(CheckpointError, match="model_1.safetensors.*outside the checkpoint"):
        acc2.load_state(str(path))
    assert torch.equal(n1.weight, before)


# -- 13, 14: a run that trains nothing or on NaN ---------------------------------------------------
class NoneSteps(LinearModule):
    def training_step(self, batch, batch_idx):
        return None


def test_training_step_returning_none_on_every_batch_is_an_error_not_an_endless_loop(tmp_path):
    for kw in ({"max_steps": 10, "max_epochs": None}, {"max_epochs": 2}):
        t = make(tmp_path, enable_checkpointing=False, **kw)
        with pytest.raises(MisconfigurationError, match="epoch 0 made no optimizer step.*training_step returned None"):
            t.fit(NoneSteps(), loader())


class NanAfter(LinearModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step >= 2 else loss


def test_nan_loss_is_caught_at_epoch_end_and_before_a_save(tmp_path):
    from ember.errors import NonFiniteLossError
    t = make(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "ck"))], log_every_n_steps=50)
    with pytest.raises(NonFiniteLossError, match="not finite"):
        t.fit(NanAfter(), loader())
    assert not os.path.exists(tmp_path / "ck") or not cio.list_checkpoints(tmp_path / "ck")


@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_bad_seed_is_a_clear_error(seed):
    with pytest.raises(MisconfigurationError, match="seed=.* is not valid; use an integer"):
        ember.Trainer(seed=seed, logger=False, enable_progress_bar=False)


def test_numpy_scalar_can_be_logged(tmp_path):
    import numpy as np

    class M(LinearModule):
        def training_step(self, batch, batch_idx):
            self.log("np", np.float32(2.5) + batch_idx, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)
    t = make(tmp_path, enable_checkpointing=False, max_epochs=1)
    t.fit(M(), loader())
    assert float(t.callback_metrics["np"]) == pytest.approx(2.5 + 1.5)   # epoch mean of 2.5..5.5
