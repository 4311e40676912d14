"""Checkpoint files: atomic writes, safetensors round trips, safe loading, sharded export, RNG."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from ember.checkpoint import io as cio
from ember.errors import CheckpointError, MisconfigurationError


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight


def _assert_same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# -- safetensors ------------------------------------------------------------------------
def test_safetensors_roundtrip_tied_views_and_dtypes(tmp_path):
    base = torch.randn(8, 5)
    sd = {
        "tied_a": base,
        "tied_b": base,                      # same tensor twice: stored once, alias restored
        "transposed": torch.randn(4, 7).t(),  # non-contiguous
        "row_slice": base[2:4],              # overlaps tied_a: must be copied, not aliased
        "every_other": torch.arange(20.0)[::2],
        "bf16": torch.randn(3, 3).to(torch.bfloat16),
        "fp16": torch.randn(3).half(),
        "fp64": torch.randn(2, 2, dtype=torch.float64),
        "int64": torch.arange(5),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "param": nn.Parameter(torch.ones(2, 2)),
    }
    path = tmp_path / "w.safetensors"
    cio.save_safetensors(sd, path, metadata={"note": "hello", "n": 3})
    md = cio.read_safetensors_metadata(path)
    assert md["note"] == "hello" and md["n"] == "3" and md["format"] == "pt"
    assert json.loads(md[cio.ALIAS_KEY]) == {"tied_b": "tied_a"}
    out = cio.load_safetensors(path)
    expected = {k: v.detach().contiguous() for k, v in sd.items()}
    _assert_same(out, expected)
    assert out["tied_a"] is out["tied_b"]
    assert out["row_slice"].data_ptr() != out["tied_a"].data_ptr()
    assert not out["param"].requires_grad
    # the stored file holds one copy of the tied tensor only
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert "tied_b" not in set(f.keys()) and "tied_a" in set(f.keys())


def test_tied_module_round_trip_restores_tying(tmp_path):
    m = Tied()
    cio.write_checkpoint(tmp_path / "c", m.state_dict(), None, {})
    weights, state, meta = cio.read_checkpoint(tmp_path / "c")
    assert state is None and meta["files"] == {"model.safetensors": os.path.getsize(tmp_path / "c" / "model.safetensors")}
    m2 = Tied()
    cio.check_compatible(m2, weights, tmp_path / "c")
    m2.load_state_dict(weights)
    _assert_same(m2.state_dict(), m.state_dict())
    assert m2.head.weight is m2.emb.weight


def test_save_weights_file_is_atomic_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "model.safetensors"
    cio.save_weights_file(path, {"a": torch.ones(3)})
    cio.save_weights_file(path, {"a": torch.full((3,), 2.0)})
    assert os.listdir(tmp_path / "sub") == ["model.safetensors"]
    assert torch.equal(cio.load_safetensors(path)["a"], torch.full((3,), 2.0))
    with pytest.raises(CheckpointError, match="not a tensor"):
        cio.save_weights_file(path, {"a": torch.ones(3), "bad": [1, 2]})
    assert os.listdir(tmp_path / "sub") == ["model.safetensors"]
    assert torch.equal(cio.load_safetensors(path)["a"], torch.full((3,), 2.0))


# -- full checkpoints ------------------------------------------------------------------------
def _trained_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_write_read_checkpoint_round_trip(tmp_path):
    model, opt, sched = _trained_state()
    state = {"optimizers": [opt.state_dict()], "schedulers": [sched.state_dict()],
             "loop": {"epoch": 2, "global_step": 3, "np_value": np.float64(0.25)},
             "best": np.array([1.5, 2.5]), "dirpath": tmp_path, "rng": cio.collect_rng_states()}
    path = cio.write_checkpoint(tmp_path / "epoch=0-step=3", model.state_dict(), state,
                                {"strategy": "single", "hparams": {"lr": 0.01, "dims": (4, 8)}})
    assert sorted(os.listdir(path)) == ["meta.json", "model.safetensors", "trainer_state.pt"]
    weights, loaded, meta = cio.read_checkpoint(path)
    _assert_same(weights, model.state_dict())
    assert meta["strategy"] == "single" and meta["hparams"] == {"lr": 0.01, "dims": [4, 8]}
    assert meta["torch_version"] == torch.__version__ and meta["ember_version"] and meta["created"]
    assert loaded["loop"] == {"epoch": 2, "global_step": 3, "np_value": 0.25}
    assert torch.equal(loaded["best"], torch.tensor([1.5, 2.5], dtype=torch.float64))
    assert loaded["dirpath"] == str(tmp_path)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt2.load_state_dict(loaded["optimizers"][0])
    for p in model.parameters():
        assert torch.equal(opt2.state[p]["exp_avg"], opt.state[p]["exp_avg"])
        assert torch.equal(opt2.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert loaded["schedulers"][0] == sched.state_dict()
    w, s, _ = cio.read_checkpoint(path, load_state=False)
    assert s is None and set(w) == set(weights)


def test_unsafe_state_is_refused_at_save_time_and_old_checkpoint_survives(tmp_path):
    path = tmp_path / "last"
    cio.write_checkpoint(path, {"w": torch.ones(2)}, {"step": 1}, {"step": 1})
    with pytest.raises(CheckpointError, match=r"state\['callbacks'\]\['cb'\]\['fn'\].*function"):
        cio.write_checkpoint(path, {"w": torch.zeros(2)}, {"callbacks": {"cb": {"fn": print}}}, {"step": 2})
    assert sorted(os.listdir(tmp_path)) == ["last"]
    w, s, meta = cio.read_checkpoint(path)
    assert torch.equal(w["w"], torch.ones(2)) and s == {"step": 1} and meta["step"] == 1


# -- atomicity ------------------------------------------------------------------------------
def test_exception_inside_atomic_directory_leaves_nothing(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with cio.atomic_directory(tmp_path / "ckpt") as tmp:
            assert tmp == str(tmp_path / "ckpt.ember-tmp")
            cio.save_safetensors({"a": torch.ones(2)}, os.path.join(tmp, "model.safetensors"))
            1 / 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-fallback"])
def test_replacing_a_checkpoint_keeps_a_complete_one(tmp_path, monkeypatch, exchange):
    if not exchange:  # the code path taken where renameat2 is unavailable (macOS, Windows, NFS)
        monkeypatch.setattr(cio, "_exchange", lambda a, b: False)
    path = tmp_path / "last"
    cio.write_checkpoint(path, {"w": torch.ones(3)}, {"step": 1}, {"step": 1})
    with pytest.raises(RuntimeError, match="boom"):
        with cio.atomic_directory(path) as tmp:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                f.write("{}")
            raise RuntimeError("boom")
    assert torch.equal(cio.read_checkpoint(path)[0]["w"], torch.ones(3))
    cio.write_checkpoint(path, {"w": torch.full((3,), 2.0)}, {"step": 2}, {"step": 2})
    w, s, meta = cio.read_checkpoint(path)
    assert torch.equal(w["w"], torch.full((3,), 2.0)) and s == {"step": 2} and meta["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last"]


def test_stale_tmp_and_old_dirs_are_ignored_and_cleaned(tmp_path):
    good = cio.write_checkpoint(tmp_path / "epoch=0-step=10", {"w": torch.ones(2)}, {"s": 1}, {})
    # a crash in the middle of writing "epoch=1-step=20" left its staging dir, and a
    # crash during a replacement left a complete previous version under .old-<hex>
    stale = tmp_path / "epoch=1-step=20.ember-tmp"
    stale.mkdir()
    (stale / cio.STAGING_MARKER).touch()      # every staging folder ember makes starts with it
    (stale / "model.safetensors").write_bytes(b"\x00" * 10)
    old = tmp_path / "epoch=0-step=10.old-0123abcd"
    cio.write_checkpoint(old, {"w": torch.zeros(2)}, {"s": 0}, {})
    assert os.path.isfile(old / "meta.json")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "half").mkdir()  # a directory without meta.json
    assert cio.list_checkpoints(tmp_path) == [good]
    assert cio.resolve_last(tmp_path) == good
    with pytest.raises(CheckpointError, match="incomplete.*staging directory"):
        cio.read_checkpoint(stale)
    with pytest.raises(CheckpointError, match="half is incomplete.*no meta.json"):
        cio.read_checkpoint(tmp_path / "half")
    new = cio.write_checkpoint(tmp_path / "epoch=1-step=20", {"w": torch.ones(2)}, {"s": 2}, {})
    assert not stale.exists()
    assert cio.read_checkpoint(new)[1] == {"s": 2}
    assert cio.list_checkpoints(tmp_path)[-1] == new


def test_list_checkpoints_orders_by_time(tmp_path):
    assert cio.list_checkpoints(tmp_path / "missing") == [] and cio.resolve_last(tmp_path) is None
    paths = [cio.write_checkpoint(tmp_path / n, {"w": torch.ones(1)}, None, {}) for n in ("b", "c", "a")]
    for i, p in enumerate(paths):
        os.utime(os.path.join(p, "meta.json"), ns=(10**18 + i * 10**9,) * 2)
    assert cio.list_checkpoints(tmp_path) == paths
    assert cio.resolve_last(tmp_path) == paths[-1]


_CHILD = textwrap.dedent("""
    import sys, torch
    from ember.checkpoint import io as cio
    root, start = sys.argv[1], int(sys.argv[2])
    i = start
    while True:
        w = {"w": torch.full((128, 128), float(i)), "tied": None}
        w["tied"] = w["w"]
        cio.write_checkpoint(f"{root}/ckpt-{start}-{i % 3}", w,
                             {"step": i, "exp_avg": torch.full((64, 64), float(i))}, {"step": i})
        if i == start:
            print("ready", flush=True)
        i += 1
