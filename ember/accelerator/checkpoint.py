"""``Accelerator.save_state`` / ``load_state`` / ``save_model`` in the checkpoint
format of ``docs/checkpoint_format.md``, Accelerate's automatic checkpoint naming,
and the rules for a save called on some processes only (see ``docs/accelerator.md``).
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch

from ember.checkpoint import io as cio
from ember.errors import CheckpointError, MisconfigurationError


# -- save_model / save_state / load_state ----------------------------------------------------------
_AUTO_RE = re.compile(r"^checkpoint_(\d+)$")


def _auto_dir(acc, new: bool) -> str:
    root = os.path.join(acc.project_dir, "checkpoints")
    if new:
        return next_auto_dir(acc)
    newest = _newest_auto(root)
    if newest < 0:
        raise CheckpointError(f"load_state(): no checkpoint_N directories under {root}; pass the directory")
    acc.save_iteration = newest + 1
    return os.path.join(root, f"checkpoint_{newest}")


def save_model(acc: Any, model: Any, save_directory: str | os.PathLike, max_shard_size: int | str,
               safe_serialization: bool) -> list:
    """``Accelerator.save_model``: the full weights as safetensors shards; returns the files written."""
    if not safe_serialization:
        raise MisconfigurationError("save_model(safe_serialization=False) is not supported: ember writes "
                                    "safetensors only")
    cio.parse_size(max_shard_size)
    from ember.strategies.full_load import raise_rank0_error
    weights = acc.strategy.module_state_dict(model)   # every process (sharded strategies gather)
    files: list = []
    error = None
    if acc.is_main_process:
        try:
            files = cio.save_model_sharded(weights, save_directory, max_shard_size)
        except Exception as err:   # reported to every process below, raised here as it is
            error = err
    raise_rank0_error(acc.strategy, error, f"save_model({os.fspath(save_directory)!r}) failed on the main process")
    return files


def _guarded_by_main_process_check() -> bool:
    """True when the user's call to ``save_state`` sits right under an ``if`` on
    ``is_main_process`` / ``is_local_main_process`` (the usual Accelerate pattern)."""
    import inspect
    import linecache
    frame = inspect.currentframe()
    try:
        f = frame.f_back.f_back.f_back   # _guarded.. <- save_state (here) <- Accelerator.save_state <- user
        if f is None:
            return False
        fn, line = f.f_code.co_filename, f.f_lineno
    finally:
        del frame
    text = linecache.getline(fn, line)
    indent = len(text) - len(text.lstrip())
    for n in range(line - 1, max(0, line - 60), -1):   # the enclosing blocks, innermost first
        above = linecache.getline(fn, n)
        if not above.strip() or above.lstrip().startswith("#"):
            continue
        ind = len(above) - len(above.lstrip())
        if ind >= indent:
            continue
        indent, head = ind, above.strip()
        if head.startswith(("if ", "elif ")):
            return "not " not in head and ("is_main_process" in head or "is_local_main_process" in head
                                           or "process_index == 0" in head)
        if not head.startswith(("try:", "with ", "else:", "for ", "while ")):
            return False
    return False


def _wait_for_all_ranks(acc, what: str) -> None:
    """Sharded strategies: every rank must call ``what``. Each rank counts itself in
    the rendezvous store (no collective) and waits, at most the strategy's collective
    timeout, for the others; a rank left alone raises instead of hanging in a gather."""
    import time
    from torch.distributed import distributed_c10d as c10d
    world = acc.strategy.world_size
    acc._arrivals[what] = n = acc._arrivals.get(what, 0) + 1
    if world == 1 or not c10d.is_initialized():
        return
    store, key = c10d._get_default_store(), f"ember/accelerator/{what}/{n}"
    limit = getattr(acc.strategy, "timeout", None)
    limit = limit.total_seconds() if limit is not None else 1800.0
    store.add(key, 1)
    deadline = time.monotonic() + limit
    while (got := int(store.add(key, 0))) < world:
        if time.monotonic() > deadline:
            raise MisconfigurationError(
                f"{what}() under the {acc.strategy.name} strategy must be called on every process (the state is "
                f"sharded: every rank writes its part); {got} of {world} called it within {limit:.0f} s. Call "
                f"accelerator.{what}(...) outside 'if accelerator.is_main_process:'")
        time.sleep(0.01)


def _main_only_error(acc, what: str) -> MisconfigurationError:
    return MisconfigurationError(
        f"{what}() under the {acc.strategy.name} strategy must be called on every process: its state is "
        f"sharded, each rank writes its part. Call accelerator.{what}(...) outside "
        f"'if accelerator.is_main_process:' (every rank calls it; the files are written correctly)")


def rng_file(path: str, rank: int) -> str:
    """The file of ``rank``'s RNG states in a ``save_state`` folder."""
    return os.path.join(path, f"rng_state_{rank}.pt")


