"""Lightning names ember offers under its own modules (ember.utilities, ...)."""
import logging
import os
import subprocess
import sys
import warnings

import pytest

from ember import utilities
from ember.utilities import (rank_zero_debug, rank_zero_info, rank_zero_only,
                             rank_zero_warn)


@pytest.fixture
def rank():
    old = rank_zero_only.rank
    yield
    rank_zero_only.rank = old


def test_rank_zero_only_runs_on_rank_zero_only(rank):
    calls = []

    @rank_zero_only
    def f(x):
        calls.append(x)
        return x * 2

    rank_zero_only.rank = 0
    assert f(3) == 6
    rank_zero_only.rank = 1
    assert f(4) is None
    assert calls == [3]
    assert rank_zero_only(lambda: 1, default=7)() == 7
    assert f.__name__ == "f"


@pytest.mark.parametrize("env,expected", [({"RANK": "3", "LOCAL_RANK": "1"}, 3),
                                          ({"LOCAL_RANK": "1"}, 1),
                                          ({"SLURM_PROCID": "2"}, 2), ({}, 0)])
def test_rank_read_from_environment(env, expected):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")}
    out = subprocess.run([sys.executable, "-c",
                          "from ember.utilities import rank_zero_only, rank_zero_warn\n"
                          "import warnings\nwarnings.simplefilter('always')\n"
                          "print(rank_zero_only.rank); rank_zero_warn('hello')"],
                         env={**clean, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)
    assert ("hello" in out.stderr) == (expected == 0)


def test_rank_zero_info_warn_debug(rank, caplog):
    rank_zero_only.rank = 0
    with caplog.at_level(logging.DEBUG, logger="ember.utilities"):
        rank_zero_info("info %d", 1)
        rank_zero_debug("dbg")
    assert [r.getMessage() for r in caplog.records] == ["info 1", "dbg"]
    with pytest.warns(UserWarning, match="careful"):
        rank_zero_warn("careful")
    rank_zero_only.rank = 1
    caplog.clear()
    with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.DEBUG, logger="ember.utilities"):
        warnings.simplefilter("always")
        rank_zero_warn("careful")
        rank_zero_info("info")
    assert w == [] and caplog.records == []
    assert utilities.rank_prefixed_message("m", 2) == "[rank: 2] m"


# ----------------------------------------------------------------------------- convert_lightning_checkpoint
import json  # noqa: E402
from collections import OrderedDict  # noqa: E402

import torch  # noqa: E402

from ember.errors import CheckpointError  # noqa: E402
from ember.utils import convert_lightning_checkpoint  # noqa: E402
from conftest import LinearModule  # noqa: E402


def _lightning_ckpt(module, **extra):
    """The dict Lightning's Trainer.save_checkpoint writes (2.x layout)."""
    return {"epoch": 4, "global_step": 120, "pytorch-lightning_version": "2.6.0",
            "state_dict": OrderedDict(module.state_dict()),
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"completed": 4}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5)}},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
            "lr_schedulers": [], "hparams_name": "kwargs",
            "hyper_parameters": {"dim": 3, "lr": 0.25}, **extra}


