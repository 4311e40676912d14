"""The batch walks that lean on torch's pytree also walk what it does not know: a dict
subclass (e.g. ``datasets.DatasetDict``, a user's ``class Batch(dict)``) is moved, pinned
and combined by its values, not taken as one opaque leaf; ragged per-sample outputs
(generated token ids) are joined as whole lists."""
from __future__ import annotations

import torch

from ember.big_modeling.hooks import send_to_device
from ember.data.combined import CombinedLoader
from ember.distributed.collectives import concat_outputs, split_outputs, tensor_leaves
from ember.strategies.base import move_to_device

META = torch.device("meta")


class Batch(dict):
    pass


def test_a_dict_subclass_batch_moves_with_its_tensors():
    batch = Batch(x=torch.ones(2), nested=[Batch(y=torch.zeros(1))], name="b")
    moved = move_to_device(batch, META)
    assert type(moved) is Batch and moved["x"].device == META and moved["nested"][0]["y"].device == META
    assert moved["name"] == "b" and batch["x"].device.type == "cpu"   # the input is not changed
    assert [t.device for t in tensor_leaves(moved) if isinstance(t, torch.Tensor)] == [META, META]


def test_send_to_device_moves_into_dict_subclasses_and_keeps_what_need_not_move():
    batch = Batch(x=torch.ones(2), rest=[torch.zeros(1)])
    assert send_to_device(batch, torch.device("cpu")) is batch   # nothing to move: the same object
    moved = send_to_device(batch, META)
    assert type(moved) is Batch and moved["x"].device == META and moved["rest"][0].device == META


def test_combined_loader_walks_a_dict_subclass_of_loaders():
    out = list(CombinedLoader(Batch(a=range(2), b=range(3, 5)), "max_size_cycle"))
    assert [b for b, _, _ in out] == [{"a": 0, "b": 3}, {"a": 1, "b": 4}]


def test_ragged_per_sample_outputs_concatenate_and_split_back():
    parts = [{"ids": [[1, 2], [3]], "p": torch.ones(2)}, {"ids": [[4]], "p": torch.zeros(1)}]
    joined = concat_outputs(parts)
    assert joined["ids"] == [[1, 2], [3], [4]] and torch.equal(joined["p"], torch.tensor([1.0, 1.0, 0.0]))
    assert split_outputs(concat_outputs([[[1, 2], [3]], [[4]]]), 2) == [[[1, 2], [3]], [[4]]]
    pair = concat_outputs([[torch.ones(2), torch.zeros(2)], [torch.ones(1), torch.zeros(1)]])   # per tensor
    assert [t.tolist() for t in pair] == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