def save_state(acc: Any, output_dir: str | os.PathLike | None) -> str:
    """Non-sharded strategies (single, DDP) enter no collective: the main process writes
    the checkpoint atomically, so ``if accelerator.is_main_process: save_state()`` works.
    When the other ranks call it too, each adds its own RNG state (``rng_state_<rank>.pt``)
    once the main process's checkpoint is in place. Sharded strategies (FSDP, DeepSpeed)
    need every rank: a main-process-only call raises instead of hanging."""
    strategy = acc.strategy
    acc.step_rules.flush()   # a scheduler step waiting for its optimizer step's skip flag
    sharded = strategy.is_sharded or strategy.owns_optimizer_step
    if sharded and strategy.world_size > 1:
        if _guarded_by_main_process_check():
            raise _main_only_error(acc, "save_state")
        _wait_for_all_ranks(acc, "save_state")
    if output_dir is None:
        output_dir = next_auto_dir(acc)
    path = os.path.normpath(os.fspath(output_dir))
    if strategy.is_global_zero and not (sharded and strategy.world_size > 1):
        # the main process writes (another DDP rank adds its RNG file to the main process's new
        # checkpoint, which may already hold the user's own files by then); a sharded save is
        # checked by rank 0 inside the strategy's save, whose verdict reaches every rank (a rank
        # that checked alone could refuse a target another rank's node does not see, or the reverse)
        from ember.checkpoint.trust import check_save_target
        check_save_target(path, "Accelerator.save_state")   # read-only: no collective
    models = acc._models
    raw_opts = [o.optimizer for o in acc._optimizers]
    loaders = [dl.state_dict() for dl in acc._dataloaders]
    # each process's own position in its loaders (a stateful loader's state): kept apart from the
    # state every process holds alike (the token below), one list per process
    positions = [sd.pop("position", None) for sd in loaders]
    state = {
        "schedulers": [s.scheduler.state_dict() for s in acc._schedulers],
        "precision": strategy.precision.state_dict(),
        "dataloaders": loaders,
        "data_positions": strategy.all_gather_object(positions) if sharded else [positions],
        "custom_objects": [o.state_dict() for o in acc._custom_objects],
        "rng": strategy.all_gather_object(cio.collect_rng_states()) if sharded else [cio.collect_rng_states()],
        "accelerator": {"step": acc._step, "num_models": len(models), "model_files": {},
                        "gradient_accumulation_steps": acc.gradient_accumulation_steps},
    }
    meta = {"kind": "accelerator", "strategy": strategy.name, "world_size": strategy.world_size,
            "precision": strategy.precision.name, "num_models": len(models)}
    if sharded:   # FSDP, DeepSpeed: the strategy writes
        if len(models) != 1:
            raise MisconfigurationError(f"save_state() under the {strategy.name} strategy needs exactly one "
                                        f"prepared model; {len(models)} are prepared")
        strategy.save_checkpoint(path, models[0], raw_opts, state, meta)
        return path
    meta["state_token"] = _state_token(acc, state)
    if not strategy.is_global_zero:   # no collective: add this rank's RNG once the main process committed
        _write_rank_rng(acc, path, meta["state_token"], positions)
        return path
    weights = [strategy.module_state_dict(m) for m in models]
    for hook in getattr(acc, "_save_hooks", ()):
        hook(models, weights, path)
    opt_states = [strategy.optimizer_state_dict(o, models[0] if models else None) for o in raw_opts]
    tmp = cio.make_staging(path, "Accelerator.save_state")   # the target check, then an empty NAME.ember-tmp
    try:
        for i, w in enumerate(weights[1:], 1):  # model 0 is model.safetensors, as in Trainer checkpoints
            name = f"model_{i}.safetensors"
            cio.save_safetensors(w, os.path.join(tmp, name))
            state["accelerator"]["model_files"][name] = os.path.getsize(os.path.join(tmp, name))
        state["optimizers"] = opt_states
        files = dict(state["accelerator"]["model_files"])
        cio.write_checkpoint(path, weights[0] if weights else {}, state, meta, keep_existing_tmp=True,
                             extra_files=files, digest_extra=tuple(files))
    except BaseException:
        cio.remove_staging(path)
        raise
    return path