def test_convert_lightning_checkpoint_loads_into_module(tmp_path):
    torch.manual_seed(0)
    src = LinearModule(dim=3, lr=0.25)
    torch.save(_lightning_ckpt(src), tmp_path / "last.ckpt")
    out = convert_lightning_checkpoint(tmp_path / "last.ckpt", tmp_path / "converted")
    m = LinearModule.load_from_checkpoint(out)
    assert m.lr == 0.25 and m.net.in_features == 3     # rebuilt from the hparams
    for (k, a), (k2, b) in zip(src.state_dict().items(), m.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    meta = json.loads((tmp_path / "converted" / "meta.json").read_text())
    assert meta["epoch"] == 4 and meta["global_step"] == 120
    assert meta["converted_from"]["version"] == "2.6.0"


def test_convert_refuses_files_needing_unpickling(tmp_path):
    import argparse
    src = LinearModule(dim=3)      # an argparse.Namespace needs unpickling a class: refused
    torch.save(_lightning_ckpt(src, extra_object=argparse.Namespace(lr=1)), tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        convert_lightning_checkpoint(tmp_path / "evil.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    torch.save({"model": src.state_dict()}, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="state_dict"):
        convert_lightning_checkpoint(tmp_path / "plain.ckpt", tmp_path / "out")
    with pytest.raises(CheckpointError, match="not a file"):
        convert_lightning_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")


def test_convert_warns_for_hparams_json_cannot_hold(tmp_path):
    src = LinearModule(dim=3)
    ck = _lightning_ckpt(src)
    ck["hyper_parameters"]["init"] = torch.zeros(2)
    torch.save(ck, tmp_path / "a.ckpt")
    with pytest.warns(UserWarning, match=r"\['init'\]"):
        out = convert_lightning_checkpoint(tmp_path / "a.ckpt", tmp_path / "c")
    assert "init" not in json.loads((tmp_path / "c" / "meta.json").read_text())["hparams"]
    assert LinearModule.load_from_checkpoint(out).net.in_features == 3


# ----------------------------------------------------------------------------- finetuning callbacks
import ember  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from ember.callbacks import BackboneFinetuning, BaseFinetuning, Callback  # noqa: E402
from conftest import regression_data  # noqa: E402


class Backboned(ember.TrainModule):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)


class Record(Callback):
    def __init__(self):
        self.rows = []

    def on_train_epoch_end(self, trainer, module):
        opt = trainer.optimizers[0]
        self.rows.append((trainer.current_epoch, module.backbone[0].weight.requires_grad,
                          [g["lr"] for g in opt.param_groups], module.backbone[0].weight.detach().clone()))


def _fit(tmp_path, max_epochs, module=None, ckpt_path=None, **kw):
    torch.manual_seed(0)
    module = module or Backboned()
    rec = Record()
    trainer = ember.Trainer(max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                            devices="cpu", seed=0,
                            callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=2, **kw), rec])
    trainer.fit(module, DataLoader(regression_data(32, 4), batch_size=8, shuffle=True), ckpt_path=ckpt_path)
    return module, trainer, rec


def test_backbone_finetuning_freezes_then_adds_param_group(tmp_path):
    torch.manual_seed(0)
    m = Backboned()
    w0 = m.backbone[0].weight.detach().clone()
    _, _, rec = _fit(tmp_path, 4, module=m)
    (e0, g0, lr0, w_0), (e1, g1, lr1, w_1), (e2, g2, lr2, w_2), (e3, g3, lr3, w_3) = rec.rows
    assert not g0 and not g1 and torch.equal(w_0, w0) and torch.equal(w_1, w0)   # frozen: untouched
    assert g2 and g3 and not torch.equal(w_2, w0) and not torch.equal(w_3, w_2)  # unfrozen: trains
    assert lr0 == lr1 == [0.1]
    assert lr2 == pytest.approx([0.1, 0.1 * 0.1])               # backbone_initial_ratio_lr
    assert lr3 == pytest.approx([0.1, 0.1 * 0.1 * 1.5])         # lambda_func(epoch + 1) = 1.5
    ref = m.backbone[1]
    assert ref.track_running_stats and ref.weight.requires_grad        # train_bn=True


@pytest.mark.parametrize("split", [1, 3])   # resume before the unfreeze epoch, and after it
def test_backbone_finetuning_resume_is_exact(tmp_path, split):
    full, _, rec_full = _fit(tmp_path / "full", 4)
    _, first, _ = _fit(tmp_path / "a", split)
    first.save_checkpoint(tmp_path / "ck")
    resumed, trainer, rec = _fit(tmp_path / "b", 4, ckpt_path=tmp_path / "ck")
    assert [r[2] for r in rec.rows] == [r[2] for r in rec_full.rows[split:]]
    assert len(trainer.optimizers[0].param_groups) == 2
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_base_finetuning_needs_overrides_and_backbone(tmp_path):
    class NoBackbone(Backboned):
        def __init__(self):
            super().__init__()
            self.body = self.backbone
            del self.backbone

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.body(x)), y)

    with pytest.raises(ember.errors.MisconfigurationError, match="backbone"):
        _fit(tmp_path, 1, module=NoBackbone())
    with pytest.raises(NotImplementedError, match="freeze_before_training"):
        BaseFinetuning().freeze_before_training(Backboned())


