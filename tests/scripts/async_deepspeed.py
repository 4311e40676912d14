"""DeepSpeedStrategy(async_save=True) under ZeRO stage 2 (two CPU processes, gloo, a 60 s
process-group timeout), run by tests/strategies/test_deepspeed.py. Started as a plain script:
``Trainer(devices=2)`` starts rank 1 itself.

    python async_deepspeed.py OUT      # writes OUT/<check>.rank<r>.json

(shard_deepspeed.py runs these checks too, after its ZeRO stages, in the same launch:
``run(OUT)``.)

1. The same run (checkpoint every 3 steps, 6 steps) saving synchronously and in the
   background: every tensor of every rank's DeepSpeed files is equal.
2. A fit resumed from the background-saved step=3 ends bit-identical to the uninterrupted run.
3. Parameters and fp32 master partitions changed right after save_checkpoint returned (its
   writer held back until then) do not change what was saved.
4. Rank 1's file missing at the commit: nothing committed, a CheckpointError naming rank 1
   on both ranks.
5. An exception in training (both ranks) while step=3 is pending: it is dropped without a
   collective (not committed, its NAME.ember-tmp removed) and the exception reaches the caller.
6. A write that fails on one rank only (ENOSPC at its torch.save) inside DeepSpeed's
   ``save_checkpoint``, synchronous (rank 1's ZeRO partition; rank 0's model states) and in
   the background (rank 1): every rank raises a CheckpointError naming the failing rank and
   the real error within seconds (no rank left in DeepSpeed's closing barrier), nothing is
   committed, and the next save succeeds.
"""
import errno
import os
import sys
import threading
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shard_common as sc  # noqa: E402

from ember.checkpoint import io as cio  # noqa: E402
from ember import Trainer  # noqa: E402
from ember.callbacks import Callback, ModelCheckpoint  # noqa: E402
from ember.strategies import DeepSpeedStrategy  # noqa: E402
from ember.strategies.deepspeed import load_full_weights  # noqa: E402

OUT = ""      # set by run()
ACC = 2


def ds(cls=DeepSpeedStrategy, **kw):
    return cls(devices=2, stage=2, timeout=timedelta(seconds=60), **kw)


def trainer(strategy, **kw):
    args = dict(sc.QUIET, enable_checkpointing=False, default_root_dir=OUT, accumulate_grad_batches=ACC)
    args.update(kw)
    return Trainer(strategy=strategy, **args)