def _state_token(acc, state: dict) -> str:
    """What every DDP rank holds alike at a save (weights, optimizer steps, data
    position), condensed: the main process records it in ``meta.json``; another rank
    knows the main process committed *this* save when the token matches."""
    import hashlib
    sums = [p.detach().double().sum() for m in acc._models for p in m.parameters()]
    h = hashlib.sha1(repr((state["dataloaders"], state["accelerator"]["step"],
                           [o.optimizer.state_dict()["param_groups"] for o in acc._optimizers])).encode())
    if sums:
        h.update(torch.stack(sums).cpu().numpy().tobytes())
    return h.hexdigest()


def _write_rank_rng(acc, path: str, token: str, positions: list | None = None) -> None:
    """Wait (polling the file system, at most the strategy's timeout) until the main
    process committed this save (its ``meta.json`` holds the same state token), then
    write this rank's RNG state next to it, atomically, with its ``positions`` in its
    prepared loaders (``"data_positions"``; the RNG restore ignores that key)."""
    import json
    import time
    limit = getattr(acc.strategy, "timeout", None)
    limit = limit.total_seconds() if limit is not None else 1800.0
    deadline = time.monotonic() + limit
    meta_file = os.path.join(path, cio.META_NAME)
    states = cio.collect_rng_states()
    if positions is not None and any(p is not None for p in positions):
        states["data_positions"] = positions
    while True:
        try:
            with open(meta_file) as f:
                if json.load(f).get("state_token") == token:
                    break
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            warnings.warn(f"save_state(): the main process did not write {path} within {limit:.0f} s; "
                          f"rank {acc.process_index}'s RNG state is not saved (load_state gives this rank the "
                          "main process's RNG state). Call save_state on every process or on the main one "
                          "only, the same way each time", UserWarning, stacklevel=4)
            return
        time.sleep(0.02)
    target = rng_file(path, acc.process_index)
    cio.save_torch(states, target + ".tmp")
    os.replace(target + ".tmp", target)


def next_auto_dir(acc: Any) -> str:
    """``project_dir/checkpoints/checkpoint_<save_iteration>`` (Accelerate's automatic
    naming); :attr:`Accelerator.save_iteration` then advances. No collective: every rank
    counts its own calls. With ``ProjectConfiguration(total_limit=N)`` the main process
    removes the oldest automatic checkpoints beyond N."""
    root = os.path.join(acc.project_dir, "checkpoints")
    if acc.save_iteration is None:
        acc.save_iteration = _newest_auto(root) + 1
    path = os.path.join(root, f"checkpoint_{acc.save_iteration}")
    acc.save_iteration += 1
    limit = getattr(acc.project_configuration, "total_limit", None)
    if limit is not None and acc.is_main_process and os.path.isdir(root):
        nums = sorted(int(m.group(1)) for n in os.listdir(root) if (m := _AUTO_RE.match(n)))
        for n in nums[: max(0, len(nums) + 1 - int(limit))]:
            try:
                cio.remove_checkpoint(os.path.join(root, f"checkpoint_{n}"))
            except (CheckpointError, OSError) as err:   # never delete what is not a checkpoint
                warnings.warn(f"ProjectConfiguration(total_limit={limit}): {err}", UserWarning, stacklevel=3)
    return path


def _newest_auto(root: str) -> int:
    nums = sorted(int(m.group(1)) for n in (os.listdir(root) if os.path.isdir(root) else [])
                  if (m := _AUTO_RE.match(n)) and cio.is_checkpoint(os.path.join(root, n)))
    return nums[-1] if nums else -1


def _count(what: str, saved: int, have: int, path: str) -> None:
    if saved != have:
        raise CheckpointError(f"checkpoint {path} holds {saved} {what}, but {have} are prepared/registered "
                              f"now: prepare the same objects, in the same order, before load_state()")


