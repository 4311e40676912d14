"""The rich progress bar in a notebook: one live output widget redrawn in place (rich's
Jupyter rendering through ipywidgets), whose final frame shows the logged values; without
ipywidgets, a warning and plain lines. Runs in a kernel-less IPython shell whose display
publisher keeps what a kernel would send to the notebook."""
from __future__ import annotations

import io
import re
import sys

import pytest
from rich.console import Console
from torch.utils.data import DataLoader

import ember
from ember.callbacks import RichProgressBar
from conftest import LinearModule, regression_data

IPython = pytest.importorskip("IPython")


@pytest.fixture
def notebook():
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    saved = {k: getattr(sys, k) for k in ("ps1", "ps2", "excepthook", "displayhook") if hasattr(sys, k)}
    main = sys.modules["__main__"]   # the shell puts its own namespace there, without pytest's __spec__
    shell = InteractiveShell.instance()
    old = shell.display_pub
    shell.display_pub = CapturingDisplayPublisher()   # what the kernel would send to the browser
    try:
        yield shell
    finally:
        shell.display_pub = old
        InteractiveShell.clear_instance()
        # left in place, ember would no longer see that it runs inside pytest: a later
        # DDPStrategy(devices=2) would start rank 1 by re-running the whole session
        sys.modules["__main__"] = main
        for k in ("ps1", "ps2", "excepthook", "displayhook"):   # the shell marks the process interactive
            if k in saved:
                setattr(sys, k, saved[k])
            elif hasattr(sys, k):
                delattr(sys, k)


class Shown(LinearModule):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/idx", float(batch_idx), prog_bar=True, on_step=False, on_epoch=True)
        return loss


def _fit(callbacks):
    dl = DataLoader(regression_data(64), batch_size=8)
    t = ember.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_model_summary=False,
                      devices="cpu", callbacks=callbacks, log_every_n_steps=4)
    t.fit(Shown(), dl)
    return t


def test_notebook_bar_is_one_live_widget_with_the_logged_values(notebook):
    ipywidgets = pytest.importorskip("ipywidgets")
    con = Console(record=True, width=110, force_jupyter=True, color_system=None, file=io.StringIO())
    bar = RichProgressBar(console=con)
    widgets = []

    class Watch(ember.callbacks.Callback):
        def on_train_epoch_end(self, trainer, module):
            widgets.append(bar._progress.live.ipy_widget)

    t = _fit([bar, Watch()])
    # both epochs drew into the same Output widget (redrawn in place, not a line per epoch)
    assert len(widgets) == 2 and isinstance(widgets[0], ipywidgets.Output) and widgets[0] is widgets[1]
    # what the cell shows at the end: each redraw cleared the previous one, so one frame of the
    # bar remains (the last: epoch 1, 8/8), then the summary; not one line per epoch
    published = [o["data"]["text/plain"] for o in notebook.display_pub.outputs]
    frames = [p for p in published if "Epoch" in p]
    assert len(frames) == 1, published
    last = frames[0].splitlines()
    assert re.search(r"^Epoch 1/1 +━+ +8/8 ", last[0]), last[0]
    pbm = t.progress_bar_metrics
    assert pbm["train/idx"] == 3.5
    assert last[1].strip() == "step 16 " + " ".join(f"{k}={v:.4g}" for k, v in pbm.items())
    assert published[-1].startswith("Fit stopped: reached max_epochs=2")


def test_notebook_without_ipywidgets_warns_and_prints_plain_lines(notebook, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    con = Console(record=True, width=110, force_jupyter=True, color_system=None, file=io.StringIO())
    with pytest.warns(UserWarning, match=r"needs ipywidgets \(pip install ipywidgets\)"):
        t = _fit([RichProgressBar(console=con)])
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(":")[0] for ln in lines if ln.startswith("Epoch")] == ["Epoch 0/1", "Epoch 1/1"]
    assert lines[-1].startswith("Epoch 1/1: 8/8 batches, step 16,") and "train/idx=3.5" in lines[-1]
    assert t.progress_bar_metrics["train/idx"] == 3.5