# ----------------------------------------------------------------------------- TrainModule helpers
class TwoOpt(ember.TrainModule):
    """GAN-shaped manual optimization: two optimizers, toggled, gradients clipped."""

    def __init__(self, clip=0.05, algorithm="norm"):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.g = nn.Linear(4, 4)
        self.d = nn.Linear(4, 1)
        self.seen = []
        self.example_input_array = torch.randn(2, 4)

    def forward(self, x):
        return self.d(self.g(x))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        with self.toggled_optimizer(opt_g):
            self.seen.append((self.g.weight.requires_grad, self.d.weight.requires_grad))
            loss = self(x).pow(2).mean()
            self.manual_backward(loss)
            norm = self.clip_gradients(opt_g, self.hparams.clip, self.hparams.algorithm)
            grads = [p.grad for p in self.g.parameters()]
            after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            self.seen.append((norm, after, max(g.abs().max() for g in grads)))
            opt_g.step()
            opt_g.zero_grad()
        self.seen.append((self.g.weight.requires_grad, self.d.weight.requires_grad))
        assert self.d.weight.grad is None                      # the untoggled model got no gradient

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)


def _fit_two(tmp_path, **kw):
    torch.manual_seed(0)
    m = TwoOpt(**kw.pop("module_kw", {}))
    kw = {"max_steps": 2, **kw}
    trainer = ember.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path, devices="cpu", **kw)
    trainer.fit(m, DataLoader(regression_data(16, 4), batch_size=8))
    return m, trainer


def test_toggled_optimizer_and_clip_gradients_norm(tmp_path):
    m, _ = _fit_two(tmp_path)
    assert m.seen[0] == (True, False) and m.seen[2] == (True, True)     # toggled in, then restored
    norm, after, _ = m.seen[1]
    assert norm > 0.05 and after == pytest.approx(0.05, rel=1e-4)       # norm before, clipped to 0.05


def test_clip_gradients_value_and_unscaled_under_16_mixed(tmp_path):
    m, _ = _fit_two(tmp_path, module_kw={"clip": 0.01, "algorithm": "value"})
    assert m.seen[1][0] is None and m.seen[1][2] <= 0.01 + 1e-7
    m, _ = _fit_two(tmp_path, precision="16-mixed", max_steps=8, module_kw={"clip": 1e9})
    finite = [(n.item(), a.item()) for n, a, _ in m.seen[1::3] if torch.isfinite(n)]   # first steps overflow
    ref, _ = _fit_two(tmp_path / "fp32", module_kw={"clip": 1e9})
    assert finite
    for norm, after in finite:
        assert norm == pytest.approx(after, rel=1e-3)      # the gradients were unscaled in place
        assert 0.1 < norm / ref.seen[1][0].item() < 10     # the true norm (a scaled one is >= 2**10 times more)


def test_module_helpers(tmp_path):
    m, trainer = _fit_two(tmp_path)
    assert m.global_rank == 0 and m.local_rank == 0 and m.logger is None and m.loggers == []
    assert m.dtype == torch.float32 and m.to(torch.float64).dtype == torch.float64
    m.hparams.clip = 1.0
    assert m.hparams_initial == {"clip": 0.05, "algorithm": "norm"} and m.hparams.clip == 1.0
    m.float().freeze()
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    m.unfreeze()
    assert m.training and all(p.requires_grad for p in m.parameters())
    x = torch.randn(3, 4)
    traced = m.to_torchscript(tmp_path / "m.pt", method="trace")
    assert torch.allclose(torch.jit.load(tmp_path / "m.pt")(x), m(x)) and torch.allclose(traced(x), m(x))
    assert m.training                                      # mode restored
    with pytest.raises(ember.errors.MisconfigurationError, match="trace"):
        m.to_torchscript(method="bogus")


def test_to_onnx(tmp_path):
    pytest.importorskip("onnxscript")
    import onnx
    from onnx.reference import ReferenceEvaluator
    m = TwoOpt()
    m.train()
    m.to_onnx(tmp_path / "m.onnx")
    assert m.training   # mode restored
    model = onnx.load(str(tmp_path / "m.onnx"))
    onnx.checker.check_model(model)
    x = m.example_input_array
    (out,) = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: x.numpy()})
    with torch.no_grad():
        assert torch.allclose(torch.from_numpy(out), m.eval()(x), atol=1e-5)


