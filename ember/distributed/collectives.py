"""Collectives for user code and metrics: gather, all_gather, reduce, broadcast,
pad_across_processes, gather_for_metrics.

Every function takes an optional ``strategy`` (anything with the Strategy
collectives: ``all_gather``, ``all_gather_object``, ``reduce``, ``broadcast``,
``barrier``, ``world_size``); without one it uses the current default process
group, and on a single process it returns its input unchanged (gathers add the
rank dimension where documented). Tensors may be nested in dicts, lists and
tuples.

``gather_for_metrics`` is the exact one: ranks hold rank-strided shards of the
(padded) dataset order (rank ``r`` has global positions ``r, r+W, r+2W, ...``,
as :class:`ember.data.ResumableSampler` and ``DistributedSampler`` shard), so
the gathered rows are re-interleaved into dataset order and the ``num_padded``
duplicates at the end are dropped: the result is exactly the dataset's samples.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from ember.errors import invalid_choice

REDUCE_OPS = ("sum", "mean", "max", "min")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def _reduce_op(op: Any):
    if isinstance(op, str) and op.lower() in ("avg", "average"):
        op = "mean"
    if not isinstance(op, str) or op.lower() not in REDUCE_OPS:
        raise invalid_choice("op", op, REDUCE_OPS)
    op = op.lower()
    return {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN}[op], op == "mean"


class ProcessGroupOps:
    """Collectives over a process group (default: the whole world; identity on one process).

    ``device`` is where tensors travel for NCCL (the rank's GPU); with gloo they
    travel on the CPU and come back to the device they came from. ``group``
    restricts them to a sub-group (e.g. the data-parallel dimension of a
    DeviceMesh); ranks and sizes are then those inside the group.
    """

    def __init__(self, device: torch.device | None = None, group=None):
        self.device = device
        self.group = group

    @property
    def active(self) -> bool:
        return is_initialized() and dist.get_world_size(self.group) > 1

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if is_initialized() else 1

    @property
    def global_rank(self) -> int:
        return dist.get_rank(self.group) if is_initialized() else 0

    def _src(self, src: int) -> int:
        """``src`` is a rank inside the group; the collectives take global ranks."""
        return src if self.group is None else dist.get_global_rank(self.group, src)

    def _comm_device(self, t: torch.Tensor) -> torch.device:
        backend = dist.get_backend(self.group)
        if "nccl" in backend:
            if self.device is not None and self.device.type == "cuda":
                return self.device
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu") if backend == "gloo" else t.device

    def barrier(self, name: str | None = None) -> None:
        if not self.active:
            return
        if "nccl" in dist.get_backend(self.group) and torch.cuda.is_available():
            dist.barrier(group=self.group, device_ids=[self._comm_device(torch.empty(0)).index])
        else:
            dist.barrier(group=self.group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Tensors (the same shape on every rank) via ``dist.broadcast``; any other
        picklable object via ``broadcast_object_list``. Returns rank ``src``'s value."""
        if not self.active:
            return obj
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to(self._comm_device(obj)).clone().contiguous()
            dist.broadcast(t, self._src(src), group=self.group)
            return t.to(obj.device)
        box = [obj]
        dist.broadcast_object_list(box, self._src(src), group=self.group)
        return box[0]

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """``[world, *tensor.shape]``; the shape must be the same on every rank."""
        if not self.active:
            return tensor.unsqueeze(0)
        if sync_grads:
            from torch.distributed.nn.functional import all_gather as _ag
            return torch.stack(_ag(tensor.contiguous(), group=self.group or dist.group.WORLD))
        t = tensor.detach().to(self._comm_device(tensor)).contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out).to(tensor.device)

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0 in rank order; first dimensions may differ."""
        if not self.active:
            return tensor
        padded, sizes = _gather_padded(self, tensor)
        return torch.cat([padded[r, :n] for r, n in enumerate(sizes)])

    def all_gather_object(self, obj: Any) -> list:
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """A new tensor reduced over ranks; ``op`` in sum | mean | max | min."""
        red, mean = _reduce_op(op)
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.tensor(tensor, device=self.device or "cpu")
        if not self.active:
            return tensor.float() if mean and not tensor.is_floating_point() else tensor
        t = tensor.detach().to(self._comm_device(tensor)).clone()
        if mean and not t.is_floating_point():
            t = t.float()
        dist.all_reduce(t, op=red, group=self.group)
        if mean:
            t = t / self.world_size
        return t.to(tensor.device)


_DEFAULT = ProcessGroupOps()


def _ops(strategy):
    return strategy if strategy is not None else _DEFAULT


def _data_ops(strategy):
    """The collectives that gather or reduce *data* (samples, predictions, metrics): over
    the data-parallel ranks only. Under tensor parallelism the ranks of one data-parallel
    group hold the same samples, so a strategy with a DeviceMesh exposes the data-parallel
    sub-group as ``strategy.data_parallel_ops``; for every other strategy it is the world."""
    if strategy is None:
        return _DEFAULT
    return getattr(strategy, "data_parallel_ops", None) or strategy


def _world(ops) -> int:
    return int(getattr(ops, "world_size", 1) or 1)


def _gather_padded(ops, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """All-gather a tensor whose dim 0 differs across ranks: ``([W, max_n, ...], sizes)``."""
    if tensor.dim() == 0:
        tensor = tensor.unsqueeze(0)
    size = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    sizes = [int(s) for s in ops.all_gather(size).view(-1).tolist()]
    longest = max(sizes)
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    return ops.all_gather(tensor), sizes


def map_tensors(fn: Callable[[Any], Any], data: Any) -> Any:
    """``fn`` applied to every leaf of ``data``, as ``torch.utils._pytree.tree_map``, and also
    inside the mappings the pytree does not know (dict subclasses, ``UserDict`` such as
    transformers' ``BatchEncoding``), each rebuilt as a shallow copy of itself with its
    values mapped, as the hand-written walks this replaced did."""
    from collections.abc import MutableMapping

    def leaf(x: Any) -> Any:
        if isinstance(x, MutableMapping):
            out = copy.copy(x)
            for k, v in x.items():
                out[k] = map_tensors(fn, v)
            return out
        return fn(x)
    return tree_map(leaf, data)


def tensor_leaves(data: Any) -> list:
    """The leaves of ``data`` that :func:`map_tensors` reaches (into unknown mappings too)."""
    from collections.abc import Mapping
    out: list = []
    for x in tree_leaves(data):
        out.extend(tensor_leaves(list(x.values())) if isinstance(x, Mapping) else [x])
    return out


def is_sample_list(data: Any) -> bool:
    """A list/tuple of plain values (strings, numbers): one value per sample, gathered
    as a whole rather than element by element."""
    return isinstance(data, (list, tuple)) and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in data)


def _per_sample(data: Any) -> bool:
    """A list/tuple with no tensor anywhere inside: one value per sample (plain values, or
    ragged lists such as generated token ids), joined as a whole."""
    return isinstance(data, (list, tuple)) and not any(isinstance(v, torch.Tensor) for v in tree_leaves(data))


def concat_outputs(parts: list) -> Any:
    """Per-batch outputs (tensors, per-sample lists or values, in dicts, lists, tuples)
    joined along dim 0, leaf by leaf."""
    flat = [tree_flatten(p, is_leaf=_per_sample) for p in parts]

    def join(col: tuple) -> Any:
        if isinstance(col[0], torch.Tensor):
            return torch.cat([x.reshape(-1) if x.ndim == 0 else x for x in col])
        return [v for x in col for v in (x if isinstance(x, (list, tuple)) else [x])]
    return tree_unflatten([join(col) for col in zip(*(leaves for leaves, _ in flat))], flat[0][1])


def split_outputs(data: Any, size: int) -> list:
    """``data`` (as :func:`concat_outputs` joins it) cut back into batches of ``size`` rows."""
    n = len(tree_leaves(data, is_leaf=_per_sample)[0])
    return [tree_map(lambda x: x[i:i + size], data, is_leaf=_per_sample) for i in range(0, n, size)]


def first_rows(data: Any) -> int | None:
    """Rows (dim 0) of the first tensor in ``data``, or the length of a per-sample list."""
    if isinstance(data, torch.Tensor):
        return data.shape[0] if data.dim() else 1
    if is_sample_list(data):
        return len(data)
    values = data.values() if isinstance(data, dict) else data if isinstance(data, (list, tuple)) else ()
    for v in values:
        n = first_rows(v)
        if n is not None:
            return n
    return None


def _map(data: Any, fn: Callable[[torch.Tensor], Any], leaf: Callable[[Any], Any] | None = None) -> Any:
    """``fn`` on every tensor of ``data``; ``leaf`` (when given) on every other value and
    on each non-empty per-sample list, which it takes whole. A dict subclass torch's pytree
    does not know is an error (its tensors would pass unreduced)."""
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, dict):
            raise TypeError(f"a {type(x).__qualname__} (a dict subclass torch.utils._pytree does not know) cannot "
                            "go through a collective: pass a dict, or register the class with "
                            "torch.utils._pytree.register_pytree_node")
        return x if leaf is None else leaf(x)
    return tree_map(one, data, is_leaf=None if leaf is None else lambda x: is_sample_list(x) and len(x) > 0)


# -- public helpers ------------------------------------------------------------------

def barrier(strategy=None) -> None:
    _ops(strategy).barrier()


def broadcast(obj: Any, src: int = 0, strategy=None) -> Any:
    """Rank ``src``'s value on every rank (tensors, nested tensors, or any picklable object)."""
    ops = _ops(strategy)
    if isinstance(obj, (dict, list, tuple)) and any(isinstance(v, torch.Tensor) for v in
                                                   (obj.values() if isinstance(obj, dict) else obj)):
        return _map(obj, lambda t: ops.broadcast(t, src))
    return ops.broadcast(obj, src)


def all_gather(data: Any, strategy=None) -> Any:
    """Stack every tensor over ranks: each leaf becomes ``[world, *shape]`` (shapes must match)."""
    ops = _data_ops(strategy)
    return _map(data, ops.all_gather)


def all_gather_object(obj: Any, strategy=None) -> list:
    return _data_ops(strategy).all_gather_object(obj)


def gather(data: Any, strategy=None) -> Any:
    """Concatenate every tensor over ranks along dim 0, in rank order (first
    dimensions may differ; 0-d tensors become ``[world]``)."""
    ops = _data_ops(strategy)

    def one(t: torch.Tensor) -> torch.Tensor:
        if _world(ops) == 1:
            return t.unsqueeze(0) if t.dim() == 0 else t
        padded, sizes = _gather_padded(ops, t)
        return torch.cat([padded[r, :n] for r, n in enumerate(sizes)])

    return _map(data, one)


def reduce(data: Any, op: str = "mean", strategy=None) -> Any:
    """Reduce every tensor over ranks with ``op`` in sum | mean | max | min."""
    _reduce_op(op)  # validate even on one process
    ops = _data_ops(strategy)
    return _map(data, lambda t: ops.reduce(t, op))


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False,
                         strategy=None) -> Any:
    """Pad every tensor along ``dim`` to the largest size over ranks (with
    ``pad_index``; at the start when ``pad_first``), so that they can be gathered."""
    ops = _data_ops(strategy)

    def one(t: torch.Tensor) -> torch.Tensor:
        if _world(ops) == 1 or t.dim() == 0:
            return t
        d = dim if dim >= 0 else t.dim() + dim
        size = torch.tensor([t.shape[d]], dtype=torch.long, device=t.device)
        longest = int(ops.all_gather(size).max())
        if t.shape[d] == longest:
            return t
        shape = list(t.shape)
        shape[d] = longest - t.shape[d]
        pad = t.new_full(shape, pad_index)
        return torch.cat([pad, t] if pad_first else [t, pad], dim=d)

    return _map(data, one)