def _read_extra_model(strategy, model, path: str, name: str, size, strict: bool) -> dict:
    """The weights of an extra prepared model, read and checked (not loaded)."""
    fp = cio.checks.member(path, name)   # inside the checkpoint: no symlink out of it
    if not os.path.isfile(fp):
        raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    if size is not None and os.path.getsize(fp) != size:
        raise CheckpointError(f"{fp} is truncated or corrupt: it has {os.path.getsize(fp)} bytes, "
                              f"the checkpoint recorded {size}")
    weights = cio.load_safetensors(fp)
    cio.check_compatible(strategy.unwrap_module(model), weights, fp, strict=strict)
    return weights


def load_state(acc: Any, input_dir: str | os.PathLike | None, strict: bool = True) -> dict:
    """``Accelerator.load_state``: restore what :func:`save_state` wrote. A checkpoint one
    rank refuses is refused by every rank, with the first failing rank's message
    (docs/architecture.md, "Where the ranks agree")."""
    strategy = acc.strategy
    if strategy.world_size == 1:
        path = os.fspath(input_dir) if input_dir is not None else _auto_dir(acc, new=False)
        return _load_state(acc, path, strict)
    from ember.checkpoint.agree import agree_outcome, check_files, collective_failed
    path, error = "", None
    try:
        path = os.fspath(input_dir) if input_dir is not None else _rank0_auto_dir(acc)
        check_files(path)
    except Exception as err:   # agreed below, so no rank goes on alone
        error = err
    agree_outcome(strategy, error)
    error, meta = None, {}
    try:
        meta = _load_state(acc, path, strict)
    except Exception as err:
        if collective_failed(err):
            raise
        error = err
    agree_outcome(strategy, error)
    return meta


def _rank0_auto_dir(acc: Any) -> str:
    """The newest ``checkpoint_N`` as rank 0 lists it, on every rank (one broadcast)."""
    picked: tuple[str, int, str | None] | None = None
    if acc.strategy.is_global_zero:
        try:
            picked = (_auto_dir(acc, new=False), acc.save_iteration, None)
        except CheckpointError as err:
            picked = ("", 0, str(err))
    path, iteration, message = acc.strategy.broadcast(picked)
    if message is not None:
        raise CheckpointError(message)
    acc.save_iteration = iteration   # the next automatic save name, as _auto_dir sets it
    return path


def _check_loaders(acc: Any, state: dict, meta: dict, path: str) -> None:
    """Each prepared loader refuses a position saved mid-pass over other data (batch size,
    dataset length, a stream's shards: ``DataLoaderShard.check_state``). Saved by another
    number of processes, the loaders restart their pass (below): nothing to check."""
    saved_world = int(meta.get("world_size", acc.strategy.world_size) or acc.strategy.world_size)
    if saved_world != acc.strategy.world_size:
        return
    for i, (dl, sd) in enumerate(zip(acc._dataloaders, state.get("dataloaders", []))):
        if callable(getattr(dl, "check_state", None)):
            dl.check_state(sd, f"load_state(): {path} (dataloader {i})")


