"""``ember predict --output`` and ``BasePredictionWriter`` destroy nothing: the path is
checked before anything is predicted (an existing file only with --overwrite, never a
folder, a path under a file, a file inside a checkpoint or the weights being loaded),
and the file is written atomically."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ember
from conftest import LinearModule, regression_data
from ember.callbacks import BasePredictionWriter
from ember.checkpoint import io as cio
from ember.errors import MisconfigurationError

ROOT = Path(__file__).resolve().parents[2]

MODEL = '''
import os
from toy import ToyRegressor


class Marked(ToyRegressor):
    """Leaves predicted.txt when it predicts; PREDICT_RETURNS=lambda returns an object torch.save refuses."""

    def predict_step(self, batch, batch_idx):
        open("predicted.txt", "w").close()
        if os.environ.get("PREDICT_RETURNS") == "lambda":
            return lambda: None
        return super().predict_step(batch, batch_idx)
'''


@pytest.fixture
def cli(cli, tmp_path, monkeypatch):
    """``cli(*args)`` -> conftest.py's ``cli("predict", ...)`` of the marked model (written to
    ``tmp_path``, importable) with examples/cli's config and no logger, then ``args``."""
    (tmp_path / "marked_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["-c", str(ROOT / "examples" / "cli" / "config.yaml"), "--trainer.logger", "false",
            "--model", "marked_model.Marked", "--model.hidden", "8"]
    return lambda *args: cli("predict", *base, *args)


def _predicted(tmp_path) -> bool:
    return (tmp_path / "predicted.txt").exists()


def test_an_existing_file_is_refused_before_predicting_unless_overwrite(tmp_path, cli):
    out = tmp_path / "p.pt"
    out.write_bytes(b"my notes")
    r = cli("--output", out)
    assert r.returncode == 2 and f"--output '{out}' exists; refusing to overwrite it" in r.stderr, r.stderr
    assert out.read_bytes() == b"my notes" and not _predicted(tmp_path)
    r = cli("--output", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert len(torch.load(out)) == 8 and not list(tmp_path.glob("p.pt.*"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_input_weights_are_never_overwritten(tmp_path, cli, overwrite):
    from toy import ToyRegressor
    w = tmp_path / "w.safetensors"
    cio.save_safetensors(ToyRegressor(hidden=8).state_dict(), w)
    before = w.read_bytes()
    r = cli("--ckpt_path", w, "--output", w, *(["--overwrite"] if overwrite else []))
    assert r.returncode == 2 and "is the input" in r.stderr, r.stderr
    assert w.read_bytes() == before and not _predicted(tmp_path)


@pytest.mark.parametrize("overwrite", [False, True])
def test_nothing_is_written_into_a_checkpoint(tmp_path, cli, overwrite):
    from toy import ToyRegressor
    t = ember.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=str(tmp_path))
    x = torch.randn(8, 4)
    t.fit(ToyRegressor(hidden=8), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]),
                                                              batch_size=4))
    ckpt = tmp_path / "ckpt"
    t.save_checkpoint(str(ckpt))
    for target in (ckpt / cio.WEIGHTS_NAME, ckpt / "preds.pt"):
        r = cli("--output", target, *(["--overwrite"] if overwrite else []))
        assert r.returncode == 2 and f"lies inside the checkpoint {ckpt}" in r.stderr, r.stderr
    cio.read_checkpoint(ckpt)            # still complete and loadable
    assert not (ckpt / "preds.pt").exists() and not _predicted(tmp_path)


def test_a_folder_or_a_path_under_a_file_is_one_line_before_predicting(tmp_path, cli):
    (tmp_path / "dir").mkdir()
    (tmp_path / "afile").write_text("x")
    for target, message in ((tmp_path / "dir", "is a folder"),
                            (tmp_path / "afile" / "p.pt", "is a file, so no file can be written under it")):
        r = cli("--output", target)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1
    assert not _predicted(tmp_path)


def test_a_failed_write_leaves_the_old_file(tmp_path, cli, monkeypatch):
    out = tmp_path / "p.pt"
    torch.save([torch.ones(1)], out)
    before = out.read_bytes()
    monkeypatch.setenv("PREDICT_RETURNS", "lambda")     # predictions torch.save cannot pickle
    with pytest.raises(Exception):
        cli("--output", out, "--overwrite")
    assert _predicted(tmp_path) and out.read_bytes() == before and not list(tmp_path.glob("p.pt.*"))


class EpochWriter(BasePredictionWriter):
    def __init__(self, **kw):
        super().__init__("epoch", **kw)

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        self.save(trainer, predictions)


def _predict(tmp_path, writer, ckpt_path=None):
    t = ember.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), callbacks=[writer])
    seen = []

    class Counting(LinearModule):
        def predict_step(self, batch, batch_idx):
            seen.append(batch_idx)
            return super().predict_step(batch, batch_idx)
    t.predict(Counting(), torch.utils.data.DataLoader(regression_data(8), batch_size=4), ckpt_path=ckpt_path)
    return seen


def test_prediction_writer_has_the_same_rules(tmp_path):
    out = tmp_path / "w.pt"
    out.write_bytes(b"keep")
    seen = []
    with pytest.raises(MisconfigurationError, match="exists; refusing to overwrite it"):
        seen = _predict(tmp_path, EpochWriter(output=out))
    assert seen == [] and out.read_bytes() == b"keep"
    assert _predict(tmp_path, EpochWriter(output=out, overwrite=True)) == [0, 1]
    assert len(torch.load(out)) == 1 and len(torch.load(out)[0]) == 2
    w = tmp_path / "lin.safetensors"
    cio.save_safetensors(LinearModule().state_dict(), w)
    before = w.read_bytes()
    with pytest.raises(MisconfigurationError, match="is the input"):
        _predict(tmp_path, EpochWriter(output=w, overwrite=True), ckpt_path=str(w))
    assert w.read_bytes() == before
