"""DeepSpeedStrategy checks for ZeRO stages, all of them in one launch (a process that
imports DeepSpeed takes seconds to start). Started as a plain script: ``Trainer(devices=2)``
starts rank 1 itself, which runs the same stages.

    python shard_deepspeed.py OUT STAGE [STAGE ...] [async]
        # writes OUT/zero<STAGE>/<check>.rank<r>.json; "async": async_deepspeed.py's checks in OUT/async
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shard_common as sc  # noqa: E402

from ember.checkpoint import io as cio  # noqa: E402
from ember import Accelerator, Trainer  # noqa: E402
from ember.callbacks import ModelCheckpoint  # noqa: E402
from ember.strategies import DeepSpeedStrategy  # noqa: E402
from ember.strategies.deepspeed import load_full_weights  # noqa: E402

STEPS, ACC, CLIP = 4, 2, 0.5


def run_stage(OUT: str, STAGE: int) -> None:
    """Every check for ZeRO stage ``STAGE``, results under ``OUT``."""
    ZERO = {"stage3_param_persistence_threshold": 0} if STAGE == 3 else {}

    def ds(**kw):
        return DeepSpeedStrategy(devices=2, stage=STAGE, **ZERO, **kw)

    def trainer(strategy, **kw):
        args = dict(sc.QUIET, enable_checkpointing=False, default_root_dir=OUT)
        args.update(kw)
        return Trainer(strategy=strategy, **args)

    # 1. matches the single-process fp32 reference: accumulation, clipping, a per-step scheduler
    net = sc.make_net(sched=True)
    ref = sc.reference(net, STEPS, window=4 * 2 * ACC, clip=CLIP, sched=True)
    t = trainer(ds(), max_steps=STEPS, accumulate_grad_batches=ACC, gradient_clip_val=CLIP)
    t.fit(net, sc.loader(), val_dataloaders=sc.loader(n=32))     # validation at the end of the one epoch
    rank = t.global_rank
    full = t.strategy.module_state_dict(t.model)
    cfg = t.strategy.config
    plain = sc.Net(sched=True)
    plain.load_state_dict(ref)
    x, y = sc.data(32).tensors
    sc.write_result(OUT, "reference", {
        "val_loss": float(t.callback_metrics["val/loss"]), "val_expected": F.cross_entropy(plain(x), y).item(),
        "max_diff": sc.max_diff(full, ref), "world": t.world_size, "engine": type(t.model).__name__,
        "lr": t.optimizers[0].param_groups[0]["lr"],
        "config": {k: cfg[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                       "train_batch_size", "gradient_clipping", "managed_gradient_accumulation")},
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    }, rank)

    # 2. resume from a mid-epoch checkpoint is bit-identical (shuffled data)
    ck_dir = os.path.join(OUT, "resume_ckpts")
    t = trainer(ds(), max_steps=6, accumulate_grad_batches=ACC, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=ck_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1)])
    t.fit(sc.make_net(lr=0.5), sc.loader(shuffle=True))
    straight = t.strategy.module_state_dict(t.model)
    clip_cfg = t.strategy.config["gradient_clipping"]
    mid = os.path.join(ck_dir, "step=3")
    t2 = trainer(ds(), max_steps=6, accumulate_grad_batches=ACC)
    t2.fit(sc.make_net(seed=9, lr=0.5), sc.loader(shuffle=True), ckpt_path=mid)
    resumed = t2.strategy.module_state_dict(t2.model)
    sc.write_result(OUT, "resume", {
        "bit_identical": sc.equal(straight, resumed), "global_step": t2.global_step,
        "gradient_clipping": clip_cfg, "files": sorted(os.listdir(mid)),
        "leftover_tmp": [n for n in os.listdir(ck_dir) if n.endswith((".tmp", ".ember-tmp"))]}, rank)

    # 2b. without gradient_clip_val nothing is clipped (SGD, large gradients: DeepSpeed's default 1.0 would show)
    net = sc.make_net(opt="sgd", lr=0.05, loss_mult=20.0)
    ref_noclip = sc.reference(net, 4, window=4 * 2 * ACC, clip=None)
    t = trainer(ds(), max_steps=4, accumulate_grad_batches=ACC)
    t.fit(net, sc.loader())
    clipped_ref = sc.reference(sc.make_net(opt="sgd", lr=0.05, loss_mult=20.0), 4, window=4 * 2 * ACC, clip=1.0)
    sc.write_result(OUT, "noclip", {"max_diff": sc.max_diff(t.strategy.module_state_dict(t.model), ref_noclip),
                                    "clip_1_would_differ_by": sc.max_diff(clipped_ref, ref_noclip)}, rank)

    # 3. validate from the checkpoint before any fit (weights consolidated from the ZeRO files)
    vt = trainer(ds())
    metrics = vt.validate(sc.make_net(seed=11), sc.loader(n=32), ckpt_path=mid)
    plain = sc.Net()
    plain.load_state_dict(load_full_weights(mid))
    x, y = sc.data(32).tensors
    with torch.no_grad():
        expected = F.cross_entropy(plain(x), y).item()
    rebuilt = sc.Net.load_from_checkpoint(mid, trust_deepspeed=True)   # hparams + consolidated ZeRO weights, no engine
    sc.write_result(OUT, "validate", {"val_loss": metrics[0]["val/loss"], "expected": expected,
                                      "load_from_checkpoint_equal": sc.equal(rebuilt.state_dict(), plain.state_dict()),
                                      "load_from_checkpoint_lr": rebuilt.hparams.lr}, rank)

    # 4. full export loads into a plain module and gives the same outputs
    net = sc.make_net(seed=5)
    t = trainer(ds(), max_steps=2)
    t.fit(net, sc.loader())
    sc.write_result(OUT, "export", sc.export_result(t.strategy, net, os.path.join(OUT, "export"), rank), rank)

    # 5. memory: parameters (ZeRO-3) and optimizer states (fp32 master + AdamW's 2) are partitioned
    params = [getattr(p, "ds_tensor", p) for p in net.parameters()]
    sc.write_result(OUT, "memory", {
        "param_bytes": sc.storage_bytes(params),
        "optim_bytes": sc.storage_bytes(sc.ds_optimizer_tensors(t.model.optimizer)),
        "full_param_bytes": sc.full_param_bytes(sc.make_net())}, rank)

    # 6. bf16-mixed trains
    losses = sc.Losses()
    t = trainer(ds(), max_steps=12, precision="bf16-mixed", callbacks=[losses])
    t.fit(sc.make_net(lr=0.02), sc.loader(n=48))
    sc.write_result(OUT, "bf16", {"first": sum(losses.values[:3]) / 3, "last": sum(losses.values[-3:]) / 3,
                                  "bf16": t.strategy.config["bf16"]["enabled"],
                                  "finite": all(v == v for v in losses.values)}, rank)

    # 7. Accelerator.prepare(model, optimizer) and a custom loop with gradient accumulation
    acc = Accelerator(strategy="deepspeed" if STAGE == 2 else DeepSpeedStrategy(stage=STAGE, **ZERO), devices=2,
                      gradient_accumulation_steps=ACC)
    model, opt, ref = sc.accelerator_loop(acc)
    sc.write_result(OUT, "accelerator", {
        "max_diff": sc.max_diff(acc.strategy.module_state_dict(model), ref), "stage": acc.strategy.stage,
        "model": type(model).__name__, "unwrapped": type(acc.unwrap_model(model)).__name__}, rank)

    # 8. CPU offload of optimizer states (and of parameters under ZeRO-3) with the torch optimizer
    if STAGE >= 2:
        net = sc.make_net()
        ref = sc.reference(net, 4, window=4 * 2 * ACC, clip=CLIP)
        t = trainer(ds(offload_optimizer=True, offload_parameters=STAGE == 3), max_steps=4,
                    accumulate_grad_batches=ACC, gradient_clip_val=CLIP)
        t.fit(net, sc.loader())
        zero = t.strategy.config["zero_optimization"]
        sc.write_result(OUT, "offload", {"max_diff": sc.max_diff(t.strategy.module_state_dict(t.model), ref),
                                         "offload_optimizer": zero.get("offload_optimizer", {}).get("device"),
                                         "offload_param": zero.get("offload_param", {}).get("device")}, rank)

    # 9. ZeRO-3: configure_model runs in deepspeed.zero.Init (partitioned at construction) and trains
    #    like the single-process reference built in the same order
    if STAGE == 3:
        probe = {}

        class LateNet(sc.Net):
            def configure_model(self):
                super().configure_model()
                probe["partitioned_at_build"] = all(hasattr(p, "ds_id") and p.numel() == 0
                                                    for p in self.blocks.parameters())
                probe["inp_partitioned_at_build"] = hasattr(self.inp.weight, "ds_id")

        torch.manual_seed(0)
        snap = sc.Snapshot()
        t = trainer(ds(), max_steps=4, accumulate_grad_batches=ACC, gradient_clip_val=CLIP, callbacks=[snap])
        t.fit(LateNet(late_blocks=True), sc.loader())
        plain = sc.Net(late_blocks=True)
        plain.configure_model()
        plain.load_state_dict(snap.weights)                  # the initial weights, gathered at fit start
        ref = sc.reference(plain, 4, window=4 * 2 * ACC, clip=CLIP)
        sc.write_result(OUT, "zero_init", dict(probe, max_diff=sc.max_diff(t.strategy.module_state_dict(t.model), ref),
                                               init_std=float(snap.weights["blocks.0.lin.weight"].std())), rank)

    # 10. full weights (a .safetensors file) into a trained engine: parameters and fp32 master copy
    other = sc.make_net(seed=42)
    wfile = os.path.join(OUT, "other.safetensors")
    if rank == 0:
        cio.save_weights_file(wfile, other.state_dict())
    net = sc.make_net()
    t = trainer(ds(), max_steps=2)
    t.fit(net, sc.loader())                       # (its collectives order rank 0's write before the reads)
    metrics = t.validate(net, sc.loader(n=32), ckpt_path=wfile)
    x, y = sc.data(32).tensors
    with torch.no_grad():
        expected = F.cross_entropy(other(x), y).item()
    sc.write_result(OUT, "load_weights", {"val_loss": metrics[0]["val/loss"], "expected": expected,
                                          "master_equal": sc.equal(t.strategy.module_state_dict(t.model),
                                                                   other.state_dict())}, rank)

    # 11. a commit checks every rank's files: rank 1's ZeRO file missing -> nothing committed, an
    #     error on every rank naming rank 1; a complete checkpoint lists every rank's files in meta.json
    DropsRank1File, dropped = sc.deepspeed_dropping_rank1_file()
    res = sc.commit_result(lambda: trainer(DropsRank1File(devices=2, stage=STAGE, **ZERO), max_steps=1),
                           lambda: trainer(ds(), max_steps=1), OUT)
    sc.write_result(OUT, "shard_commit", dict(res, dropped=dropped), rank)


if __name__ == "__main__":
    for arg in sys.argv[2:]:
        if arg == "async":          # async_deepspeed.py's checks (ZeRO-2, async_save=True), in this launch
            import async_deepspeed
            async_deepspeed.run(os.path.join(sys.argv[1], "async"))
            continue
        out = os.path.join(sys.argv[1], f"zero{arg}")
        os.makedirs(out, exist_ok=True)
        run_stage(out, int(arg))