def _load_state(acc: Any, path: str, strict: bool) -> dict:
    strategy = acc.strategy
    for hook in getattr(acc, "_load_hooks", ()):
        hook(acc._models, path)
    from ember.accelerator.accelerate_checkpoint import is_accelerate_checkpoint, load_accelerate_state
    if is_accelerate_checkpoint(path):   # written by Accelerate's save_state
        return load_accelerate_state(acc, path, strict)
    models = acc._models
    raw_opts = [o.optimizer for o in acc._optimizers]
    if strategy.is_sharded or strategy.owns_optimizer_step:   # FSDP, DeepSpeed: the strategy writes
        if len(models) != 1:
            raise MisconfigurationError(f"load_state() under the {strategy.name} strategy needs exactly one "
                                        f"prepared model; {len(models)} are prepared")
        state = strategy.load_checkpoint(path, models[0], raw_opts, strict=strict)
        meta = state.pop("meta", {})
        info = state.get("accelerator") or {}
    else:
        weights, state, meta = cio.read_checkpoint(path)
        if state is None:
            raise CheckpointError(f"{path} holds weights only (no {cio.STATE_NAME}); load them with "
                                  "ember.checkpoint.io.read_checkpoint / load_model_sharded instead")
        info = state.get("accelerator")
        if info is None:
            raise CheckpointError(f"{path} was not written by Accelerator.save_state() (a Trainer checkpoint?); "
                                  "resume it with Trainer.fit(ckpt_path=...)")
        _count("models", int(info.get("num_models", 0)), len(models), path)
        _count("optimizers", len(state.get("optimizers", [])), len(raw_opts), path)
        # every file read and checked before anything is loaded
        if models:
            if weights is None:
                raise CheckpointError(f"{path} holds sharded (DCP) weights; load it with the strategy that wrote "
                                      f"it ({meta.get('strategy')})")
            cio.check_compatible(strategy.unwrap_module(models[0]), weights, path, strict=strict)
        files = info.get("model_files") or {}
        extra = [_read_extra_model(strategy, m, path, f"model_{i}.safetensors", files.get(f"model_{i}.safetensors"),
                                   strict) for i, m in enumerate(models[1:], 1)]
        from ember.checkpoint.trust import check_optimizers
        check_optimizers(raw_opts, state.get("optimizers"), meta, path)
        _count("schedulers", len(state.get("schedulers", [])), len(acc._schedulers), path)
        _count("dataloaders", len(state.get("dataloaders", [])), len(acc._dataloaders), path)
        _count("registered objects", len(state.get("custom_objects", [])), len(acc._custom_objects), path)
        _check_loaders(acc, state, meta, path)   # before anything is loaded
        if models:
            strategy.load_module_state_dict(models[0], weights, strict=strict)
        for m, w in zip(models[1:], extra):
            strategy.load_module_state_dict(m, w, strict=strict)
        for o, s in zip(raw_opts, state.get("optimizers", [])):
            strategy.load_optimizer_state_dict(o, s, models[0] if models else None)
    _count("schedulers", len(state.get("schedulers", [])), len(acc._schedulers), path)
    _count("dataloaders", len(state.get("dataloaders", [])), len(acc._dataloaders), path)
    _count("registered objects", len(state.get("custom_objects", [])), len(acc._custom_objects), path)
    if strategy.is_sharded or strategy.owns_optimizer_step:   # (checked before the load above otherwise)
        _check_loaders(acc, state, meta, path)
    saved_world = int(meta.get("world_size", strategy.world_size) or strategy.world_size)
    if saved_world != strategy.world_size and acc._dataloaders:
        warnings.warn(f"load_state(): {path} was saved by {saved_world} process(es) and is loaded by "
                      f"{strategy.world_size}; the dataloaders restart their epoch from the start",
                      UserWarning, stacklevel=3)
    for s, sd in zip(acc._schedulers, state.get("schedulers", [])):
        s.scheduler.load_state_dict(sd)
    strategy.precision.load_state_dict(state.get("precision") or {})
    rng = state.get("rng") or []
    own = rng_file(path, strategy.global_rank)
    if os.path.lexists(own):
        own = cio.checks.member(path, os.path.basename(own))   # no symlink out of the checkpoint
    own_states = cio.load_torch(own) if os.path.isfile(own) and not (strategy.is_sharded or
                                                                    strategy.owns_optimizer_step) else None
    # this process's positions in its loaders: its own file, else the state's list (gathered
    # under sharded strategies; the main process's alone otherwise)
    positions = (own_states or {}).get("data_positions")
    saved_positions = state.get("data_positions") or []
    if positions is None and strategy.global_rank < len(saved_positions) and saved_world == strategy.world_size:
        positions = saved_positions[strategy.global_rank]
    for i, (dl, sd) in enumerate(zip(acc._dataloaders, state.get("dataloaders", []))):
        if saved_world != strategy.world_size:
            sd = dict(sd, batches_done=0)
        sd = dict(sd, position=positions[i] if positions is not None and i < len(positions) else None)
        dl.load_state_dict(sd)
    for o, sd in zip(acc._custom_objects, state.get("custom_objects", [])):
        o.load_state_dict(sd)
    if own_states is not None:
        cio.restore_rng_states({k: v for k, v in own_states.items() if k != "data_positions"})
    elif rng:
        cio.restore_rng_states(rng[strategy.global_rank % len(rng)])
    acc._step = int(info.get("step", 0))
    return meta
