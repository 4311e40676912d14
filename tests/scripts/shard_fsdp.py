"""FSDPStrategy checks, several per launch (each writes OUT/<check>.rank<r>.json).

    python shard_fsdp.py OUT w1        # one process: single-device + FSDP world-1 checkpoints
    torchrun --nproc_per_node 2 shard_fsdp.py OUT w2
    python shard_fsdp.py OUT w1b       # one process: resume the world-2 checkpoint
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shard_common as sc  # noqa: E402

import ember  # noqa: E402
from ember.checkpoint import io as cio  # noqa: E402
from ember.errors import MisconfigurationError  # noqa: E402
from ember import Accelerator, Trainer  # noqa: E402
from ember.callbacks import ModelCheckpoint  # noqa: E402
from ember.strategies import FSDPStrategy  # noqa: E402
from ember.strategies.fsdp import load_full_weights  # noqa: E402

OUT, MODE = sys.argv[1], sys.argv[2]
STEPS, ACC, CLIP = 4, 2, 0.5


def trainer(strategy, **kw):
    args = dict(sc.QUIET, enable_checkpointing=False, default_root_dir=OUT)
    args.update(kw)
    return Trainer(strategy=strategy, **args)


def fsdp(**kw):
    return FSDPStrategy(auto_wrap_policy={sc.Block}, **kw)


def opt_state(t):
    return t.strategy.optimizer_state_dict(t.optimizers[0], t.model)


def save_full(t, name):
    """Full weights + full optimizer state (rank 0) of a fitted trainer."""
    w, o = t.strategy.module_state_dict(t.model), opt_state(t)
    if t.is_global_zero:
        torch.save({"weights": w, "optim": o}, os.path.join(OUT, name))


def resume_and_compare(ckpt, full_file, world, steps_after=1):
    """Resume ``ckpt`` under FSDP; return whether the restored state equals ``full_file``."""
    snap = sc.Snapshot()
    net = sc.make_net(seed=123)            # different init: everything must come from the checkpoint
    start = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=True)["loop"]["global_step"]
    t = trainer(fsdp(), max_steps=start + steps_after, callbacks=[snap], accumulate_grad_batches=ACC)
    t.fit(net, sc.loader(), ckpt_path=ckpt)
    res = {"global_step": t.global_step, "world": t.world_size}
    if t.is_global_zero:                    # only rank 0 wrote (and reads) the full state
        saved = torch.load(os.path.join(OUT, full_file), weights_only=True)
        res["weights_equal"] = sc.equal(snap.weights, saved["weights"])
        res["optim_equal"] = sc.optim_states_equal(snap.optim, saved["optim"])
        res["optim_step"] = [float(v["step"]) for v in snap.optim["state"].values()][:1]
    return res, t


if MODE == "w1":
    # a single-device checkpoint (model.safetensors + index-keyed optimizer state)
    net = sc.make_net()
    t = Trainer(strategy="single", max_steps=2, default_root_dir=OUT, **sc.QUIET, enable_checkpointing=False)
    t.fit(net, sc.loader())
    t.save_checkpoint(os.path.join(OUT, "single_ckpt"))
    names = [n for n, _ in net.named_parameters()]
    osd = t.optimizers[0].state_dict()
    torch.save({"weights": {k: v.clone() for k, v in net.state_dict().items()},
                "optim": {"state": {names[i]: s for i, s in osd["state"].items()}}},
               os.path.join(OUT, "single_full.pt"))
    # FSDP on one process (a one-rank process group), saved for the world-2 run
    t = trainer(fsdp(), max_steps=2, accumulate_grad_batches=ACC)
    t.fit(sc.make_net(), sc.loader())
    t.save_checkpoint(os.path.join(OUT, "w1_ckpt"))
    save_full(t, "w1_full.pt")
    # a layer built on the meta device without reset_parameters(): a clear error before training
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Parameter(torch.ones(sc.D))

        def forward(self, x):
            return x * self.g

    class NoReset(sc.Net):
        def configure_model(self):
            self.blocks = torch.nn.Sequential(sc.Block(), Scale())

    try:
        trainer(fsdp(), max_steps=1).fit(NoReset(late_blocks=True), sc.loader())
        error = None
    except MisconfigurationError as e:
        error = str(e)
    sc.write_result(OUT, "w1", {"world": t.world_size, "strategy": repr(t.strategy), "no_reset_error": error,
                                "files": sorted(os.listdir(os.path.join(OUT, "w1_ckpt")))}, 0)

elif MODE == "w2":
    rank = int(os.environ["RANK"])

    # 1. matches the single-process fp32 reference (wrap policy, accumulation, clipping)
    net = sc.make_net()
    ref = sc.reference(net, STEPS, window=4 * 2 * ACC, clip=CLIP)
    t = trainer(fsdp(), max_steps=STEPS, accumulate_grad_batches=ACC, gradient_clip_val=CLIP)
    t.fit(net, sc.loader(), val_dataloaders=sc.loader(n=32))   # validation at the end of the one epoch
    full = t.strategy.module_state_dict(t.model)
    plain = sc.Net()
    plain.load_state_dict(ref)
    x, y = sc.data(32).tensors
    sc.write_result(OUT, "reference", {
        "val_loss": float(t.callback_metrics["val/loss"]), "val_expected": F.cross_entropy(plain(x), y).item(),
        "max_diff": sc.max_diff(full, ref) if rank == 0 else None, "world": t.world_size,
        "param_types": sorted({type(p).__name__ for p in net.parameters()}),
        "local_numel": sum(p.to_local().numel() for p in net.parameters()),
        "full_numel": sum(p.numel() for p in net.parameters())}, rank)

    # 1b. activation checkpointing + CPU offload: same numbers, blocks recomputed in backward
    res = {}
    for name, kw in (("plain_", {}), ("", dict(activation_checkpointing=True, cpu_offload=True))):
        net = sc.make_net()
        t = trainer(fsdp(**kw), max_steps=STEPS, accumulate_grad_batches=ACC, gradient_clip_val=CLIP)
        sc.Block.calls = 0
        t.fit(net, sc.loader())
        res[f"{name}block_calls_per_micro_batch"] = sc.Block.calls / (STEPS * ACC)
        full = t.strategy.module_state_dict(t.model)
        if name == "" and rank == 0:
            res["max_diff"] = sc.max_diff(full, ref)
    sc.write_result(OUT, "ac_offload", res, rank)

    # 1c. accumulation keeps gradients sharded by default (reduce-scatter per micro-batch);
    #     shard_accumulated_grads=False holds them unsharded inside FSDP until the window ends
    res = {"local_numel": sum(p.to_local().numel() for p in net.parameters())}
    for name, kw in (("sharded", {}), ("unsharded", dict(shard_accumulated_grads=False))):
        seen = []

        class Peek(ember.callbacks.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if batch_idx % ACC == 0:     # the first micro-batch of a window: no step yet
                    seen.append(sum(p.grad.to_local().numel() for p in module.parameters() if p.grad is not None))
        net = sc.make_net()
        t = trainer(fsdp(**kw), max_steps=STEPS, accumulate_grad_batches=ACC, gradient_clip_val=CLIP,
                    callbacks=[Peek()])
        t.fit(net, sc.loader())
        full = t.strategy.module_state_dict(t.model)
        res[name] = {"grad_numel_mid_window": seen[0], "max_diff": sc.max_diff(full, ref) if rank == 0 else None}
    sc.write_result(OUT, "accumulation", res, rank)

    # 2. resume from a mid-epoch sharded checkpoint is bit-identical (shuffled data)
    ck_dir = os.path.join(OUT, "resume_ckpts")
    t = trainer(fsdp(), max_steps=6, accumulate_grad_batches=ACC, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=ck_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1)])
    t.fit(sc.make_net(), sc.loader(shuffle=True))
    straight = t.strategy.module_state_dict(t.model)
    straight_opt = opt_state(t)
    if rank == 0:   # the weights the ranks trained, for load_from_checkpoint of step=6 (tests/strategies/test_fsdp.py)
        torch.save(straight, os.path.join(OUT, "resume_final_full.pt"))
    mid = os.path.join(ck_dir, "step=3")
    t2 = trainer(fsdp(), max_steps=6, accumulate_grad_batches=ACC)
    t2.fit(sc.make_net(seed=7), sc.loader(shuffle=True), ckpt_path=mid)
    resumed = t2.strategy.module_state_dict(t2.model)
    resumed_opt = opt_state(t2)
    meta = __import__("json").load(open(os.path.join(mid, "meta.json")))
    sc.write_result(OUT, "resume", {
        "bit_identical": sc.equal(straight, resumed) if rank == 0 else None,
        "optim_identical": sc.optim_states_equal(straight_opt, resumed_opt) if rank == 0 else None,
        "files": sorted(os.listdir(mid)), "dcp_files": sorted(os.listdir(os.path.join(mid, "model"))),
        "leftover_tmp": [n for n in os.listdir(ck_dir) if n.endswith((".tmp", ".ember-tmp"))],
        "meta": {k: meta.get(k) for k in ("strategy", "world_size", "module_class", "sharded", "state_dict_type")},
        "global_step": t2.global_step}, rank)

    # 3. a world-1 FSDP checkpoint resumes at world 2 (DCP reshards)
    res, _ = resume_and_compare(os.path.join(OUT, "w1_ckpt"), "w1_full.pt", 2)
    sc.write_result(OUT, "from_world1", res, rank)

    # 4. a single-device checkpoint (model.safetensors) resumes under FSDP, optimizer included
    res, _ = resume_and_compare(os.path.join(OUT, "single_ckpt"), "single_full.pt", 2)
    if rank == 0:
        saved = torch.load(os.path.join(OUT, "single_full.pt"), weights_only=True)
        res["single_step"] = [float(v["step"]) for v in saved["optim"]["state"].values()][:1]
    sc.write_result(OUT, "from_single", res, rank)

    # 5. checkpoint for the world-1 resume (w1b)
    t = trainer(fsdp(), max_steps=3, accumulate_grad_batches=ACC)
    t.fit(sc.make_net(seed=3), sc.loader())
    t.save_checkpoint(os.path.join(OUT, "w2_ckpt"))
    save_full(t, "w2_full.pt")

    # 6. bf16-mixed, 16-mixed and bf16-true train (loss goes down)
    out = {}
    for prec in ("bf16-mixed", "16-mixed", "bf16-true"):
        losses = sc.Losses()
        t = trainer(fsdp(), max_steps=12, precision=prec, callbacks=[losses])
        net = sc.make_net(lr=0.02)
        t.fit(net, sc.loader(n=48))
        out[prec] = {"first": sum(losses.values[:3]) / 3, "last": sum(losses.values[-3:]) / 3,
                     "param_dtypes": sorted({str(p.dtype) for p in net.parameters()}),
                     "finite": all(v == v for v in losses.values)}
    sc.write_result(OUT, "mixed", out, rank)

    # 7. full export loads into a plain module and gives the same outputs
    t = trainer(fsdp(), max_steps=2)
    net = sc.make_net(seed=5)
    t.fit(net, sc.loader())
    path = os.path.join(OUT, "export")
    res = sc.export_result(t.strategy, net, path, rank)
    # save_weights_only checkpoints hold full weights (ModelCheckpoint uses module_state_dict)
    wo = os.path.join(OUT, "weights_only")
    t.save_checkpoint(wo, weights_only=True)
    if rank == 0:
        full = load_full_weights(wo)
        res["weights_only_matches_export"] = sc.equal(full, cio.load_model_sharded(path))
    sc.write_result(OUT, "export", res, rank)

    # 8. memory: each rank holds about half of the parameter and optimizer-state bytes
    net = sc.make_net()
    t = trainer(fsdp(), max_steps=1)
    t.fit(net, sc.loader())
    sc.write_result(OUT, "memory", {
        "param_bytes": sc.storage_bytes(net.parameters()),
        "optim_bytes": sc.storage_bytes([v for st in t.optimizers[0].state.values() for v in st.values()
                                         if v.dim() > 0]),
        "full_param_bytes": sc.full_param_bytes(sc.make_net())}, rank)

    # 9. Accelerator.prepare(model, optimizer) (optimizer built before sharding) in a custom loop
    acc = Accelerator(strategy="fsdp", devices=2, gradient_accumulation_steps=ACC)
    model, opt, ref = sc.accelerator_loop(acc, clip=CLIP)
    full = acc.strategy.module_state_dict(model)
    # async save: the checkpoint holds the weights of the moment of the save
    acc.strategy.async_save = True
    acc.save_state(os.path.join(OUT, "acc_async"))
    pending = not os.path.exists(os.path.join(OUT, "acc_async"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.strategy.wait_for_checkpoint()
    res = {"type": type(acc.strategy).__name__, "opt_param_types": sorted(
        {type(p).__name__ for g in opt.param_groups for p in g["params"]})}
    acc.strategy.async_save = False
    acc.load_state(os.path.join(OUT, "acc_async"))          # back to the weights of the save
    loaded = acc.strategy.module_state_dict(model)
    if rank == 0:
        res["max_diff"] = sc.max_diff(full, ref)
        res["async_matches_save_time"] = sc.equal(load_full_weights(os.path.join(OUT, "acc_async")), full)
        res["async_was_pending"] = pending
        res["load_state_restores"] = sc.equal(loaded, full)
    sc.write_result(OUT, "accelerator", res, rank)

    # 10. configure_model on the meta device: shards materialised and initialised
    net = sc.make_net(late_blocks=True)
    losses, snap = sc.Losses(), sc.Snapshot()
    t = trainer(fsdp(), max_steps=10, callbacks=[losses, snap])
    t.fit(net, sc.loader(n=40))
    res = {"meta_left": [n for n, p in net.named_parameters() if p.is_meta],
           "first": losses.values[0], "last": losses.values[-1]}
    if rank == 0:
        lw, lb = snap.weights["blocks.0.lin.weight"], snap.weights["blocks.0.lin.bias"]
        res.update(max_abs=float(lw.abs().max()), bias_max_abs=float(lb.abs().max()), std=float(lw.std()),
                   halves_differ=not torch.equal(lw[:8], lw[8:]), finite=bool(torch.isfinite(lw).all()),
                   inp_kept=sc.equal({"w": snap.weights["inp.weight"]}, {"w": sc.make_net(late_blocks=True).inp.weight.detach()}))
    sc.write_result(OUT, "meta_init", res, rank)

    # 11. state_dict_type="full": model.safetensors + name-keyed optimizer state; resumes sharded
    t = trainer(fsdp(state_dict_type="full"), max_steps=2)
    t.fit(sc.make_net(seed=4), sc.loader())
    t.save_checkpoint(os.path.join(OUT, "full_ckpt"))
    save_full(t, "full_full.pt")
    res, _ = resume_and_compare(os.path.join(OUT, "full_ckpt"), "full_full.pt", 2)
    res["files"] = sorted(os.listdir(os.path.join(OUT, "full_ckpt")))
    sc.write_result(OUT, "full_type", res, rank)

    # 12. a commit checks every rank's shard: one missing -> nothing committed, an error on
    #     every rank naming the rank; a complete one lists each shard in meta.json
    class DropsRank1Shard(FSDPStrategy):
        def _commit(self, path, state, meta):
            self.barrier()
            if self.is_global_zero:
                os.remove(os.path.join(cio.tmp_path(path), cio.DCP_WEIGHTS_DIR, "__1_0.distcp"))
            super()._commit(path, state, meta)

    res = sc.commit_result(lambda: trainer(DropsRank1Shard(auto_wrap_policy={sc.Block}), max_steps=1),
                           lambda: trainer(fsdp(), max_steps=1), OUT)
    sc.write_result(OUT, "shard_commit", res, rank)

    # 13. an exception after an async save started: the save is dropped, not committed at
    #     teardown (no collective on the error path)
    class FailAfterSave(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                trainer.save_checkpoint(os.path.join(OUT, "async_failed"))
                raise RuntimeError("boom after the save started")

    t = trainer(fsdp(async_save=True), max_steps=3, callbacks=[FailAfterSave()])
    import warnings as _w
    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        try:
            t.fit(sc.make_net(), sc.loader())
            err = None
        except RuntimeError as e:
            err = str(e)
    t.strategy.barrier()     # the test's own sync point, after fit ended on both ranks
    sc.write_result(OUT, "async_dropped", {
        "error": err, "committed": os.path.exists(os.path.join(OUT, "async_failed")),
        "warned": any("was not committed" in str(w.message) for w in caught)}, rank)

    # 14. async_save with ModelCheckpoint(save_top_k=1, save_last=True): the superseded
    #     checkpoint is deleted and 'last' moved only once the new one is committed by
    #     every rank (its commit is at the next save), so a complete checkpoint is always there
    ckdir = os.path.join(OUT, "async_topk")
    watch = sc.CommittedWatch(ckdir)
    t = trainer(fsdp(async_save=True), max_steps=4, enable_checkpointing=True,
                callbacks=[watch, ModelCheckpoint(dirpath=ckdir, filename="{step}", every_n_train_steps=1,
                                                  save_top_k=1, save_last=True)])
    t.fit(sc.make_net(), sc.loader())
    t.strategy.barrier()
    sc.write_result(OUT, "async_topk", {"seen": watch.seen, "final": sc.committed_steps(ckdir),
                                        "last": sc.last_step(ckdir)}, rank)

elif MODE == "w1b":
    res, _ = resume_and_compare(os.path.join(OUT, "w2_ckpt"), "w2_full.pt", 1)
    sc.write_result(OUT, "from_world2", res, 0)