""")


@pytest.mark.multiproc
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_during_saves_never_leaves_a_broken_checkpoint(tmp_path):
    rng = random.Random(1234)
    root = tmp_path / "ckpts"
    root.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    start = 0
    for _ in range(3):
        child = subprocess.Popen([sys.executable, str(script), str(root), str(start)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.4))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        start += 1000
    found = cio.list_checkpoints(root)
    assert found, os.listdir(root)
    for path in found:
        weights, state, meta = cio.read_checkpoint(path)
        step = meta["step"]
        # every file of one checkpoint comes from the same save
        assert state["step"] == step
        assert torch.equal(weights["w"], torch.full((128, 128), float(step)))
        assert weights["tied"] is weights["w"]
        assert torch.equal(state["exp_avg"], torch.full((64, 64), float(step)))


# -- safe loading -------------------------------------------------------------------------------
class _Exploit:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_pickled_code_in_trainer_state_is_refused_without_running_it(tmp_path):
    # control: an unrestricted torch.load of such a file does run the command
    control = tmp_path / "control"
    torch.save({"x": _Exploit(control)}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    cio.save_safetensors({"w": torch.ones(2)}, ckpt / "model.safetensors")
    torch.save({"step": 1, "payload": _Exploit(marker)}, ckpt / "trainer_state.pt")
    (ckpt / "meta.json").write_text('{"format_version": 1, "files": {}}')
    with pytest.raises(CheckpointError, match=r"refusing to load .*trainer_state\.pt.*not plain tensors/containers"):
        cio.read_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="refusing.*system"):
        cio.load_torch(ckpt / "trainer_state.pt")
    assert not marker.exists()
    # the weights can still be taken without the state
    w, s, _ = cio.read_checkpoint(ckpt, load_state=False)
    assert s is None and torch.equal(w["w"], torch.ones(2))


@pytest.mark.parametrize("fraction", [0.0, 0.003, 0.5, 0.98])
def test_truncated_files_raise_checkpoint_error(tmp_path, fraction):
    model, opt, _ = _trained_state()
    path = cio.write_checkpoint(tmp_path / "c", model.state_dict(), {"opt": opt.state_dict()}, {})
    for name in ("model.safetensors", "trainer_state.pt"):
        f = os.path.join(path, name)
        data = open(f, "rb").read()
        open(f, "wb").write(data[: int(len(data) * fraction)])
        with pytest.raises(CheckpointError, match=f"{name}.* truncated or corrupt"):
            cio.read_checkpoint(path)
        # without the size record in meta.json the loaders themselves notice
        loader = cio.load_safetensors if name.endswith("safetensors") else cio.load_torch
        with pytest.raises(CheckpointError, match=f"{name} is truncated or corrupt"):
            loader(f)
        open(f, "wb").write(data)
    cio.read_checkpoint(path)


def test_corrupt_meta_json(tmp_path):
    path = cio.write_checkpoint(tmp_path / "c", {"w": torch.ones(1)}, None, {})
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write('{"files": {"model.safe')
    with pytest.raises(CheckpointError, match="meta.json is truncated or corrupt"):
        cio.read_checkpoint(path)


def test_missing_path_names_nearby_checkpoints(tmp_path):
    cio.write_checkpoint(tmp_path / "epoch=0-step=5", {"w": torch.ones(1)}, None, {})
    cio.write_checkpoint(tmp_path / "epoch=1-step=10", {"w": torch.ones(1)}, None, {})
    with pytest.raises(CheckpointError) as e:
        cio.read_checkpoint(tmp_path / "epoch=2-step=15")
    msg = str(e.value)
    assert "not found" in msg and "epoch=0-step=5" in msg and "epoch=1-step=10" in msg
    with pytest.raises(CheckpointError, match="no complete checkpoints"):
        cio.read_checkpoint(tmp_path / "epoch=0-step=5" / "nested")
    with pytest.raises(CheckpointError, match="does not exist either"):
        cio.read_checkpoint(tmp_path / "nowhere" / "ckpt")
    with pytest.raises(CheckpointError, match="is a file; an ember checkpoint is a directory"):
        (tmp_path / "x.ckpt").write_bytes(b"abc")
        cio.read_checkpoint(tmp_path / "x.ckpt")


def test_safetensors_file_reads_as_weights_only_checkpoint(tmp_path):
    m = Tied()
    cio.save_weights_file(tmp_path / "m.safetensors", m.state_dict())
    w, s, meta = cio.read_checkpoint(tmp_path / "m.safetensors")
    assert s is None and meta == {}
    _assert_same(w, m.state_dict())


def test_dcp_model_folder_yields_weights_none(tmp_path):
    path = tmp_path / "sharded"
    tmp = cio.tmp_path(path)
    os.makedirs(os.path.join(tmp, "model"))  # what the ranks' DCP save writes
    with open(os.path.join(tmp, "model", "__0_0.distcp"), "wb") as f:
        f.write(b"shard")
    cio.write_checkpoint(path, None, {"step": 4}, {"strategy": "fsdp"}, keep_existing_tmp=True)
    w, s, meta = cio.read_checkpoint(path)
    assert w is None and s == {"step": 4} and meta["strategy"] == "fsdp"
    assert os.path.isfile(path / "model" / "__0_0.distcp")
    cio.check_compatible(nn.Linear(2, 2), None, path)  # no-op
    with pytest.raises(CheckpointError, match="weights=None but no model/ folder"):
        cio.write_checkpoint(tmp_path / "other", None, {"step": 4}, {})
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.ember-tmp").exists()


# -- compatibility ------------------------------------------------------------------------------
def test_check_compatible_lists_missing_unexpected_and_shapes(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cio.check_compatible(model, weights, "ok")
    del weights["1.bias"]
    weights["2.weight"] = torch.zeros(1)
    weights["0.weight"] = torch.zeros(5, 4)
    with pytest.raises(CheckpointError) as e:
        cio.check_compatible(model, weights, tmp_path / "ck")
    msg = str(e.value)
    assert str(tmp_path / "ck") in msg and "Sequential" in msg
    assert "missing keys (1): 1.bias" in msg
    assert "unexpected keys (1): 2.weight" in msg
    assert "shape mismatches (1): 0.weight: checkpoint (5, 4) vs model (3, 4)" in msg
    with pytest.raises(CheckpointError, match="shape mismatches") as e:
        cio.check_compatible(model, weights, "p", strict=False)
    assert "missing" not in str(e.value)


def test_check_compatible_truncates_long_lists_and_hints_prefix():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(15)])
    weights = {f"module.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        cio.check_compatible(model, weights, "p")
    msg = str(e.value)
    assert "missing keys (30): " in msg and "... and 20 more" in msg
    assert "'module.' prefix" in msg
    assert len(msg) < 2000


# -- sharded export -------------------------------------------------------------------------------
def test_sharded_save_and_load(tmp_path):
    torch.manual_seed(0)
    m = Tied()
    extra = nn.Linear(40, 40)
    sd = dict(m.state_dict(), **{f"extra.{k}": v for k, v in extra.state_dict().items()})
    files = cio.save_model_sharded(sd, tmp_path, max_shard_size=2000, metadata={"source": "test"})
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    stored = {k: v for k, v in sd.items() if k != "head.weight"}
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in stored.values())
    loaded = cio.load_model_sharded(tmp_path)
    _assert_same(loaded, sd)
    assert loaded["head.weight"] is loaded["emb.weight"]
    w, s, meta = cio.read_checkpoint(tmp_path)  # a sharded export reads as weights only
    assert s is None and meta == {} and set(w) == set(sd)
    # re-exporting into one file removes the stale shards and index
    assert cio.save_model_sharded(sd, tmp_path, max_shard_size="1GB") == ["model.safetensors"]
    assert os.listdir(tmp_path) == ["model.safetensors"]
    _assert_same(cio.load_model_sharded(tmp_path), sd)


def test_sharding_needs_huggingface_hub_and_one_file_does_not(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # not installed
    sd = {"a": torch.zeros(100), "b": torch.zeros(100)}
    assert cio.save_model_sharded(sd, tmp_path, max_shard_size="1MB") == ["model.safetensors"]
    with pytest.raises(ModuleNotFoundError, match=r"max_shard_size=500.*huggingface_hub.*pip install"):
        cio.save_model_sharded(sd, tmp_path, max_shard_size=500)


def test_parse_size():
    assert cio.parse_size("500MB") == 500 * 10**6
    assert cio.parse_size("2GB") == 2 * 10**9
    assert cio.parse_size("1GiB") == 2**30
    assert cio.parse_size("1.5kb") == 1500
    assert cio.parse_size(123) == 123
    for bad in ("lots", "0MB", -5, "5 parsecs"):
        with pytest.raises(MisconfigurationError, match="max_shard_size"):
            cio.parse_size(bad)


# -- RNG ---------------------------------------------------------------------------------------
def _draw():
    return (random.random(), random.randint(0, 10**9), np.random.rand(3).tolist(),
            np.random.randn(), torch.rand(4).tolist(), torch.randint(0, 100, (3,)).tolist())


def test_rng_states_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = cio.collect_rng_states()
    first = _draw()
    assert _draw() != first  # the streams do advance
    cio.restore_rng_states(state)
    assert _draw() == first
    cio.save_torch({"rng": state}, tmp_path / "rng.pt")
    loaded = cio.load_torch(tmp_path / "rng.pt")["rng"]
    _draw()
    cio.restore_rng_states(loaded)
    assert _draw() == first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_and_generators(tmp_path):
    w = torch.randn(4, 4, device="cuda")
    cio.save_safetensors({"a": w, "b": w, "t": w.t()}, tmp_path / "w.safetensors")
    out = cio.load_safetensors(tmp_path / "w.safetensors")
    assert out["a"].device.type == "cpu" and out["a"] is out["b"]
    assert torch.equal(out["t"], w.t().cpu())
    assert cio.load_safetensors(tmp_path / "w.safetensors", device="cuda:0")["a"].is_cuda
    torch.cuda.manual_seed_all(5)
    torch.rand(1, device="cuda")
    state = cio.collect_rng_states()
    assert "cuda" in state
    first = torch.rand(3, device="cuda").tolist()
    cio.save_torch(state, tmp_path / "rng.pt")
    cio.restore_rng_states(cio.load_torch(tmp_path / "rng.pt"))
    assert torch.rand(3, device="cuda").tolist() == first


def test_fsync_reaches_every_file_and_folder(tmp_path, monkeypatch):
    # the suite runs with EMBER_CHECKPOINT_FSYNC=0 (tests/conftest.py); the default is on
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        real_fsync(fd)
    monkeypatch.setattr(cio, "FSYNC", True)
    monkeypatch.setattr(os, "fsync", fsync)
    path = cio.write_checkpoint(tmp_path / "ck", {"w": torch.ones(3)}, {"loop": {}}, {"strategy": "single"})
    if not os.path.exists("/proc/self/fd"):
        assert synced
        return
    files = {os.path.join(path, n) for n in os.listdir(path)}
    tmp = cio.tmp_path(path)
    written = {p.replace(tmp, path) for p in synced}
    assert files <= written, files - written          # every file, synced before the rename
    assert str(tmp_path) in written                   # the parent folder, after the rename


def test_replace_file_leaves_the_old_file_and_no_temporary_when_the_write_fails(tmp_path):
    """The one single-file writer (weights files, the copied ``last``, predictions, the
    report page): a write that fails midway leaves the old file whole and nothing else."""
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")

    def half(tmp):
        with open(tmp, "wb") as f:
            f.write(b"new, half writ")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space"):
        cio.replace_file(path, half)
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["out.bin"]
    cio.replace_file(path, lambda tmp: open(tmp, "wb").write(b"new"))
    assert path.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["out.bin"]
