"""``ModelParallelStrategy``: N-D parallelism on a 2-D DeviceMesh, FSDP2 over the
data-parallel dimension and tensor parallelism (DTensor) over the other.

The strategy builds the mesh ``("data_parallel", "tensor_parallel")`` and hands it
to the module as ``self.device_mesh`` in ``configure_model``, where the user
applies the tensor-parallel plan (``parallelize_module``) and, optionally,
``fully_shard`` over ``self.device_mesh["data_parallel"]`` per block, as in
torchtitan and Lightning's ``ModelParallelStrategy``::

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class GPT(ember.TrainModule):
        def configure_model(self):
            tp = self.device_mesh["tensor_parallel"]
            for block in self.blocks:
                parallelize_module(block.mlp, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    trainer = ember.Trainer(strategy=ModelParallelStrategy(tensor_parallel_size=2), devices=4)

Whatever the user did not shard is sharded by the strategy (the blocks
:func:`~ember.strategies.blocks.find_blocks` detects, then the root) over the
data-parallel dimension. Everything else follows the mesh: the sampler shards
the data by data-parallel rank only (the ranks of one tensor-parallel group
see the same batch), ``gather_for_metrics`` / ``all_gather`` / ``reduce`` of
data run over the data-parallel ranks, gradient clipping is DTensor-aware, and
checkpoints are DCP folders that load on any mesh (2x2 -> 4x1 -> 1 process).
"""
from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ember.errors import MisconfigurationError
from ember.strategies.fsdp import FSDPStrategy

DIM_NAMES = ("data_parallel", "tensor_parallel")


def _size(name: str, v) -> "int | str":
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise MisconfigurationError(f"{name}={v!r} is not valid; use a positive int or 'auto'")
    return v


class ModelParallelStrategy(FSDPStrategy):
    """Data parallel (FSDP2) x tensor parallel on a 2-D DeviceMesh.

    Args:
        data_parallel_size: ranks along the data-parallel dimension; ``"auto"``: the
            world size divided by ``tensor_parallel_size``.
        tensor_parallel_size: ranks along the tensor-parallel dimension (``"auto"``:
            the ranks of one node; default 1).
        devices, num_nodes, timeout, accelerator, process_group_backend, start_method,
            cluster_environment: as for :class:`~ember.strategies.ddp.DDPStrategy`.
        **kwargs: as for :class:`~ember.strategies.fsdp.FSDPStrategy` (``reshard_after_forward``,
            ``activation_checkpointing``, ``mixed_precision``, ``state_dict_type``,
            ``async_save``, ``auto_wrap_policy``, ...), applied over the data-parallel dimension.
    """

    name = "model_parallel"

    def __init__(self, data_parallel_size: int | str = "auto", tensor_parallel_size: int | str = 1,
                 devices: int | list[int] | str | None = None, num_nodes: int = 1,
                 timeout: "timedelta | float" = timedelta(minutes=30), **kwargs: Any) -> None:
        if "device_mesh" in kwargs or "hsdp" in kwargs:
            raise MisconfigurationError("ModelParallelStrategy builds its own mesh from data_parallel_size and "
                                        "tensor_parallel_size; device_mesh/hsdp are FSDPStrategy arguments")
        super().__init__(devices=devices, num_nodes=num_nodes, timeout=timeout, **kwargs)
        self.data_parallel_size = _size("data_parallel_size", data_parallel_size)
        self.tensor_parallel_size = _size("tensor_parallel_size", tensor_parallel_size)
        self._device_mesh = None
        self._dp_ops = None

    # -- mesh ------------------------------------------------------------------------
    def _sizes(self, world: int | None = None) -> tuple[int, int]:
        if world is None:
            world = dist.get_world_size() if dist.is_initialized() else self.world_size
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        if tp == "auto":
            tp = max(1, world // max(1, self.num_nodes)) if dp == "auto" else world // dp
        if dp == "auto":
            dp = world // tp if tp and world % tp == 0 else 0
        if dp * tp != world:
            raise MisconfigurationError(
                f"data_parallel_size={self.data_parallel_size} x tensor_parallel_size={self.tensor_parallel_size} "
                f"does not fit the {world} running processes (data x tensor must equal the world size)")
        return dp, tp

    @property
    def device_mesh(self):
        """The 2-D mesh ``("data_parallel", "tensor_parallel")`` (built at setup)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            self._device_mesh = init_device_mesh(self.root_device.type, self._sizes(), mesh_dim_names=DIM_NAMES)
        return self._device_mesh

    @property
    def mesh(self):
        """What ``fully_shard`` shards over: the data-parallel dimension."""
        return self.device_mesh["data_parallel"]

    def setup_environment(self) -> None:
        self._sizes(self.world_size)   # before any process work: a mismatch fails fast on every rank
        super().setup_environment()
        _ = self.device_mesh

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh.get_local_rank("data_parallel")

    @property
    def tensor_parallel_rank(self) -> int:
        return self.device_mesh.get_local_rank("tensor_parallel")

    # -- data ------------------------------------------------------------------------
    def distributed_sampler_kwargs(self) -> dict | None:
        """Shard by data-parallel rank: the ranks of one tensor-parallel group get the same batch."""
        if self._single:
            return None
        dp, _ = self._sizes()
        return {"num_replicas": dp, "rank": self.data_parallel_rank}

    @property
    def data_parallel_ops(self):
        """Collectives over the data-parallel ranks of this rank's group (used by
        ``gather_for_metrics``, ``all_gather``, ``reduce`` of data in :mod:`ember.distributed`)."""
        if self._single or not dist.is_initialized():
            return None
        if self._dp_ops is None:
            from ember.distributed.collectives import ProcessGroupOps
            self._dp_ops = ProcessGroupOps(self.root_device, group=self.mesh.get_group())
        return self._dp_ops

    def setup_module(self, module):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*FSDP.*DTensor.*")
            return super().setup_module(module)

    def __repr__(self) -> str:
        sizes = self._sizes() if dist.is_initialized() else (self.data_parallel_size, self.tensor_parallel_size)
        return (f"ModelParallelStrategy(data_parallel={sizes[0]}, tensor_parallel={sizes[1]}, "
                f"rank={self.global_rank}, device={self.root_device})")