def tensors_equal(a, b) -> bool:
    """Same structure, every tensor equal (dtype and values), other leaves equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str) and \
            all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):     # e.g. DeepSpeed's loss scaler object
        return type(a) is type(b) and tensors_equal(vars(a), vars(b))
    return a == b


def files_of(ckpt):
    folder = os.path.join(ckpt, "model")
    return {n: torch.load(os.path.join(folder, n), map_location="cpu", weights_only=False)
            for n in sorted(os.listdir(folder)) if n.endswith(".pt")}


def run(out: str) -> None:
    """Every check, results under ``out``."""
    global OUT
    OUT = out
    os.makedirs(out, exist_ok=True)
    # 1 + 2. sync and async runs save the same tensors; resume from the async checkpoint is bit-identical
    final, dirs = {}, {}
    for mode in ("sync", "async"):
        dirs[mode] = os.path.join(OUT, mode)
        t = trainer(ds(async_save=mode == "async"), max_steps=6, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=dirs[mode], filename="{step}", every_n_train_steps=3,
                                               save_top_k=-1)])
        t.fit(sc.make_net(lr=0.5), sc.loader(shuffle=True))
        final[mode] = t.strategy.module_state_dict(t.model)
    rank = t.global_rank
    sync_files, async_files = files_of(os.path.join(dirs["sync"], "step=3")), files_of(os.path.join(dirs["async"], "step=3"))
    t2 = trainer(ds(async_save=True), max_steps=6)
    t2.fit(sc.make_net(seed=9, lr=0.5), sc.loader(shuffle=True), ckpt_path=os.path.join(dirs["async"], "step=3"))
    sc.write_result(OUT, "async_equal", {
        "files": sorted(async_files), "same_files": sorted(sync_files) == sorted(async_files),
        "unequal": [n for n in sync_files if not tensors_equal(sync_files[n], async_files.get(n))],
        "final_equal": sc.equal(final["sync"], final["async"]),
        "resumed_bit_identical": sc.equal(final["sync"], t2.strategy.module_state_dict(t2.model)),
        "global_step": t2.global_step, "committed": sorted(os.listdir(dirs["async"]))}, rank)

    # 3. changes right after the save returned do not reach the files
    t = trainer(ds(async_save=True), max_steps=2)
    net = sc.make_net()
    t.fit(net, sc.loader())
    before = t.strategy.module_state_dict(t.model)
    engine = t.model
    gate = threading.Event()
    real_save = engine.checkpoint_engine.inner.save

    def held_save(state_dict, path):
        gate.wait()
        real_save(state_dict, path)

    engine.checkpoint_engine.inner.save = held_save      # this rank's writer waits until the changes are made
    path = os.path.join(OUT, "held")
    t.save_checkpoint(path)
    mine = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"     # this rank's ZeRO partition
    written_at_return = os.path.exists(os.path.join(cio.tmp_path(path), "model", mine))
    with torch.no_grad():
        for p in net.parameters():
            p.add_(100.0)
        for flat in engine.optimizer.single_partition_of_fp32_groups:
            flat.add_(100.0)
    gate.set()
    t.strategy.wait_for_checkpoint()
    saved = load_full_weights(path)
    module_file = torch.load(os.path.join(path, "model", "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    module_file = {k[len("module."):] if k.startswith("module.") else k: v for k, v in module_file.items()}
    sc.write_result(OUT, "async_snapshot", {
        "written_at_return": written_at_return, "changed_live": not sc.equal(before, t.strategy.module_state_dict(t.model)),
        "fp32_equal": sc.equal(saved, before), "module_file_equal": sc.equal(module_file, before)}, rank)

    # 4. the commit rule: rank 1's file missing -> nothing committed, an error naming rank 1 on every rank
    DropsRank1File, dropped = sc.deepspeed_dropping_rank1_file()
    res = {}
    t = trainer(ds(DropsRank1File, async_save=True), max_steps=1)
    t.fit(sc.make_net(), sc.loader())
    t.save_checkpoint(os.path.join(OUT, "dropped_ckpt"))
    res["returned"] = True
    try:
        t.strategy.wait_for_checkpoint()
        res["error"] = None
    except Exception as err:
        res["error"] = f"{type(err).__name__}: {err}"
    res["dropped"] = dropped
    res["committed"] = os.path.exists(os.path.join(OUT, "dropped_ckpt"))
    sc.write_result(OUT, "async_commit", res, rank)

    # 5. an exception in training drops the pending checkpoint (no collective, nothing committed)
    class FailsAtStep4(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                raise RuntimeError("failed at step 4")

    fail_dir = os.path.join(OUT, "failed_run")
    t = trainer(ds(async_save=True), max_steps=6, enable_checkpointing=True,
                callbacks=[FailsAtStep4(), ModelCheckpoint(dirpath=fail_dir, filename="{step}", every_n_train_steps=3,
                                                           save_top_k=-1)])
    import warnings  # noqa: E402
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.fit(sc.make_net(), sc.loader(shuffle=True))
            error = None
        except RuntimeError as err:
            error = str(err)
    torch.distributed.barrier()       # both ranks have dropped theirs before rank 0's listing is read
    sc.write_result(OUT, "async_failed_run", {
        "error": error, "left": sorted(os.listdir(fail_dir)) if os.path.isdir(fail_dir) else [],
        "warned": [str(w.message) for w in caught if "was not committed" in str(w.message)]}, rank)

    # 6. one rank's write fails inside engine.save_checkpoint: every rank raises at once, naming it
    real_torch_save = torch.save

    def enospc_on(rank_, name_part):
        def failing_save(obj, f, *args, **kwargs):
            if rank == rank_ and name_part in (os.fspath(f) if isinstance(f, (str, os.PathLike)) else ""):
                raise OSError(errno.ENOSPC, "No space left on device", os.fspath(f))
            return real_torch_save(obj, f, *args, **kwargs)
        return failing_save

    for case, async_save, rank_, name_part in (("sync_rank1", False, 1, "zero_pp_rank_1_"),
                                               ("sync_rank0", False, 0, "mp_rank_00_model_states"),
                                               ("async_rank1", True, 1, "zero_pp_rank_1_")):
        t = trainer(ds(async_save=async_save), max_steps=1)
        t.fit(sc.make_net(), sc.loader())
        path = os.path.join(OUT, f"enospc_{case}")
        res = {}
        torch.save = enospc_on(rank_, name_part)
        t0 = time.monotonic()
        try:
            t.save_checkpoint(path)
            t.strategy.wait_for_checkpoint()
            res["error"] = None
        except Exception as err:
            res["error"] = f"{type(err).__name__}: {err}"
            res["cause"] = type(err.__cause__).__name__ if err.__cause__ is not None else None
        finally:
            torch.save = real_torch_save
        res["seconds"] = time.monotonic() - t0
        res["committed"] = os.path.exists(path)
        again = os.path.join(OUT, f"again_{case}")
        t.save_checkpoint(again)
        t.strategy.wait_for_checkpoint()
        res["next_save_committed"] = os.path.isfile(os.path.join(again, "meta.json"))
        sc.write_result(OUT, f"enospc_{case}", res, rank)


if __name__ == "__main__":
    run(sys.argv[1])
