"""Accelerator.load_state checks every file before it loads anything: a refused
``optimizer.bin`` (one that would need unpickling arbitrary objects, or the state of
another optimizer) leaves the model as it was, in an Accelerate folder and in ember's
own format."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ember
from ember.checkpoint import io as cio
from ember.errors import CheckpointError


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _prepared():
    acc = ember.Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net, opt = acc.prepare(net, opt)
    return acc, net, opt


def _accelerate_folder(path, optimizer_file):
    """What Accelerate's save_state writes, with other weights than the model's."""
    path.mkdir()
    torch.manual_seed(1)
    cio.save_safetensors(nn.Linear(3, 2).state_dict(), path / "model.safetensors")
    optimizer_file(path / "optimizer.bin")
    return path


def _same(net, before) -> bool:
    return all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("kind", ["pickled code", "another optimizer"])
def test_a_refused_optimizer_bin_leaves_the_model_unchanged(tmp_path, kind):
    acc, net, opt = _prepared()
    marker = tmp_path / "pwned"
    if kind == "pickled code":
        write = lambda fp: torch.save({"state": {}, "param_groups": Evil(marker)}, fp)   # noqa: E731
        match = "refusing to load"
    else:
        other = torch.optim.Adam(nn.Linear(3, 2).parameters())
        write = lambda fp: torch.save(other.state_dict(), fp)   # noqa: E731
        match = "other options than the checkpoint's"
    folder = _accelerate_folder(tmp_path / "acc_ckpt", write)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        acc.load_state(str(folder))
    assert _same(net, before) and not marker.exists()


def test_ember_format_refuses_another_optimizers_state_before_loading(tmp_path):
    acc, net, opt = _prepared()
    path = tmp_path / "ckpt"
    acc.save_state(str(path))
    # the same folder loaded where an Adam is prepared instead of SGD
    acc2 = ember.Accelerator(cpu=True)
    torch.manual_seed(5)
    net2 = nn.Linear(3, 2)
    net2, opt2 = acc2.prepare(net2, torch.optim.Adam(net2.parameters()))
    before = {k: v.clone() for k, v in net2.state_dict().items()}
    with pytest.raises(CheckpointError, match="other options than the checkpoint's"):
        acc2.load_state(str(path))
    assert _same(net2, before)
    acc.load_state(str(path))          # the matching one still loads