def _interleave(padded: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Rows of rank ``r`` (``padded[r, :sizes[r]]``) sit at global positions
    ``r, r+W, ...``: put them back in that order."""
    world = len(sizes)
    if len(set(sizes)) == 1:
        n = sizes[0]
        return padded[:, :n].transpose(0, 1).reshape((n * world,) + tuple(padded.shape[2:]))
    rows, pos = [], []
    for r, n in enumerate(sizes):
        rows.append(padded[r, :n])
        pos.append(torch.arange(n, device=padded.device) * world + r)
    order = torch.argsort(torch.cat(pos))
    return torch.cat(rows)[order]


def _interleave_objects(per_rank: list[list]) -> list:
    world = len(per_rank)
    out = []
    for i in range(max((len(x) for x in per_rank), default=0)):
        for r in range(world):
            if i < len(per_rank[r]):
                out.append(per_rank[r][i])
    return out


def gather_for_metrics(data: Any, *, num_padded: int, strategy=None) -> Any:
    """Gather this rank's samples from every rank in *dataset order* and drop the
    ``num_padded`` duplicates the distributed sampler appended.

    ``data``: a tensor (dim 0 = samples, in this rank's sampler order), or dicts,
    lists, tuples of them; a list of non-tensors (e.g. strings) counts as one
    value per sample. Call it on every rank. With ``num_padded=ember.data.num_padded(loader)``
    on the epoch's concatenated outputs the result equals a single-process pass
    over the dataset.
    """
    ops = _data_ops(strategy)
    num_padded = int(num_padded or 0)
    if num_padded < 0:
        raise ValueError(f"num_padded={num_padded} must be >= 0")

    def drop(x):
        if num_padded == 0:
            return x
        if num_padded > len(x):
            raise ValueError(f"num_padded={num_padded} is larger than the {len(x)} gathered samples")
        return x[: len(x) - num_padded]

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            t = t.unsqueeze(0)
        if _world(ops) == 1:
            return drop(t)
        padded, sizes = _gather_padded(ops, t)
        return drop(_interleave(padded, sizes))

    def objects(values) -> list:
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if _world(ops) == 1:
            return drop(values)
        return drop(_interleave_objects(ops.all_gather_object(values)))

    return _map(data, one, objects)


def destroy() -> None:
    """Barrier, then destroy the default process group (ember otherwise does this at exit)."""
    from ember.distributed.failures import shutdown_process_group
    shutdown_process_group(barrier=True)


# -- who did not arrive ----------------------------------------------------------------
_ARRIVALS = {"n": 0}
_ARRIVAL_KEY = "ember/arrived/rank{}"


def mark_arrival():
    """Count an agreement point on this rank in the rendezvous store (one small write to
    the store, no collective): ``(store, n)`` for :func:`missing_ranks`, or None without a
    process group. Every rank passes the agreement points in the same order, so after the
    ``n``-th one a rank whose count is below ``n`` never arrived there."""
    if not is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed import distributed_c10d as c10d
    _ARRIVALS["n"] += 1
    n = _ARRIVALS["n"]
    try:
        store = c10d._get_default_store()
        store.set(_ARRIVAL_KEY.format(dist.get_rank()), str(n))
    except Exception:   # no store to write to: the error path just says less
        return None
    return store, n


def missing_ranks(arrival) -> list[int]:
    """The ranks that did not reach the agreement point ``arrival`` (from
    :func:`mark_arrival`); empty when unknown (the store is gone)."""
    if arrival is None:
        return []
    store, n = arrival
    missing = []
    try:
        for r in range(dist.get_world_size()):
            key = _ARRIVAL_KEY.format(r)
            if not store.check([key]) or int(store.get(key)) < n:
                missing.append(r)
    except Exception:
        return []
    return missing