# ----------------------------------------------------------------------------- Trainer call shapes
from conftest import LinearModule as _Linear  # noqa: E402


def test_trainer_accelerator_argument():
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t = ember.Trainer(accelerator="cpu", devices=1, **quiet)
    assert t.strategy.root_device.type == "cpu" and t.world_size == 1
    assert ember.Trainer(accelerator="auto", **quiet).strategy.root_device.type == \
        ember.Trainer(**quiet).strategy.root_device.type
    if not torch.cuda.is_available():
        with pytest.raises(ember.errors.MisconfigurationError, match="no CUDA device"):
            ember.Trainer(accelerator="gpu", devices=2, **quiet)
    else:
        assert ember.Trainer(accelerator="gpu", devices=1, **quiet).strategy.root_device.type == "cuda"
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        with pytest.raises(ember.errors.MisconfigurationError, match="MPS is not available"):
            ember.Trainer(accelerator="mps", **quiet)
    with pytest.raises(ember.errors.MisconfigurationError, match="'tpu' is not supported"):
        ember.Trainer(accelerator="tpu", **quiet)


def test_lightning_call_shapes(tmp_path, capsys):
    t = ember.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
    m = _Linear()
    dl = DataLoader(regression_data(16, 4), batch_size=8)
    t.fit(model=m, train_dataloaders=dl)
    assert t.global_step == 2
    capsys.readouterr()
    out = t.validate(model=m, dataloaders=dl, verbose=False)
    assert "val/loss" in out[0] and capsys.readouterr().out == ""
    assert t.test(model=m, dataloaders=dl, verbose=False)[0]
    assert t.predict(model=m, dataloaders=dl, return_predictions=False) is None
    preds = t.predict(m, dl, return_predictions=True)
    assert torch.cat(preds).shape == (16, 1)
    with pytest.raises(ember.errors.MisconfigurationError, match="once"):
        t.fit(m, dl, model=m)


def _shared(levels: int) -> list:
    """9**levels strings by reference: a few hundred bytes pickled."""
    x = ["lol"] * 9
    for _ in range(levels - 1):
        x = [x] * 9
    return x


def test_convert_refuses_hparams_that_expand_by_shared_references(tmp_path):
    ck = _lightning_ckpt(LinearModule(dim=3))
    ck["hyper_parameters"]["laughs"] = _shared(6)          # 531,441 values, the file stays tiny
    torch.save(ck, tmp_path / "lol.ckpt")
    assert os.path.getsize(tmp_path / "lol.ckpt") < 8192
    with pytest.raises(CheckpointError, match=r"hyper_parameters in .*lol.ckpt hold more than 100000 values "
                                              r"\(counting each shared reference every time it appears; 'laughs'"):
        convert_lightning_checkpoint(tmp_path / "lol.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()      # refused before anything is written
    loop = [1]
    loop.append(loop)                                        # a list holding itself: never ends, left out
    ck["hyper_parameters"] = {"dim": 3, "loop": loop}
    torch.save(ck, tmp_path / "loop.ckpt")
    with pytest.warns(UserWarning, match=r"\['loop'\] of .* cannot be stored in meta.json"):
        convert_lightning_checkpoint(tmp_path / "loop.ckpt", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["hparams"] == {"dim": 3}


def test_convert_leaves_out_hparams_nested_deeper_than_meta_json_holds(tmp_path):
    ck = _lightning_ckpt(LinearModule(dim=3))
    deep = 0
    for _ in range(200):
        deep = [deep]
    ck["hyper_parameters"].update(deep=deep, fine=[[1, 2], {"a": [3]}], shared=[_shared(2)] * 3)
    torch.save(ck, tmp_path / "deep.ckpt")
    with pytest.warns(UserWarning, match=r"\['deep'\] of .* cannot be stored in meta.json"):
        out = convert_lightning_checkpoint(tmp_path / "deep.ckpt", tmp_path / "c")
    from ember.checkpoint.trust import read_meta
    hp = read_meta(os.path.join(out, "meta.json"))["hparams"]     # within ember's own limits on meta.json
    assert "deep" not in hp and hp["fine"] == [[1, 2], {"a": [3]}] and hp["shared"] == [_shared(2)] * 3
