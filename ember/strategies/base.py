"""The Strategy interface: *where* the work runs.

A Strategy owns the process group and cluster environment, the root device,
wrapping the module, preparing optimizers, sharding data, backward and
``no_backward_sync``, collectives, and how checkpoints are written and read.
The single-device strategy below is the reference implementation; DDP, FSDP
and DeepSpeed override what differs.
"""
from __future__ import annotations

import os
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from ember.distributed.collectives import map_tensors
from ember.errors import MisconfigurationError
from ember.precision import NULL_CONTEXT, Precision



def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a batch (the containers torch's pytree knows: dicts, lists,
    tuples, namedtuples, transformers' ModelOutput, and other mappings:
    :func:`~ember.distributed.collectives.map_tensors`) to ``device``; other objects with a
    ``.to`` move themselves. A tensor, or a flat tuple,
    list or dict of tensors (most batches) moves without the tree walk, which costs
    about 6x the Python calls on this per-step path."""
    kind = type(batch)
    if kind is torch.Tensor:
        return batch.to(device, non_blocking=non_blocking)
    if kind is tuple or kind is list or kind is dict:
        for x in (batch.values() if kind is dict else batch):
            if type(x) is not torch.Tensor:
                break
        else:
            if kind is dict:
                return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}
            moved = [x.to(device, non_blocking=non_blocking) for x in batch]
            return moved if kind is list else tuple(moved)

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=non_blocking)
        if callable(getattr(x, "to", None)) and not isinstance(x, nn.Module):
            try:
                return x.to(device)
            except TypeError:
                return x
        return x
    return map_tensors(move, batch)


class Strategy:
    """Base strategy; also the behaviour of one process on one device."""

    name = "single"
    #: True when each rank holds only a shard of the parameters
    is_sharded = False
    #: True when the strategy runs backward/step itself (DeepSpeed)
    owns_optimizer_step = False
    #: the loss scaler "16-mixed" uses under this strategy: "torch" (GradScaler),
    #: "sharded" (ShardedGradScaler) or None (the strategy scales losses itself)
    loss_scaler: str | None = "torch"
    async_save = False
    _pending_save = None
    _async_in_flight = False
    _commit_actions: "list | None" = None

    def __init__(self, device: "str | torch.device | None" = None, async_save: bool = False) -> None:
        self._device = torch.device(device) if device is not None else None
        self.precision: Precision = Precision()
        self.num_processes = 1
        #: write checkpoints in a background thread (:mod:`ember.strategies.async_save`)
        self.async_save = bool(async_save)
        self._pending_save = None      # rank 0's PendingWrite
        self._async_in_flight = False  # every rank: a background save may be pending on rank 0

    # -- topology ----------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """The device this process computes on."""
        return self._device or torch.device("cpu")

    @root_device.setter
    def root_device(self, device: str | torch.device) -> None:
        self._device = torch.device(device)

    world_size = 1
    global_rank = 0
    local_rank = 0
    node_rank = 0

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is global rank 0."""
        return self.global_rank == 0

    @property
    def is_local_zero(self) -> bool:
        """Whether this process is rank 0 of its machine."""
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether the run has more than one process."""
        return self.world_size > 1

    # -- lifecycle -----------------------------------------------------------
    def setup_environment(self) -> None:
        """Create process groups, pick the device. Called once, before any model work."""
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        self.precision.setup(self.root_device, self.loss_scaler)

    def module_init_context(self) -> ContextManager[None]:
        """Context in which ``configure_model`` builds layers (meta device for FSDP)."""
        ctx = getattr(self.precision, "module_init_context", None)
        return ctx() if ctx is not None else NULL_CONTEXT

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move to device, convert to the precision's dtype, wrap for the strategy."""
        module = self.precision.convert_module(module)
        return module.to(self.root_device)

    def setup_optimizers(self, module: nn.Module, optimizers: list) -> tuple[nn.Module, list]:
        """Last chance to rewrap module and optimizers together (DeepSpeed, FSDP)."""
        return module, optimizers

    def unwrap_module(self, module: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper (DDP, FSDP, DeepSpeed engine)."""
        while hasattr(module, "module") and isinstance(module.module, nn.Module) and (
                type(module).__name__ in ("DistributedDataParallel", "DeepSpeedEngine",
                                          "OptimizedModule", "_EmberModuleWrapper")):
            module = module.module
        return getattr(module, "_orig_mod", module)

    def teardown(self) -> None:
        """Release what the strategy set up (process group, engine) at the end of a run;
        a pending ``async_save`` checkpoint is finished (committed) first, and the CPU copy
        it was written from (kept between saves to reuse its buffers) is released."""
        self._finish_pending_save()
        self._snapshot = None

    def on_exception(self, exc: BaseException) -> None:
        """After an exception in the run (the Trainer calls this before teardown): a
        background save not committed yet is dropped (its writer is let finish and removes
        its ``NAME.ember-tmp``, which never counts; no collective, so a failed rank ends at once),
        and what waited for its commit (:meth:`after_commit`) never runs."""
        self._commit_actions = None
        pending, self._pending_save = self._pending_save, None
        self._async_in_flight = False
        if pending is not None and pending.drop():
            import warnings
            warnings.warn(f"the asynchronous save of {pending.path} was not committed: the run failed "
                          f"({type(exc).__name__})", UserWarning, stacklevel=2)

    # -- data ------------------------------------------------------------------
    def distributed_sampler_kwargs(self) -> dict | None:
        """``num_replicas``/``rank`` for sharding, or None when not distributed."""
        return None

    def batch_to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in nested lists, tuples, dicts) moved to :attr:`root_device`."""
        return move_to_device(batch, self.root_device)

    # -- step ----------------------------------------------------------------
    def forward_context(self) -> ContextManager[None]:
        """The context the module's forward runs in (the precision's autocast)."""
        return self.precision.forward_context()

    def backward(self, loss: torch.Tensor, module: nn.Module | None = None, **kwargs: Any) -> None:
        """``loss.backward()`` through the precision (loss scaling)."""
        self.precision.backward(loss, **kwargs)

    def manual_backward(self, loss: torch.Tensor, module: nn.Module | None = None, **kwargs: Any) -> None:
        """``TrainModule.manual_backward`` (manual optimization): the strategy's backward."""
        self.backward(loss, module, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None,
                       closure: Callable[[], Any] | None = None) -> None:
        """``optimizer.step()`` through the precision (a scaled step may be skipped)."""
        self.precision.optimizer_step(optimizer, closure)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager[None]:
        """Context that skips the gradient all-reduce (accumulation micro-batches)."""
        return NULL_CONTEXT

    # -- collectives (identity on one process) ---------------------------------
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process arrives (``name`` labels it in timeout messages)."""
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (a tensor or any picklable object)."""
        return obj

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack ``tensor`` from every rank along a new dim 0 (shape [world, ...])."""
        return tensor.unsqueeze(0)

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0; ranks may hold different first dimensions."""
        return tensor

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        return [obj]

    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over the ranks with ``op`` (``"mean"``, ``"sum"``, ``"max"``, ``"min"``)."""
        return tensor

    def agree(self, decision: Any, how: str = "max") -> Any:
        """One decision for every rank, with one small collective (none on one process).

        ``decision`` is a bool, a number, or a list of numbers (several decisions in one
        collective). ``how``: ``"max"`` (a bool: True when any rank says True), ``"min"``
        (a bool: True only when every rank says True; Lightning's
        ``reduce_boolean_decision(all=True)``) or ``"rank0"`` (rank 0's value). Returns the
        agreed value(s) in the same form. Every rank must call it at the same point.

        A rank that does not arrive within the process-group timeout is named in the
        error (a DistributedOperationError): each rank counts its agreement points in
        the rendezvous store (a small write, no collective), read only on the error path."""
        if how not in ("max", "min", "rank0"):
            from ember.errors import invalid_choice
            raise invalid_choice("agree(how)", how, ["max", "min", "rank0"])
        if self.world_size == 1:
            return decision
        from ember.distributed.collectives import mark_arrival, missing_ranks
        many = isinstance(decision, (list, tuple))
        values = list(decision) if many else [decision]
        flag = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.root_device)
        arrival = mark_arrival()
        try:
            out = self.broadcast(flag, 0) if how == "rank0" else self.reduce(flag, how)
            host = out.tolist()   # where an asynchronous backend (NCCL) would wait
        except Exception as err:
            missing = missing_ranks(arrival)
            if not missing:
                raise
            from ember.errors import DistributedOperationError
            who = ", ".join(map(str, missing))
            limit = getattr(self, "timeout", None)
            within = f" within the process-group timeout ({limit.total_seconds():g} s)" if limit is not None else ""
            raise DistributedOperationError(
                f"rank(s) {who} never arrived at a point where the ranks agree (at setup, a log point, a "
                f"validation's end or an epoch's end: docs/architecture.md, \"Where the ranks agree\"){within}: rank(s) {who} failed, hang or are much slower (see "
                f"their own output). If they are only slow, raise the strategy's timeout=. ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''})") from err
        kinds = [type(v) for v in values]
        res = [bool(x) if k is bool else int(x) if k is int else float(x) for k, x in zip(kinds, host)]
        return res if many else res[0]

    # -- checkpoints -------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights, on every rank that needs them."""
        return self.unwrap_module(module).state_dict()

    def load_module_state_dict(self, module: nn.Module, state: dict, strict: bool = True) -> Any:
        """Load ``state`` (as :meth:`module_state_dict` returns it) into ``module``."""
        return self.unwrap_module(module).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None) -> dict:
        """The optimizer's state for a checkpoint (full or this rank's shard, per strategy)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict,
                                  module: nn.Module | None = None) -> None:
        """Load ``state`` (as :meth:`optimizer_state_dict` returns it) into ``optimizer``."""
        optimizer.load_state_dict(state)

    def save_checkpoint(self, path: str, module: nn.Module, optimizers: list,
                        trainer_state: dict, meta: dict, weights_only: bool = False) -> None:
        """Write a checkpoint directory atomically (rank zero writes; all ranks return
        after it is complete). ``trainer_state`` excludes model and optimizers. A failed
        write on rank 0 (a full disk) raises on every rank: rank 0 broadcasts its verdict
        in place of a closing barrier, so no rank waits for it until the timeout."""
        from ember.checkpoint import io as cio
        from ember.strategies.full_load import raise_rank0_error
        self._finish_pending_save()
        weights = self.module_state_dict(module)
        opt_states = [] if weights_only else [self.optimizer_state_dict(o, module) for o in optimizers]
        error = None
        if self.is_global_zero:
            try:
                state = dict(trainer_state, optimizers=opt_states) if not weights_only else None
                if self.async_save:   # copied to CPU here; written and committed by a background thread
                    from ember.strategies.async_save import PendingWrite, cpu_snapshot
                    # the buffers of the previous snapshot (its write has finished) are reused
                    snap = cpu_snapshot((weights, state), getattr(self, "_snapshot", None))
                    self._snapshot = snap
                    self._pending_save = PendingWrite(os.fspath(path), snap[0], snap[1], dict(meta))
                else:
                    cio.write_checkpoint(path, weights, state, meta)
            except Exception as err:     # reported to every rank below, raised here as it is
                error = err
        self._async_in_flight = self.async_save and error is None
        raise_rank0_error(self, error, f"checkpoint {os.fspath(path)} was not written on rank 0")

    def _finish_pending_save(self) -> None:
        """Wait for the background save (``async_save``); its error is raised on every rank
        (a collective when distributed: every rank calls it, at a save, a load, teardown).
        Once it is committed, what waited for it runs (:meth:`after_commit`)."""
        if not self._async_in_flight:
            return
        self._async_in_flight = False
        pending, self._pending_save = self._pending_save, None
        error = None
        if pending is not None:
            try:
                pending.result()
            except Exception as err:   # reported to every rank below, raised here as it is
                error = err
        from ember.strategies.full_load import raise_rank0_error
        with self._committing():
            raise_rank0_error(self, error, "the asynchronous save of the last checkpoint failed on rank 0")

    # -- after a commit ------------------------------------------------------------
    @property
    def save_pending(self) -> bool:
        """Whether a background save (``async_save``) may not be committed yet: the same on
        every rank (rank 0 alone may be writing, but every rank takes part in its commit)."""
        return bool(self._async_in_flight)

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the checkpoint saved last is committed, on every rank's
        part: at once when no save is pending (a synchronous save is committed when it
        returns, every rank agreed); after a background save (``async_save``) when it is
        finished and committed (at the next save or load, :meth:`wait_for_checkpoint`,
        teardown), in the order given. A save that fails or is dropped after an exception
        never runs them: what a new checkpoint supersedes (the older checkpoints to delete,
        the ``last`` link to move) stays until it exists. ``action`` must be local: no
        collective (it may run in teardown)."""
        if not self.save_pending:
            action()
            return
        if self._commit_actions is None:
            self._commit_actions = []
        self._commit_actions.append(action)

    def _committing(self):
        """Around a pending save's commit: :meth:`after_commit` actions run on success, dropped on an error."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            try:
                yield
            except BaseException:
                self._commit_actions = None
                raise
            actions, self._commit_actions = self._commit_actions or [], None
            for action in actions:
                action()
        return ctx()

    def wait_for_checkpoint(self) -> None:
        """Block until the last ``async_save`` checkpoint is committed (raises its write error)."""
        self._finish_pending_save()

    def export_full(self, path: str, module: nn.Module | None = None, max_shard_size: int | str = "10GB") -> str:
        """Write the full weights as safetensors: ``path`` ending in ``.safetensors`` is one
        file; anything else a directory (``model.safetensors``, or shards + index).
        Collective (sharded strategies gather the weights); rank 0 writes. Returns ``path``."""
        from ember.checkpoint import io as cio
        module = module if module is not None else self._last_module()
        if module is None:
            raise MisconfigurationError("export_full() needs a module: no module was set up by this strategy")
        from ember.strategies.full_load import raise_rank0_error
        weights = self.module_state_dict(module)
        path = os.fspath(path)
        error = None
        if self.is_global_zero:
            try:
                if path.endswith(".safetensors"):
                    cio.save_weights_file(path, weights)
                else:
                    cio.save_model_sharded(weights, path, max_shard_size)
            except Exception as err:   # reported to every rank below, raised here as it is
                error = err
        raise_rank0_error(self, error, f"export_full({path!r}) failed on rank 0")   # no closing barrier
        return path

    def _last_module(self) -> nn.Module | None:
        """The module ``export_full`` writes when none is given."""
        return None

    def load_checkpoint(self, path: str, module: nn.Module, optimizers: list,
                        strict: bool = True, weights_only: bool = False) -> dict:
        """Load weights (and optimizer states) in place; return the trainer state."""
        from ember.checkpoint import io as cio
        from ember.checkpoint.trust import check_optimizers
        self._finish_pending_save()
        weights, state, meta = cio.read_checkpoint(path, load_state=not weights_only)
        cio.check_compatible(self.unwrap_module(module), weights, path, strict=strict)
        state = state or {}
        if optimizers and not weights_only:   # before anything is loaded
            check_optimizers(optimizers, state.get("optimizers"), meta, path)
        self.load_module_state_dict(module, weights, strict=strict)
        for opt, s in zip(optimizers, state.get("optimizers", [])):
            self.load_optimizer_state_dict(opt, s, module)
        state["meta"] = meta
        return state


class SingleDeviceStrategy(Strategy):
    """One process, one device (``cpu``, ``cuda:N`` or ``mps``).
    ``SingleDeviceStrategy(device, async_save=True)`` writes checkpoints in a background
    thread (the state is copied to CPU memory first), as ``FSDPStrategy(async_save=True)``."""

    name = "single"


def auto_device() -> torch.device:
    """cuda > mps > cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count()))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
